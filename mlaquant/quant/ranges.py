"""Per-channel value ranges of latent rows: the percentile clip bounds calibration and the guard share."""

from __future__ import annotations

import torch


def percentile_bounds(rows: torch.Tensor, q: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (lo, hi) [d] at quantiles (1 − q, q) of rows [n, d], widened to include 0."""
    n = rows.shape[0]
    k_hi = min(n, max(1, round(q * n)))
    hi = rows.kthvalue(k_hi, dim=0).values
    lo = rows.kthvalue(n + 1 - k_hi, dim=0).values
    return torch.minimum(lo, torch.zeros_like(lo)), torch.maximum(hi, torch.zeros_like(hi))
