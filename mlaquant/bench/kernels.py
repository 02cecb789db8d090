"""`mlaquant bench kernels`: the Triton kernels timed on a CUDA GPU, beside baselines timed in the same run.

    mlaquant bench kernels [--out runs/bench_kernels.md]      (≤ 5 minutes on one GPU by default)
    mlaquant bench kernels --aot sm_90a,sm_80 [--json PATH]   (no GPU: compiled code + cost model, kernels/aot.py)

MLA decode at DeepSeek-V3 shapes (H = 128 and 16, d_c 512, d_r 64), batch 1/8/32/128, context 1k-64k, one
row per cache codec (FP16, INT8, INT4 latent; RoPE part FP16 by default): time per call, achieved bandwidth
(cache bytes + query/output/partials) and TFLOP/s against the device peak, and the speedup of each quantized
codec over the FP16 kernel at the same shape. Baseline: torch SDPA over K/V expanded to H heads (FP16; the
expansion itself is not timed, so this is the baseline's best case; skipped where the expanded K/V exceed
`--sdpa-max-gb`). W8A8 GEMM at DeepSeek-V3 projection shapes against bitsandbytes' LLM.int8() ops
(`int8_vectorwise_quant` + `int8_linear_matmul` + `int8_mm_dequant`, activation quantization included on
both sides) and an FP16 cuBLAS matmul.

Device peaks are spec-sheet values for the GPUs in `SPEC_PEAKS` (dense, no sparsity), else absent; the
measured device-to-device copy bandwidth is always reported beside them. Timing is
`triton.testing.do_bench` (median, L2 flushed between calls). Without CUDA the command refuses with a
BackendError: there is no CPU fallback for timings, and no number in the report is estimated.
Writes a Markdown table and the same rows as JSON (`<out>.json`), atomically.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mlaquant.atomic import atomic_write
from mlaquant.errors import BackendError
from mlaquant.versions import library_versions

# name substring -> (HBM TB/s, dense FP16 tensor TFLOP/s, dense INT8 tensor TOP/s); first match wins.
SPEC_PEAKS = [
    ("H200", (4.8, 989.0, 1979.0)),
    ("H100 PCIe", (2.0, 756.0, 1513.0)),
    ("H100", (3.35, 989.0, 1979.0)),
    ("H800", (3.35, 989.0, 1979.0)),
    ("A100-SXM4-80GB", (2.039, 312.0, 624.0)),
    ("A100", (1.555, 312.0, 624.0)),
    ("L40S", (0.864, 362.0, 733.0)),
]
DEFAULT_CODECS = "fp16/fp16,int8-g64/fp16,int4-g32/fp16"
BASE_ROWS = 1024  # at most this many distinct encoded rows tiled through a pool (values don't change timing)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/bench_kernels.md", help="Markdown report (JSON written beside it)")
    p.add_argument("--heads", default="128,16", help="comma-separated head counts")
    p.add_argument("--batches", default="1,8,32,128", help="comma-separated batch sizes")
    p.add_argument("--contexts", default="1024,4096,16384,65536", help="comma-separated context lengths")
    p.add_argument("--codecs", default=DEFAULT_CODECS, help="c_kv/k_pe codec pairs, the first is the base")
    p.add_argument("--d-c", type=int, default=512, help="kv_lora_rank")
    p.add_argument("--d-r", type=int, default=64, help="qk_rope_head_dim")
    p.add_argument("--d-n", type=int, default=128, help="qk_nope_head_dim (SDPA baseline)")
    p.add_argument("--d-v", type=int, default=128, help="v_head_dim (SDPA baseline)")
    p.add_argument("--gemm-shapes", default="16384x7168,1536x24576",
                   help="KxN weight shapes (DeepSeek-V3 o_proj, q_b_proj); M runs over --batches")
    p.add_argument("--sdpa-max-gb", type=float, default=16.0, help="skip SDPA where expanded K/V exceed this")
    p.add_argument("--rep-ms", type=int, default=40, help="do_bench repetition time per measurement")
    p.add_argument("--time-budget", type=float, default=270.0, help="seconds; later measurements are skipped")
    p.add_argument("--aot", default=None, metavar="TARGETS",
                   help="no GPU: compile every kernel variant for these targets (e.g. sm_90a,sm_80) and report "
                        "registers, spills, MMA kinds and the cost model's predicted times (mlaquant.kernels.aot)")
    p.add_argument("--json", default=None, help="with --aot: also write the rows as JSON here")


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"bench kernels: --{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"bench kernels: --{name} needs positive integers, got {text!r}")
    return values


def _require_cuda() -> None:
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        raise BackendError("bench kernels: TRITON_INTERPRET is set; timings need compiled kernels on a GPU")
    if not torch.cuda.is_available():
        raise BackendError("bench kernels needs a CUDA GPU and none is visible (no CPU timings are produced)")


class _Clock:
    """Median time (ms) of fn through `timer`, until the budget runs out (then None)."""

    def __init__(self, timer: Callable[[Callable[[], object]], float], budget_s: float) -> None:
        self.timer, self.deadline = timer, time.monotonic() + budget_s

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def __call__(self, fn: Callable[[], object]) -> float | None:
        return None if self.expired() else float(self.timer(fn))


def _peaks(device: torch.device) -> tuple[str, tuple[float, float, float] | None]:
    if device.type != "cuda":
        return device.type, None
    name = torch.cuda.get_device_name(device)
    return name, next((peak for key, peak in SPEC_PEAKS if key in name), None)


def _pool(codec, n_rows: int, block: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n_rows / block, block, row_bytes]: a few encoded random latents tiled through the pool."""
    d, distinct = codec.width, math.gcd(n_rows, BASE_ROWS)
    rows = torch.randn(distinct, d, generator=gen) * torch.exp(torch.randn(d, generator=gen) * 0.5)
    base = codec.encode(rows).to(device)
    pool = torch.empty(n_rows // block, block, codec.row_bytes, dtype=torch.uint8, device=device)
    pool.view(-1, distinct, codec.row_bytes).copy_(base.expand(n_rows // distinct, -1, -1))
    return pool


def decode_rows(
    heads: list[int], batches: list[int], contexts: list[int], codecs: list[str], dims: dict[str, int],
    device: torch.device, clock: _Clock, sdpa_max_gb: float, peaks: tuple[float, float, float] | None,
) -> list[dict]:
    """Time mla_decode per (H, B, context, codec) and the expanded SDPA baseline; one dict per row."""
    from mlaquant.kernels import mla_decode as K
    from mlaquant.quant.codecs import LayerCodec, split_pair

    d_c, d_r = dims["d_c"], dims["d_r"]
    scale = (dims["d_n"] + d_r) ** -0.5
    gen = torch.Generator().manual_seed(0)
    layer_codecs = [LayerCodec.from_names(*split_pair(name), d_c, d_r) for name in codecs]
    config = K.load_kernel_config()  # what K.mla_decode runs with by default, for the chunk column
    rows: list[dict] = []
    for h in heads:
        for b in batches:
            for ctx in contexts:
                shape = {"heads": h, "batch": b, "context": ctx}
                if ctx % K.PAGE_TOKENS:
                    raise ValueError(f"bench kernels: contexts must be multiples of 64, got {ctx}")
                q = (torch.randn(b, h, d_c + d_r, generator=gen) * 0.5).to(device, torch.float16)
                lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
                base_ms = None
                for name, codec in zip(codecs, layer_codecs):
                    row = {"kind": "mla_decode", "codec": name, **shape, "bytes_per_token": codec.row_bytes}
                    need = b * ctx * codec.row_bytes
                    if clock.expired():
                        rows.append({**row, "skipped": "time budget"})
                        continue
                    if device.type == "cuda" and need > 0.6 * torch.cuda.mem_get_info(device)[0]:
                        rows.append({**row, "skipped": f"cache needs {need / 2**30:.1f} GiB"})
                        continue
                    pool = _pool(codec, b * ctx, K.PAGE_TOKENS, device, gen)
                    table = torch.randperm(pool.shape[0], generator=gen).view(b, -1).to(device, torch.int32)
                    n_sm = K.sm_count(device.index or 0) if device.type == "cuda" else None
                    chunk = K.schedule_chunk(config, b, h, ctx, n_sm, codec)
                    n_split = -(-ctx // chunk)
                    ms = clock(functools.partial(K.mla_decode, q, pool, table, lens, codec, d_c, scale,
                                                 max_seq_len=ctx))
                    del pool, table
                    if ms is None:
                        rows.append({**row, "skipped": "time budget"})
                        continue
                    partials = 2 * b * h * n_split * (d_c + 1) * 4 if n_split > 1 else 0
                    moved = need + q.numel() * 2 + b * h * (d_c + 1) * 4 + partials
                    flops = 2 * b * h * ctx * (2 * d_c + d_r)
                    base_ms = ms if name == codecs[0] else base_ms
                    speedup = {"speedup_vs_base": base_ms / ms} if base_ms is not None else {}
                    rows.append({**row, "chunk_tokens": chunk, **_rates(ms, moved, flops, peaks, int8=False),
                                 **speedup, **_prediction(name, h, b, ctx, device, dims)})
                rows.append(_sdpa_row(shape, dims, scale, device, clock, sdpa_max_gb, peaks, base_ms))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _prediction(name: str, heads: int, batch: int, context: int, device: torch.device, dims: dict) -> dict:
    """The cost model's time for a measured row (`kernels/aot.py` `predict_measured`: the same launch compiled for
    this GPU's target), as {"predicted_us", "predicted_bound"}, or {"predicted": why there is none}."""
    from mlaquant.kernels import aot

    if device.type != "cuda" or (dims["d_c"], dims["d_r"]) != (aot.D_C, aot.D_R):
        return {"predicted": f"n/a: the cost model is for CUDA at d_c {aot.D_C}, d_r {aot.D_R}"}
    try:
        p = aot.predict_measured(name, heads, batch, context, torch.cuda.get_device_name(device))
    except Exception as e:  # a failed compile must not cost the measurement beside it
        return {"predicted": f"n/a: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    if p is None:
        return {"predicted": f"n/a: no cost-model device for {torch.cuda.get_device_name(device)}"}
    return {"predicted_us": p["us"], "predicted_bound": p["bound"]}


def _sdpa_row(shape, dims, scale, device, clock, max_gb, peaks, base_ms: float | None) -> dict:
    """torch SDPA with the query and K/V expanded to H heads (what a non-absorbed decode attends over);
    `speedup_vs_base` < 1 means our first-codec kernel is faster."""
    b, h, ctx = shape["batch"], shape["heads"], shape["context"]
    dk, dv = dims["d_n"] + dims["d_r"], dims["d_v"]
    row = {"kind": "sdpa_expanded", "codec": "fp16 (expanded K/V)", **shape,
           "bytes_per_token": h * (dk + dv) * 2}
    need = b * h * ctx * (dk + dv) * 2
    if need > max_gb * 2**30:
        return {**row, "skipped": f"expanded K/V need {need / 2**30:.0f} GiB > --sdpa-max-gb"}
    if clock.expired():
        return {**row, "skipped": "time budget"}
    # Drawn on the device: gigabytes of CPU random numbers would dominate the run.
    k = torch.randn(b, h, ctx, dk, device=device, dtype=torch.float16)
    v = torch.randn(b, h, ctx, dv, device=device, dtype=torch.float16)
    q = torch.randn(b, h, 1, dk, device=device, dtype=torch.float16)
    ms = clock(functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, scale=scale))
    if ms is None:
        return {**row, "skipped": "time budget"}
    speedup = {"speedup_vs_base": base_ms / ms} if base_ms is not None else {}
    return {**row, **_rates(ms, need, 2 * b * h * ctx * (dk + dv), peaks, int8=False), **speedup}


def gemm_rows(
    batches: list[int], shapes: list[tuple[int, int]], device: torch.device, clock: _Clock,
    peaks: tuple[float, float, float] | None,
) -> list[dict]:
    """Time int8_gemm, bitsandbytes' int8 path and an FP16 matmul per (M, K, N)."""
    from mlaquant.kernels import int8_gemm as G

    try:
        import bitsandbytes.functional as bnb
    except ImportError:
        bnb = None
    gen = torch.Generator().manual_seed(1)
    rows: list[dict] = []
    for k, n in shapes:
        w = (torch.randn(n, k, generator=gen) * 0.02).to(device, torch.float16)
        w8, ws = G.quantize_weight_per_channel(w)
        cb = scb = None
        if bnb is not None:
            cb, scb, _ = bnb.int8_vectorwise_quant(w.clone())
        for m in batches:
            x = torch.randn(m, k, generator=gen).to(device, torch.float16)
            shape = {"m": m, "k": k, "n": n}
            flops = 2 * m * n * k
            moved = m * k * 2 + n * k + m * n * 2
            base = clock(functools.partial(torch.matmul, x, w.T))
            candidates = [("fp16_matmul", base, False, n * k)]  # its weight has 2 bytes per value
            ours = clock(functools.partial(G.int8_gemm, x, w8, ws, torch.float16))
            candidates.append(("int8_gemm", ours, True, 0))
            if bnb is None:
                rows.append({"kind": "bnb_int8", **shape, "skipped": "bitsandbytes not installed"})
            else:
                def bnb_call(x=x, cb=cb, scb=scb):
                    ca, sca, _ = bnb.int8_vectorwise_quant(x)
                    return bnb.int8_mm_dequant(bnb.int8_linear_matmul(ca, cb), sca, scb)

                try:
                    candidates.append(("bnb_int8", clock(bnb_call), True, 0))
                except (RuntimeError, NotImplementedError) as e:  # bitsandbytes without this device's kernels
                    rows.append({"kind": "bnb_int8", **shape, "skipped": f"bitsandbytes failed: {e}"[:120]})
            for kind, ms, int8, extra_bytes in candidates:
                if ms is None:
                    rows.append({"kind": kind, **shape, "skipped": "time budget"})
                    continue
                rates = _rates(ms, moved + extra_bytes, flops, peaks, int8=int8)
                speedup = {"speedup_vs_base": base / ms} if base is not None else {}
                rows.append({"kind": kind, **shape, **rates, **speedup})
    return rows


def _rates(ms: float, moved: int, flops: int, peaks, int8: bool) -> dict:
    out = {"time_us": ms * 1e3, "gb_per_s": moved / ms / 1e6, "tflops": flops / ms / 1e9}
    if peaks is not None:
        out["bw_pct_peak"] = 100 * out["gb_per_s"] / (peaks[0] * 1e3)
        out["compute_pct_peak"] = 100 * out["tflops"] / (peaks[2] if int8 else peaks[1])
    return out


def copy_bandwidth(device: torch.device, clock: _Clock, n_bytes: int = 1 << 30) -> float | None:
    """Measured device-to-device copy bandwidth (read + write), GB/s."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = clock(lambda: dst.copy_(src))
    return None if ms is None else 2 * n_bytes / ms / 1e6


def _fmt(v, digits: int = 1) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def render_markdown(meta: dict, rows: list[dict]) -> str:
    """The report: a header with the device and its peaks, then one table per benchmark."""
    peaks = meta.get("spec_peaks")
    lines = [
        "# Kernel benchmark",
        "",
        f"Device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}; "
        f"measured copy bandwidth {_fmt(meta.get('copy_gb_per_s'), 0)} GB/s.",
        "Spec-sheet peaks: " + (f"{peaks[0]} TB/s, {peaks[1]} FP16 TFLOP/s, {peaks[2]} INT8 TOP/s (dense)."
                                if peaks else "unknown for this device (percentages omitted)."),
        "",
        "## MLA decode (`mla_decode`, split-KV) and SDPA over expanded K/V",
        "",
        "| H | B | context | codec | B/token | chunk | µs | GB/s | % peak BW | TFLOP/s | % FP16 peak | "
        "× vs first codec | predicted µs (bound) | measured / predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["kind"] in ("mla_decode", "sdpa_expanded")):
        head = f"| {r['heads']} | {r['batch']} | {r['context']} | {r['codec']} | {r['bytes_per_token']} |"
        if "skipped" in r:
            lines.append(f"{head} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        predicted = (f"{r['predicted_us']:.1f} ({r['predicted_bound']}) | {r['time_us'] / r['predicted_us']:.2f}"
                     if "predicted_us" in r else f"{r.get('predicted', '—')} | —")
        lines.append(
            f"{head} {r.get('chunk_tokens', '—')} | {_fmt(r['time_us'])} | {_fmt(r['gb_per_s'], 0)} | "
            f"{_fmt(r.get('bw_pct_peak'))} | {_fmt(r['tflops'], 2)} | {_fmt(r.get('compute_pct_peak'))} | "
            f"{_fmt(r.get('speedup_vs_base'), 2)} | {predicted} |"
        )
    lines += [
        "",
        "## W8A8 GEMM (`int8_gemm`) vs bitsandbytes LLM.int8() and FP16 matmul",
        "",
        "| kind | M | K | N | µs | TFLOP/s (TOP/s) | % peak | × vs FP16 matmul |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["kind"] in ("int8_gemm", "bnb_int8", "fp16_matmul")):
        head = f"| {r['kind']} | {r['m']} | {r['k']} | {r['n']} |"
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped']} | | | |")
            continue
        rates = f"{_fmt(r['time_us'])} | {_fmt(r['tflops'], 1)} | {_fmt(r.get('compute_pct_peak'))}"
        lines.append(f"{head} {rates} | "
                     f"{_fmt(r.get('speedup_vs_base'), 2)} |")
    lines += ["", "Settings: " + json.dumps(meta["args"], sort_keys=True), ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.aot:
        from mlaquant.kernels import aot

        return aot.run(args.aot, args.json)
    _require_cuda()
    import triton
    import triton.testing

    heads, batches = _ints(args.heads, "heads"), _ints(args.batches, "batches")
    contexts = _ints(args.contexts, "contexts")
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.gemm_shapes.split(",") if s]
    except ValueError:
        raise ValueError(
            f"bench kernels: --gemm-shapes must look like 16384x7168,..., got {args.gemm_shapes!r}"
        ) from None
    device = torch.device("cuda")
    name, peaks = _peaks(device)
    clock = _Clock(lambda fn: triton.testing.do_bench(fn, warmup=10, rep=args.rep_ms, return_mode="median"),
                   args.time_budget)
    dims = {"d_c": args.d_c, "d_r": args.d_r, "d_n": args.d_n, "d_v": args.d_v}
    settings = {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}
    meta = {"device": name, "spec_peaks": peaks, **library_versions("triton"), "args": settings}
    meta["copy_gb_per_s"] = copy_bandwidth(device, clock)
    rows = decode_rows(heads, batches, contexts, codecs, dims, device, clock, args.sdpa_max_gb, peaks)
    rows += gemm_rows(batches, shapes, device, clock, peaks)
    out = Path(args.out)
    atomic_write(out, render_markdown(meta, rows))
    atomic_write(out.with_suffix(".json"), json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0
