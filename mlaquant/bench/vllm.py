"""`mlaquant bench vllm --out DIR`: decode speed and KV capacity inside vLLM, the plugin against vLLM's own backend.

A DeepSeek-V2-Lite-shaped attention (16 heads, d_c 512, d_r 64; `--layers` layers, a small MoE, synthetic weights:
`mlaquant.modeling.synthetic`) served by vLLM on the CPU, per batch × context: vLLM's own `CPU_MLA` (the model
dtype's cache; under the plugin's CPU RoPE fix, which does not touch its speed, and with its prefill attention
run `--stock-prefill-rows` query rows at a time, the same math, so that a 16k prompt fits in 24 GB; its decode is
untouched: `vllm.plugin.bound_cpu_prefill`) and the plugin with each plan of
`--codecs` (uniform plans, one codec pair per layer). Each row is one vLLM launch (`mlaquant.integrations.vllm.run`)
on `batch` random prompts of `context` tokens stepped through vLLM's engine: one decode step of the batch (the
median of the scheduler steps in which every request decoded, `vllm.run --time-decode`), and vLLM's KV capacity
for the run's cache memory. mlaquant's own `DecodeSession` on the same model and prompts is timed beside them (its
decode steps, after the same prefill; `--no-session` leaves it out), and llama.cpp where llama-cpp-python is
installed (else the report says why not; `--no-llama-cpp` leaves it out): its batched decode with a q8_0 and a q4_0
latent cache (`mlaquant.integrations.llamacpp.decode_steps`) on the same prompts, on a sibling model whose query
goes through a rank-512 LoRA (llama.cpp's loader needs one below 26 layers); its cached latent has the same shape.

vLLM runs in the Python of `--vllm-python` (default: this one when it has vLLM, else MLAQUANT_VLLM_PYTHON). Its CPU
worker runs on `--threads` cores (VLLM_CPU_OMP_THREADS_BIND=0-(threads-1); the default is what vLLM's own auto-bind
gives one rank, every core but one, which it keeps for its scheduler process: vllm/utils/ompmultiprocessing.py), and
the plugin's kernels run on those threads; DecodeSession is timed on as many torch threads. Ratios are against vLLM's
own backend in the same run; every figure comes with the CPU capability.

Output: DIR/report.md (table) and DIR/report.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from mlaquant.atomic import atomic_write
from mlaquant.errors import MLAQuantError
from mlaquant.integrations.vllm.plugin import PREFILL_ROWS_ENV

SHAPES = dict(hidden=1024, heads=16, kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128, q_lora_rank=None,
              intermediate=1024, experts=4, moe_intermediate=256)  # fmt: skip
LLAMA_CACHES = ("q8_0", "q4_0")
LLAMA_Q_LORA_RANK = 512
DEFAULT_CODECS = ("fp16", "int8-row/int8-row", "int4-row/int4-row", "band-4x64-3x128-2x64-0x256/int4-row")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for report.md / report.json and the synthetic model")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--contexts", default="1024,4096", help="prompt tokens per sequence (the issue's: 4096,16384)")
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS), help="plugin plans, one uniform codec pair each")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps per run")
    p.add_argument("--dtype", default="float32", help="model dtype in vLLM (stock CPU_MLA caches in it)")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="cores of vLLM's CPU worker and DecodeSession's torch threads (default: all but one)")
    p.add_argument("--prefill", choices=("batch", "one"), default="batch",
                   help="prompts vLLM prefills per scheduler step: the whole batch (then it decodes in lockstep), or "
                        "one (less memory; needs --new-tokens > 2 x batch for steps in which the whole batch decodes)")
    p.add_argument("--stock-prefill-rows", type=int, default=1024,
                   help="vLLM CPU_MLA's own prefill attention this many query rows at a time (the plugin's "
                        "MLAQUANT_VLLM_PREFILL_ROWS: its dense heads x T x T scores are 17 GB at 16k); "
                        "0: as vLLM has it")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave out llama.cpp's rows where it is installed")
    p.add_argument("--no-session", action="store_true",
                   help="leave out mlaquant's DecodeSession row (its prefill is another long one at 16k contexts)")


def vllm_python(given: str | None) -> str:
    """The Python that runs vLLM: `given`, this one when it imports vLLM, else MLAQUANT_VLLM_PYTHON."""
    if given:
        return given
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    env = os.environ.get("MLAQUANT_VLLM_PYTHON")
    if not env:
        raise MLAQuantError("bench vllm: no vLLM here; pass --vllm-python or set MLAQUANT_VLLM_PYTHON "
                            "(bash scripts/vllm_venv.sh builds one)")
    return env


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _launch(python: str, work: Path, name: str, model: Path, prompts: list, new: int, memory: int, dtype: str,
            threads: int, model_len: int, *flags: str, prefill_rows: int = 0) -> dict:
    inp, out = work / f"{name}.in.json", work / f"{name}.json"
    inp.write_text(json.dumps({"prompts": prompts}))
    skip = ("MLAQUANT_PLAN", "VLLM_CPU_KVCACHE", PREFILL_ROWS_ENV)
    env = {k: v for k, v in os.environ.items() if not k.startswith(skip)}
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    if prefill_rows:
        env[PREFILL_ROWS_ENV] = str(prefill_rows)
    cmd = [python, "-m", "mlaquant.integrations.vllm.run", "--model", str(model), "--prompts", str(inp),
           "--max-tokens", str(new), "--kv-cache-memory", str(memory), "--dtype", dtype,
           "--max-model-len", str(model_len), "--time-decode", *flags,
           "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": launch_failure(done.stdout + "\n" + done.stderr, done.returncode)}
    return json.loads(out.read_text())


def launch_failure(output: str, returncode: int) -> str:
    """Why a vLLM launch failed, one line of its output (vLLM logs to stdout, tracebacks go to stderr: both, in that
    order): a worker that died (the kernel's OOM killer leaves no traceback, and the last error is then the engine's
    EngineDeadError), else the last error line, else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for mark in ("died unexpectedly", "Error"):
        hits = [ln for ln in lines if mark in ln]
        if hits:
            return hits[-1].split("] ", 1)[-1]
    return lines[-1] if lines else f"rc {returncode}"


def _session_step(model, prompts: list, new: int, threads: int) -> float:
    """Median decode step of mlaquant's DecodeSession (fp16 plan, auto backend, `threads` torch threads) on
    `prompts`, after prefill."""
    from mlaquant.runtime.session import DecodeSession

    torch.set_num_threads(threads)
    session = DecodeSession(model, plan="fp16")
    logits = session.prefill(prompts)
    nxt = logits[:, -1].argmax(-1)
    times = []
    for _ in range(new):
        started = time.perf_counter()
        nxt = session.decode(nxt).argmax(-1)
        times.append(time.perf_counter() - started)
    return _median(times)


def run(args: argparse.Namespace) -> int:
    from mlaquant.modeling.loader import load_model
    from mlaquant.modeling.synthetic import write_checkpoint
    from mlaquant.runtime.plan import Plan

    contexts, batches = _ints(args.contexts), _ints(args.batches)
    if args.prefill == "one" and args.new_tokens <= 2 * max(batches):
        raise MLAQuantError(f"bench vllm: --prefill one needs --new-tokens > 2 x the largest batch ({max(batches)}): "
                            "the first prompts decode while the others prefill, one a step")
    python = vllm_python(args.vllm_python)
    out = Path(args.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    positions = max(batches) * (max(contexts) + args.new_tokens + 64)  # ≥ any max_model_len below
    model_dir = write_checkpoint(work / "model", shards=1, layers=args.layers, max_positions=positions, **SHAPES)
    plans = {c: Plan.uniform(c, args.layers).save(work / "plans" / c.replace("/", "_")) for c in args.codecs.split(",")}
    model = load_model(model_dir)
    llama_gguf, llama_note = _llama_model(work, args, positions)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for context in contexts:
        for batch in batches:
            prompts = torch.randint(1, 320, (batch, context), generator=gen).tolist()
            memory = 2 * batch * (context + args.new_tokens + 32) * args.layers * 576 * 4  # room at FP32, twice
            tag = f"b{batch}_c{context}"
            # vLLM's CPU build prefills up to max_model_len tokens a step for MLA (vllm/platforms/cpu.py)
            model_len = (batch if args.prefill == "batch" else 1) * (context + args.new_tokens + 16)
            runs = {"vLLM CPU_MLA": _launch(python, work, f"{tag}_stock", model_dir, prompts, args.new_tokens, memory,
                                            args.dtype, args.threads, model_len, "--stock", "--rope-fix",
                                            prefill_rows=args.stock_prefill_rows)}
            for codec, plan in plans.items():
                runs[f"plugin {codec}"] = _launch(python, work, f"{tag}_{plan.name}", model_dir, prompts,
                                                  args.new_tokens, memory, args.dtype, args.threads, model_len,
                                                  "--plan", str(plan))
            base = runs["vLLM CPU_MLA"]
            for name, r in runs.items():
                rows.append({"batch": batch, "context": context, "engine": name, "step_s": r.get("decode_step_s"),
                             "capacity_tokens": r.get("capacity_tokens"), "error": r.get("error"),
                             "cpu_capability": r.get("cpu_capability"),
                             "step_vs_stock": _ratio(r.get("decode_step_s"), base.get("decode_step_s")),
                             "capacity_vs_stock": _ratio(r.get("capacity_tokens"), base.get("capacity_tokens"))})
            if llama_gguf is not None:
                rows += _llama_rows(llama_gguf, batch, context, prompts, args, base.get("decode_step_s"))
            if not args.no_session:
                step = _session_step(model, prompts, args.new_tokens, args.threads)
                rows.append({"batch": batch, "context": context, "engine": "mlaquant DecodeSession fp16",
                             "step_s": step, "step_vs_stock": _ratio(step, base.get("decode_step_s"))})
    report = {"rows": rows, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "shapes": SHAPES,
              "layers": args.layers, "dtype": args.dtype, "new_tokens": args.new_tokens, "threads": args.threads,
              "prefill": args.prefill, "stock_prefill_rows": args.stock_prefill_rows, "llama_cpp": llama_note}
    atomic_write(out / "report.json", json.dumps(report, indent=1))
    atomic_write(out / "report.md", _markdown(report))
    print(_markdown(report))
    return 0


def _llama_model(work: Path, args: argparse.Namespace, positions: int) -> tuple[Path | None, str]:
    """llama.cpp's GGUF of the bench model and the report's note on llama.cpp: the same attention, but the query
    through a rank-512 LoRA (DeepSeek-V3's q_a / q_b), since llama.cpp's deepseek2 loader takes a q_lora-free model
    at 26 or 27 layers only; f32 weights like vLLM's; converted by llama.cpp's own converter
    (`mlaquant.integrations.llamacpp.convert`). (None, why) where llama.cpp is not installed or not asked for."""
    from mlaquant.integrations import llamacpp

    if args.no_llama_cpp:
        return None, "left out (--no-llama-cpp)"
    why = llamacpp.unavailable()
    if why:
        return None, f"not run: {why}"
    from mlaquant.modeling.synthetic import write_checkpoint

    model = write_checkpoint(work / "model-qlora", shards=1, layers=args.layers, max_positions=positions,
                             **{**SHAPES, "q_lora_rank": LLAMA_Q_LORA_RANK})
    llamacpp.add_a_merge(model)
    import llama_cpp

    gguf = llamacpp.convert(model, work / "model-qlora.gguf")  # each run: --layers / shapes may differ from the last
    return gguf, (f"llama-cpp-python {llama_cpp.__version__}, the model with a rank-{LLAMA_Q_LORA_RANK} query LoRA "
                  "(its loader's condition), flash attention, q8_0 / q4_0 latent cache")


def _llama_rows(gguf: Path, batch: int, context: int, prompts: list, args: argparse.Namespace,
                stock_step: float | None) -> list[dict]:
    """llama.cpp's decode step (`llamacpp.decode_steps`, median) per latent cache type, on `args.threads` threads
    (its untimed prefill on every core)."""
    from mlaquant.integrations.llamacpp import decode_steps

    rows = []
    for cache in LLAMA_CACHES:
        _, steps = decode_steps(gguf, prompts, args.new_tokens, cache, args.threads)
        step = _median(steps)
        rows.append({"batch": batch, "context": context, "engine": f"llama.cpp {cache} latent", "step_s": step,
                     "step_vs_stock": _ratio(step, stock_step)})
    return rows


def _median(times: list[float]) -> float:
    """The middle of `times` (the upper one of an even count: vllm.run's convention)."""
    return sorted(times)[len(times) // 2]


def _ratio(a, b) -> float | None:
    return None if not a or not b else a / b


def _rows_text(rows: int | None) -> str:
    return f"{rows} query rows at a time (decode untouched)" if rows else "whole prompts, as vLLM has it"


def _markdown(report: dict) -> str:
    lines = [f"decode inside vLLM, {report['layers']} layers of 16 heads × (512 + 64), {report['dtype']} weights; "
             f"CPU capability {report['cpu_capability']}, {report['threads']} thread(s); "
             f"prefill: {report['prefill']} a step; vLLM CPU_MLA's prefill attention: "
             f"{_rows_text(report.get('stock_prefill_rows'))}; llama.cpp: {report['llama_cpp']}", "",
             "| batch | context | engine | decode step (ms) | vs vLLM CPU_MLA | KV capacity (tokens) | vs CPU_MLA |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        def fmt(x, f):
            return "" if x is None else format(x, f)
        step = r.get("error") or fmt(r["step_s"] and r["step_s"] * 1e3, ".2f")
        lines.append(f"| {r['batch']} | {r['context']} | {r['engine']} | {step} | {fmt(r['step_vs_stock'], '.2f')} | "
                     f"{fmt(r.get('capacity_tokens'), ',')} | {fmt(r.get('capacity_vs_stock'), '.2f')} |")
    return "\n".join(lines) + "\n"
