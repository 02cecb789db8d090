"""Does the fast CPU decode path keep a calibrated plan's accuracy? Step-decode held-out text through the
plan on the fast path (backend "cpu", what "auto" takes on CPU for long calls: `backends.CpuRouting.takes`) and
on the FP32 reference (backend "torch", what teacher-forced evaluation computes), compare perplexity
against the FP16 cache, and check that greedy `generate` picks the same tokens on both paths.

    python scripts/measure_fast_path.py --plan plans/default [--samples 8 --seq-len 512 --prefill 64]

Every sequence is prefilled with its first `--prefill` tokens, then decoded teacher-forced one token at a
time, so each later token's NLL comes from the paged cache through `ops.mla_decode` on the given path.
Greedy tokens: `--new-tokens` per prompt; where they differ the first differing step and the reference's
top-2 logit margin there are printed (a near-tie flips). Prints markdown; `--out` also writes JSON.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mlaquant import DecodeSession, load_model
from mlaquant.atomic import write_json
from mlaquant.calib.data import split_path
from mlaquant.evaluation.samples import token_samples
from mlaquant.runtime.plan import Plan
from mlaquant.runtime.session import generate

PROMPTS = ["def fib(n):", "The capital of France is", "import numpy as np\n"]


def decode_nll(model, plan, ids: torch.Tensor, prefill: int, backend: str) -> tuple[float, int, float]:
    """Summed NLL of ids[:, prefill:] given everything before, step-decoded; (nll, tokens, seconds)."""
    session = DecodeSession(model, plan=plan, backend=backend)
    logits = session.prefill(ids[:, :prefill])[:, -1]
    nll, start = 0.0, time.perf_counter()
    for t in tqdm(range(prefill, ids.shape[1]), desc=f"decode ({backend})", leave=False):
        nll -= F.log_softmax(logits, -1).gather(-1, ids[:, t, None]).sum().item()
        logits = session.decode(ids[:, t])
    return nll, ids.shape[0] * (ids.shape[1] - prefill), time.perf_counter() - start


def greedy_check(model, plan, new_tokens: int) -> list[dict]:
    """Greedy tokens of each prompt on both paths; where they differ, the step and the reference's margin."""
    rows = []
    for text in PROMPTS:
        prompt = model.tokenizer.encode(text).ids
        fast = generate(model, prompt, new_tokens, plan=plan, backend="cpu")[0]
        ref = generate(model, prompt, new_tokens, plan=plan, backend="torch")[0]
        row = {"prompt": text, "equal": fast == ref, "first_diff": None, "margin": None}
        if fast != ref:
            step = next(i for i, (a, b) in enumerate(zip(fast, ref)) if a != b)
            session = DecodeSession(model, plan=plan, backend="torch")
            logits = session.prefill([prompt + ref[:step]])[0, -1]
            top = logits.topk(2).values
            row |= {"first_diff": step, "margin": float(top[0] - top[1])}
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default="plans/default", help="a plan directory or codec names")
    p.add_argument("--model", default=None)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--prefill", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    ids = token_samples(model.tokenizer, split_path("test"), args.samples, args.seq_len, 2, model.cfg.eos_id)
    plan = Plan.load(args.plan) if Path(args.plan).is_dir() else args.plan
    runs = {"fp16 cache, reference": ("fp16", "torch"), "plan, reference": (plan, "torch"), "plan, fast": (plan, "cpu")}
    rows = []
    for name, (run_plan, backend) in runs.items():
        nll, n, sec = decode_nll(model, run_plan, ids, args.prefill, backend)
        rows.append({"run": name, "nll": nll / n, "tokens": n, "decode_s": sec})
    base = rows[0]["nll"]
    print("| run | ppl | vs FP16 cache | decode s |\n|---|---:|---:|---:|")
    for r in rows:
        r["loss"] = math.exp(r["nll"] - base) - 1
        print(f"| {r['run']} | {math.exp(r['nll']):.3f} | {r['loss']:+.3%} | {r['decode_s']:.1f} |")
    print(f"{args.samples} test sequences × {args.seq_len} tokens, prefill {args.prefill}, {rows[0]['tokens']} decoded")
    greedy = greedy_check(model, plan, args.new_tokens)
    print("| prompt | greedy fast = reference | first differing step | reference top-2 margin |\n|---|---|---:|---:|")
    for g in greedy:
        print(f"| {g['prompt']!r} | {g['equal']} | {g['first_diff']} | {g['margin']} |")
    if args.out:
        write_json(args.out, {"args": vars(args), "rows": rows, "greedy": greedy}, indent=1)


if __name__ == "__main__":
    main()
