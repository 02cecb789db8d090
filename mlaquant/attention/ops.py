"""The MLA decode-attention op over a paged, quantized latent cache: one definition, two backends.

Decode with W_UK absorbed into the query is MQA with one KV head whose rows are the cached
`[c_kv | k_pe]` latents (the notation and both attention paths: the docstring of `mlaquant/modeling/model.py`):

    score[b, h, t] = scale * (q[b, h, :d_c] · c_kv[b, t] + q[b, h, d_c:] · k_pe[b, t])   t < seq_lens[b]
    out[b, h]      = softmax_t(score[b, h]) @ c_kv[b]          (V is a view of c_kv; W_UV comes later)
    lse[b, h]      = logsumexp_t(score[b, h])                  (natural log, for merging split-KV partials)

Paged cache: `pool[block, slot]` holds one encoded row (`LayerCodec` bytes); token t of sequence b
lives in block `block_table[b, t // block_size]`, slot `t % block_size`. Entries of `block_table` past
a sequence's last block, and slots past `seq_lens[b]` in its last block, may hold anything and are
never read.

Backends (`Backend`): "torch" is the FP32 reference in this file; "triton" is
`mlaquant.kernels.mla_decode.mla_decode` (same signature without `backend`), on CUDA or on CPU under
TRITON_INTERPRET=1; "cpu" is the fast CPU path `mlaquant.attention.cpu_decode.mla_decode_cpu` (integer scores, blocked
P·V, its error bound in its docstring); "auto" picks triton for CUDA tensors when the kernel imports and
reads the codec (fp16/int8/int4 parts, power-of-two groups ≥ 32 channels), cpu for CPU tensors where the
fast path is faster on this machine (`auto_takes_fast`, by the rule `cpu_routing` states: what the CPU and torch
run, then a call reading enough tokens), else torch: below that the fast path's per-sequence blocks cost more
than the reference's one batched pass (`mlaquant bench decode --batch 1,4,16 --contexts 512,1024,2048,4096,8192
--codecs fp16,int8-row,int4-row,int8`, under each CPU capability).
Every backend checks its arguments against the one input contract, `mlaquant.attention.decode_inputs.DecodeInputs`.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
import os

import torch
from torch import Tensor

from mlaquant.attention import cpu_decode, native
from mlaquant.attention.decode_inputs import DecodeInputs, gather_pages
from mlaquant.errors import BackendError
from mlaquant.quant.codecs import LayerCodec

# where "auto" on CPU takes the fast path (`auto_takes_fast`, by the rule of `cpu_routing`; the measurements behind
# each threshold, on an AVX-512 VNNI CPU and under ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA=AVX2: docs/cpu.md)
CPU_FAST_MIN_TOKENS = 8192  # cached tokens per call (all sequences together): a float c_kv (FP32 GEMMs)
# a codec with an integer part read by the C kernels: this many tokens per non-empty sequence on average, by ISA
# variant (avxvnni not measured: the avx2 figure)
CPU_NATIVE_MIN_MEAN = {"avx512vnni": 1024, "avxvnni": 2048, "avx2": 2048}
# an integer c_kv through torch._int_mm (no C kernels; only where torch's int8 GEMM has VNNI):
CPU_FAST_ROW_MEAN = 2048  # a row-wise one: CPU_FAST_MIN_TOKENS in all, or this many per sequence on average
CPU_FAST_GROUPED_TOKENS = 16384  # a grouped one: this many in all ...
CPU_FAST_MIN_MEAN = 1024  # ... and this many per sequence on average

# op -> (module, function) of its Triton implementation
KERNELS = {
    "mla_decode": ("mlaquant.kernels.mla_decode", "mla_decode"),
    "int8_gemm": ("mlaquant.kernels.int8_gemm", "int8_gemm"),
    "int8_gemm_grouped": ("mlaquant.kernels.int8_gemm", "int8_gemm_grouped"),
}


class Backend(str, enum.Enum):
    """Which implementation runs an op."""

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    CPU = "cpu"


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def load_kernel(op: str = "mla_decode"):
    """The Triton function of `op` (a key of KERNELS), or raise BackendError saying why it cannot be loaded."""
    module_name, name = KERNELS[op]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BackendError(f"backend 'triton': cannot import {module_name} ({e})") from e
    kernel = getattr(module, name, None)
    if kernel is None:
        raise BackendError(f"backend 'triton': {module_name} has no function {name}")
    return kernel


def resolve_backend(backend: str | Backend, device: torch.device | str, op: str = "mla_decode") -> str:
    """'torch', 'triton' or 'cpu' for `op` on tensors on `device`; an explicit backend that cannot run →
    BackendError."""
    try:
        backend = Backend(backend)
    except ValueError:
        choices = ", ".join(b.value for b in Backend)
        raise BackendError(f"unknown backend {backend!r} (choose one of: {choices})") from None
    device = torch.device(device)
    if backend is Backend.TORCH:
        return Backend.TORCH.value
    if backend is Backend.CPU or (backend is Backend.AUTO and device.type == "cpu"):
        if device.type != "cpu":
            raise BackendError(f"backend 'cpu' runs on CPU tensors only, got device '{device.type}'")
        return Backend.CPU.value
    if backend is Backend.AUTO:
        if device.type != "cuda":
            return Backend.TORCH.value
        try:
            load_kernel(op)
        except BackendError:
            return Backend.TORCH.value
        return Backend.TRITON.value
    if device.type == "cpu" and not _triton_interpret():
        raise BackendError("backend 'triton' on CPU needs TRITON_INTERPRET=1 (or use backend 'torch')")
    if device.type not in ("cpu", "cuda"):
        raise BackendError(f"backend 'triton' does not run on device '{device.type}' (use backend 'torch')")
    load_kernel(op)
    return Backend.TRITON.value


def _kernel_reads(codec: LayerCodec, device: torch.device) -> bool:
    """Whether the Triton kernel takes this codec on `device` ("auto" sends the others to torch)."""
    module = importlib.import_module(KERNELS["mla_decode"][0])
    return module.supports(codec, on_gpu=device.type == "cuda") is None


def mla_decode(
    q: Tensor,
    pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    codec: LayerCodec,
    d_c: int,
    scale: float,
    backend: str | Backend = "auto",
    scratch: Scratch | None = None,
) -> tuple[Tensor, Tensor]:
    """Absorbed MLA decode attention over a paged quantized cache.

    q: [B, H, d_c + d_r] absorbed query (q_nope·W_UK concatenated with rotated q_pe), float32.
    pool: uint8 [num_blocks, block_size, codec.row_bytes] (a layer's paged cache).
    block_table: int32 [B, max_blocks] (block ids per sequence, unused entries arbitrary).
    seq_lens: int32 [B] (tokens to attend per sequence, >= 1; 0 gives out 0 and lse -inf).
    Returns out [B, H, d_c] = softmax(q·[c_kv|k_pe]^T * scale) @ c_kv, float32, and
    lse [B, H] float32 (natural-log log-sum-exp of the scaled scores).
    scratch: buffers the torch path reuses between calls (see `Scratch`); the Triton kernel and the cpu path
    (cache-sized blocks) need none.
    """
    resolved = resolve_backend(backend, q.device)
    if resolved == Backend.CPU.value:
        if Backend(backend) is Backend.CPU:  # explicit: whatever is built, a forced scalar variant included
            return cpu_decode.mla_decode_cpu(q, pool, block_table, seq_lens, codec, d_c, scale)
        routing = cpu_routing()
        if auto_takes_fast(codec, seq_lens, routing):
            return cpu_decode.mla_decode_cpu(q, pool, block_table, seq_lens, codec, d_c, scale,
                                             c_kernels=routing.integer == "native")
    if resolved == Backend.TRITON.value and (
        Backend(backend) is not Backend.AUTO or _kernel_reads(codec, q.device)
    ):
        return load_kernel()(q, pool, block_table, seq_lens, codec, d_c, scale)
    return mla_decode_reference(q, pool, block_table, seq_lens, codec, d_c, scale, scratch)


def describe_backend(backend: str | Backend, device: torch.device | str) -> str:
    """What `mla_decode(..., backend=backend)` runs on `device`, in words (for reports): on CPU under "auto",
    the routing rule of this machine (`cpu_routing`)."""
    resolved = resolve_backend(backend, device)
    if resolved == Backend.CPU.value and Backend(backend) is Backend.AUTO:
        return f"auto (cpu fast path where faster here, else torch: {cpu_routing().describe()})"
    return resolved


@dataclasses.dataclass(frozen=True)
class CpuRouting:
    """Which rule "auto" follows on this CPU (`cpu_routing`): torch's CPU capability, the C kernels' ISA variant
    (None: not built), and whether torch's int8 GEMM (`torch._int_mm`, oneDNN) has VNNI here."""

    capability: str
    native_isa: str | None
    torch_vnni: bool

    @property
    def integer(self) -> str:
        """How integer caches go: "native" (C kernels, a vector ISA), "int_mm" (torch ops, VNNI) or "reference"."""
        if self.native_isa in native.VECTOR_ISAS:
            return "native"
        return "int_mm" if self.torch_vnni else "reference"

    def describe(self) -> str:
        integer = {
            "native": f"integer caches by the {self.native_isa} C kernels from "
                      f"{CPU_NATIVE_MIN_MEAN.get(self.native_isa, 2048)} tokens per sequence",
            "int_mm": "integer caches by torch._int_mm (VNNI) from the measured thresholds",
            "reference": "integer caches on the reference (no C kernels, and torch's int8 GEMM has no VNNI here)",
        }[self.integer]
        return (f"CPU capability {self.capability}, native {self.native_isa or 'none'}; {integer}; float caches by "
                f"FP32 GEMMs from {CPU_FAST_MIN_TOKENS} tokens per call")


def torch_int8_vnni() -> bool:
    """Whether torch's int8 GEMM runs on VNNI here: an AVX-512 capability (an AVX2 one caps oneDNN below it) on a
    CPU with AVX-512 VNNI. AVX-VNNI-only CPUs count as without: oneDNN's use of it was not measured."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    return bool(probe()) if probe is not None else "avx512vnni" in native.cpu_features()


def cpu_routing() -> CpuRouting:
    """The routing rule "auto" follows on this CPU (cheap: every input is cached per process)."""
    return CpuRouting(torch.backends.cpu.get_cpu_capability(), native.chosen_isa(), torch_int8_vnni())


def auto_takes_fast(codec: LayerCodec, seq_lens: Tensor, routing: CpuRouting | None = None) -> bool:
    """Whether "auto" on CPU takes the fast path for a call over seq_lens int [B], by the rule of this machine
    (`cpu_routing`, or `routing`): a codec with an integer part only where the C kernels run (a vector ISA) — from
    `CPU_NATIVE_MIN_MEAN[isa]` tokens per non-empty sequence on average — or where torch's int8
    GEMM has VNNI (`cpu_decode.prefers` and the `CPU_FAST_*` thresholds of `torch._int_mm`), never otherwise;
    a float codec from `CPU_FAST_MIN_TOKENS` in all. The measurements behind the thresholds: docs/cpu.md."""
    routing = cpu_routing() if routing is None else routing
    live = seq_lens[seq_lens > 0]
    total = int(live.sum())
    mean = total / max(1, live.numel())
    if not any(rc.spec.kind in ("int8", "int4") for rc in (codec.ckv, codec.kpe)):
        return total >= CPU_FAST_MIN_TOKENS
    if routing.integer == "native":
        return mean >= CPU_NATIVE_MIN_MEAN.get(routing.native_isa, 2048)
    if routing.integer == "reference" or not cpu_decode.prefers(codec, c_kernels=False):
        return False
    ckv = codec.ckv
    if ckv.spec.kind not in ("int8", "int4"):
        return total >= CPU_FAST_MIN_TOKENS
    if ckv.layout.n_groups == 1:
        return total >= CPU_FAST_MIN_TOKENS or mean >= CPU_FAST_ROW_MEAN
    return total >= CPU_FAST_GROUPED_TOKENS and mean >= CPU_FAST_MIN_MEAN


def mla_decode_reference(
    q: Tensor,
    pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    codec: LayerCodec,
    d_c: int,
    scale: float,
    scratch: Scratch | None = None,
) -> tuple[Tensor, Tensor]:
    """FP32 torch reference of `mla_decode` (same arguments, no backend): gathers only the rows
    t < seq_lens[b], decodes them with `codec`, and runs exact attention. Keep TF32 matmuls off on
    CUDA when using it as a reference.

    The decoded FP32 rows and the scores go into the buffers of `scratch` (a fresh one when None), which
    a session reuses step after step: a fresh multi-MB tensor per step costs page faults whenever the
    allocator has handed its memory back to the OS — every step from 16k tokens on, where FP32 c_kv
    reaches 32 MiB, glibc's largest mmap threshold.
    """
    inputs = DecodeInputs(q, pool, block_table, seq_lens, codec, d_c)
    scratch = Scratch() if scratch is None else scratch
    pages, lens = inputs.host_pages()
    t_max = max(lens, default=0)
    n_pages = -(-t_max // pool.shape[1])
    raw = gather_pages(pool, [row + [0] * (n_pages - len(row)) for row in pages])[:, :t_max]  # [B, T, row_bytes]
    batch, heads, _ = q.shape
    # the two parts are decoded apart and never concatenated: one less pass over the rows per step
    c_kv = scratch.take("c_kv", (batch, t_max, d_c), q.device)
    k_pe = scratch.take("k_pe", (batch, t_max, codec.kpe.width), q.device)
    codec.decode_parts(raw, out=(c_kv, k_pe))
    for b, n in enumerate(lens):
        if n < t_max:
            c_kv[b, n:] = 0.0  # slots past a sequence's end are undefined and may decode to NaN / Inf
            k_pe[b, n:] = 0.0
    q = q.float()
    # rows @ q^T runs several times faster on CPU than q @ rows^T (BLAS with a transposed large operand)
    scores = scratch.take("scores", (batch, t_max, heads), q.device)  # [B, T, H]
    torch.bmm(c_kv, q[..., :d_c].transpose(1, 2), out=scores).baddbmm_(k_pe, q[..., d_c:].transpose(1, 2))
    # the softmax on a contiguous [B, H, T] copy: reductions along a strided dim are far slower
    probs = scratch.take("probs", (batch, heads, t_max), q.device).copy_(scores.transpose(1, 2)).mul_(scale)
    for b, n in enumerate(lens):
        if n < t_max:
            probs[b, :, n:] = float("-inf")
    lse = torch.logsumexp(probs, dim=-1)  # [B, H]
    # an empty sequence has lse = -inf; subtracting 0 instead keeps its probabilities 0, not NaN
    probs.sub_(lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1)).exp_()
    return torch.bmm(probs, c_kv), lse  # [B, H, d_c], [B, H]


class Scratch:
    """Float32 buffers the torch decode path reuses from step to step, one per name, kept and grown on
    demand: a `DecodeSession` holds the FP32 rows of its longest layer read (B × T × (d_c + d_r) × 4
    bytes, 38 MB at 16k tokens with DeepSeek's d_c 512, d_r 64) plus up to GROWTH − 1 of slack.
    Not for concurrent use."""

    GROWTH = 1.25  # a buffer outgrown by one more token grows by a quarter, not by one row per step

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], device: torch.device) -> Tensor:
        """A contiguous float32 tensor of `shape` on `device` (contents undefined)."""
        size = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size or buf.device != device:
            grown = size if buf is None or buf.device != device else max(size, int(buf.numel() * self.GROWTH))
            self._buffers.pop(name, None)  # free the old buffer before taking the new one
            buf = self._buffers[name] = torch.empty(grown, device=device)
        return buf[:size].view(shape)
