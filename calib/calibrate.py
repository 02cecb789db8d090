"""`mlaquant calibrate`: the smallest latent-cache plan whose measured loss stays under the budget.

Pipeline (three disjoint splits; numbers reported on the one that chose nothing):

1. observe   calibration split, `samples` × `seq_len` tokens → per-layer, per-channel ranges of the
             latent rows (min/max and the `percentile` quantile) and a row subsample.
2. measure   validation split: for every layer and candidate codec the loss with only that layer
             quantized, in the variant (clipped to the calibrated ranges or not; c_kv and k_pe each
             Hadamard-rotated or not) with the lowest row error on the calibration rows.
3. search    every layer starts at its cheapest candidate; while the summed single-layer losses
             exceed `headroom × budget`, upgrade the layer/candidate with the best loss saved per
             byte added.
4. verify    the whole plan on validation; while over `headroom × budget`, fall back layer by layer —
             the layer with the largest single-layer loss moves to its next wider candidate that
             measured a lower loss alone (e.g. INT4 → INT8 → FP16) — and record why.
   narrow    the search's sum of single-layer losses is only an estimate: while measured loss is
             left under the target, try cheaper candidates (most bytes saved per single-layer loss
             added first; never a layer that fell back), each verified end to end on validation,
             and keep those that stay under `headroom × budget` (at most `narrow_trials` checks).
   int8      with `int8_matmul`, every layer's absorbed projections (q_nope·W_UK, W_UV, o_proj) go
             W8A8 on top of the verified cache plan; while the plan is over `headroom × budget`, the
             layer whose projections cost most alone (validation loss, FP16 cache) goes back to FP
             matmuls, and the fallback is recorded.
5. report    the plan's loss on the test split, guard bounds from the calibration rows, and an
             atomically written plan directory (plan.yaml + scales.safetensors).
   long      the plan on test windows of `long_seq_len` tokens (4× the default sample length), loss by
             position bucket; where it breaks the budget there, the fixes measured on the same tokens
             (a residual FP16 window, INT8 RoPE keys) are reported — offered, not applied.

Each step is a function of this module, its inputs and outputs in its signature: `observe_variants`,
`measure`, `search`, `fall_back` (verify), `narrow`, `int8_projections`, `build_report` (with
`long_context`); `calibrate` runs them in that order.

Loss = relative perplexity increase against the FP16 cache, teacher-forced, every token through the
quantized cache (`mlaquant.evaluation.eval`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mlaquant.calib import transform
from mlaquant.calib.data import shift_description, shift_source, split_path
from mlaquant.calib.observers import LatentStats, observe
from mlaquant.config import ConfigError, load_config, to_dict
from mlaquant.device import add_device_arguments, auto_batch_size, peak_memory, place
from mlaquant.device import from_args as device_from_args
from mlaquant.device import settings as device_settings
from mlaquant.errors import MLAQuantError
from mlaquant.evaluation.eval import EvalResult, Evaluator, sample_bytes
from mlaquant.evaluation.samples import token_samples
from mlaquant.modeling.int8_proj import with_int8_projections
from mlaquant.modeling.model import MLAModel, hadamard_signs, latent_rotation
from mlaquant.modeling.protocol import LatentModel
from mlaquant.modeling.stream import StreamedModel
from mlaquant.quant.codecs import CodecError, LayerCodec, split_pair
from mlaquant.quant.ranges import percentile_bounds
from mlaquant.runtime.plan import LayerPlan, Plan

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CalibrateConfig:
    version: int = 1
    samples: int = 512
    seq_len: int = 512
    val_samples: int = 32
    test_samples: int = 128
    # Long-context check on the test split (with test_samples > 0): `long_test_samples` windows of
    # `long_seq_len` tokens (0 = off);
    # over budget there, a residual FP16 window of `long_window` rows is one of the fixes measured.
    long_seq_len: int = 2048
    long_test_samples: int = 16
    long_window: int = 128
    # Off-distribution check: the plan on text unlike the bundled splits (`mlaquant.calib.data.shift_source`, or
    # --shift-data), `shift_samples` windows of seq_len and `shift_long_samples` of long_seq_len tokens (0 = off).
    shift_samples: int = 32
    shift_long_samples: int = 8
    # A second validation domain: the plan must also stay under headroom x budget on `shift_val_samples` windows
    # of long_seq_len tokens of third-party text disjoint from the reported one (`shift_validation_source`;
    # 0 = off), where long contexts and unfamiliar code cost the most.
    shift_val_samples: int = 8
    budget: float = 0.01
    headroom: float = 0.6
    seed: int = 0
    # samples per forward batch; None: from free GPU memory on CUDA (`calibration_batch_size`), 8 elsewhere
    batch_size: int | None = None
    percentile: float = 0.999
    try_clip: bool = True
    try_rotation: bool = True
    int8_matmul: bool = False
    narrow_trials: int = 8
    # 'pca-<rate>' c_kv candidates (`mlaquant.calib.transform`): bits allocated in blocks of band_block
    # channels among band_bits
    band_block: int = 16
    band_bits: tuple = (0, 2, 3, 4, 8)
    candidates: tuple = (
        "int4-row/int4-row",
        "int4-row/int4-row-asym",
        "int4-g64/int4-g32",
        "int4-g32/int4-g32",
        "int4-g32/int4-row-asym",
        "int4-row/int8-row",
        "int4-g32/int8-g32",
        "int8-g64/int8-g32",
        "fp16/fp16",
    )

    def __post_init__(self) -> None:
        if not 0 < self.budget < 1:
            raise ConfigError(f"calibrate: budget must be in (0, 1), got {self.budget}")
        if self.samples <= 0 or self.val_samples <= 0 or self.test_samples < 0:
            raise ConfigError(
                f"calibrate: samples must be > 0 (got samples={self.samples}, val_samples={self.val_samples}, "
                f"test_samples={self.test_samples})"
            )
        if self.seq_len < 2 or not 0 < self.headroom <= 1 or not 0.5 < self.percentile <= 1:
            raise ConfigError("calibrate: need seq_len ≥ 2, 0 < headroom ≤ 1, 0.5 < percentile ≤ 1")
        if min(self.long_seq_len, self.long_test_samples, self.long_window) < 0 or self.long_seq_len == 1:
            raise ConfigError("calibrate: long_seq_len (0 or ≥ 2), long_test_samples and long_window must be ≥ 0")
        if min(self.shift_samples, self.shift_long_samples, self.shift_val_samples) < 0:
            raise ConfigError("calibrate: shift_samples, shift_long_samples and shift_val_samples must be ≥ 0")
        if self.batch_size is not None and self.batch_size <= 0:
            raise ConfigError(f"calibrate: batch_size must be > 0 or null (auto), got {self.batch_size}")
        if "fp16/fp16" not in self.candidates:
            raise ConfigError("calibrate: candidates must include 'fp16/fp16' (the fallback of last resort)")


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


class LayerVariants:
    """One layer's cached rows as observed, with each part plain or rotated: samples, ranges.

    Variants are keyed (c_kv rotation, rotate k_pe): c_kv False (plain), True (Hadamard) or "pca" (its
    principal axes, `mlaquant.calib.transform`, for 'pca-<rate>' candidates, with `self.pca` and the rotated
    second moments `self.pca_moments`); a Hadamard part rotates only if its width is a power of two.
    `widths`: the model's latent widths (d_c, d_r).
    """

    def __init__(self, stats: LatentStats, widths: tuple[int, int], cfg: CalibrateConfig, seed: int) -> None:
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


def layer_variants(model: LatentModel, stats: list[LatentStats], cfg: CalibrateConfig) -> list[LayerVariants]:
    return [LayerVariants(s, model.cfg.latent_widths, cfg, cfg.seed + i) for i, s in enumerate(stats)]


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


def measure_layers(
    model: LatentModel,
    validation: Validation,
    variants: list[LayerVariants],
    cfg: CalibrateConfig,
    progress,
) -> list[list[Choice]]:
    """Per layer, the candidates sorted by bytes, each with its single-layer loss on the validation split (and
    on the second domain, when on)."""
    n = len(model.layers)
    table = []
    for i, v in enumerate(variants):
        choices = []
        for name in cfg.candidates:
            row_bytes = v.codec(name, False, (False, False)).row_bytes
            if name == "fp16/fp16":
                zero = None if validation.second is None else 0.0
                choices.append(Choice(name, False, False, False, row_bytes, 0.0, zero))
                continue
            rotate, rotate_rope, clip = best_variant(v, name, cfg.try_clip)
            m = model.rotated({i: v.rotation(rotate, rotate_rope)}) if rotate or rotate_rope else model
            codecs = [None] * n
            codecs[i] = v.codec(name, clip, (rotate, rotate_rope))
            losses = [
                None if ev is None else ev.evaluate(codecs, first_layer=i, model=m, loss_only=True).loss
                for ev in (validation.primary, validation.second)
            ]
            choices.append(Choice(name, clip, rotate, rotate_rope, row_bytes, *losses))
            progress.update(1)
        table.append(sorted(choices, key=lambda c: (c.row_bytes, c.worst)))
    return table


def describe(c: Choice) -> str:
    """One measured candidate as a plan.yaml line: codec, bytes, single-layer validation loss, variant."""
    rotated = "PCA-rotated c_kv" if c.rotate == "pca" else "rotated c_kv"
    flags = ((rotated, c.rotate), ("rotated k_pe", c.rotate_rope), ("clipped", c.clip))
    variant = [name for name, on in flags if on]
    second = "" if c.second_loss is None else f", third-party {c.second_loss:+.4%}"
    return f"{c.name}: {c.row_bytes} B, {c.loss:+.4%}{second}" + (f" ({', '.join(variant)})" if variant else "")


def search(table: list[list[Choice]], target: float) -> list[int]:
    """Index of the chosen candidate per layer: cheapest first, greedy upgrades by loss saved per byte (the
    single-layer losses `Choice.worst` of the two validation domains)."""
    pick = [0] * len(table)
    while sum(table[i][p].worst for i, p in enumerate(pick)) > target:
        best, best_gain = None, 0.0
        for i, p in enumerate(pick):
            for q in range(p + 1, len(table[i])):
                saved = table[i][p].worst - table[i][q].worst
                gain = saved / max(1, table[i][q].row_bytes - table[i][p].row_bytes)
                if saved > 0 and gain > best_gain:
                    best, best_gain = (i, q), gain
        if best is None:
            break
        pick[best[0]] = best[1]
    return pick


def int8_matmul_costs(model: MLAModel, evaluator: Evaluator, progress=None) -> list[float]:
    """Per layer, the validation loss with only that layer's absorbed projections in W8A8 (FP16 cache)."""
    n = len(model.layers)
    costs = []
    for i in range(n):
        m = with_int8_projections(model, [i])
        costs.append(evaluator.evaluate([None] * n, first_layer=i, model=m, loss_only=True).loss)
        if progress is not None:
            progress.update(1)
    return costs


def add_int8_matmul(
    plan: Plan, model: MLAModel, validation: Validation, costs: list[float], target: float, fallbacks: list
) -> Checked:
    """Turn `int8_matmul` on in every layer of `plan`, then off again, costliest layer first, while the
    plan's validation loss (every check) is over `target`; returns the final validation."""
    for lp in plan.layers:
        lp.int8_matmul = True
    checked = validation.check(model, plan)
    while checked.loss > target and any(lp.int8_matmul for lp in plan.layers):
        i = max((j for j, lp in enumerate(plan.layers) if lp.int8_matmul), key=costs.__getitem__)
        plan.layers[i].int8_matmul = False
        fallbacks.append(
            {
                "layer": i,
                "from": "int8_matmul",
                "to": "fp matmul",
                "reason": f"{checked.describe()} > {target:.4%} (headroom × budget); "
                f"layer {i}'s INT8 projections cost the most alone ({costs[i]:.4%})",
            }
        )
        log.info("fallback: layer %d int8_matmul → fp matmul", i)
        checked = validation.check(model, plan)
    return checked


def wider(row: list[Choice], p: int) -> int:
    """The fallback from candidate p of a layer's row (sorted by bytes): the next wider candidate that
    measured a lower single-layer loss, else the last (FP16) — never one that measured worse alone."""
    last = len(row) - 1
    return next((q for q in range(p + 1, last) if row[q].worst < row[p].worst), last)


def narrowing_moves(table: list[list[Choice]], pick: list[int], frozen: set[int]) -> list[tuple[int, int]]:
    """(layer, cheaper candidate index) pairs outside `frozen` layers, most bytes saved per single-layer loss
    added first."""
    moves = []
    for i, p in enumerate(pick):
        if i in frozen:
            continue
        for q in range(p):
            saved = table[i][p].row_bytes - table[i][q].row_bytes
            if saved > 0:
                moves.append((saved / max(table[i][q].worst - table[i][p].worst, 1e-9), i, q))
    return [(i, q) for _, i, q in sorted(moves, reverse=True)]


def max_row_error(rows: torch.Tensor, codec: LayerCodec) -> float:
    """Worst per-row relative quantization error of calibration rows [n, d_c + d_r] (the guard's bound)."""
    return float(codec.relative_error(rows, "none").max())


@dataclasses.dataclass(frozen=True)
class Sources:
    """Where each split's text comes from: the given file, directory or JSONL, else the bundled split; `shift`
    the off-distribution text (default: `shift_source`, described by `shift_name`)."""

    calibration: str | Path
    validation: str | Path
    test: str | Path
    shift: str | Path | tuple[Path, ...]
    shift_name: str
    shift_validation: tuple[Path, ...]

    @classmethod
    def resolve(
        cls,
        data: str | Path | None,
        val_data: str | Path | None,
        test_data: str | Path | None,
        shift_data: str | Path | None = None,
    ) -> Sources:
        shift, name = (shift_data, str(shift_data)) if shift_data else (shift_source(), shift_description())
        return cls(
            data or split_path("calibration"),
            val_data or split_path("validation"),
            test_data or split_path("test"),
            shift,
            name,
            shift_source("validation"),
        )


@dataclasses.dataclass
class Checked:
    """A plan measured by every validation check: `result` on the validation split, `second` on the second
    domain (None when off); `loss` is the worse of the two, what the search's target applies to."""

    result: EvalResult
    second: EvalResult | None
    second_len: int = 0  # tokens per window of the second domain

    @property
    def loss(self) -> float:
        return self.result.loss if self.second is None else max(self.result.loss, self.second.loss)

    def describe(self) -> str:
        """'plan validation loss 0.5210%' (+ the second domain's)."""
        second = "" if self.second is None else f", third-party validation @{self.second_len} {self.second.loss:.4%}"
        return f"plan validation loss {self.result.loss:.4%}{second}"


class Validation:
    """The checks of the plan search: `primary` the validation split at seq_len, `second` the second domain
    (third-party text at long_seq_len) or None."""

    def __init__(self, primary: Evaluator, second: Evaluator | None = None) -> None:
        self.primary, self.second = primary, second

    def check(
        self, model: LatentModel, plan: Plan, loss_only: bool = False, target: float | None = None
    ) -> Checked:
        """`plan` through every check (the second domain loss only); with `target`, a plan already over it on
        the validation split is not run through the second domain (its `loss` is over `target` either way)."""
        primary = verify(model, self.primary, plan, loss_only)
        if self.second is None or (target is not None and primary.loss > target):
            return Checked(primary, None)
        return Checked(primary, verify(model, self.second, plan, loss_only=True), int(self.second.samples.shape[1]))


@dataclasses.dataclass
class Measurements:
    """What observe and measure found, read by every later stage.

    `variants[i]`: layer i's observed rows and ranges; `validation`: the checks with their FP16 references
    (`validation.primary` the validation split, on which every single-layer loss is measured); `table[i]`:
    layer i's candidates sorted by bytes, each with its single-layer loss; `int8_costs[i]`: layer i's
    single-layer loss with W8A8 projections (None without `int8_matmul`).
    """

    variants: list[LayerVariants]
    validation: Validation
    table: list[list[Choice]]
    int8_costs: list[float] | None


@dataclasses.dataclass
class Verified:
    """A plan, its validation results, and the search state it was built from.

    `pick[i]`: index of layer i's chosen candidate in `Measurements.table[i]`; `fallbacks`: the moves
    recorded so far (plan.yaml `fallbacks`); `notes[i]`: layer i's plan.yaml note.
    """

    pick: list[int]
    fallbacks: list[dict]
    notes: dict[int, str]
    plan: Plan
    checked: Checked


def progress_total(
    model: LatentModel,
    cfg: CalibrateConfig,
    cal: torch.Tensor,
    val: torch.Tensor,
    second: torch.Tensor | None,
) -> int:
    """Progress-bar steps of observe + measure: calibration, validation and second-domain batches, one per
    measured layer candidate (and per layer's INT8 projections with `int8_matmul`)."""
    batches = lambda x, size: -(-x.shape[0] // size)
    int_candidates = sum(1 for c in cfg.candidates if c != "fp16/fp16")
    extra = 0 if second is None else batches(second, long_batch(model, cfg, second.shape[1]))
    return batches(cal, cfg.batch_size) + batches(val, cfg.batch_size) + extra + len(model.layers) * (
        int_candidates + cfg.int8_matmul
    )


def long_batch(model: LatentModel, cfg: CalibrateConfig, seq_len: int) -> int:
    """Samples per batch of windows of `seq_len` tokens: what fits half the free GPU memory, else at most 4."""
    return auto_batch_size(model.device, sample_bytes(model, seq_len), None, default=min(cfg.batch_size, 4))


def observe_variants(
    model: LatentModel, cal: torch.Tensor, cfg: CalibrateConfig, progress
) -> list[LayerVariants]:
    """Stage observe: per-layer latent ranges and row samples of the calibration tokens [n, seq_len] int64,
    plain and rotated."""
    progress.set_postfix_str("observing ranges")
    stats = observe(model, cal, cfg.batch_size, progress=progress)
    return layer_variants(model, stats, cfg)


def measure(
    model: LatentModel,
    val: torch.Tensor,
    variants: list[LayerVariants],
    cfg: CalibrateConfig,
    progress,
    second: torch.Tensor | None = None,
) -> Measurements:
    """Stage measure: the FP16 references on the validation tokens [n, seq_len] int64 (and on the second
    domain's [m, long_seq_len], when given), then every layer's single-layer loss per candidate on the
    validation split (and per layer's W8A8 projections with `int8_matmul`)."""
    progress.set_postfix_str("fp16 reference")
    evaluator = Evaluator(model, val, cfg.batch_size, progress=progress)
    if second is not None:
        batch = long_batch(model, cfg, second.shape[1])
        validation = Validation(evaluator, Evaluator(model, second, batch, progress=progress))
    else:
        validation = Validation(evaluator)
    progress.set_postfix_str("per-layer sensitivity")
    table = measure_layers(model, validation, variants, cfg, progress)
    int8_costs = None
    if cfg.int8_matmul:
        progress.set_postfix_str("int8 projections")
        int8_costs = int8_matmul_costs(model, evaluator, progress)
    return Measurements(variants, validation, table, int8_costs)


def build_plan(
    model: LatentModel, m: Measurements, pick: list[int], notes: dict[int, str], budget: float
) -> Plan:
    """The plan of candidate `pick[i]` per layer, with its tensors (clip and observed ranges, rotation
    signs) and each layer's guard bound (worst row error on the calibration rows); bound to `model`."""
    layers, tensors = [], {}
    for i, p in enumerate(pick):
        ch, v = m.table[i][p], m.variants[i]
        ckv, kpe = split_pair(v.resolve(ch.name))
        variant = (ch.rotate, ch.rotate_rope)
        lo, hi = v.bounds[variant]
        tensors[f"layer{i}.clip_lo"], tensors[f"layer{i}.clip_hi"] = lo, hi
        if ch.rotate == "pca":
            tensors[f"layer{i}.ckv_rotation"] = v.pca
        elif ch.rotate:
            tensors[f"layer{i}.rotation_signs"] = v.signs
        if ch.rotate_rope:
            tensors[f"layer{i}.rope_rotation_signs"] = v.rope_signs
        rows = v.rows[variant]
        tensors[f"layer{i}.range_lo"], tensors[f"layer{i}.range_hi"] = rows.min(0).values, rows.max(0).values
        err = max_row_error(rows, v.codec(ch.name, ch.clip, variant))
        note = notes.get(i, "")
        layers.append(LayerPlan(ckv, kpe, ch.clip, bool(ch.rotate), ch.rotate_rope, ch.loss, err, note=note))
    return Plan(layers=layers, fingerprint=model.fingerprint(), budget=budget, tensors=tensors).bind(model.cfg)


def verify(model: LatentModel, evaluator: Evaluator, plan: Plan, loss_only: bool = False) -> EvalResult:
    """The whole plan (bound to `model`) through `evaluator` (every layer quantized, rotations applied)."""
    return evaluator.evaluate(plan.layer_codecs(), model=plan.apply(model), loss_only=loss_only)


def fall_back(model: LatentModel, m: Measurements, pick: list[int], cfg: CalibrateConfig) -> Verified:
    """Stage fallback: verify the searched `pick` by every validation check; while over `headroom × budget`,
    the layer with the largest single-layer loss (`Choice.worst`) moves to its `wider` candidate, each move
    recorded."""
    target = cfg.headroom * cfg.budget
    pick, fallbacks = list(pick), []
    plan = build_plan(model, m, pick, {}, cfg.budget)
    checked = m.validation.check(model, plan)
    while checked.loss > target:
        movable = [i for i, p in enumerate(pick) if p + 1 < len(m.table[i])]
        i = max(movable, key=lambda j: m.table[j][pick[j]].worst)
        old = m.table[i][pick[i]]
        pick[i] = wider(m.table[i], pick[i])
        new = m.table[i][pick[i]]
        fallbacks.append(
            {
                "layer": i,
                "from": old.name,
                "to": new.name,
                "reason": f"{checked.describe()} > {target:.4%} (headroom × budget); "
                f"layer {i} had the largest single-layer loss ({old.worst:.4%})",
            }
        )
        log.info("fallback: layer %d %s → %s", i, old.name, new.name)
        plan = build_plan(model, m, pick, {}, cfg.budget)
        checked = m.validation.check(model, plan)
    return Verified(pick, fallbacks, {}, plan, checked)


def narrow(model: LatentModel, m: Measurements, v: Verified, cfg: CalibrateConfig) -> Verified:
    """Stage narrow: up to `narrow_trials` cheaper candidates (`narrowing_moves`, never a layer that fell
    back), each verified end to end by every check; a move is kept while the plan stays under
    `headroom × budget`."""
    target = cfg.headroom * cfg.budget
    pick, notes = list(v.pick), dict(v.notes)
    trials, frozen = 0, {f["layer"] for f in v.fallbacks}
    while trials < cfg.narrow_trials:
        for i, q in narrowing_moves(m.table, pick, frozen):
            old, pick[i] = pick[i], q
            trial = build_plan(model, m, pick, notes, cfg.budget)
            measured = m.validation.check(model, trial, loss_only=True, target=target)
            trials += 1
            if measured.loss <= target:
                log.info("narrowed: layer %d %s → %s", i, m.table[i][old].name, m.table[i][q].name)
                notes[i] = f"narrowed from {m.table[i][old].name}: {measured.describe()} ≤ {target:.4%}"
                break
            pick[i] = old
            if trials >= cfg.narrow_trials:
                break
        else:
            break  # no cheaper candidate keeps the plan under the target
    if not trials:
        return v
    plan = build_plan(model, m, pick, notes, cfg.budget)
    return Verified(pick, v.fallbacks, notes, plan, m.validation.check(model, plan))


def int8_projections(model: LatentModel, m: Measurements, v: Verified, cfg: CalibrateConfig) -> Verified:
    """Stage int8: with `cfg.int8_matmul`, W8A8 projections on top of the verified cache plan
    (`add_int8_matmul`, which sets the flags on `v.plan`); without it, `v` unchanged."""
    if not cfg.int8_matmul:
        return v
    fallbacks = list(v.fallbacks)
    checked = add_int8_matmul(v.plan, model, m.validation, m.int8_costs, cfg.headroom * cfg.budget, fallbacks)
    return dataclasses.replace(v, fallbacks=fallbacks, checked=checked)


def build_report(
    model: LatentModel,
    cfg: CalibrateConfig,
    sources: Sources,
    samples: tuple[torch.Tensor, torch.Tensor],
    m: Measurements,
    v: Verified,
    t0: float,
) -> tuple[Plan, dict]:
    """Stage report: the plan's test-split metrics, fallbacks, metrics and settings filled in; returns the
    plan and the report dict. `samples`: the (calibration, validation) tokens; `t0`: the run's start
    (`time.perf_counter`)."""
    plan, (cal, val) = v.plan, samples
    report = {"validation": v.checked.result.as_dict()}
    if v.checked.second is not None:
        report["shift_validation"] = {
            "data": shift_description("validation"),
            "seq_len": v.checked.second_len,
            "loss": v.checked.second.loss,
        }
    report["candidates"] = [[dataclasses.asdict(c) for c in row] for row in m.table]
    if cfg.test_samples:
        test = token_samples(
            model.tokenizer, sources.test, cfg.test_samples, cfg.seq_len, cfg.seed + 2, model.cfg.eos_id
        )
        report["test"] = verify(model, Evaluator(model, test, cfg.batch_size), plan).as_dict()
    if cfg.test_samples and cfg.long_seq_len and cfg.long_test_samples:
        report["long_context"] = long_context(model, cfg, sources, plan)
    if cfg.shift_samples or cfg.shift_long_samples:
        report["shift"] = off_distribution(model, cfg, sources, plan)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report |= peak_memory(model.device)
    plan.fallbacks = v.fallbacks
    kept = ("validation", "shift_validation", "test", "long_context", "shift")
    plan.metrics = {k: report[k] for k in kept if k in report} | {
        "bytes_per_token_per_layer": plan.bytes_per_token() / len(model.layers),
        "bits_per_value": round(plan.bits_per_value(), 4),
        "fp16_bytes_per_token_per_layer": model.cfg.latent_dim * 2,
        "candidates": {f"layer{i}": [describe(c) for c in row] for i, row in enumerate(m.table)},
    }
    plan.settings = {
        **to_dict(cfg),
        "model": model.source,
        "data": str(sources.calibration),
        "val_data": str(sources.validation),
        "test_data": str(sources.test),
        "shift_data": sources.shift_name,
        "calibration_tokens": int(cal.numel()),
        "validation_tokens": int(val.numel()),
        # where it ran: recorded, not part of the fingerprint (a plan fits any device and dtype)
        **device_settings(model.device, model.dtype),
    }
    return plan, report


def long_context(model: LatentModel, cfg: CalibrateConfig, sources: Sources, plan: Plan) -> dict:
    """Stage long: `plan` on `long_test_samples` test windows of `long_seq_len` tokens [n, long_seq_len]
    (loss by position bucket). Over `plan.budget` there, the fixes are measured on the same tokens and
    listed (`long_context_fixes`); the plan (bound to `model`) itself is left as calibrated."""
    ids = token_samples(
        model.tokenizer, sources.test, cfg.long_test_samples, cfg.long_seq_len, cfg.seed + 3, model.cfg.eos_id
    )
    evaluator = Evaluator(model, ids, long_batch(model, cfg, cfg.long_seq_len))
    result = verify(model, evaluator, plan)
    out = {"seq_len": int(ids.shape[1]), "result": result.as_dict(), "holds": result.loss <= plan.budget, "fixes": []}
    if not out["holds"]:
        for name, fixed, window in long_context_fixes(plan, cfg.long_window):
            r = evaluator.evaluate(fixed.layer_codecs(), model=fixed.apply(model), window=window)
            bits = fixed.bits_per_value()
            out["fixes"].append(
                {"fix": name, "bits_per_value": round(bits, 4), "loss": r.loss, "holds": r.loss <= plan.budget}
            )
    return out


def off_distribution(model: LatentModel, cfg: CalibrateConfig, sources: Sources, plan: Plan) -> dict:
    """Stage shift: `plan` on the off-distribution text (`sources.shift`), `shift_samples` windows of `seq_len`
    and `shift_long_samples` of `long_seq_len` tokens, each [n, T]; `holds` when every length is within
    `plan.budget`. Measured, reported, never used to choose (like the test split)."""
    runs = []
    for n, seq_len, seed in ((cfg.shift_samples, cfg.seq_len, 4), (cfg.shift_long_samples, cfg.long_seq_len, 5)):
        if not n or not seq_len:
            continue
        ids = token_samples(model.tokenizer, sources.shift, n, seq_len, cfg.seed + seed, model.cfg.eos_id)
        result = verify(model, Evaluator(model, ids, long_batch(model, cfg, seq_len)), plan)
        runs.append({"seq_len": int(ids.shape[1]), "result": result.as_dict()})
    holds = all(r["result"]["loss"] <= plan.budget for r in runs)
    return {"data": sources.shift_name, "runs": runs, "holds": holds}


def long_context_fixes(plan: Plan, window: int) -> list[tuple[str, Plan, int]]:
    """What `long_context` measures when a plan breaks its budget at long context: (description, plan,
    residual window) — the plan with a residual FP16 window of `window` rows, and the plan with every
    INT4 RoPE-key part widened to int8-row."""
    wide = copy.deepcopy(plan)
    for lp in wide.layers:
        if lp.kpe.startswith("int4"):
            lp.kpe = "int8-row"
    fixes = [(f"residual FP16 window of {window} rows (+w{window})", plan, window)] if window else []
    return fixes + [("k_pe int8-row in every INT4 layer", wide, 0)]


def calibrate(
    model: LatentModel,
    cfg: CalibrateConfig,
    data: str | Path | None = None,
    val_data: str | Path | None = None,
    test_data: str | Path | None = None,
    quiet: bool = False,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    shift_data: str | Path | None = None,
) -> tuple[Plan, dict]:
    """Run the whole pipeline (observe → measure → search → fallback → narrow → int8 → report); returns
    the plan and a report dict (timings, per-split metrics, peak RSS and peak GPU memory).

    device / dtype (`mlaquant.device`), when given, move / cast the model first (in place); the pipeline
    runs where the model is, weights in its dtype, latent statistics and losses in FP32."""
    if model.tokenizer is None:
        raise MLAQuantError(f"{model.source}: no tokenizer.json; calibration needs text → tokens")
    model = place(model, device, dtype)
    fits, skipped = fitting_candidates(cfg.candidates, *model.cfg.latent_widths, cfg.band_block)
    cfg = dataclasses.replace(cfg, batch_size=calibration_batch_size(model, cfg), candidates=fits)
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    t0 = time.perf_counter()
    if cfg.int8_matmul and not model.supports_int8_projections:
        raise MLAQuantError("calibrate: int8_matmul is not supported with --stream (load the model whole)")
    sources, tok, eos = Sources.resolve(data, val_data, test_data, shift_data), model.tokenizer, model.cfg.eos_id
    cal = token_samples(tok, sources.calibration, cfg.samples, cfg.seq_len, cfg.seed, eos)
    val = token_samples(tok, sources.validation, cfg.val_samples, cfg.seq_len, cfg.seed + 1, eos)
    second = None
    if cfg.shift_val_samples and cfg.long_seq_len:
        n, length = cfg.shift_val_samples, cfg.long_seq_len
        second = token_samples(tok, sources.shift_validation, n, length, cfg.seed + 6, eos)
    total = progress_total(model, cfg, cal, val, second)
    with tqdm(total=total, desc="calibrate", disable=quiet, file=sys.stderr) as bar:
        measured = measure(model, val, observe_variants(model, cal, cfg, bar), cfg, bar, second)
    verified = fall_back(model, measured, search(measured.table, cfg.headroom * cfg.budget), cfg)
    verified = int8_projections(model, measured, narrow(model, measured, verified, cfg), cfg)
    plan, report = build_report(model, cfg, sources, (cal, val), measured, verified, t0)
    if skipped:
        report["skipped_candidates"] = plan.metrics["skipped_candidates"] = skipped
    return plan, report


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


def calibration_batch_size(model: LatentModel, cfg: CalibrateConfig) -> int:
    """`cfg.batch_size` when given; else as many samples as fit half the free GPU memory, 8 off CUDA."""
    return auto_batch_size(model.device, sample_bytes(model, cfg.seq_len), cfg.batch_size, default=8)


def summary_table(plan: Plan, model: LatentModel, report: dict) -> str:
    fp16 = model.cfg.latent_dim * 2
    lines = [
        "| layer | c_kv | k_pe | clip | rotate c_kv | rotate k_pe | int8 matmul | bytes/token | vs FP16 "
        "| val loss (layer alone) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, lp in enumerate(plan.layers):
        rb = plan.layer_codec(i).row_bytes
        flags = " | ".join("yes" if f else "no" for f in (lp.clip, lp.rotate, lp.rotate_rope, lp.int8_matmul))
        lines.append(f"| {i} | {lp.ckv} | {lp.kpe} | {flags} | {rb} | {fp16 / rb:.2f}× | {lp.loss:+.3%} |")
    total = plan.bytes_per_token()
    lines.append(f"| all | | | | | | | {total} | {fp16 * len(plan.layers) / total:.2f}× | |")
    out = "\n".join(lines)
    for split in ("validation", "test"):
        if split in report:
            r = report[split]
            out += (
                f"\n{split:>10}: loss {r['loss']:+.3%} (ppl {r['ppl']:.3f}), KL {r['kl']:.5f}, "
                f"top-1 {r['top1']:.2%}, {r['tokens']} tokens"
            )
    if "long_context" in report:
        out += "\n" + long_context_lines(report["long_context"], plan.budget)
    if "shift" in report:
        out += "\n" + shift_line(report["shift"], plan.budget)
    if "skipped_candidates" in report:
        names = ", ".join(s["candidate"] for s in report["skipped_candidates"])
        out += f"\n   skipped: {names} (do not fit d_c {model.cfg.kv_lora_rank} / d_r {model.cfg.qk_rope_head_dim})"
    if "shift_validation" in report:
        sv = report["shift_validation"]
        out += f"\n  (search also held third-party validation @{sv['seq_len']}: loss {sv['loss']:+.3%}; {sv['data']})"
    out += (
        f"\nbudget {plan.budget:.2%}; {plan.bits_per_value():.2f} bits/value; "
        f"{len(plan.fallbacks)} fallback(s); {report['seconds']} s, peak RSS {report['peak_rss_mib']} MiB"
        + (f", peak GPU {report['peak_gpu_mib']} MiB" if "peak_gpu_mib" in report else "")
        + f" ({plan.settings.get('device')}, {plan.settings.get('dtype')} weights)"
    )
    return out


def long_context_lines(long: dict, budget: float) -> str:
    """The summary's long-context lines: loss at `seq_len` by position bucket, and any fixes measured."""
    r = long["result"]
    buckets = ", ".join(f"{b['positions'][0]}–{b['positions'][1]} {b['loss']:+.3%}" for b in r["by_position"])
    verdict = "within" if long["holds"] else "OVER"
    out = f"test @{long['seq_len']}: loss {r['loss']:+.3%} ({verdict} budget {budget:.2%}); by position: {buckets}"
    for f in long["fixes"]:
        out += f"\n    fix measured: {f['fix']}: {f['loss']:+.3%} at {f['bits_per_value']:.2f} bits/value" + (
            " (within budget)" if f["holds"] else ""
        )
    return out


def shift_line(shift: dict, budget: float) -> str:
    """The summary's off-distribution line: loss per length, the verdict and what text it was."""
    parts = ", ".join(f"@{r['seq_len']} {r['result']['loss']:+.3%}" for r in shift["runs"])
    verdict = "within" if shift["holds"] else "OVER"
    return f"   shifted: loss {parts} ({verdict} budget {budget:.2%}); text: {shift['data']}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--data", default=None, help="calibration text: file, directory or JSONL (default: bundled)")
    p.add_argument("--val-data", default=None, help="validation text for the plan search (default: bundled)")
    p.add_argument("--test-data", default=None, help="held-out text for the reported numbers (default: bundled)")
    p.add_argument(
        "--shift-data", default=None, help="off-distribution text, reported only (default: installed torch's Python)"
    )
    p.add_argument("--config", default=None, help="calibration YAML (default: configs/calibrate.yaml)")
    p.add_argument("--samples", type=int, default=None, help="calibration samples (default 512)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 512)")
    p.add_argument("--budget", type=float, default=None, help="max relative perplexity increase (default 0.01)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--int8-matmul",
        action="store_true",
        default=None,
        help="also run the absorbed projections as W8A8 GEMMs where the budget allows (config: int8_matmul)",
    )
    p.add_argument("--out", default="plans/default", help="plan directory to write")
    p.add_argument(
        "--stream",
        action="store_true",
        help="load one decoder layer at a time (peak memory ≈ one layer + activations; same plan)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON summary on stdout (the table goes to stderr)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per batch (default: from free memory)")
    add_device_arguments(p)


def json_summary(plan: Plan, model: LatentModel, report: dict, out: Path) -> dict:
    """What `calibrate --json` prints: the plan per layer, its size, the measured splits, timings."""
    layers = [
        {
            **{k: getattr(lp, k) for k in ("ckv", "kpe", "clip", "rotate", "rotate_rope", "int8_matmul", "loss")},
            "layer": i,
            "bytes_per_token": plan.layer_codec(i).row_bytes,
        }
        for i, lp in enumerate(plan.layers)
    ]
    return {
        "plan": str(out),
        "model": model.source,
        "budget": plan.budget,
        "bits_per_value": round(plan.bits_per_value(), 4),
        "bytes_per_token": plan.bytes_per_token(),
        "layers": layers,
        **{k: report[k] for k in ("validation", "test", "long_context", "shift", "skipped_candidates") if k in report},
        "fallbacks": len(plan.fallbacks),
        "seconds": report["seconds"],
        "peak_rss_mib": report["peak_rss_mib"],
    }


def run(args: argparse.Namespace) -> int:
    from mlaquant.modeling.loader import load_model

    base = load_config(CalibrateConfig, args.config, "calibrate.yaml")
    overrides = {
        k: v
        for k, v in {
            "samples": args.samples,
            "seq_len": args.seq_len,
            "budget": args.budget,
            "seed": args.seed,
            "int8_matmul": args.int8_matmul,
            "batch_size": args.batch_size,
        }.items()
        if v is not None
    }
    cfg = load_config(CalibrateConfig, {**to_dict(base), **overrides}, "calibrate.yaml")
    device, dtype = device_from_args(args)
    model = StreamedModel(args.model, dtype, device=device) if args.stream else load_model(args.model, device, dtype)
    plan, report = calibrate(
        model, cfg, args.data, args.val_data, args.test_data, quiet=args.quiet, shift_data=args.shift_data
    )
    out = plan.save(args.out)
    human = sys.stderr if args.json else sys.stdout
    if not (args.json and args.quiet):
        print(summary_table(plan, model, report), file=human)
        print(f"plan written to {out}/plan.yaml (+ scales.safetensors)", file=human)
    if args.json:
        print(json.dumps(json_summary(plan, model, report, out)))
    return 0
