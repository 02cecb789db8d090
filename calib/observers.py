"""Dynamic-range observers: per-layer, per-channel statistics of the latent rows [c_kv | k_pe].

One pass of the model over the calibration samples records, for every layer and channel, the
running min / max / absmax exactly, and keeps a strided subsample of rows (at most `max_rows` per
layer) for percentiles and for measuring per-row quantization error and clip rate. `observe` runs any
`mlaquant.modeling.protocol.LatentModel`: a loaded `MLAModel`, or a `StreamedModel` layer-major with the same
statistics bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlaquant.errors import MLAQuantError
from mlaquant.modeling.protocol import LatentModel


@dataclass
class LatentStats:
    """Statistics of one layer's latent rows (float32, [d_c + d_r] per channel), kept on the CPU whatever
    device the model runs on (they are small, and plans are device-independent)."""

    min: torch.Tensor
    max: torch.Tensor
    rows: list[torch.Tensor] = field(default_factory=list)
    count: int = 0

    @property
    def absmax(self) -> torch.Tensor:
        return torch.maximum(self.min.abs(), self.max.abs())

    def sample(self) -> torch.Tensor:
        """The kept subsample of rows [n, d_c + d_r]."""
        return torch.cat(self.rows)


class LatentObserver:
    """`latent_rows` hook for `MLAModel.forward` that records `LatentStats` per layer."""

    def __init__(self, num_layers: int, every: int = 1) -> None:
        self.stats: list[LatentStats | None] = [None] * num_layers
        self.every = every

    def __call__(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        flat = rows.reshape(-1, rows.shape[-1]).float()
        if not torch.isfinite(flat).all():
            raise MLAQuantError(f"layer {layer}: latent rows contain NaN/Inf during calibration")
        lo, hi = flat.min(0).values.cpu(), flat.max(0).values.cpu()
        s = self.stats[layer]
        if s is None:
            s = self.stats[layer] = LatentStats(lo, hi)
        else:
            s.min, s.max = torch.minimum(s.min, lo), torch.maximum(s.max, hi)
        s.rows.append(flat[(-s.count) % self.every :: self.every].to("cpu", copy=True))
        s.count += flat.shape[0]
        return rows


def observe(
    model: LatentModel, samples: torch.Tensor, batch_size: int = 8, max_rows: int = 65536, progress=None
) -> list[LatentStats]:
    """Run the calibration samples [N, T] int64 through `model` in batches of `batch_size`; returns
    [LatentStats] per layer."""
    every = max(1, samples.numel() // max_rows)
    observer = LatentObserver(len(model.layers), every)
    model.run(list(samples.split(batch_size)), observer, progress=progress)
    return observer.stats
