"""Does the guard's clip-range re-estimation (`recalibrate_every`) help? Step-decode held-out text through a
calibrated plan with it off and on, and compare perplexity against the FP16 cache on the same tokens.

    python scripts/measure_recalibration.py --plan plans/default [--clip-all] [--samples 8 --seq-len 2048 --every 64]

Every sequence is prefilled with its first `--prefill` tokens, then decoded teacher-forced one token at a
time (the guard sees every new row), so each later token's NLL comes from the quantized cache as it is
at that step. Sequences longer than the calibration samples (512 tokens by default; 2048 = 4x) make the
late rows drift away from the calibration data, which is the case re-estimation is meant for. Each run's
loss is also given per bucket of target positions (`mlaquant.evaluation.eval.position_spans`).
Prints a markdown table; `--out` also writes it as JSON.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mlaquant import DecodeSession, load_model
from mlaquant.atomic import write_json
from mlaquant.calib.data import split_path
from mlaquant.evaluation.eval import position_spans
from mlaquant.evaluation.samples import token_samples
from mlaquant.runtime.guard import Guard
from mlaquant.runtime.plan import Plan


def decode_nll(model, plan, ids: torch.Tensor, prefill: int, guard: Guard | None) -> torch.Tensor:
    """NLL of ids[:, prefill:] given everything before, step-decoded, summed over sequences per target
    position: [T - prefill] float64 (entry j = position prefill + j - 1 counted from the first target)."""
    session = DecodeSession(model, plan=plan, backend="torch", guard=guard)
    logits = session.prefill(ids[:, :prefill])[:, -1]
    nll = torch.zeros(ids.shape[1] - prefill, dtype=torch.float64)
    for t in tqdm(range(prefill, ids.shape[1]), desc=f"decode ({'guard' if guard else 'no guard'})", leave=False):
        nll[t - prefill] = -F.log_softmax(logits, -1).gather(-1, ids[:, t, None]).double().sum()
        logits = session.decode(ids[:, t])
    return nll


def buckets(nll: torch.Tensor, ref: torch.Tensor, first: int, sequences: int) -> dict[str, float]:
    """Loss against `ref` per position bucket; entry j of both is the NLL summed over `sequences`
    sequences at target position `first` + j."""
    out = {}
    for lo, hi in position_spans(nll.numel(), first):
        a, b = lo - first, hi - first
        out[f"{lo}–{hi}"] = math.exp(float(nll[a:b].mean() - ref[a:b].mean()) / sequences) - 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default="plans/default")
    p.add_argument("--model", default=None)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--prefill", type=int, default=64)
    p.add_argument("--every", type=int, default=64, help="recalibrate_every for the 'on' row")
    p.add_argument("--rows", type=int, default=512, help="recalibrate_rows for the 'on' row")
    p.add_argument(
        "--clip-all",
        action="store_true",
        help="clip every layer to its calibrated ranges (re-estimation only acts on clipped layers)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = load_model(args.model)
    eos = model.cfg.eos_id
    ids = token_samples(model.tokenizer, split_path("test"), args.samples, args.seq_len, 2, eos)
    plan = Plan.load(args.plan)
    if args.clip_all:
        for lp in plan.layers:
            lp.clip = True
    runs = {
        "fp16 cache": ("fp16", None),
        "plan, guard (recalibration off)": (plan, Guard({"recalibrate_every": 0})),
        f"plan, guard + recalibrate every {args.every}": (
            plan,
            Guard({"recalibrate_every": args.every, "recalibrate_rows": args.rows}),
        ),
    }
    rows, per_position = [], []
    for name, (plan, guard) in runs.items():
        nll = decode_nll(model, plan, ids, args.prefill, guard)
        per_position.append(nll)
        updates = len(guard.recalibrations) if guard else 0
        n = ids.shape[0] * nll.numel()
        rows.append({"run": name, "nll": float(nll.sum()) / n, "tokens": n, "recalibrations": updates})
    base = rows[0]["nll"]
    for r, nll in zip(rows, per_position):
        r["loss"] = math.exp(r["nll"] - base) - 1
        r["by_position"] = buckets(nll, per_position[0], args.prefill - 1, ids.shape[0])
    names = list(rows[0]["by_position"])
    print("| run | ppl | vs FP16 cache | " + " | ".join(f"@ {b}" for b in names) + " | clip-range updates |")
    print("|---|---:|---:|" + "---:|" * len(names) + "---:|")
    for r in rows:
        cells = " | ".join(f"{r['by_position'][b]:+.3%}" for b in names)
        print(f"| {r['run']} | {math.exp(r['nll']):.3f} | {r['loss']:+.3%} | {cells} | {r['recalibrations']} |")
    print(f"{args.samples} test sequences × {args.seq_len} tokens, prefill {args.prefill}, {rows[0]['tokens']} decoded")
    if args.out:
        write_json(args.out, {"args": vars(args), "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
