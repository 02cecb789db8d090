"""W8A8 quantization rules (torch only, no Triton): what `mlaquant.kernels.int8_gemm` and
`mlaquant.modeling.int8_proj` both compute, kept importable where Triton is not installed.

Per row (bitsandbytes' `int8_vectorwise_quant`): amax = max |x|, codes round_half_even(x · (127 / amax)),
scale amax / 127 (an all-zero row gets codes 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _row_codes(x: Tensor, amax: Tensor) -> Tensor:
    """bitsandbytes' rule: round_half_even(x * (127.0 / amax)) per row (codes 0 where amax == 0); torch
    computes `127.0 / amax` as reciprocal(amax) * 127, which the kernel reproduces."""
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    return torch.round(x.float() * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)


def quantize_weight_per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """[N, K] float -> (w_int8 [N, K] int8, w_scale [N] fp32), w ≈ w_int8 * w_scale[:, None], absmax / 127."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_weight_per_channel: expected float [N, K], got {w.dtype} {list(w.shape)}")
    amax = w.float().abs().amax(1)
    return _row_codes(w, amax), amax / 127.0


def quantize_activation(x: Tensor, outlier_threshold: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Torch mirror of the kernel's per-token quantization of x [M, K]:
    (x8 int8 [M, K], s_x fp32 [M], outlier column mask bool [K] (all False without a threshold))."""
    a = x.float().abs()
    if outlier_threshold is None:
        cols = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)
        amax = a.amax(1)
    else:
        big = a >= outlier_threshold
        cols = big.any(0)
        amax = a.masked_fill(big, 0.0).amax(1)
    x8 = _row_codes(x, amax).masked_fill(cols, 0)
    return x8, amax / 127.0, cols
