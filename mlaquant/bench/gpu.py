"""`mlaquant bench gpu --out DIR` (`mlaquant.bench.gpu`): one GPU acceptance run → report.md + report.json.

Sized for ≤ 8 minutes on one H100 / H200 (a target; the report records each step's wall time).

Steps, in order; each records its status (ok / failed / skipped, with the reason), wall time and peak
GPU memory, and a failure does not stop the later steps:

    tests     the CUDA test subset: kernels against the torch reference, DecodeSession greedy tokens
              triton = torch, the device tests (pytest in a subprocess; needs the repo's tests/: from an
              installed package, without a source checkout, the step is skipped and says so)
    kernels   `mlaquant bench kernels` at DeepSeek-V3 shapes (H = 128, d_c 512, d_r 64; CUDA only)
    calibrate `calibrate` (default config) and a short `sweep` on the bundled model on the device
    stream    `calibrate --stream` on a synthetic checkpoint with DeepSeek-V2-Lite layer shapes
              (mlaquant.modeling.synthetic), peak GPU memory against one layer's weights
    decode    decode tokens/s with FP16 / INT8 / INT4 latent caches at batch 32 × 8k context
    vllm      the vLLM plugin on the device (`--attention-backend CUSTOM` on CUDA): the bundled model under a uniform
              int4-row plan in vLLM, greedy tokens against DecodeSession's, vLLM's capacity and decode step; skipped,
              saying so, where vLLM is not importable (the plugin's CUDA path is then covered outside vLLM by
              tests/test_vllm_pages.py)

`--device cpu --quick` runs the same steps on tiny shapes (the suite runs it, so the pipeline cannot rot);
there, `kernels` is skipped (Triton timings need a GPU). Optional peers (bitsandbytes, quanto, HQQ) are left
out of the sweep; the report says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import mlaquant
from mlaquant.atomic import atomic_write
from mlaquant.device import add_device_arguments, dtype_name, peak_memory
from mlaquant.device import from_args as device_from_args
from mlaquant.versions import library_versions

REPO = Path(mlaquant.__file__).resolve().parents[1]
CUDA_TESTS = ["tests/test_kernel_mla_decode.py", "tests/test_kernel_int8_gemm.py", "tests/test_kernel_session.py"]
QUICK_TESTS = ["tests/test_device.py::test_resolution_and_cuda_refused_without_cuda"]
# DeepSeek-V2-Lite layer shapes for mlaquant.modeling.synthetic.config_dict (its MoE: 64 experts of 1408)
V2_LITE = dict(hidden=2048, heads=16, kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128, q_lora_rank=None,
               intermediate=10944, experts=64, moe_intermediate=1408)  # fmt: skip
TINY = dict(hidden=48, heads=4, kv_lora_rank=32, rope_dim=8, nope_dim=12, v_dim=12, q_lora_rank=24,
            intermediate=64, experts=4, moe_intermediate=16)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each step runs: full (the GPU acceptance run) or quick (tiny shapes, any device)."""

    calibrate: dict
    sweep_samples: int
    stream_layers: int
    stream_dims: dict
    stream_calibrate: dict
    decode_batch: int
    decode_context: int
    decode_steps: int

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        if quick:
            tiny_cal = dict(samples=4, seq_len=32, val_samples=2, test_samples=2, batch_size=2, narrow_trials=1,
                            long_seq_len=64, long_test_samples=1, shift_samples=1, shift_long_samples=1,
                            shift_val_samples=1,
                            try_clip=False, try_rotation=False,
                            candidates=("int8-g64/int8-g32", "fp16/fp16"))  # fmt: skip
            return cls(tiny_cal, 2, 2, TINY, tiny_cal, 2, 96, 3)
        stream_cal = dict(samples=32, seq_len=512, val_samples=8, test_samples=8, narrow_trials=2, long_test_samples=0,
                          shift_samples=0, shift_long_samples=0, shift_val_samples=0)
        return cls({}, 16, 4, V2_LITE, stream_cal, 32, 8192, 16)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for report.md + report.json (and step outputs)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (runs on CPU; what the test suite runs)")
    add_device_arguments(p)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(name: str, device: torch.device, fn: Callable[[], dict]) -> dict:
    """fn() → the step's numbers; adds status, seconds and peak memory. A step that raises is 'failed' with
    its one-line error; one that raises `Skip` is 'skipped' with the reason."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    try:
        out = {"status": "ok", **fn()}
    except Skip as e:
        out = {"status": "skipped", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 — the report records any failure and the run goes on
        out = {"status": "failed", "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    _sync(device)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out |= peak_memory(device)
    print(f"bench gpu: {name}: {out['status']} in {out['seconds']} s", file=sys.stderr, flush=True)
    return {"step": name, **out}


class Skip(Exception):
    """A step that cannot run here (missing GPU, test files or optional package); the message says why."""


def step_tests(device: torch.device, quick: bool) -> dict:
    files = QUICK_TESTS if quick else [*CUDA_TESTS, "tests/test_device.py", "tests/test_session.py"]
    if not all((REPO / f.split("::")[0]).is_file() for f in files):
        raise Skip("needs a source checkout (tests/ not found)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" or device.type != "cuda"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *files]  # -q comes from pyproject
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if any(w in ln for w in ("passed", "failed", "error"))]
    summary = lines[-1].strip("= ") if lines else "(no summary)"
    if proc.returncode != 0:
        raise RuntimeError(f"pytest exit {proc.returncode}: {summary}")
    return {"files": files, "summary": summary}


def step_kernels(device: torch.device, quick: bool, out: Path) -> dict:
    if device.type != "cuda":
        raise Skip("Triton kernel timings need a CUDA GPU (the tests step checks the kernels' numbers)")
    from mlaquant.bench import kernels as kernel_bench

    p = argparse.ArgumentParser()
    kernel_bench.add_arguments(p)
    args = p.parse_args(["--out", str(out / "kernels.md"), "--heads", "128", "--batches", "1,32",
                         "--contexts", "4096,16384", "--time-budget", "120"])  # fmt: skip
    kernel_bench.run(args)
    rows = json.loads((out / "kernels.md.json").read_text()) if (out / "kernels.md.json").exists() else None
    return {"report": "kernels.md", "rows": rows}


def step_calibrate(device: torch.device, dtype: torch.dtype, sizes: Sizes, out: Path) -> dict:
    from mlaquant.calib.calibrate import CalibrateConfig, calibrate
    from mlaquant.calib.sweep import load_sweep_config, sweep
    from mlaquant.modeling.loader import load_model

    model = load_model(None, device, dtype)
    plan, report = calibrate(model, CalibrateConfig(**sizes.calibrate), quiet=True)
    plan.save(out / "plan")
    cal = {k: report[k] for k in ("seconds", "peak_rss_mib", "peak_gpu_mib", "test") if k in report}
    t0 = time.perf_counter()
    overrides = {"codecs": ["fp16", "int8", "int4"], "peers": [], "budgets": [], "samples": sizes.sweep_samples}
    if sizes.calibrate:  # quick: short samples, one codec, no window rows, a short decode timing
        overrides |= {"seq_len": sizes.calibrate["seq_len"], "codecs": ["int4"], "window": 0}
        overrides |= {"decode_context": 16, "decode_steps": 2}
    swept = sweep(model, load_sweep_config(None, overrides), out / "sweep", None, [str(out / "plan")], quiet=True)
    rows = {r.get("codec", r.get("label")): r.get("metrics", {}).get("loss") for r in swept.get("rows", [])}
    return {
        "calibrate": cal,
        "bits_per_value": round(plan.bits_per_value(), 3),
        "sweep_seconds": round(time.perf_counter() - t0, 2),
        "sweep_loss": rows,
        "sweep_note": "peers off (bitsandbytes / quanto / HQQ are optional and not in the GPU image)",
    }


def layer_bytes(model, dtype: torch.dtype, layer: int) -> int:
    """Bytes of decoder layer `layer`'s weights in `dtype` (what sequential onloading holds on the device)."""
    meta = model._meta.layers[layer] if hasattr(model, "_meta") else model.layers[layer]
    size = torch.empty(0, dtype=dtype, device="meta").element_size()
    return sum(p.numel() for p in meta.parameters()) * size


def step_stream(device: torch.device, dtype: torch.dtype, sizes: Sizes, ckpt: Path) -> dict:
    from mlaquant.calib.calibrate import CalibrateConfig, calibrate
    from mlaquant.modeling.stream import StreamedModel
    from mlaquant.modeling.synthetic import write_checkpoint

    t0 = time.perf_counter()
    write_checkpoint(ckpt, layers=sizes.stream_layers, shards=2, **sizes.stream_dims)
    written = round(time.perf_counter() - t0, 2)
    model = StreamedModel(ckpt, dtype, device=device)
    plan, report = calibrate(model, CalibrateConfig(**sizes.stream_calibrate), quiet=True)
    one_layer = layer_bytes(model, model.dtype, sizes.stream_layers - 1)
    out = {"layers": sizes.stream_layers, "shapes": sizes.stream_dims, "checkpoint_seconds": written}
    out |= {k: report[k] for k in ("seconds", "peak_rss_mib", "peak_gpu_mib", "test") if k in report}
    out["one_layer_mib"] = round(one_layer / 2**20, 1)
    if "peak_gpu_mib" in out:
        out["peak_gpu_over_one_layer"] = round(out["peak_gpu_mib"] / out["one_layer_mib"], 2)
    out["max_resident_layers"] = model.max_resident_layers
    return out


def step_decode(device: torch.device, dtype: torch.dtype, sizes: Sizes, ckpt: Path) -> dict:
    from mlaquant.attention.backends import resolve_backend
    from mlaquant.modeling.loader import load_model
    from mlaquant.runtime.cache import LatentCache
    from mlaquant.runtime.session import DecodeSession

    if not (ckpt / "config.json").is_file():
        raise Skip("needs the stream step's synthetic checkpoint")
    model = load_model(ckpt, device, dtype)
    B, T, width = sizes.decode_batch, sizes.decode_context, model.cfg.latent_dim
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = torch.randn(T, width, generator=gen, device="cpu").to(device)  # the same rows in every sequence
    out = {"batch": B, "context": T, "layers": model.cfg.num_hidden_layers, "tokens_per_s": {}}
    for codec in ("fp16", "int8", "int4"):
        session = DecodeSession(model, plan=codec)
        session.cache = LatentCache(session.codecs, B, session.runtime.block_size, device)
        for layer in range(len(model.layers)):
            for b in range(B):
                session.cache.write(layer, b, rows)
        session.lengths = [T] * B
        nxt = torch.ones(B, dtype=torch.long, device=device)
        session.decode(nxt)  # warm-up (and kernel compilation)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(sizes.decode_steps):
            session.decode(nxt)
        _sync(device)
        out["tokens_per_s"][codec] = round(B * sizes.decode_steps / (time.perf_counter() - t0), 1)
        out[f"{codec}_backend"] = resolve_backend(session.backend, device).value
        del session
    return out


def step_vllm(device: torch.device, out: Path) -> dict:
    """The plugin inside vLLM on `device` (module docstring)."""
    import importlib.util

    from mlaquant.modeling.loader import default_model_path, load_model
    from mlaquant.runtime.plan import Plan
    from mlaquant.runtime.session import generate

    if importlib.util.find_spec("vllm") is None:
        raise Skip("vLLM is not importable on this machine: the plugin's CUDA path ran outside vLLM only "
                   "(tests/test_vllm_pages.py)")
    work = out / "vllm"
    work.mkdir(parents=True, exist_ok=True)
    plan = Plan.uniform("int4-row/int4-row", 4).save(work / "plan")
    model = load_model(None, device)
    prompts = [model.tokenizer.encode(t).ids for t in ("def fib(n):", "import torch\nclass Net(", "for i in range(")]
    (work / "prompts.json").write_text(json.dumps({"prompts": prompts}))
    cmd = [sys.executable, "-m", "mlaquant.integrations.vllm.run", "--model", str(default_model_path()), "--plan",
           str(plan), "--prompts", str(work / "prompts.json"), "--max-tokens", "32", "--out", str(work / "run.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "vllm.run failed")
    report = json.loads((work / "run.json").read_text())
    want = generate(model, prompts, 32, plan=plan)
    return {"tokens_equal": report["tokens"] == want, "capacity_tokens": report["capacity_tokens"],
            "decode_step_s": report["decode_step_s"], "vllm": report["vllm"]}


def render(report: dict) -> str:
    """report.md: one table row per step, then each step's numbers as JSON."""
    m = report["meta"]
    quick = ", quick" if m["quick"] else ""
    lines = [
        f"# mlaquant bench gpu — {m['device_name']} ({m['device']}, {m['dtype']} weights{quick})",
        "",
        f"{m['date']}; mlaquant {m['mlaquant']}, torch {m['torch']}, triton {m['triton']}, python {m['python']}; "
        f"total {report['seconds']} s",
        "",
        "| step | status | seconds | peak GPU MiB | peak RSS MiB | note |",
        "|---|---|---|---|---|---|",
    ]
    for s in report["steps"]:
        note = s.get("reason", "")
        lines.append(
            f"| {s['step']} | {s['status']} | {s['seconds']} | {s.get('peak_gpu_mib', '—')} | {s['peak_rss_mib']} "
            f"| {note} |"
        )
    for s in report["steps"]:
        lines += ["", f"## {s['step']}", "", "```json", json.dumps(s, indent=2, default=str), "```"]
    return "\n".join(lines) + "\n"


def _meta(device: torch.device, dtype: torch.dtype, quick: bool) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "device": str(device), "device_name": name, "dtype": dtype_name(dtype), "quick": quick,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **library_versions("triton"),
    }  # fmt: skip


def bench_gpu(out: Path, device: torch.device, dtype: torch.dtype, quick: bool) -> dict:
    """Run every step into `out`; returns the report (also written as report.json + report.md)."""
    sizes, t0 = Sizes.of(quick), time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlaquant-bench-gpu-") as tmp:
        ckpt = Path(tmp) / "v2lite-shaped"
        steps = [
            run_step("tests", device, lambda: step_tests(device, quick)),
            run_step("kernels", device, lambda: step_kernels(device, quick, out)),
            run_step("calibrate", device, lambda: step_calibrate(device, dtype, sizes, out)),
            run_step("stream", device, lambda: step_stream(device, dtype, sizes, ckpt)),
            run_step("decode", device, lambda: step_decode(device, dtype, sizes, ckpt)),
            run_step("vllm", device, lambda: step_vllm(device, out)),
        ]
    report = {"meta": _meta(device, dtype, quick), "steps": steps, "seconds": round(time.perf_counter() - t0, 1)}
    atomic_write(out / "report.json", json.dumps(report, indent=2, default=str) + "\n")
    atomic_write(out / "report.md", render(report))
    return report


def run(args: argparse.Namespace) -> int:
    device, dtype = device_from_args(args)
    report = bench_gpu(Path(args.out), device, dtype, args.quick)
    print(render(report).split("\n## ")[0])
    print(f"report written to {args.out}/report.md (+ report.json)")
    return 0 if all(s["status"] != "failed" for s in report["steps"]) else 1

