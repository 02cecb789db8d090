"""Pure-torch FP32 references the kernel tests compare against: what the Triton decode kernel
(`mlaquant.kernels.mla_decode`) computes, written plainly, and the error bound its docstring states.

Tests import them as `from tests.reference import ...`: pytest's importlib mode (pyproject) names each test
module after its path from the rootdir and makes `tests` a namespace package, so this works from a clean
clone with plain `pytest` and no sys.path edit.
"""

from __future__ import annotations

import torch
from torch import Tensor


def quantize_query(q: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Torch mirror of the kernel's query quantization: [..., W] -> (int8 [..., W], fp32 scales [..., W/G]).

    qs = absmax / 127 per group (1 for an all-zero group), q8 = round_half_even(q / qs), in FP32."""
    x = q.float().unflatten(-1, (-1, group_size))
    amax = x.abs().amax(-1)
    qs = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q8 = torch.round(x / qs.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q8.flatten(-2), qs


def effective_query(q: Tensor, codec) -> Tensor:
    """The query the kernel's scores effectively use, FP32 [B, H, d_c + d_r]: integer parts `q8 * qs`
    (`quantize_query` with the part's grouping), fp16 parts rounded to FP16. An exact reference fed with it
    sees the kernel's own arithmetic only, without the query quantization. `codec`: a `LayerCodec`."""
    parts = []
    for rc, x in zip((codec.ckv, codec.kpe), q.float().split([codec.ckv.width, codec.kpe.width], dim=-1)):
        if rc.spec.kind in ("int8", "int4"):
            q8, qs = quantize_query(x, rc.layout.group_size)
            x = (q8.float().unflatten(-1, (-1, rc.layout.group_size)) * qs.unsqueeze(-1)).flatten(-2)
        elif rc.spec.kind == "fp16":
            x = x.half().float()
        parts.append(x)
    return torch.cat(parts, dim=-1)


def merge_gated_fp16_reference(out_parts: Tensor, lse_parts: Tensor) -> tuple[Tensor, Tensor]:
    """Torch mirror of the kernel's stage 2 (`merge_gated_fp16`): fold S partials [..., S, D] / LSEs [..., S]
    left to right with the FP16 sigmoid gate -> ([..., D] fp32, [...] fp32). Same arithmetic as
    `_merge_kernel`."""
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
