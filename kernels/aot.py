"""Ahead-of-time inspection of the Triton kernels: compile for a GPU on the CPU, read the machine code, predict.

    mlaquant bench kernels --aot sm_90a,sm_80 [--json PATH]

No GPU is needed: Triton compiles for the named target and its wheel's ptxas assembles the cubin, which
`cuobjdump --dump-resource-usage` (REG, STACK) and `nvdisasm` (SASS) read. Every variant is compiled exactly as
a launch would specialize it: the launch is built by the kernel module's own `stage1_launch` / `merge_launch`
(or the GEMM's tile rule) on meta tensors of the real shapes, and bound by Triton's own argument binder
(integer arguments divisible by 16 and 16-byte-aligned pointers get `tt.divisibility`, constexprs, the
launcher's num_warps / num_stages). Shapes: DeepSeek-V3 (d_c 512, d_r 64), H = 128 and H = 16 (one GPU of
TP-8), B = 32.

Per variant: registers, stack (spill) bytes, STL/LDL count, shared memory, MMA instruction kinds (HGMMA /
IGMMA = wgmma, HMMA / IMMA = mma.sync), and the main loop: the backward branch span holding the most MMA
instructions (the largest such span when tied); its static instruction count, of them the conditional ones (a
forward branch inside the loop can skip them: the decode kernel's lazy softmax rescale), its MMA work and, per
cached token (the loop covers BLOCK_N tokens and runs once per head block of a sequence), SM issue cycles and
MMA cycles. Each target compiles the variants of its own settings (`KernelConfig.for_target`); decode rows get
predictions for the devices of their target (`Device.target`: sm_90a -> H100, H200; sm_80 -> A100).

Cost model (decode: the query kernel when a part is INT8-scored, stage 1, merge), per device, B sequences of
`context` tokens:

    t_hbm   = (B·T·row_bytes + query + partials written) / HBM_BW      each cache byte once from HBM
    t_l2    = (B·T·row_bytes · head_blocks + ...) / L2_BW             sibling head blocks re-read through L2
    t_issue = B·T · issue_cycles_per_token / (SMS · CLOCK)            issue = executed instructions · warps / 4
    t_mma   = B·T · mma_cycles_per_token / (SMS · CLOCK)              mma = Σ flops / (per-SM rate of the kind)
    stage1  = max(t_hbm, t_l2, t_issue, t_mma) · waves,   waves = ceil(P / SMS) / (P / SMS), P = programs
    merge   = partials read + output written over HBM_BW (when split) ;  + LAUNCH_US per kernel launched
    (the query kernel counts as its launch only: it reads B·H·(d_c + d_r) values once)

Executed instructions per loop iteration = the unconditional ones + the conditional ones × r, with
r = RESCALES_PER_PROGRAM · BLOCK_N / chunk: the rescale branch runs on a program's first tile and when a head's
running max grows by more than 2^8 later. Measured on the bundled model's real attention (every query of the
last 512 positions of a 4096-token window of stdlib source, 4 layers x 4 heads, the kernel's tile order;
script in docs/results/aot/aot_round3.md): 0.16-0.77 later rescales per program for tiles of 16 / 32 tokens and
chunks of 512 / 2048 / 4096 tokens; RESCALES_PER_PROGRAM = 2 (the first tile + 1, rounded up). Long-context DeepSeek
scores could grow more often; r = 1 is the worst case (every tile), which `loop_conditional` lets a reader
recompute. With two value programs per head block (`d_split` 2) the kernel holds one loop per program; each
program is charged the loop with the most MMA work (equal for every codec but a band part, whose two programs'
tiles can differ: an upper bound there).

Constants (`DEVICES`): H100 SXM 132 SMs at 1.755 GHz, HBM 3.0 TB/s achieved (3.35 peak), L2 5.5 TB/s;
H200 the same SMs and L2, HBM 4.3 TB/s achieved (4.8 peak, the same 90 %). Per SM and cycle, wgmma does
4096 FP16 flops and 8192 INT8 ops (989 / 1979 dense TFLOP/s at 1.83 GHz over 132 SMs, NVIDIA's H100
datasheet); mma.sync on Hopper is taken at half of that (`MMA_SYNC_FACTOR`, a lead: the FlashAttention-3
paper has its wgmma kernels 1.5-2x faster than FlashAttention-2's mma.sync ones on H100; until round 3 the
factor multiplied the flops, i.e. counted mma.sync at twice the wgmma rate). A100 SXM4 80 GB: 108 SMs at
1.41 GHz (boost), HBM 1.8 TB/s taken (2.04 peak, the same 90 %), mma.sync at 2048 FP16 flops and 4096 INT8
ops per SM and cycle (312 / 624 dense TFLOP/s, NVIDIA's A100 datasheet), L2 4.0 TB/s (an assumption, no
datasheet figure: it matters where head blocks re-read a tile). Launch 3 µs per kernel.

Limits (it is an estimate from static code, never a measurement): it counts each unconditional static
instruction of the loop once per iteration (predicated-off ones too) and assumes one warp-instruction per
scheduler and cycle whatever its pipe (no latency stalls, no occupancy limit, no bank conflicts; conversions
and MUFU run at a quarter of that rate or less on real hardware), full tiles, every sibling re-read an L2 hit,
and the terms overlapping perfectly (the max). It does not model the query's quantization outside the loop.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

TARGETS = {"sm_90a": 90, "sm_80": 80}
D_C, D_R = 512, 64
BATCH = 32
CONTEXTS = (4096, 32768)
HEADS = (128, 16)
# c_kv / k_pe codec pairs a plan can produce: every kind of each part (fp16, int8/int4 sym/asym, row/groups).
DECODE_CODECS = (
    "fp16/fp16",
    "int8-row/int8-row",
    "int8-row-asym/int8-row-asym",
    "int8-g64/int8-g64",
    "int4-row/int4-row",
    "int4-row-asym/int4-row-asym",
    "int4-g32/int4-g32",
    "int4-g64/int4-g32",  # the default plan's last layer
    "int4-row/int8-row",
    "int4-row/fp16",
    # the sub-4-bit tier (band c_kv): the bundled model's calibrated allocations (d_c 128) scaled by 4 to d_c 512,
    # 2.0 bits of codes (the 3-bit plan's layers 2-3: 8/4/2 bits, half the channels 0) and 2.5 bits (the
    # ablation's PCA water-filling 2.5 layer 0: 4/3/2 bits, a quarter 0), each beside the plan's two k_pe codecs
    "band-8x64-4x64-2x128-0x256/int4-row",
    "band-8x64-4x64-2x128-0x256/int8-row",
    "band-4x192-3x128-2x64-0x128/int4-row",
    "band-4x192-3x128-2x64-0x128/int8-row",
)
GEMM_M = (1, 32, 128)  # decode batches: the W8A8 GEMM's tile rule picks its variant from M
LAUNCH_US = 3.0
MMA_SYNC_FACTOR = 0.5
RESCALES_PER_PROGRAM = 2.0  # lazy-rescale branches taken per stage-1 program (module docstring)
_MMA = re.compile(r"\b(HGMMA|IGMMA|HMMA|IMMA)\.(\d+)x?(\d*)x?(\d*)")
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


@dataclass(frozen=True)
class Device:
    """Cost-model constants of one GPU (module docstring)."""

    sms: int
    clock_ghz: float
    hbm_tb_s: float
    l2_tb_s: float
    fp16_flops_per_sm_cycle: float = 4096.0
    int8_ops_per_sm_cycle: float = 8192.0
    mma_sync_factor: float = MMA_SYNC_FACTOR  # mma.sync's rate over the one above
    target: str = "sm_90a"  # the compile target whose rows it predicts

    def mma_cycles(self, flops: dict) -> float:
        """SM cycles of `flops` {HGMMA|IGMMA|HMMA|IMMA: flops} at this device's rates."""
        f16, i8, sync = self.fp16_flops_per_sm_cycle, self.int8_ops_per_sm_cycle, self.mma_sync_factor
        rate = {"HGMMA": f16, "IGMMA": i8, "HMMA": f16 * sync, "IMMA": i8 * sync}
        return sum(f / rate[k] for k, f in flops.items())


DEVICES = {
    "H100": Device(132, 1.755, 3.0, 5.5),
    "H200": Device(132, 1.755, 4.3, 5.5),
    "A100": Device(108, 1.41, 1.8, 4.0, 2048.0, 4096.0, 1.0, "sm_80"),
}


@dataclass
class Variant:
    """One kernel specialization to compile; `decode` holds what the cost model needs (decode only)."""

    kernel: str
    label: str
    heads: int | None
    launch: object
    decode: dict = field(default_factory=dict)


def _bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def compile_launch(launch, arch: int):
    """Compile `launch` (a `mla_decode.Launch`) for compute capability `arch` the way `fn[grid](...)` would."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, spec, opts)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def _mma_flops(mnemonic: str, warps: int) -> tuple[str, float]:
    """(HGMMA|IGMMA|HMMA|IMMA, flops per program) of one MMA instruction executed once by every warp of the
    program."""
    m = _MMA.search(mnemonic)
    kind, a, b, c = m.group(1), m.group(2), m.group(3), m.group(4)
    if kind in ("HGMMA", "IGMMA"):  # HGMMA.64x64x16: one per warpgroup
        mnk = int(a) * int(b) * int(c) * (warps / 4)
    else:  # HMMA.16816 = m16 n8 k16, IMMA.16832 = m16 n8 k32, one per warp
        mnk = int(a[:2]) * int(a[2]) * int(a[3:]) * warps
    return kind, 2.0 * mnk


def parse_sass(sass: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """SASS text -> ([(address, instruction)], {label: address of the next instruction})."""
    instrs, labels, pending = [], {}, []
    for line in sass.splitlines():
        lab = _LABEL.match(line.strip())
        if lab:
            pending.append(lab.group(1))
            continue
        m = _LINE.search(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            instrs.append((addr, m.group(2).strip()))
    return instrs, labels


def main_loop(sass: str) -> list[str]:
    """Instructions of the main loop (module docstring), [] when the code has no loop."""
    return [t for _, t in _main_loop(sass)[0]]


def _main_loop(sass: str) -> tuple[list[tuple[int, str]], set[int]]:
    """(the main loop's [(address, instruction)], addresses of its conditional instructions: those a forward
    branch inside the loop can skip, up to its target inside the loop)."""
    instrs, labels = parse_sass(sass)
    best, best_key = [], (-1, -1)
    for i, (addr, text) in enumerate(instrs):
        br = _BRANCH.search(text)
        if not br or labels.get(br.group(1), addr + 1) > addr:
            continue
        start = labels[br.group(1)]
        body = [(a, t) for a, t in instrs[: i + 1] if a >= start]
        key = (sum(1 for _, t in body if _MMA.search(t)), len(body))
        if key > best_key:
            best, best_key = body, key
    skipped: set[int] = set()
    if best:
        end = best[-1][0]
        for a, t in best:
            br = _BRANCH.search(t)
            target = labels.get(br.group(1)) if br else None
            if t.startswith("@") and target is not None and a < target <= end:
                skipped.update(b for b, _ in best if a < b < target)
    return best, skipped


def inspect_cubin(cubin: bytes, warps: int) -> dict:
    """Registers, stack, spill instructions, MMA kinds and the main loop's cost of one compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", str(path)], check=True,
                               capture_output=True, text=True).stdout
        sass = subprocess.run([_bin("nvdisasm"), "-c", str(path)], check=True, capture_output=True,
                              text=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    ops = [t.split()[0] if not t.startswith("@") else t.split()[1] for _, t in parse_sass(sass)[0]]
    kinds = {k: sum(1 for o in ops if o.startswith(k + ".")) for k in ("HGMMA", "IGMMA", "HMMA", "IMMA")}
    body, skipped = _main_loop(sass)
    loop = [t for _, t in body]
    flops = {"HGMMA": 0.0, "IGMMA": 0.0, "HMMA": 0.0, "IMMA": 0.0}
    for a, t in body:
        if _MMA.search(t) and a not in skipped:
            kind, f = _mma_flops(t, warps)
            flops[kind] += f
    loop_mma = sorted({_MMA.search(t).group(1) for t in loop if _MMA.search(t)})
    return {
        "registers": regs, "stack_bytes": stack,
        "spill_instructions": sum(1 for o in ops if o.startswith(("STL", "LDL"))),
        "mma": kinds, "loop_instructions": len(loop), "loop_conditional": len(skipped), "loop_mma": loop_mma,
        "loop_flops": flops,
        "ldg128": sum(1 for o in ops if o.startswith("LDG.E.128")),
    }


def _meta(*shape, dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def decode_variants(heads=HEADS, codecs=DECODE_CODECS, config=None) -> list[Variant]:
    """The stage-1 decode launches (B = 32, 32k context) of every codec pair x head count, plus the merge."""
    from mlaquant.kernels import mla_decode as K

    config = config or K.load_kernel_config()
    out = []
    for h in heads:
        for name in codecs:
            decode, stage0 = decode_variant(name, h, max(CONTEXTS), config)
            out.append(decode)
            if stage0 is not None:
                out.append(Variant("query", name, h, stage0))
        parts = _meta(BATCH, h, 2, D_C, dtype=torch.float32)
        lse = _meta(BATCH, h, 2, dtype=torch.float32)
        merge, _, _ = K.merge_launch(parts, lse, _meta(BATCH, dtype=torch.int32), 1024)
        out.append(Variant("merge", f"d_c {D_C}", h, merge))
    return out


def decode_variant(name: str, heads: int, context: int, config, batch: int = BATCH, n_sm: int | None = None):
    """(the stage-1 decode Variant of codec pair `name` at this shape, its stage-0 query launch or None)."""
    from mlaquant.kernels import mla_decode as K
    from mlaquant.quant.codecs import LayerCodec, split_pair

    codec = LayerCodec.from_names(*split_pair(name), D_C, D_R)
    launch, _, stage0 = _decode_launch(K, codec, heads, context, config, n_sm, batch)
    return Variant("mla_decode", name, heads, launch, {
        "codec": codec, "row_bytes": codec.row_bytes, "block_n": launch.kwargs["BLOCK_N"],
        "warps": launch.kwargs["num_warps"], "head_blocks": launch.grid[0],  # programs per sequence and chunk
        "config": config}), stage0


def _decode_launch(K, codec, heads: int, context: int, config, n_sm: int | None = None, batch: int = BATCH):
    q = _meta(batch, heads, D_C + D_R, dtype=torch.float16)
    pool = _meta(batch * context // K.PAGE_TOKENS, K.PAGE_TOKENS, codec.row_bytes, dtype=torch.uint8)
    table = _meta(batch, context // K.PAGE_TOKENS, dtype=torch.int32)
    lens = _meta(batch, dtype=torch.int32)
    chunk = K.schedule_chunk(config, batch, heads, context, n_sm, codec)
    stage0, staged = K.query_launch(q, codec, D_C, 0.1, config, on_gpu=True)
    launch, parts, lse = K.stage1_launch(q, staged, pool, table, lens, codec, D_C, 0.1, chunk, context, config,
                                         on_gpu=True)
    return launch, parts, stage0


def gemm_variants() -> list[Variant]:
    """W8A8 GEMM (DeepSeek-V3 o_proj, K 16384 x N 7168) and its row quantizer at the decode batches."""
    from mlaquant.kernels import int8_gemm as G

    out = []
    for m in GEMM_M:
        launch, tiles = G.gemm_launch(_meta(m, 16384, dtype=torch.int8), _meta(7168, 16384, dtype=torch.int8),
                                      _meta(m, dtype=torch.float32), _meta(7168, dtype=torch.float32),
                                      _meta(m, 7168, dtype=torch.float16))
        out.append(Variant("int8_gemm", f"M {m}, tile {tiles}", None, launch))
    x = _meta(BATCH, 16384, dtype=torch.float16)
    out.append(Variant("quantize_rows", "K 16384", None, G.quantize_rows_launch(x, None)[0]))
    return out


def predict(stats: dict, v: Variant, device: Device, context: int, batch: int = BATCH) -> dict:
    """Predicted decode time (µs) and its terms for `batch` sequences of `context` tokens (module docstring)."""
    from mlaquant.kernels import mla_decode as K

    d = v.decode
    launch, parts, stage0 = _decode_launch(K, d["codec"], v.heads, context, d["config"], device.sms, batch)
    programs = math.prod(launch.grid)
    n_split = parts.shape[2]
    tokens = batch * context
    per_token = d["head_blocks"] / d["block_n"]
    chunk = K.schedule_chunk(d["config"], batch, v.heads, context, device.sms, d["codec"])
    rate = min(1.0, RESCALES_PER_PROGRAM * d["block_n"] / min(chunk, context))  # per loop iteration
    executed = stats["loop_instructions"] - (1.0 - rate) * stats["loop_conditional"]
    issue = executed * d["warps"] / 4 * per_token
    mma = device.mma_cycles(stats["loop_flops"]) * per_token
    cache = tokens * d["row_bytes"]
    small = batch * v.heads * (D_C + D_R) * 2 + batch * v.heads * n_split * (D_C + 1) * 4
    sm_rate = device.sms * device.clock_ghz * 1e3  # cycles per µs over all SMs
    terms = {
        "hbm": (cache + small) / (device.hbm_tb_s * 1e6),
        "l2": (cache * d["head_blocks"] + small) / (device.l2_tb_s * 1e6),
        "issue": tokens * issue / sm_rate,
        "mma": tokens * mma / sm_rate,
    }
    waves = math.ceil(programs / device.sms) / (programs / device.sms)
    merge = 0.0
    if n_split > 1:
        merge = (batch * v.heads * (n_split * (D_C + 1) + D_C) * 4) / (device.hbm_tb_s * 1e6) + LAUNCH_US
    bound = max(terms, key=terms.get)
    total = terms[bound] * waves + merge + LAUNCH_US * (1 if stage0 is None else 2)
    return {"us": total, "bound": bound, "waves": waves, "programs": programs, "splits": n_split, "chunk": chunk,
            "rescale_rate": rate,
            "issue_cycles_per_token": issue, "mma_cycles_per_token": mma, **{f"t_{k}": t for k, t in terms.items()}}


def device_named(name: str) -> Device | None:
    """The cost model's device whose key ("H100", "H200", "A100") is in a CUDA device name, else None."""
    return next((d for key, d in DEVICES.items() if key in name), None)


def predict_measured(name: str, heads: int, batch: int, context: int, device_name: str, config=None) -> dict | None:
    """The prediction beside a measured decode (`bench kernels` on a GPU): codec pair `name` at H, B, context on
    the cost model's device for `device_name` (None where the model has none), compiled for its target with the
    settings a launch there uses; context a multiple of 64."""
    from mlaquant.kernels import mla_decode as K

    device = device_named(device_name)
    if device is None:
        return None
    config = (config or K.load_kernel_config()).for_target(device.target)
    v, _ = decode_variant(name, heads, context, config, batch, device.sms)
    return predict(inspect_variant(v, TARGETS[device.target]), v, device, context, batch)


_CACHE: dict = {}


def inspect_variant(v: Variant, arch: int) -> dict:
    """Compile and inspect one variant (cached per process: the test suite and the CLI share it)."""
    key = (v.kernel, v.label, v.heads, arch, repr(sorted(v.launch.kwargs.items())))
    if key not in _CACHE:
        compiled = compile_launch(v.launch, arch)
        stats = inspect_cubin(compiled.asm["cubin"], v.launch.kwargs.get("num_warps", 4))
        stats["shared_bytes"] = int(compiled.metadata.shared)
        _CACHE[key] = stats
    return _CACHE[key]


def report(targets: list[str], variants=None) -> list[dict]:
    """One row per (target, variant): compile stats, and for decode rows the predicted times on the devices
    of that target (`Device.target`). `variants`: a list, or a function of the target's `KernelConfig`
    returning one; None: every decode variant and the GEMM's, with the packaged config for that target."""
    from mlaquant.kernels import mla_decode as K

    rows = []
    for target in targets:
        if target not in TARGETS:
            raise ValueError(f"bench kernels --aot: unknown target {target!r} (known: {', '.join(TARGETS)})")
        config = K.load_kernel_config().for_target(target)
        if variants is None:
            chosen = decode_variants(config=config) + gemm_variants()
        else:
            chosen = variants(config) if callable(variants) else variants
        for v in chosen:
            stats = inspect_variant(v, TARGETS[target])
            row = {"target": target, "kernel": v.kernel, "variant": v.label, "heads": v.heads,
                   "num_warps": v.launch.kwargs.get("num_warps", 4), **stats}
            row["tile"] = {k: w for k, w in v.launch.kwargs.items() if k.startswith("BLOCK_")}
            if v.kernel == "mla_decode":
                row["predicted"] = {f"{dev} {ctx // 1024}k": predict(stats, v, d, ctx)
                                    for dev, d in DEVICES.items() if d.target == target for ctx in CONTEXTS}
            rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    """Markdown table of `report` rows (predicted µs with the bound term, B = 32)."""
    cols = [f"{d} {c // 1024}k" for d in DEVICES for c in CONTEXTS]
    head = ["target", "kernel", "variant", "H", "tile, warps", "regs", "stack B", "STL/LDL", "smem KiB",
            "HGMMA/IGMMA/HMMA/IMMA", "loop MMA", "loop instr (cond.)", "issue cyc/token", "MMA cyc/token"]
    lines = ["| " + " | ".join(head + [f"µs {c}" for c in cols]) + " |", "|" + "---|" * (len(head) + len(cols))]
    for r in rows:
        pred = r.get("predicted") or {}
        first = next(iter(pred.values()), None)
        cells = [
            r["target"], r["kernel"], r["variant"], r["heads"] or "—",
            "×".join(str(v) for v in r["tile"].values()) + f", {r['num_warps']}", r["registers"], r["stack_bytes"],
            r["spill_instructions"], f"{r['shared_bytes'] / 1024:.0f}",
            "/".join(str(r["mma"][k]) for k in ("HGMMA", "IGMMA", "HMMA", "IMMA")),
            "+".join(r["loop_mma"]) or "—",
            f"{r['loop_instructions']} ({r['loop_conditional']})" if r["loop_conditional"] else r["loop_instructions"],
            f"{first['issue_cycles_per_token']:.0f}" if first else "—",
            f"{first['mma_cycles_per_token']:.0f}" if first else "—",
        ] + [f"{pred[c]['us']:.0f} ({pred[c]['bound']})" if c in pred else "—" for c in cols]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def run(targets: str, json_path: str | None) -> int:
    """`bench kernels --aot`: print the table; write the rows as JSON where asked."""
    from mlaquant.atomic import atomic_write
    from mlaquant.errors import BackendError
    from mlaquant.kernels import mla_decode as K

    if K.interpreter_active():
        raise BackendError("bench kernels --aot compiles for a GPU: unset TRITON_INTERPRET (the CPU interpreter "
                           "replaces the compiler)")
    rows = report([t.strip() for t in targets.split(",") if t.strip()])
    text = render(rows)
    print(text, end="")
    if json_path:
        atomic_write(Path(json_path), json.dumps({"model": __doc__, "rows": rows}, indent=2, default=str))
    return 0
