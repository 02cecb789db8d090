"""The MLA decode-attention op over a paged, quantized latent cache: one definition, two backends.

Decode with W_UK absorbed into the query is MQA with one KV head whose rows are the cached
`[c_kv | k_pe]` latents (see DESIGN.md):

    score[b, h, t] = scale * (q[b, h, :d_c] · c_kv[b, t] + q[b, h, d_c:] · k_pe[b, t])   t < seq_lens[b]
    out[b, h]      = softmax_t(score[b, h]) @ c_kv[b]          (V is a view of c_kv; W_UV comes later)
    lse[b, h]      = logsumexp_t(score[b, h])                  (natural log, for merging split-KV partials)

Paged cache: `pool[block, slot]` holds one encoded row (`LayerCodec` bytes); token t of sequence b
lives in block `block_table[b, t // block_size]`, slot `t % block_size`. Entries of `block_table` past
a sequence's last block, and slots past `seq_lens[b]` in its last block, may hold anything and are
never read.

Backends (`Backend`): "torch" is the FP32 reference in this file; "triton" is
`mlaquant.kernels.mla_decode.mla_decode` (same signature without `backend`), on CUDA or on CPU under
TRITON_INTERPRET=1; "auto" picks triton for CUDA tensors when the kernel imports and reads the codec
(fp16/int8/int4 parts, power-of-two groups ≥ 32 channels), else torch.
"""

from __future__ import annotations

import enum
import importlib
import os

import torch
from torch import Tensor

from mlaquant.codecs import LayerCodec
from mlaquant.errors import BackendError

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
    """'torch' or 'triton' for `op` on tensors on `device`; an explicit backend that cannot run → BackendError."""
    try:
        backend = Backend(backend)
    except ValueError:
        choices = ", ".join(b.value for b in Backend)
        raise BackendError(f"unknown backend {backend!r} (choose one of: {choices})") from None
    device = torch.device(device)
    if backend is Backend.TORCH:
        return Backend.TORCH.value
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


def _check_args(q: Tensor, pool: Tensor, block_table: Tensor, seq_lens: Tensor, codec: LayerCodec, d_c: int):
    """Shape/dtype/device checks that need no device synchronisation."""
    if q.dim() != 3 or q.shape[-1] != codec.width or not q.is_floating_point():
        raise ValueError(f"mla_decode: q must be float [B, H, {codec.width}], got {q.dtype} {list(q.shape)}")
    if d_c != codec.ckv.width:
        raise ValueError(f"mla_decode: d_c={d_c} but codec {codec.name} has c_kv width {codec.ckv.width}")
    if pool.dtype != torch.uint8 or pool.dim() != 3 or pool.shape[-1] != codec.row_bytes:
        raise ValueError(
            f"mla_decode: pool must be uint8 [num_blocks, block_size, {codec.row_bytes}] for {codec.name}, "
            f"got {pool.dtype} {list(pool.shape)}"
        )
    batch = q.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.is_floating_point():
        shape = list(block_table.shape)
        raise ValueError(f"mla_decode: block_table must be int [{batch}, max_blocks], got {shape}")
    if tuple(seq_lens.shape) != (batch,) or seq_lens.is_floating_point():
        raise ValueError(f"mla_decode: seq_lens must be int [{batch}], got {list(seq_lens.shape)}")
    devices = {t.device for t in (q, pool, block_table, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"mla_decode: q, pool, block_table, seq_lens must share a device, got {devices}")


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
) -> tuple[Tensor, Tensor]:
    """Absorbed MLA decode attention over a paged quantized cache.

    q: [B, H, d_c + d_r] absorbed query (q_nope·W_UK concatenated with rotated q_pe), float32.
    pool: uint8 [num_blocks, block_size, codec.row_bytes] (a layer's paged cache).
    block_table: int32 [B, max_blocks] (block ids per sequence, unused entries arbitrary).
    seq_lens: int32 [B] (tokens to attend per sequence, >= 1; 0 gives out 0 and lse -inf).
    Returns out [B, H, d_c] = softmax(q·[c_kv|k_pe]^T * scale) @ c_kv, float32, and
    lse [B, H] float32 (natural-log log-sum-exp of the scaled scores).
    """
    _check_args(q, pool, block_table, seq_lens, codec, d_c)
    if resolve_backend(backend, q.device) == Backend.TRITON.value and (
        Backend(backend) is not Backend.AUTO or _kernel_reads(codec, q.device)
    ):
        return load_kernel()(q, pool, block_table, seq_lens, codec, d_c, scale)
    return mla_decode_reference(q, pool, block_table, seq_lens, codec, d_c, scale)


def mla_decode_reference(
    q: Tensor, pool: Tensor, block_table: Tensor, seq_lens: Tensor, codec: LayerCodec, d_c: int, scale: float
) -> tuple[Tensor, Tensor]:
    """FP32 torch reference of `mla_decode` (same arguments, no backend): gathers only the rows
    t < seq_lens[b], decodes them with `codec`, and runs exact attention. Keep TF32 matmuls off on
    CUDA when using it as a reference."""
    _check_args(q, pool, block_table, seq_lens, codec, d_c)
    batch, _, width = q.shape
    num_blocks, block_size, _ = pool.shape
    lens = seq_lens.long()
    lens_host = lens.tolist()
    if min(lens_host) < 0 or max(lens_host) > block_table.shape[1] * block_size:
        raise ValueError(
            f"mla_decode: seq_lens must lie in [0, {block_table.shape[1] * block_size}] "
            f"(max_blocks x block_size), got {lens_host}"
        )
    t_max = max(lens_host)
    pos = torch.arange(t_max, device=q.device)
    valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [B, T]
    # gather whole pages (fast contiguous copies); slots past seq_len are decoded, then zeroed
    n_pages = -(-t_max // block_size)
    pages = block_table[:, :n_pages].long()  # [B, n_pages]
    used = torch.arange(n_pages, device=q.device).unsqueeze(0) * block_size < lens.unsqueeze(1)
    named = pages[used]
    if named.numel() and (named.min() < 0 or named.max() >= num_blocks):
        raise ValueError(f"mla_decode: block_table names blocks outside [0, {num_blocks}) within seq_lens")
    pages = torch.where(used, pages, 0)
    # whole pages as flat rows of 8-byte words: index_select copies them several times faster than pool[pages]
    page_bytes = block_size * pool.shape[2]
    flat = pool.reshape(num_blocks, page_bytes)
    flat = flat.view(torch.int64) if page_bytes % 8 == 0 and flat.is_contiguous() else flat
    raw = flat.index_select(0, pages.flatten()).view(torch.uint8)
    raw = raw.view(batch, n_pages * block_size, -1)[:, :t_max]  # [B, T, row_bytes]
    # the two parts are decoded apart and never concatenated: one less pass over the rows per step
    c_kv, k_pe = codec.decode_parts(raw)  # float32 [B, T, d_c], [B, T, d_r]
    if min(lens_host) < t_max:
        c_kv.masked_fill_(~valid.unsqueeze(-1), 0.0)  # undefined slots may decode to NaN / Inf
        k_pe.masked_fill_(~valid.unsqueeze(-1), 0.0)
    q = q.float()
    # rows @ q^T: several times faster on CPU than q @ rows^T (BLAS with a transposed large operand)
    scores = torch.matmul(c_kv, q[..., :d_c].transpose(1, 2))  # [B, T, H]
    scores = scores.add_(torch.matmul(k_pe, q[..., d_c:].transpose(1, 2))).mul_(scale).transpose(1, 2)
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H]
    # an empty sequence has lse = -inf; subtracting 0 instead keeps its probabilities 0, not NaN
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
    out = torch.matmul(probs, c_kv)  # [B, H, d_c]
    return out, lse
