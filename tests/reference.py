"""Pure-torch FP32 references the kernel tests compare against: what the Triton decode kernel
(`mlaquant.kernels.mla_decode`) computes, written plainly, and the error bound its docstring states.

Tests import them as `from tests.reference import ...`: pytest's importlib mode (pyproject) names each test
module after its path from the rootdir and makes `tests` a namespace package, so this works from a clean
clone with plain `pytest` and no sys.path edit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mlaquant.attention import native
from mlaquant.attention.cpu_decode import native_parts, pv_kind, quantize_query
from mlaquant.quant.int8_quant import quantize_activation

UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def quantized_query(q: Tensor, slices: list[tuple[int, int, int]]) -> Tensor:
    """q FP32 [B, H, D] with each (first channel, channels, group size) slice replaced by the `q8 * qs` that the
    kernels' `quantize_query` makes of it (`cpu_quantized_slices` gives the fast CPU path's); other channels as
    given. An exact reference fed with it sees the kernel's own arithmetic only, without the query quantization."""
    x = q.float().clone()
    for start, width, group in slices:
        q8, qs = quantize_query(x[..., start : start + width], group)
        x[..., start : start + width] = (q8.float().unflatten(-1, (-1, group)) * qs.unsqueeze(-1)).flatten(-2)
    return x


def effective_query(q: Tensor, codec) -> Tensor:
    """The query the Triton kernel's scores effectively use, FP32 [B, H, d_c + d_r]: integer parts `q8 * qs`
    (`quantized_query` with each part's grouping), fp16 parts rounded to FP16 (its fp16 dot). `codec`: a
    `LayerCodec`."""
    x = quantized_query(q, cpu_quantized_slices(codec, c_kernels=False))
    start = 0
    for rc in (codec.ckv, codec.kpe):
        if rc.spec.kind == "fp16":
            x[..., start : start + rc.width] = x[..., start : start + rc.width].half().float()
        start += rc.width
    return x


def kernel_reference(
    q: Tensor, pool: Tensor, block_table: Tensor, seq_lens: Tensor, codec, d_c: int, scale: float, config=None,
) -> tuple[Tensor, Tensor]:
    """FP64 mirror of what the Triton decode computes on the same paged cache, without its split-KV merge:
    (out [B, H, d_c] fp32, lse [B, H] fp32); an empty sequence gives 0, -inf.

    Scores use the kernel's operands (`scored_parts`): a part scored as FP16 dots on its dequantized tile
    (a band c_kv part always; its 0-bit channels decode to 0) with the query and the decoded keys rounded to
    FP16; other integer parts with the query `quantize_query` makes (`effective_query`) and exact keys; other
    FP16 parts with the query rounded; P·V with the decoded values rounded to FP16, as `half_values` /
    `band_values` make them. `config`: the `KernelConfig` the kernel ran with (None: the packaged one)."""
    from mlaquant.kernels import mla_decode as K  # lazily: tests set TRITON_INTERPRET before triton loads

    config = K.load_kernel_config(config)
    _, _, fp16_c, fp16_r = K.scored_parts(codec, q.shape[1], config, on_gpu=False)
    q_eff = effective_query(q, codec).double()
    if fp16_c:
        q_eff[..., :d_c] = q[..., :d_c].half().double()
    if fp16_r:
        q_eff[..., d_c:] = q[..., d_c:].half().double()
    bsz, heads = q.shape[:2]
    page = pool.shape[1]
    out = torch.zeros(bsz, heads, d_c, dtype=torch.float64)
    lse = torch.full((bsz, heads), float("-inf"), dtype=torch.float64)
    for b, n in enumerate(seq_lens.tolist()):
        if not n:
            continue
        t = torch.arange(n)
        rows = codec.decode(pool[block_table[b, t // page].long(), t % page]).double()  # [n, d_c + d_r]
        keys, values = rows.clone(), rows[:, :d_c].half().double()
        if fp16_c:
            keys[:, :d_c] = values
        if fp16_r:
            keys[:, d_c:] = rows[:, d_c:].half().double()
        scores = scale * q_eff[b] @ keys.T  # [H, n]
        lse[b] = torch.logsumexp(scores, -1)
        out[b] = torch.softmax(scores, -1) @ values
    return out.float(), lse.float()


def merge_gated_fp16_reference(out_parts: Tensor, lse_parts: Tensor) -> tuple[Tensor, Tensor]:
    """Torch mirror of the kernel's stage 2 (`merge_gated_fp16`): fold S partials [..., S, D] / LSEs [..., S]
    left to right with the FP16 sigmoid gate -> ([..., D] fp32, [...] fp32). Same arithmetic as
    `mlaquant.kernels.mla_decode_jit.merge_kernel`."""
    h = out_parts[..., 0, :].float()
    lse = lse_parts[..., 0].float()
    for k in range(1, out_parts.shape[-2]):
        lse_b = lse_parts[..., k].float()
        gate = torch.sigmoid(lse - lse_b).half().float().unsqueeze(-1)
        h = gate * h + (1.0 - gate) * out_parts[..., k, :].float()
        lse = torch.logaddexp(lse, lse_b)
    return h, lse


def merge_error_bound(n_chunks: int, values: Tensor) -> Tensor:
    """The kernel docstring's bound on |gated merge − exact softmax| per channel for `values` [T, D] -> [D]."""
    v = values.float()
    spread = v.amax(0) - v.amin(0)
    return (n_chunks - 1) * 2.0**-11 * (1 + 2.0**-10) * spread + n_chunks * 2.0**-20 * v.abs().amax(0)


def int8_gemm_reference(
    x: Tensor, w_int8: Tensor, w_scale: Tensor, out_dtype: torch.dtype = torch.float16,
    outlier_threshold: float | None = None, w_fp: Tensor | None = None,
) -> Tensor:
    """Torch reference of `int8_gemm` (same arguments, same arithmetic; the INT32 sums are exact in FP64)."""
    from mlaquant.kernels import int8_gemm as G  # lazily: tests set TRITON_INTERPRET before triton loads

    G.check_gemm_args(x, w_int8, w_scale, out_dtype, w_fp)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    x8, sx, cols = quantize_activation(x2, outlier_threshold)
    acc = (x8.double() @ w_int8.double().T).float()  # exact: |sum| < 2^31 << 2^53
    y = acc * sx.unsqueeze(1) * w_scale.unsqueeze(0)
    extra = G.outlier_product(x2, w_int8, w_scale, cols, w_fp) if outlier_threshold is not None else None
    if extra is not None:
        y = y + extra
    return y.to(out_dtype).reshape(*lead, w_int8.shape[0])


def int8_gemm_error_bound(x: Tensor, w: Tensor, w_int8: Tensor, w_scale: Tensor, y: Tensor) -> Tensor:
    """The docstring's bound on |y − x·wᵀ| [M, N] (no outlier columns): x [M, K], w [N, K] the FP weight that
    was quantized to (w_int8, w_scale), y the kernel's output."""
    x32 = x.reshape(-1, x.shape[-1]).float()
    w_hat = w_int8.float() * w_scale.unsqueeze(1)
    sx = x32.abs().amax(1) / 127.0
    quant = 0.5 * w_scale.unsqueeze(0) * x32.abs().sum(1, keepdim=True)
    quant = quant + 0.5 * sx.unsqueeze(1) * w_hat.abs().sum(1)
    epilogue = 2.0**-20 * (x32.abs() @ w_hat.abs().T)
    return quant + UNIT_ROUNDOFF[y.dtype] * y.float().abs().reshape(quant.shape) + epilogue


PV_STEP = {"digits": 1.0 / (127.0 * 256.0), "int16": (0.5 + 2.0**-7) / 32767.0}  # |ΔP·s| per unit of max |s|
INT_KINDS = ("int8", "int4")


def cpu_quantized_slices(codec, c_kernels: bool = True) -> list[tuple[int, int, int]]:
    """Where `mla_decode_cpu` quantizes the query: (first channel, channels, group size) of each integer part of
    the row, and of each stored band of a band c_kv part the C kernels read (one group per band)."""
    slices, start = [], 0
    for rc in (codec.ckv, codec.kpe):
        if rc.spec.kind in INT_KINDS:
            slices.append((start, rc.width, rc.layout.group_size))
        elif rc.spec.kind == "band" and c_kernels and native.kernels() is not None and native_parts(rc) is not None:
            slices += [(start + ch, cp.width, cp.width) for cp, _, ch in native_parts(rc)]
        start += rc.width
    return slices


def cpu_error_bound(
    q: Tensor, rows: list[Tensor], codec, d_c: int, scale: float,
    row_scales: list[Tensor] | None = None, quantized_query: bool = True, c_kernels: bool = True,
) -> tuple[Tensor, Tensor]:
    """Worst-case |lse error| [B, H] and |out error| [B, H, d_c] of `mla_decode_cpu` against the FP32
    reference, for q [B, H, d_c + d_r] and each sequence's decoded rows [T_b, d_c + d_r] (cpu_decode's module
    docstring): Δs = scale · (Σ_g qs_g/2 · Σ_c∈g |k_c| + ε · Σ_c |q_c k_c|) · (1 + 2^-10) over the tokens,
    ε = max(2^-20, (G + 4) · 2^-24) for the G groups (bands) the FP32 epilogue sums in order (the qs term only
    when `quantized_query`: off for a query already equal to its quantized value), Δout = (e^(2 Δs) − 1 + 2^-12)
    · max_t |v[t, c]| + the P·V term of a c_kv on its codes (`pv_kind`), e^(4 Δs) · step · M_g(c) · Σ_t |q_t,c| /
    Σ_t p_t: M_g = max_t |s_t,g| of `row_scales[b]` fp32 [T_b, n_g] (the stored c_kv scales, one per group or
    stored band; required for such a part), step = (1/2 + 2^-7) / 32767 for the int16 P of the C kernels
    (rounding plus the FP32 product p · s · 32767 / M), 1 / (127 · 256) for the torch ops' two int8 digits
    (row-wise only), p_t = e^(score_t − max); |q_t,c| = |v_t,c| / |s_t,g| for symmetric codes, the codes' bound
    for asymmetric ones (128 int8, 15 int4: their zero points are added apart)."""
    kind = pv_kind(codec, c_kernels)
    if kind != "fp32" and row_scales is None:
        raise ValueError(f"cpu_error_bound: codec {codec.name} decodes P·V on the codes; pass row_scales")
    slices = cpu_quantized_slices(codec, c_kernels)
    eps = max(2.0**-20, (sum(w // g for _, w, g in slices) + 4) * 2.0**-24)
    d_score, d_out = [], []
    for b, (qb, kv) in enumerate(zip(q.float(), rows)):
        heads = qb.shape[0]
        if not kv.shape[0]:
            d_score.append(torch.zeros(heads, device=q.device))
            d_out.append(torch.zeros(heads, d_c, device=q.device))
            continue
        k_abs = kv.abs()
        bound = (qb.abs() @ k_abs.t()) * eps  # [H, T]: FP32 products and sums
        for start, w, g in slices if quantized_query else ():
            _, qs = quantize_query(qb[:, start : start + w], g)  # [H, w / g]
            bound += (qs / 2) @ k_abs[:, start : start + w].unflatten(-1, (-1, g)).sum(-1).t()
        ds = scale * (1 + 2.0**-10) * bound.amax(-1)
        out = (torch.expm1(2 * ds) + 2.0**-12).unsqueeze(-1) * kv[:, :d_c].abs().amax(0)
        if kind != "fp32":
            out += _code_pv_bound(qb, kv, codec, d_c, scale, row_scales[b], ds, PV_STEP[kind])
        d_score.append(ds)
        d_out.append(out)
    return torch.stack(d_score), torch.stack(d_out)


def _channel_scales(codec, s: Tensor) -> Tensor:
    """|s| of each c_kv channel's group (or band; 0 for a 0-bit band's channels), fp32 [T, d_c], from the stored
    scales s fp32 [T, n_g]."""
    s = s.reshape(s.shape[0], -1).abs()
    if codec.ckv.spec.kind != "band":
        return s.repeat_interleave(codec.ckv.layout.group_size, dim=1)
    cols, k = [], 0
    for bits, w in codec.ckv.spec.bands:
        cols.append(s[:, k : k + 1].expand(-1, w) if bits else s.new_zeros(s.shape[0], w))
        k += bool(bits)
    return torch.cat(cols, dim=1)


def _code_pv_bound(q: Tensor, kv: Tensor, codec, d_c: int, scale: float, s: Tensor, ds: Tensor,
                   step: float) -> Tensor:
    """The P·V-on-the-codes term of `cpu_error_bound` for one sequence (s fp32 [T, n_g]): [H, d_c]."""
    scores = (q @ kv.t()) * scale  # [H, T]
    p = (scores - scores.amax(-1, keepdim=True)).exp()
    per_channel = _channel_scales(codec, s)  # [T, d_c]: |s_t,g(c)|
    if codec.ckv.spec.symmetric:
        safe = torch.where(per_channel > 0, per_channel, torch.ones_like(per_channel))
        sum_q = (kv[:, :d_c].abs() / safe).sum(0)  # [d_c]
    else:
        sum_q = torch.full((d_c,), (128.0 if codec.ckv.spec.kind == "int8" else 15.0) * kv.shape[0], device=kv.device)
    top = per_channel.amax(0) * step  # [d_c]: M_g(c) · step
    return (torch.exp(4 * ds) / p.sum(-1)).unsqueeze(-1) * (top * sum_q)
