"""One closeness measure for tests: how far `actual` is from `expected`, as a small report, and an assert
with a message that shows every figure.

    max_abs   max |a − e|
    max_rel   max |a − e| / max |e|          (relative to the output's scale, not elementwise)
    cosine    cos(a, e) of the flattened tensors
    sqnr_db   10 · log10(Σ e² / Σ (a − e)²)   (inf when equal)
    nan_match NaN at the same positions in both

All figures in float64, over the positions that are not NaN in either; equal infinities count as exact
(cosine and the signal of SQNR over the positions finite in both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Closeness:
    max_abs: float
    max_rel: float
    cosine: float
    sqnr_db: float
    nan_match: bool

    def __str__(self) -> str:
        nan = "NaN positions equal" if self.nan_match else "NaN positions DIFFER"
        return (f"max_abs {self.max_abs:.3g}, max_rel {self.max_rel:.3g}, cosine {self.cosine:.7g}, "
                f"SQNR {self.sqnr_db:.1f} dB, {nan}")


def closeness(actual: Tensor, expected: Tensor) -> Closeness:
    """The report of `actual` against `expected` (same shape, any float dtypes)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shapes differ: {list(actual.shape)} vs {list(expected.shape)}")
    a, e = actual.detach().double().flatten(), expected.detach().double().flatten()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    keep = ~(nan_a | nan_e)
    a, e = a[keep], e[keep]
    diff = torch.where(a == e, 0.0, a - e).abs()
    max_abs = diff.max().item() if diff.numel() else 0.0
    finite = torch.isfinite(a) & torch.isfinite(e)
    scale = e[finite].abs().max().item() if finite.any() else 0.0
    noise = diff.pow(2).sum().item()
    signal = e[finite].pow(2).sum().item()
    return Closeness(
        max_abs=max_abs,
        max_rel=max_abs / scale if scale else (0.0 if max_abs == 0 else math.inf),
        cosine=torch.nn.functional.cosine_similarity(a[finite], e[finite], 0).item() if finite.any() else 1.0,
        sqnr_db=math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal else -math.inf),
        nan_match=torch.equal(nan_a, nan_e),
    )


def assert_close(
    actual: Tensor, expected: Tensor, *, max_abs: float | None = None, max_rel: float | None = None,
    min_cosine: float | None = None, min_sqnr_db: float | None = None, what: str = "tensor",
) -> Closeness:
    """Assert NaN positions match and every given limit holds (≤ for the errors, ≥ for cosine and SQNR);
    returns the report. The message names the limits broken and the whole report."""
    r = closeness(actual, expected)
    broken = [f"{name} {value:.7g} {op} {limit:.7g}" for name, value, op, limit, bad in (
        ("max_abs", r.max_abs, ">", max_abs, max_abs is not None and not r.max_abs <= max_abs),
        ("max_rel", r.max_rel, ">", max_rel, max_rel is not None and not r.max_rel <= max_rel),
        ("cosine", r.cosine, "<", min_cosine, min_cosine is not None and not r.cosine >= min_cosine),
        ("SQNR dB", r.sqnr_db, "<", min_sqnr_db, min_sqnr_db is not None and not r.sqnr_db >= min_sqnr_db),
    ) if bad]
    if not r.nan_match:
        broken.append("NaN positions differ")
    assert not broken, f"{what}: {'; '.join(broken)} ({r})"
    return r
