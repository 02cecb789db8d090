"""`mlaquant bench vllm --out DIR`: decode speed and KV capacity inside vLLM, the plugin against vLLM's own backend.

A DeepSeek-V2-Lite-shaped attention (16 heads, d_c 512, d_r 64; `--layers` layers, a small MoE, synthetic weights:
`mlaquant.modeling.synthetic`) served by vLLM on the CPU, per model dtype (`--dtypes`: FP32 and BF16 caches for
vLLM's own backend) × batch × context: vLLM's own `CPU_MLA` (the model dtype's cache; under the plugin's CPU RoPE
fix, which does not touch its speed, and with its prefill attention run `--stock-prefill-rows` query rows at a
time, the same math, so that a 16k prompt fits in 24 GB; its decode is untouched: `vllm.patches.bound_cpu_prefill`),
vLLM's `AMX_MLA` where the CPU has AMX tiles (else the report says so), and the plugin with each plan of
`--codecs` (uniform plans, one codec pair per layer, each exported as a directory that declares it, as users serve
it), with `--ngram N` also under vLLM's n-gram speculative decoding. Each row is one vLLM launch
(`mlaquant.integrations.vllm.run`, eager or with `--compiled` vLLM's default compiled mode) on `batch` random
prompts of `context` tokens stepped through vLLM's engine: one decode step of the batch (the median of the
scheduler steps in which every request decoded, `vllm.run --time-decode`), the part of it spent in decode attention
(every layer's `forward_mqa`, `vllm.run --time-attention`) and the rest (projections, MoE, sampling, scheduling),
vLLM's KV capacity for the run's cache memory, and the start-up (LLM construction: model load, the plugin's checks
and kernel build, KV cache). A long prefill step is not cut off by vLLM's step timeout (VLLM_EXECUTE_MODEL_TIMEOUT_
SECONDS, 300 s by default, which a 16 × 4,096-token BF16 prefill in one step outlasts on a 2-core CPU: the launch
then dies with "RPC call to execute_model timed out"): the bench sets it to STEP_TIMEOUT_S. A launch that fails is
reported by its root cause (`launch_failure`). mlaquant's own `DecodeSession` on the same model and prompts is timed
beside them (its
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
from mlaquant.integrations.vllm.settings import PREFILL_ROWS_ENV

SHAPES = dict(hidden=1024, heads=16, kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128, q_lora_rank=None,
              intermediate=1024, experts=4, moe_intermediate=256)  # fmt: skip
LLAMA_CACHES = ("q8_0", "q4_0")
LLAMA_Q_LORA_RANK = 512
DEFAULT_CODECS = ("fp16", "int8-row/int8-row", "int4-row/int4-row", "band-4x64-3x128-2x64-0x256/int4-row")
STEP_TIMEOUT_S = 7200  # vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS for the bench's launches (module docstring)
# lines of a failed launch that wrap the root cause rather than say it
WRAPPERS = ("EngineDeadError", "Engine core initialization failed", "See stack trace", "EngineCore encountered",
            "WorkerProc failed to start", "Executor failed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for report.md / report.json and the synthetic model")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--contexts", default="1024,4096", help="prompt tokens per sequence (the issue's: 4096,16384)")
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS), help="plugin plans, one uniform codec pair each")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps per run")
    p.add_argument("--dtypes", default="float32",
                   help="model dtypes in vLLM, comma-separated (float32,bfloat16): CPU_MLA caches in it")
    p.add_argument("--compiled", action="store_true", help="vLLM's default compiled mode (default: eager)")
    p.add_argument("--ngram", type=int, default=0,
                   help="also each plugin codec under vLLM's n-gram speculative decoding, N tokens a step")
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
    env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(STEP_TIMEOUT_S))
    if prefill_rows:
        env[PREFILL_ROWS_ENV] = str(prefill_rows)
    cmd = [python, "-m", "mlaquant.integrations.vllm.run", "--model", str(model), "--prompts", str(inp),
           "--max-tokens", str(new), "--kv-cache-memory", str(memory), "--dtype", dtype,
           "--max-model-len", str(model_len), "--time-decode", "--time-attention", *flags,
           "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": launch_failure(done.stdout + "\n" + done.stderr, done.returncode)}
    return json.loads(out.read_text())


def launch_failure(output: str, returncode: int) -> str:
    """Why a vLLM launch failed, one line of its output (vLLM logs to stdout, tracebacks go to stderr: both, in that
    order): a worker that died (the kernel's OOM killer leaves no traceback, and the last error is then the engine's
    EngineDeadError), else the last exception that is not one of vLLM's wrappers around it (`WRAPPERS`: "See stack
    trace (above) for the root cause"), else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    died = [ln for ln in lines if "died unexpectedly" in ln]
    if died:
        return died[-1].split("] ", 1)[-1]
    errors = [ln.split("] ", 1)[-1] for ln in lines if "Error" in ln or "Exception" in ln]
    causes = [ln for ln in errors if not any(w in ln for w in WRAPPERS) and not ln.startswith(("File ", "raise "))]
    if causes or errors:
        return (causes or errors)[-1]
    return lines[-1] if lines else f"rc {returncode}"


def served_plans(work: Path, model_dir: Path, codecs: list[str], layers: int) -> dict[str, Path]:
    """Each codec as a uniform plan exported with the model (`mlaquant export --codecs plan`): the directory a user
    serves, whose config.json declares the plan; the export's checkpoint sample is what the plugin checks at
    start-up."""
    import shutil

    from mlaquant.integrations.export import export_plan
    from mlaquant.runtime.plan import Plan

    served = {}
    for codec in codecs:
        name = codec.replace("/", "_")
        plan = Plan.uniform(codec, layers).save(work / "plans" / name)
        out = work / "served" / name
        shutil.rmtree(out, ignore_errors=True)
        export_plan(argparse.Namespace(engine="vllm", plan=str(plan), out=str(out), model=str(model_dir), copy=False))
        served[codec] = out
    return served


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


def _engines(plans: dict[str, Path], args: argparse.Namespace, amx: bool) -> list[tuple[str, Path | None, tuple]]:
    """(row name, model directory or None for the synthetic model, run flags) of every vLLM launch of a cell."""
    stock = ("--stock", "--rope-fix")
    engines = [("vLLM CPU_MLA", None, stock)]
    if amx:
        engines.append(("vLLM AMX_MLA", None, (*stock, "--attention-backend", "AMX_MLA")))
    for codec, served in plans.items():
        engines.append((f"plugin {codec}", served, ()))
        if args.ngram:
            engines.append((f"plugin {codec} + ngram {args.ngram}", served, ("--ngram", str(args.ngram))))
    return engines


def _row(batch: int, context: int, dtype: str, name: str, r: dict, base: dict) -> dict:
    step, attention = r.get("decode_step_s"), r.get("decode_attention_s")
    return {"batch": batch, "context": context, "dtype": dtype, "engine": name, "step_s": step,
            "attention_s": attention, "rest_s": None if step is None or attention is None else step - attention,
            "capacity_tokens": r.get("capacity_tokens"), "error": r.get("error"), "load_s": r.get("load_s"),
            "cpu_capability": r.get("cpu_capability"), "spec_decode": r.get("spec_decode") or None,
            "tokens_per_step": r.get("tokens_per_step"),
            "step_vs_stock": _ratio(step, base.get("decode_step_s")),
            "capacity_vs_stock": _ratio(r.get("capacity_tokens"), base.get("capacity_tokens"))}


def run(args: argparse.Namespace) -> int:
    from mlaquant.modeling.loader import load_model
    from mlaquant.modeling.synthetic import write_checkpoint

    contexts, batches, dtypes = _ints(args.contexts), _ints(args.batches), args.dtypes.split(",")
    if args.prefill == "one" and args.new_tokens <= 2 * max(batches):
        raise MLAQuantError(f"bench vllm: --prefill one needs --new-tokens > 2 x the largest batch ({max(batches)}): "
                            "the first prompts decode while the others prefill, one a step")
    python = vllm_python(args.vllm_python)
    out = Path(args.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    positions = max(batches) * (max(contexts) + args.new_tokens + 64)  # ≥ any max_model_len below
    model_dir = write_checkpoint(work / "model", shards=1, layers=args.layers, max_positions=positions, **SHAPES)
    plans = served_plans(work, model_dir, args.codecs.split(","), args.layers)
    amx = torch.cpu._is_amx_tile_supported()
    model = load_model(model_dir)
    llama_gguf, llama_note = _llama_model(work, args, positions)
    mode = ("--compiled",) if args.compiled else ()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for context in contexts:
        for batch in batches:
            prompts = torch.randint(1, 320, (batch, context), generator=gen).tolist()
            memory = 2 * batch * (context + args.new_tokens + 32) * args.layers * 576 * 4  # room at FP32, twice
            # vLLM's CPU build prefills up to max_model_len tokens a step for MLA (vllm/platforms/cpu.py)
            model_len = (batch if args.prefill == "batch" else 1) * (context + args.new_tokens + 16)
            for dtype in dtypes:
                tag, base = f"b{batch}_c{context}_{dtype}", None
                for name, served, flags in _engines(plans, args, amx):
                    r = _launch(python, work, f"{tag}_{name.replace(' ', '_').replace('/', '_')}",
                                served or model_dir, prompts, args.new_tokens, memory, dtype, args.threads,
                                model_len, *mode, *flags, prefill_rows=0 if served else args.stock_prefill_rows)
                    base = base or r
                    rows.append(_row(batch, context, dtype, name, r, base))
                if llama_gguf is not None and dtype == dtypes[0]:
                    rows += _llama_rows(llama_gguf, batch, context, prompts, args, base.get("decode_step_s"))
                if not args.no_session and dtype == "float32":
                    step = _session_step(model, prompts, args.new_tokens, args.threads)
                    rows.append({"batch": batch, "context": context, "dtype": dtype,
                                 "engine": "mlaquant DecodeSession fp16", "step_s": step,
                                 "step_vs_stock": _ratio(step, base.get("decode_step_s"))})
    report = {"rows": rows, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "shapes": SHAPES,
              "layers": args.layers, "dtypes": dtypes, "new_tokens": args.new_tokens, "threads": args.threads,
              "prefill": args.prefill, "stock_prefill_rows": args.stock_prefill_rows, "llama_cpp": llama_note,
              "compiled": args.compiled, "amx": amx, "startup": _startup(rows)}
    atomic_write(out / "report.json", json.dumps(report, indent=1))
    atomic_write(out / "report.md", _markdown(report))
    print(_markdown(report))
    return 0


def _startup(rows: list[dict]) -> dict | None:
    """The plugin's start-up overhead over vLLM's own backend: the medians of their launches' LLM construction
    times (model load, the plugin's plan load, checkpoint-sample check and kernel build, the KV cache) and the
    difference."""
    stock = [r["load_s"] for r in rows if r.get("load_s") and r["engine"] == "vLLM CPU_MLA"]
    plugin = [r["load_s"] for r in rows if r.get("load_s") and r["engine"].startswith("plugin ")]
    if not stock or not plugin:
        return None
    return {"stock_s": _median(stock), "plugin_s": _median(plugin), "overhead_s": _median(plugin) - _median(stock),
            "launches": [len(stock), len(plugin)]}


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
    amx = "AMX_MLA beside it" if report["amx"] else "AMX_MLA not run (this CPU has no AMX tiles)"
    mode = "vLLM's default compiled mode" if report["compiled"] else "eager (enforce_eager)"
    lines = [f"decode inside vLLM, {report['layers']} layers of 16 heads × (512 + 64), weights "
             f"{' / '.join(report['dtypes'])}; CPU capability {report['cpu_capability']}, {report['threads']} "
             f"thread(s); {mode}; prefill: {report['prefill']} a step; vLLM CPU_MLA's prefill attention: "
             f"{_rows_text(report.get('stock_prefill_rows'))}; {amx}; llama.cpp: {report['llama_cpp']}", "",
             "| batch | context | dtype | engine | decode step (ms) | attention (ms) | rest (ms) | vs vLLM CPU_MLA "
             "| KV capacity (tokens) | vs CPU_MLA | start-up (s) | spec. accepted / drafted | tokens / step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(x, f, scale=1):
        return "" if x is None else format(x * scale, f)

    for r in report["rows"]:
        step = r.get("error") or fmt(r["step_s"], ".2f", 1e3)
        spec = r.get("spec_decode") or {}
        accepted = f"{spec.get('accepted_tokens', 0)} / {spec['draft_tokens']}" if "draft_tokens" in spec else ""
        lines.append(f"| {r['batch']} | {r['context']} | {r.get('dtype', '')} | {r['engine']} | {step} | "
                     f"{fmt(r.get('attention_s'), '.2f', 1e3)} | {fmt(r.get('rest_s'), '.2f', 1e3)} | "
                     f"{fmt(r['step_vs_stock'], '.2f')} | {fmt(r.get('capacity_tokens'), ',')} | "
                     f"{fmt(r.get('capacity_vs_stock'), '.2f')} | {fmt(r.get('load_s'), '.1f')} | {accepted} | "
                     f"{fmt(r.get('tokens_per_step'), '.2f')} |")
    s = report.get("startup")
    if s:
        lines += ["", f"start-up (LLM construction, median of {s['launches'][0]} / {s['launches'][1]} launches): "
                      f"vLLM CPU_MLA {s['stock_s']:.1f} s, plugin {s['plugin_s']:.1f} s: overhead "
                      f"{s['overhead_s']:+.1f} s"]
    return "\n".join(lines) + "\n"
