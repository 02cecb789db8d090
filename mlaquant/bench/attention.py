"""`mlaquant bench decode --batch 1,16`: one decode-attention call (`ops.mla_decode`, DeepSeek-V2-Lite
attention shapes H 16, d_c 512, d_r 64) per batch × context × codec × path ("reference" = backend torch,
"fast" = backend cpu: integer parts by the C kernels of `mlaquant.attention.native` where they build; "auto" = backend
auto, what this machine's routing rule picks, `backends.cpu_routing`, printed "auto (torch)" or "auto (cpu)";
"fast BxG" = the fast path with B tokens per sequence and block, G sequences per group, for tuning `cpu_decode`'s
defaults; "fast torch-ops" = the fast path with torch ops instead of the C kernels (`torch._int_mm`, the int4 unpack
still in C), for codecs with an integer part where the kernels build), against the machine's bound measured in the
same run. The first line printed names torch's CPU capability, the kernels' ISA variant and the routing rule.

Every sequence of a batch holds `context` random latent rows on shuffled 64-token pages. Rows: median
ms per call over `steps` rounds or more (until each call's runs add up to `MIN_CALL_S`), each round calling
every codec and path of the batch and context in turn (`_timed_rounds`), fast / reference of the same codec,
fast / fast of the first codec (the base, fp16), the fastest round and its ratio to the base's fastest, and the
bound: max(cache bytes / bandwidth, FLOPs / peak) with the bandwidth from a large-copy probe, the peak from an FP32
GEMM probe (float scores, P·V of float caches and of grouped ones without the C kernels) and an int8 GEMM probe (the
C kernels' `dots` where they build, else `torch._int_mm`: integer scores, and P·V on the codes at half that rate:
int16 P or two int8 digits).
"""

from __future__ import annotations

import statistics
import time

import torch

from mlaquant.attention import backends, native
from mlaquant.attention.cpu_decode import mla_decode_cpu, pv_kind
from mlaquant.attention.decode_inputs import DecodeInputs
from mlaquant.attention.ops import mla_decode
from mlaquant.quant.codecs import LayerCodec, split_pair

HEADS, D_C, D_R, PAGE = 16, 512, 64, 64
PATHS = {"reference": "torch", "fast": "cpu", "auto": "auto"}


def _median(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


MIN_CALL_S = 0.2  # past --steps rounds, rounds go on until every call's timed runs add up to this


def _timed_rounds(calls: dict, n: int, min_call_s: float = 0.0) -> dict:
    """(median, fastest) seconds of each of `calls` (name → function) over at least n rounds, each round calling
    every function in turn, so drifts of the machine (other tenants) reach every configuration alike and
    the ratios compare like with like. Each timed call follows an untimed one of the same function: it finds
    the allocator and the caches as its own previous call left them (right after a reference call, which frees
    hundreds of MB, a fast-path call runs slower: docs/cpu.md). Rounds continue past n until every function's
    timed calls add up to `min_call_s`: a 3 ms call gets 67 rounds at 0.2 s, not 11 that a scheduler hiccup
    can move by 20 %. Round r starts at the (r mod len(calls))-th function and goes on in turn, so each follows
    every other alike and what one call leaves behind reaches all of them (a fixed order put auto after the fast
    path of its codec in every round). The fastest round is
    reported beside the median: other tenants only ever add time, so on a shared machine it is the closer of the two
    to the code's own speed."""
    times = {name: [] for name in calls}
    order = list(calls.items())
    rounds = 0
    while rounds < n or min(sum(ts) for ts in times.values()) < min_call_s:
        start = rounds % len(order)
        rounds += 1
        for name, fn in order[start:] + order[:start]:
            fn()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def machine_probes(repeats: int = 5) -> dict:
    """Bandwidth (bytes/s, a 256 MiB copy: read + write), FP32 and int8 GEMM peaks (FLOP/s, ops/s)."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / _median(lambda: dst.copy_(src), repeats)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    fp32 = 2 * 1024**3 / _median(lambda: a @ b, repeats)
    a8 = torch.randint(-127, 128, (1024, 1024), dtype=torch.int8)
    kern = native.vector_kernels()
    if kern is not None:
        gemm = lambda: kern.dots(a8[None], a8[None], native.KINDS[("int8", True)], 1024)  # noqa: E731
    else:
        gemm = lambda: torch._int_mm(a8, a8)  # noqa: E731
    int8 = 2 * 1024**3 / _median(gemm, repeats)
    return {"bandwidth_Bps": bw, "fp32_flops": fp32, "int8_ops": int8}


def step_bound(codec: LayerCodec, batch: int, context: int, probes: dict) -> float:
    """Seconds one call cannot beat: max(cache bytes / bandwidth, score and P·V FLOPs / their peaks)."""
    tokens = batch * context
    integer = codec.ckv.spec.kind in ("int8", "int4")
    score_peak = probes["int8_ops"] if integer else probes["fp32_flops"]
    flops = 2 * tokens * HEADS * D_C / score_peak + 2 * tokens * HEADS * D_R / probes["fp32_flops"]
    if pv_kind(codec) != "fp32":  # P·V on the codes: int16 P or two int8 digits per probability
        flops += 2 * 2 * tokens * HEADS * D_C / probes["int8_ops"]
    else:
        flops += 2 * tokens * HEADS * D_C / probes["fp32_flops"]
    return max(tokens * codec.row_bytes / probes["bandwidth_Bps"], flops)


def describe_machine() -> str:
    """The header line: torch's CPU capability, the C kernels' ISA variant, and the routing rule of "auto"."""
    return (f"-- cpu: torch capability {torch.backends.cpu.get_cpu_capability()}, C kernels "
            f"{native.describe()}; auto: {backends.cpu_routing().describe()}")


def _problem(codec: LayerCodec, batch: int, context: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    pages = batch * -(-context // PAGE)
    pool = codec.encode(torch.randn(pages * PAGE, D_C + D_R, generator=g)).view(pages, PAGE, codec.row_bytes)
    table = torch.randperm(pages, generator=g).view(batch, -1).int()
    q = torch.randn(batch, HEADS, D_C + D_R, generator=g) * D_C**-0.5
    return q, pool, table, torch.full((batch,), context, dtype=torch.int32)


def _fast_variant(**options):
    """mla_decode_cpu with these keyword options: the rows `fast <block_tokens>x<group>` (block_tokens,
    group) and `fast torch-ops` (c_kernels=False)."""

    def call(q, pool, table, lens, codec, d_c, scale, _backend):
        return mla_decode_cpu(DecodeInputs(q, pool, table, lens, codec, d_c), scale, **options)

    return call


def decision_s(codec: LayerCodec, device: torch.device, lens: torch.Tensor, reps: int = 400) -> float:
    """Seconds per call that "auto" spends choosing beyond what an explicit "torch" call spends checking its
    backend (`backends.choose_backend`; both then run the same `DecodeInputs` and, where auto takes the reference,
    the same function): the difference of the two medians over `reps` interleaved calls of each. Where auto runs
    the reference, auto's call is the reference's plus this, a quantity the bench's two timings of one function
    cannot resolve."""
    auto, explicit = [], []
    for _ in range(reps):
        for backend, times in (("auto", auto), ("torch", explicit)):
            t0 = time.perf_counter()
            backends.choose_backend(backend, codec, device, lens)
            times.append(time.perf_counter() - t0)
    return statistics.median(auto) - statistics.median(explicit)


def bench_attention(
    batches: list[int], contexts: list[int], codecs: list[str], steps: int,
    fast_blocks: list[tuple[int, int]] = (), min_call_s: float = MIN_CALL_S,
) -> list[dict]:
    """One dict per (batch, context, codec, path): ms, ratios, bound (see the module docstring); the "auto" rows
    also name the backend auto ran ("runs": torch or cpu, `backends.choose_backend`) and what choosing it costs per
    call ("decide_s", `decision_s`).
    fast_blocks: extra fast-path rows, one per (tokens per sequence and block, sequences per group).
    min_call_s: rounds go past `steps` until each call's timed runs add up to this (`_timed_rounds`)."""
    paths = {path: (mla_decode, backend) for path, backend in PATHS.items()}
    paths.update({f"fast {bt}x{g}": (_fast_variant(block_tokens=bt, group=g), "cpu") for bt, g in fast_blocks})
    print(describe_machine(), flush=True)
    probes = machine_probes()
    print(
        f"-- probes: {probes['bandwidth_Bps'] / 1e9:.1f} GB/s copy, {probes['fp32_flops'] / 1e9:.0f} GFLOP/s FP32, "
        f"{probes['int8_ops'] / 1e9:.0f} GOP/s int8",
        flush=True,
    )
    results = []
    for batch in batches:
        for context in contexts:
            calls, bounds, auto_runs, decide = {}, {}, {}, {}
            for name in codecs:
                codec = LayerCodec.from_names(*split_pair(name), D_C, D_R)
                q, pool, table, lens = _problem(codec, batch, context, seed=context)
                bounds[name] = step_bound(codec, batch, context, probes)
                auto_runs[name] = backends.choose_backend("auto", codec, q.device, lens).name.value
                decide[name] = decision_s(codec, q.device, lens)
                mine = dict(paths)
                integer = {codec.ckv.spec.kind, codec.kpe.spec.kind} & {"int8", "int4"}
                if integer and native.kernels() is not None:
                    mine["fast torch-ops"] = (_fast_variant(c_kernels=False), "cpu")
                for path, (fn, backend) in mine.items():
                    args = (q, pool, table, lens, codec, D_C, D_C**-0.5, backend)
                    calls[(name, path)] = lambda fn=fn, args=args: fn(*args)
            rows = [{"batch": batch, "context": context, "codec": name, "path": path, "s": sec,
                     "min_s": best, "bound_s": bounds[name]}
                    for (name, path), (sec, best) in _timed_rounds(calls, steps, min_call_s).items()]
            by = {(r["codec"], r["path"]): r for r in rows}
            for r in rows:
                if r["path"] == "auto":
                    r["runs"], r["decide_s"] = auto_runs[r["codec"]], decide[r["codec"]]
                r["vs_reference"] = r["s"] / by[(r["codec"], "reference")]["s"]
                r["vs_base_fast"] = r["s"] / by[(codecs[0], "fast")]["s"]
                r["min_vs_base_fast"] = r["min_s"] / by[(codecs[0], "fast")]["min_s"]
                r["vs_bound"] = r["s"] / r["bound_s"]
                print(format_row(r), flush=True)
            results += rows
    return results


# the absorbed projections of one V2-Lite layer at decode, (name, groups, K, N): q_nope·W_UK per head (128 → 512),
# W_UV per head (512 → 128), o_proj (16 heads × 128 → 2048)
PROJECTIONS = (("q_nope·W_UK", HEADS, 128, D_C), ("W_UV", HEADS, D_C, 128), ("o_proj", 1, HEADS * 128, 2048))


def bench_projections(batches: list[int], steps: int, min_call_s: float = MIN_CALL_S) -> list[dict]:
    """The W8A8 projections as a layer runs them (`int8_proj.Int8Weight`, backend "cpu", weights packed before the
    rounds: activation quantization, the exact INT32 GEMM, the FP32 epilogue) against the FP32 GEMM of the same
    shapes (`torch.bmm` on FP32 weights), one dict per (batch, projection) of `PROJECTIONS` and their sum per batch
    ("layer (sum)", shape None): median and fastest seconds of each over interleaved rounds (`_timed_rounds`)."""
    from mlaquant.modeling.int8_proj import Int8Weight

    rows = []
    for batch in batches:
        for name, g, k, n in PROJECTIONS:
            gen = torch.Generator().manual_seed(k * n + batch)
            x, w = torch.randn(batch, g, k, generator=gen), torch.randn(g, n, k, generator=gen) * k**-0.5
            w8 = Int8Weight.quantized(w)
            w8(x, backend="cpu")  # packs the codes, as a layer's first call does
            wt = w.transpose(1, 2).contiguous()  # [G, K, N]
            calls = {"int8_matmul": lambda x=x, w8=w8: w8(x, backend="cpu"),
                     "fp32": lambda x=x, wt=wt: torch.bmm(x.transpose(0, 1), wt)}
            t = _timed_rounds(calls, steps, min_call_s)
            rows.append({"batch": batch, "projection": name, "shape": [g, k, n],
                         "int8_s": t["int8_matmul"][0], "int8_min_s": t["int8_matmul"][1],
                         "fp32_s": t["fp32"][0], "fp32_min_s": t["fp32"][1]})
        mine = rows[-len(PROJECTIONS):]
        rows.append({"batch": batch, "projection": "layer (sum)", "shape": None,
                     **{key: sum(r[key] for r in mine) for key in ("int8_s", "int8_min_s", "fp32_s", "fp32_min_s")}})
    return rows


def format_projection_table(rows: list[dict]) -> str:
    """The projections' markdown table: ms of each, int8 / fp32 of the medians and of the fastest rounds."""
    lines = ["| batch | projection | G x K x N | int8_matmul ms | FP32 GEMM ms | int8 / fp32 | fastest int8 / fp32 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = "-" if r["shape"] is None else " x ".join(map(str, r["shape"]))
        lines.append(f"| {r['batch']} | {r['projection']} | {shape} | "
                     f"{r['int8_s'] * 1e3:.3f} | {r['fp32_s'] * 1e3:.3f} | {r['int8_s'] / r['fp32_s']:.2f} | "
                     f"{r['int8_min_s'] / r['fp32_min_s']:.2f} |")
    return "\n".join(lines)


def format_header() -> str:
    cols = ["batch", "context", "codec", "path", "ms/call", "/ reference", "/ fast base", "fastest ms",
            "fastest / fast base", "bound ms", "/ bound"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def format_row(r: dict) -> str:
    path = f"{r['path']} ({r['runs']})" if "runs" in r else r["path"]
    cells = [str(r["batch"]), str(r["context"]), r["codec"], path, f"{r['s'] * 1e3:.2f}",
             f"{r['vs_reference']:.2f}", f"{r['vs_base_fast']:.2f}", f"{r['min_s'] * 1e3:.2f}",
             f"{r['min_vs_base_fast']:.2f}", f"{r['bound_s'] * 1e3:.2f}", f"{r['vs_bound']:.1f}"]
    return "| " + " | ".join(cells) + " |"
