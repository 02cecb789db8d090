"""W8A8 INT8 GEMM in Triton (LLM.int8()-style), beside its torch reference.

    y[m, n] = s_x[m] · s_w[n] · Σ_k x8[m, k] · w8[n, k]   (+ FP16 outlier part, below)

Activations `x` [..., K] (fp16/bf16/fp32) are quantized per token on the fly, the way bitsandbytes'
`int8_vectorwise_quant` does: `amax_m = max_k |x[m, k]|`,
`x8 = round_half_even(x · fl32(fl32(1 / amax_m) · 127))`
(torch's `127.0 / amax` is a reciprocal and a product, not a division),
`s_x = amax_m / 127` (an all-zero row gets codes 0). Weights `w_int8` [N, K] int8 (nn.Linear layout) carry
per-output-channel scales `w_scale` [N] fp32, w ≈ w_int8 · w_scale[:, None]; `quantize_weight_per_channel`
makes them with the same rule, so its codes equal bitsandbytes' `CB` and `w_scale = SCB / 127`. The INT8
products accumulate exactly in INT32 (`tl.dot`, K < 133,000); the epilogue scales in FP32 and writes
FP16, BF16 or FP32.

Outliers (LLM.int8(), `outlier_threshold`, bitsandbytes uses 6.0): every column k holding some |x[m, k]| ≥
threshold is an outlier column. Its entries are left out of each row's absmax and its codes are zeroed; the
outlier columns are multiplied in FP16 (BF16 when x is BF16) against `w_fp` (the original weights) or, by
default, against the dequantized INT8 weights as bitsandbytes does for INT8-stored weights, and the product is
added to the FP32 epilogue before the final rounding.

Error against the FP32 product of the same `x` and the weight `w` that was quantized (ŵ = w8·s_w,
x̂ = x8·s_x, |w − ŵ| ≤ s_w/2 and |x − x̂| ≤ s_x/2 elementwise, x·w − x̂·ŵ = x·(w − ŵ) + (x − x̂)·ŵ):

    |y[m, n] − x[m]·w[n]| ≤ ½·s_w[n]·‖x[m]‖₁ + ½·s_x[m]·‖ŵ[n]‖₁ + u_out·|y[m, n]| + 2^-20·|x[m]|·|ŵ[n]|

(u_out = 2^-11 fp16, 2^-8 bf16, 2^-24 fp32; the last term covers the FP32 epilogue; outlier columns carry
only the weight term plus their FP16 product's rounding). `int8_gemm_error_bound` in tests/reference.py
computes it without the outlier columns. Under TRITON_INTERPRET=1 a BF16 output is written as FP32 and
rounded by torch (the interpreter truncates FP32 -> BF16 instead of rounding to nearest).
"""

from __future__ import annotations

import torch
import triton  # an ImportError here is what a dispatcher turns into "backend 'triton' unavailable"
import triton.language as tl
from torch import Tensor

from mlaquant.errors import BackendError
from mlaquant.quant.int8_quant import OUT_DTYPES, quantize_activation, quantize_weight_per_channel

# --------------------------------------------------------------------------------------------- torch


def outlier_product(
    x: Tensor, w_int8: Tensor, w_scale: Tensor, cols: Tensor, w_fp: Tensor | None
) -> Tensor | None:
    """x[:, cols] @ W[:, cols]^T in 16-bit (fp32 result) or None when no column is an outlier."""
    idx = cols.nonzero().flatten()
    if idx.numel() == 0:
        return None
    half = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float16
    w_sub = w_fp[:, idx] if w_fp is not None else w_int8[:, idx].float() * w_scale.unsqueeze(1)
    return (x[:, idx].to(half) @ w_sub.to(half).T).float()


def check_gemm_args(x: Tensor, w_int8: Tensor, w_scale: Tensor, out_dtype: torch.dtype, w_fp: Tensor | None) -> None:
    if not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"int8_gemm: x must be float [..., K], got {x.dtype} {list(x.shape)}")
    if w_int8.dtype != torch.int8 or w_int8.dim() != 2 or w_int8.shape[1] != x.shape[-1]:
        got = f"{w_int8.dtype} {list(w_int8.shape)}"
        raise ValueError(f"int8_gemm: w_int8 must be int8 [N, {x.shape[-1]}], got {got}")
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != (w_int8.shape[0],):
        raise ValueError(f"int8_gemm: w_scale must be float32 [{w_int8.shape[0]}], got {w_scale.dtype} "
                         f"{list(w_scale.shape)}")
    if w_fp is not None and tuple(w_fp.shape) != tuple(w_int8.shape):
        raise ValueError(f"int8_gemm: w_fp must be shaped {list(w_int8.shape)}, got {list(w_fp.shape)}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"int8_gemm: out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    if len({t.device for t in (x, w_int8, w_scale)}) != 1:
        raise ValueError("int8_gemm: x, w_int8 and w_scale must be on one device")


# -------------------------------------------------------------------------------------------- Triton


@triton.jit
def _quantize_rows_kernel(
    x_ptr, cols_ptr, x8_ptr, sx_ptr, K, stride_xm, stride_qm, threshold,
    HAS_OUTLIERS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One row: absmax over non-outlier entries, codes round_half_even(x * (1/amax * 127)), s_x = amax/127."""
    m = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        a = tl.abs(tl.load(x_ptr + m * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32))
        if HAS_OUTLIERS:
            a = tl.where(a >= threshold, 0.0, a)
        amax = tl.maximum(amax, a)
    row_max = tl.max(amax, axis=0)
    # torch evaluates `127.0 / amax` (bitsandbytes' formula) as reciprocal(amax) * 127: do the same, exactly.
    safe = tl.where(row_max > 0, row_max, 1.0) + tl.zeros_like(amax)
    inv = tl.where(row_max > 0, tl.math.div_rn(tl.full([BLOCK_K], 1.0, tl.float32), safe) * 127.0, 0.0)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32) * inv
        # Round half to even, exactly (x − floor(x) is representable; floor(x + 0.5) is not always right).
        r = tl.floor(x)
        f = x - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        r = tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)
        q = tl.minimum(tl.maximum(r, -127.0), 127.0)
        if HAS_OUTLIERS:
            q = tl.where(tl.load(cols_ptr + offs, mask=offs < K, other=0) != 0, 0.0, q)
        tl.store(x8_ptr + m * stride_qm + offs, q.to(tl.int8), mask=offs < K)
    tl.store(sx_ptr + m, tl.math.div_rn(row_max, 127.0))


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, extra_ptr, c_ptr, M, N, K,
    stride_am, stride_bn, stride_em, stride_cm, stride_sam,
    stride_ag, stride_bg, stride_sag, stride_sbg, stride_cg,
    HAS_EXTRA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[M, N] = (A8 [M, K] · B8[N, K]^T) in INT32, then · s_a[m] · s_b[n] (+ extra) in FP32; program_id(2)
    picks a group g of a grouped GEMM (every operand offset by its group stride, 0 for a plain GEMM)."""
    g = tl.program_id(2).to(tl.int64)
    a_ptr += g * stride_ag
    b_ptr += g * stride_bg
    sa_ptr += g * stride_sag
    sb_ptr += g * stride_sbg
    c_ptr += g * stride_cg
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + rk) < K
        a = tl.load(a_rows + (k0 + rk)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0)
        b = tl.load(b_cols + (k0 + rk)[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    sa = tl.load(sa_ptr + rm.to(tl.int64) * stride_sam, mask=m_mask, other=0.0)
    sb = tl.load(sb_ptr + rn, mask=n_mask, other=0.0)
    c = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_EXTRA:
        c += tl.load(extra_ptr + rm.to(tl.int64)[:, None] * stride_em + rn[None, :], mask=mask, other=0.0)
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, c.to(c_ptr.dtype.element_ty), mask=mask)


def interpreter_active() -> bool:
    """True when the kernels run in triton's CPU interpreter (TRITON_INTERPRET=1 set before importing triton);
    BackendError when it was set in between (our kernels and triton's library disagree)."""
    from triton.runtime.interpreter import InterpretedFunction

    ours = isinstance(_gemm_kernel, InterpretedFunction)
    if ours != isinstance(tl.standard.zeros_like, InterpretedFunction):
        raise BackendError("TRITON_INTERPRET=1 must be set before triton is first imported, not in between")
    return ours


def _device_check(x: Tensor) -> bool:
    """True when interpreted (CPU tensors); BackendError when the tensors' device cannot run the kernels."""
    interpreted = interpreter_active()
    if interpreted and x.is_cuda:
        raise BackendError("int8_gemm: TRITON_INTERPRET=1 runs on CPU tensors only")
    if not interpreted and not x.is_cuda:
        raise BackendError("int8_gemm: the triton backend needs a CUDA device (or TRITON_INTERPRET=1 set "
                           "before importing triton, for the CPU interpreter)")
    return interpreted


def quantize_rows_launch(x: Tensor, outlier_threshold: float | None = None):
    """The row-quantization launch for x [M, K] (contiguous rows): (launch, x8, s_x, outlier columns)."""
    from mlaquant.kernels.mla_decode import Launch

    m, k = x.shape
    if outlier_threshold is None:
        cols = torch.zeros(k, dtype=torch.bool, device=x.device)
    else:
        cols = (x.abs() >= outlier_threshold).any(0)
    x8 = torch.empty(m, k, dtype=torch.int8, device=x.device)
    sx = torch.empty(m, dtype=torch.float32, device=x.device)
    args = (x, cols.view(torch.uint8), x8, sx, k, x.stride(0), x8.stride(0), float(outlier_threshold or 0.0))
    kwargs = dict(HAS_OUTLIERS=outlier_threshold is not None, BLOCK_K=min(1024, triton.next_power_of_2(k)))
    return Launch(_quantize_rows_kernel, (m, 1, 1), args, kwargs), x8, sx, cols


def quantize_rows(x: Tensor, outlier_threshold: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Triton per-token quantization of x [M, K] -> (x8 int8 [M, K], s_x fp32 [M], outlier columns bool [K]);
    same contract as `quantize_activation`."""
    _device_check(x)
    if x.dtype == torch.bfloat16 and not x.is_cuda:
        x = x.float()  # exact; the interpreter has no BF16 arithmetic
    x = x if x.stride(-1) == 1 else x.contiguous()
    launch, x8, sx, cols = quantize_rows_launch(x, outlier_threshold)
    if x.shape[0] and x.shape[1]:
        launch.run()
    return x8, sx, cols


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): decode-sized M gets thin tiles; INT8 tl.dot needs K ≥ 32."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    return block_m, 128, 128, 4 if block_m <= 64 else 8


def gemm_launch(x8: Tensor, w: Tensor, sx: Tensor, ws: Tensor, y: Tensor, extra: Tensor | None = None):
    """The plain GEMM launch y [M, N] = x8 [M, K] · w [N, K]^T scaled (+ extra [M, N] fp32): (launch, tiles)."""
    from mlaquant.kernels.mla_decode import Launch

    (m, k), n = x8.shape, w.shape[0]
    block_m, block_n, block_k, warps = _tiles(m)
    args = (
        x8, w, sx, ws, extra if extra is not None else y, y, m, n, k,
        x8.stride(0), w.stride(0), extra.stride(0) if extra is not None else 0, y.stride(0), 1,
        0, 0, 0, 0, 0,
    )
    kwargs = dict(HAS_EXTRA=extra is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), 1)
    return Launch(_gemm_kernel, grid, args, kwargs), f"{block_m}x{block_n}x{block_k}"


def int8_gemm(
    x: Tensor, w_int8: Tensor, w_scale: Tensor, out_dtype: torch.dtype = torch.float16,
    outlier_threshold: float | None = None, w_fp: Tensor | None = None,
) -> Tensor:
    """W8A8 GEMM: x [..., K] float, w_int8 [N, K] int8, w_scale [N] fp32 -> y [..., N] in `out_dtype`.

    `outlier_threshold` turns on the LLM.int8() outlier columns (module docstring); `w_fp` [N, K] are the
    weights they use (default: the dequantized INT8 weights)."""
    check_gemm_args(x, w_int8, w_scale, out_dtype, w_fp)
    interpreted = _device_check(x)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    n = w_int8.shape[0]
    x8, sx, cols = quantize_rows(x2, outlier_threshold)
    extra = outlier_product(x2, w_int8, w_scale, cols, w_fp) if outlier_threshold is not None else None
    store_dtype = torch.float32 if interpreted and out_dtype == torch.bfloat16 else out_dtype
    y = torch.empty(x2.shape[0], n, dtype=store_dtype, device=x.device)
    w = w_int8 if w_int8.stride(-1) == 1 else w_int8.contiguous()
    launch, _ = gemm_launch(x8, w, sx, w_scale.contiguous(), y, extra)
    if y.numel():
        launch.run()
    return y.to(out_dtype).reshape(*lead, n)


def int8_gemm_grouped(x: Tensor, w_int8: Tensor, w_scale: Tensor, out_dtype: torch.dtype = torch.float16) -> Tensor:
    """G independent W8A8 GEMMs in one launch (e.g. one per attention head): x [..., G, K] float,
    w_int8 [G, N, K] int8, w_scale [G, N] fp32 -> y [..., G, N]; y[..., g, :] = int8_gemm(x[..., g, :],
    w_int8[g], w_scale[g]) (no outlier columns)."""
    if x.dim() < 2 or w_int8.dim() != 3 or tuple(x.shape[-2:]) != (w_int8.shape[0], w_int8.shape[2]):
        raise ValueError(f"int8_gemm_grouped: x [..., G, K] and w_int8 [G, N, K] disagree: {list(x.shape)} vs "
                         f"{list(w_int8.shape)}")
    if tuple(w_scale.shape) != tuple(w_int8.shape[:2]):
        raise ValueError(f"int8_gemm_grouped: w_scale must be [G, N] = {list(w_int8.shape[:2])}, got "
                         f"{list(w_scale.shape)}")
    if w_int8.shape[0]:
        check_gemm_args(x[..., 0, :], w_int8[0], w_scale[0], out_dtype, None)
    interpreted = _device_check(x)
    lead, (groups, k), n = x.shape[:-2], x.shape[-2:], w_int8.shape[1]
    x8, sx, _ = quantize_rows(x.reshape(-1, k))  # rows m·G + g
    m = x8.shape[0] // groups
    store_dtype = torch.float32 if interpreted and out_dtype == torch.bfloat16 else out_dtype
    y = torch.empty(m, groups, n, dtype=store_dtype, device=x.device)
    w = w_int8.contiguous()
    ws = w_scale.contiguous()
    block_m, block_n, block_k, warps = _tiles(m)
    if y.numel():
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), groups)
        _gemm_kernel[grid](
            x8, w, sx, ws, y, y, m, n, k,
            groups * k, k, 0, groups * n, groups,
            k, n * k, 1, n, n,
            HAS_EXTRA=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        )
    return y.to(out_dtype).reshape(*lead, groups, n)


__all__ = [
    "int8_gemm", "int8_gemm_grouped",
    "quantize_weight_per_channel", "quantize_activation", "quantize_rows", "interpreter_active", "OUT_DTYPES",
]
