"""Runtime guard: watches each layer's quantization error while decoding and widens what breaks.

Once after prefill and every `check_every` decode steps, the guard measures for each layer the rows
just written (pre-quantization values, before they reach the cache):

    rel_error     max over rows of ||x̂ − x|| / ||x|| with the layer's current codec, against the worst
                  row seen at calibration times `margin`
    out_of_range  fraction of the values outside `margin` × the per-channel range observed at
                  calibration (`layer{i}.range_lo/hi`), against `max_out_of_range`

A layer over a bound switches to its next wider codec for new tokens
(`DecodeSession.widen_layer`); events go to `session.fallback_events` and are logged once each.

Dynamic per-row scales make the relative error scale-invariant, so rows scaled far past the
calibrated range show up as out-of-range values, not error. The range check therefore applies while a
layer still uses its planned codec; after one widening only the error check can widen it further. Uniform
plans ("int8", "int4") carry no calibrated bounds and are not guarded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mlaquant.config import load_config


@dataclasses.dataclass
class GuardConfig:
    version: int = 1
    check_every: int = 1000
    margin: float = 1.5
    max_out_of_range: float = 0.01


def out_of_range(rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> float:
    """Fraction of the values of rows [N, d] outside per-channel [lo, hi] [d]."""
    return float(((rows < lo) | (rows > hi)).float().mean())


class Guard:
    def __init__(self, config: str | Path | dict | GuardConfig | None = None) -> None:
        self.config = load_config(GuardConfig, config, "guard.yaml")
        self.steps = 0

    def after_prefill(self, session, rows: list[torch.Tensor]) -> None:
        self.check(session, rows, "prefill")

    def after_decode(self, session, rows: list[torch.Tensor]) -> None:
        self.steps += 1
        if self.steps % self.config.check_every == 0:
            self.check(session, rows, f"decode step {self.steps}")

    def check(self, session, rows: list[torch.Tensor], when: str) -> None:
        """rows[i]: layer i's rows just written [N, d_c + d_r]."""
        plan, margin = session.plan, self.config.margin
        for i, r in enumerate(rows):
            lp = plan.layers[i]
            if lp.max_rel_error is None or r.numel() == 0:
                continue
            r = r.float().reshape(-1, r.shape[-1])
            codec = session.cache.codec(i)
            err = float(codec.relative_error(r, "none").max())
            reason = None
            if err > lp.max_rel_error * margin:
                reason = f"{when}: relative error {err:.4f} > bound {lp.max_rel_error * margin:.4f}"
            elif len(session.cache.layers[i]) == 1 and f"layer{i}.range_lo" in plan.tensors:
                lo, hi = (plan.tensors[f"layer{i}.range_{k}"].to(r.device) * margin for k in ("lo", "hi"))
                rate = out_of_range(r, lo, hi)
                if rate > self.config.max_out_of_range:
                    reason = f"{when}: {rate:.1%} of values outside {margin}× the calibrated range"
            if reason is not None:
                session.widen_layer(i, reason)
