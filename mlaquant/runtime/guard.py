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

Re-estimation of clip ranges (`recalibrate_every` decode steps, 0 = off): the guard keeps each layer's
`recalibrate_rows` most recent rows; for a layer whose codec clips to calibrated per-channel ranges, the
new range is the union of the current one and the (1 − percentile, percentile) quantiles of those rows,
so a channel that drifts past its calibrated range stops being clipped while the calibrated clipping of
the others stays. Integer codecs store each row's scales, so only rows written afterwards change (static
FP8 parts, whose scale the reader needs, are left alone). Events go to `guard.recalibrations`.
On by default (every 64 decode steps; 0 turns it off): `scripts/measure_recalibration.py` measures what it
buys on sequences longer than the calibration ones (steps `guard`, `guard_clip_all` of
scripts/regenerate_readme.sh; docs/results.md).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from mlaquant.config import ConfigError, load_config
from mlaquant.quant.codecs import LayerCodec
from mlaquant.quant.ranges import percentile_bounds

log = logging.getLogger(__name__)


@dataclasses.dataclass
class GuardConfig:
    version: int = 1
    check_every: int = 1000
    margin: float = 1.5
    max_out_of_range: float = 0.01
    recalibrate_every: int = 64
    recalibrate_rows: int = 512
    percentile: float = 0.999

    def __post_init__(self) -> None:
        if self.check_every < 1 or self.recalibrate_every < 0 or self.recalibrate_rows < 1:
            raise ConfigError("guard: need check_every ≥ 1, recalibrate_every ≥ 0 and recalibrate_rows ≥ 1")
        if not 0.5 < self.percentile <= 1:
            raise ConfigError(f"guard: percentile must be in (0.5, 1], got {self.percentile}")


def out_of_range(rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> float:
    """Fraction of the values of rows [N, d] outside per-channel [lo, hi] [d]."""
    return float(((rows < lo) | (rows > hi)).float().mean())


class Guard:
    def __init__(self, config: str | Path | dict | GuardConfig | None = None) -> None:
        self.config = load_config(GuardConfig, config, "guard.yaml")
        self.steps = 0
        self.recent: list[list[torch.Tensor]] = []  # per layer, the latest rows [n, d_c + d_r] (recalibration)
        self.recalibrations: list[dict] = []
        self.fallback_events: list[dict] = []  # the watched session's `fallback_events` (same list)

    def after_prefill(self, session, rows: list[torch.Tensor]) -> None:
        self.fallback_events = session.fallback_events
        self.recent = [[] for _ in rows]
        self._remember(rows)
        self.check(session, rows, "prefill")

    def after_decode(self, session, rows: list[torch.Tensor]) -> None:
        self.steps += 1
        self._remember(rows)
        every = self.config.recalibrate_every
        if every and self.steps % every == 0:
            self.recalibrate(session, f"decode step {self.steps}")
        if self.steps % self.config.check_every == 0:
            self.check(session, rows, f"decode step {self.steps}")

    def _remember(self, rows: list[torch.Tensor]) -> None:
        if not self.config.recalibrate_every:
            return
        keep = self.config.recalibrate_rows
        for recent, r in zip(self.recent, rows):
            recent.append(r.detach().float().reshape(-1, r.shape[-1]))
            if sum(t.shape[0] for t in recent) > 2 * keep:  # trim now and then, not a copy every step
                recent[:] = [torch.cat(recent)[-keep:]]

    def recalibrate(self, session, when: str) -> None:
        """Widen each clipped layer's clip range to cover its recent rows' quantiles (module docstring)."""
        for i, recent in enumerate(self.recent):
            codec = session.cache.codec(i)
            parts = (codec.ckv, codec.kpe)
            if not recent or any(p.clip_lo is None or p.spec.is_static_fp8 for p in parts):
                continue
            lo_now, hi_now = (torch.cat([getattr(p, k) for p in parts]) for k in ("clip_lo", "clip_hi"))
            latest = torch.cat(recent)[-self.config.recalibrate_rows :]
            lo_new, hi_new = percentile_bounds(latest, self.config.percentile)
            lo, hi = torch.minimum(lo_now, lo_new.cpu()), torch.maximum(hi_now, hi_new.cpu())
            widened = int(((lo < lo_now) | (hi > hi_now)).sum())
            if not widened:
                continue
            d_c = codec.ckv.width
            new = LayerCodec.from_names(codec.ckv.spec, codec.kpe.spec, d_c, codec.kpe.width, lo, hi)
            session.cache.layers[i][-1].codec = new  # rows carry their scales: only new writes change
            event = {"layer": i, "token": session.lengths[0], "channels_widened": widened, "when": when}
            self.recalibrations.append(event)
            log.info("guard: layer %d clip range widened on %d channels (%s)", i, widened, when)

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
