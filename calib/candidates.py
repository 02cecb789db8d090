"""What a layer's cache can be: the candidate codecs that fit the model (`fitting_candidates`), one layer's
observed rows in every variant (`LayerVariants`: c_kv plain, Hadamard- or PCA-rotated, k_pe plain or rotated,
each clipped to the calibrated ranges or not), the variant a candidate is measured in (`best_variant`), and a
measured candidate (`Choice`, one plan.yaml line by `describe`)."""

from __future__ import annotations

import dataclasses

import torch

from mlaquant.calib import transform
from mlaquant.calib.calibrate_config import CalibrateConfig
from mlaquant.calib.observers import LatentStats
from mlaquant.errors import MLAQuantError
from mlaquant.modeling.model import hadamard_signs, latent_rotation
from mlaquant.modeling.protocol import LatentModel
from mlaquant.quant.codecs import CodecError, LayerCodec, split_pair
from mlaquant.quant.ranges import percentile_bounds


def fitting_candidates(candidates: tuple, d_c: int, d_r: int, band_block: int = 16) -> tuple[tuple, list[dict]]:
    """The candidates whose codecs fit latent widths d_c / d_r, and one {candidate, reason} per one that does
    not (a group that does not divide its part, an odd width for 4-bit codes, bands of `band_block` channels
    that do not tile c_kv); MLAQuantError when none but the FP16 fallback fits."""
    fits, skipped = [], []
    for name in candidates:
        ckv, kpe = split_pair(name)
        try:
            if transform.is_transform_candidate(ckv):  # stand-in: one band of the whole width
                if d_c % band_block:
                    raise CodecError(f"codec {ckv}: bands of {band_block} channels do not tile width {d_c}")
                ckv = f"band-8x{d_c}"
            LayerCodec.from_names(ckv, kpe, d_c, d_r)
        except CodecError as e:
            skipped.append({"candidate": name, "reason": str(e)})
            continue
        fits.append(name)
    if fits == ["fp16/fp16"]:
        why = "; ".join(f"{s['candidate']}: {s['reason']}" for s in skipped)
        raise MLAQuantError(f"calibrate: no candidate codec fits latent widths d_c {d_c}, d_r {d_r} ({why})")
    return tuple(fits), skipped


class LayerVariants:
    """One layer's cached rows as observed, with each part plain or rotated: samples, ranges.

    Variants are keyed (c_kv rotation, rotate k_pe): c_kv False (plain), True (Hadamard) or "pca" (its
    principal axes, `mlaquant.calib.transform`, for 'pca-<rate>' candidates, with `self.pca` and the rotated
    second moments `self.pca_moments` the bands are allocated on; given the layer's c_kv Fisher matrix `fisher`
    [d_c, d_c] (`allocation: fisher`), the axes reordered and the moments weighted by the loss,
    `transform.loss_weighted_axes`); a Hadamard part rotates only if its width is a power of two.
    `widths`: the model's latent widths (d_c, d_r).
    """

    def __init__(
        self, stats: LatentStats, widths: tuple[int, int], cfg: CalibrateConfig, seed: int,
        fisher: torch.Tensor | None = None,
    ) -> None:
        plain = stats.sample()
        d_c, d_r = widths
        self.d_c, self.d_r = d_c, d_r
        pow2 = lambda n: n & (n - 1) == 0
        self.signs = hadamard_signs(d_c, seed) if cfg.try_rotation and pow2(d_c) else None
        # k_pe's signs from another seed than c_kv's (any fixed one; 7919 is just a prime)
        self.rope_signs = hadamard_signs(d_r, seed + 7919) if cfg.try_rotation and pow2(d_r) else None
        self.pca = self.pca_moments = None
        c_rotations = [False] + ([True] if self.signs is not None else [])
        if any(transform.is_transform_candidate(split_pair(c)[0]) for c in cfg.candidates):
            self.pca, self.pca_moments = transform.principal_rotation(plain[:, :d_c])
            if fisher is not None:
                self.pca, self.pca_moments = transform.loss_weighted_axes(self.pca, self.pca_moments, fisher)
            c_rotations.append("pca")
        self.band_block, self.band_bits = cfg.band_block, tuple(cfg.band_bits)
        self.rows = {}
        for rot_c in c_rotations:
            for rot_r in (False, True) if self.rope_signs is not None else (False,):
                rows = plain @ self.rotation(rot_c, rot_r) if rot_c or rot_r else plain
                self.rows[rot_c, rot_r] = rows
        self.bounds = {k: percentile_bounds(rows, cfg.percentile) for k, rows in self.rows.items()}

    def rotation(self, rotate: bool | str, rotate_rope: bool) -> torch.Tensor:
        """The [d_c + d_r, d_c + d_r] float32 rotation of variant (rotate, rotate_rope)."""
        signs, rope_signs = self.signs if rotate is True else None, self.rope_signs if rotate_rope else None
        r = latent_rotation(signs, rope_signs, self.d_c, self.d_r)
        if rotate == "pca":
            r[: self.d_c, : self.d_c] = self.pca
        return r

    def resolve(self, name: str) -> str:
        """`name` with a 'pca-<rate>' c_kv part replaced by this layer's band codec (`transform.band_spec`)."""
        ckv, kpe = split_pair(name)
        if transform.is_transform_candidate(ckv):
            ckv = transform.band_spec(ckv, self.pca_moments, self.band_block, self.band_bits)
        return f"{ckv}/{kpe}"

    def variants_for(self, name: str) -> list[tuple]:
        """The variant keys a candidate is tried in: the PCA basis for 'pca-<rate>' c_kv, the others else."""
        pca = transform.is_transform_candidate(split_pair(name)[0])
        return [k for k in self.rows if (k[0] == "pca") == pca]

    def codec(self, name: str, clip: bool, variant: tuple) -> LayerCodec:
        ckv, kpe = split_pair(self.resolve(name))
        lo, hi = self.bounds[variant] if clip else (None, None)
        return LayerCodec.from_names(ckv, kpe, self.d_c, self.d_r, lo, hi)


def layer_variants(
    model: LatentModel, stats: list[LatentStats], cfg: CalibrateConfig, fisher: list[torch.Tensor] | None = None
) -> list[LayerVariants]:
    """Every layer's `LayerVariants` (layer i's Fisher matrix `fisher[i]` when given)."""
    fisher = fisher or [None] * len(stats)
    widths = model.cfg.latent_widths
    return [LayerVariants(s, widths, cfg, cfg.seed + i, f) for i, (s, f) in enumerate(zip(stats, fisher))]


PROXY_ROWS = 16384


def best_variant(v: LayerVariants, name: str, try_clip: bool) -> tuple[bool, bool, bool]:
    """(rotate, rotate_rope, clip) with the lowest mean relative row error on the calibration rows.

    Rotations are orthogonal, so the relative error of a row is comparable with and without them;
    this cheap proxy (on at most `PROXY_ROWS` evenly strided rows) picks the variant, and only that
    variant's loss is measured on validation.
    """
    stride = max(1, v.rows[False, False].shape[0] // PROXY_ROWS)
    errors = {
        (*variant, clip): v.codec(name, clip, variant).relative_error(v.rows[variant][::stride])
        for variant in v.variants_for(name)
        for clip in ((False, True) if try_clip else (False,))
    }
    return min(errors, key=errors.get)


@dataclasses.dataclass
class Choice:
    """A measured candidate for one layer."""

    name: str
    clip: bool
    rotate: bool | str  # c_kv Hadamard-rotated (True) or on its principal axes ("pca")
    rotate_rope: bool  # k_pe (and q_pe) Hadamard-rotated after RoPE
    row_bytes: int
    loss: float  # single-layer loss on the validation split
    second_loss: float | None = None  # on the second validation domain (None when off)

    @property
    def worst(self) -> float:
        """The larger single-layer loss of the two validation domains: what the search weighs."""
        return self.loss if self.second_loss is None else max(self.loss, self.second_loss)


def describe(c: Choice) -> str:
    """One measured candidate as a plan.yaml line: codec, bytes, single-layer validation loss, variant."""
    rotated = "PCA-rotated c_kv" if c.rotate == "pca" else "rotated c_kv"
    flags = ((rotated, c.rotate), ("rotated k_pe", c.rotate_rope), ("clipped", c.clip))
    variant = [name for name, on in flags if on]
    second = "" if c.second_loss is None else f", third-party {c.second_loss:+.4%}"
    return f"{c.name}: {c.row_bytes} B, {c.loss:+.4%}{second}" + (f" ({', '.join(variant)})" if variant else "")
