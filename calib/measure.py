"""Stages observe and measure, and the validation checks that every later stage asks.

observe (`observe_variants`): the calibration tokens' per-layer latent ranges and row samples
(`mlaquant.calib.observers`) and, with `allocation: fisher`, their loss gradients (`mlaquant.calib.sensitivity`), as
`LayerVariants`. measure (`measure`): the FP16 references on the validation split
(and the second domain), then per layer and candidate the single-layer loss (`measure_layers`) and, with
`int8_matmul`, per layer the W8A8 projections' (`int8_matmul_costs`); `Measurements` holds what they found.
`Validation.check` runs a whole plan through every validation check (`verify`), its result a `Checked`. The batch
sizes of the run (`calibration_batch_size`, `long_batch`) and the progress bar's length (`progress_total`) are
set here too.
"""

from __future__ import annotations

import dataclasses

import torch

from mlaquant.calib.calibrate_config import CalibrateConfig
from mlaquant.calib.candidates import Choice, LayerVariants, best_variant, layer_variants
from mlaquant.calib.observers import observe
from mlaquant.calib.sensitivity import FISHER_SAMPLES, latent_fisher
from mlaquant.device import auto_batch_size
from mlaquant.evaluation.eval import EvalResult, Evaluator, sample_bytes
from mlaquant.modeling.int8_proj import with_int8_projections
from mlaquant.modeling.model import MLAModel
from mlaquant.modeling.protocol import LatentModel
from mlaquant.runtime.plan import Plan


def calibration_batch_size(model: LatentModel, cfg: CalibrateConfig) -> int:
    """`cfg.batch_size` when given; else as many samples as fit half the free GPU memory, 8 off CUDA."""
    return auto_batch_size(model.device, sample_bytes(model, cfg.seq_len), cfg.batch_size, default=8)


def long_batch(model: LatentModel, cfg: CalibrateConfig, seq_len: int) -> int:
    """Samples per batch of windows of `seq_len` tokens: what fits half the free GPU memory, else at most 4."""
    return auto_batch_size(model.device, sample_bytes(model, seq_len), None, default=min(cfg.batch_size, 4))


def progress_total(
    model: LatentModel,
    cfg: CalibrateConfig,
    cal: torch.Tensor,
    val: torch.Tensor,
    second: torch.Tensor | None,
) -> int:
    """Progress-bar steps of observe + measure: calibration batches (twice with `allocation: fisher`: the
    gradients), validation and second-domain batches, one per measured layer candidate (and per layer's INT8
    projections with `int8_matmul`)."""
    batches = lambda x, size: -(-x.shape[0] // size)
    int_candidates = sum(1 for c in cfg.candidates if c != "fp16/fp16")
    extra = 0 if second is None else batches(second, long_batch(model, cfg, second.shape[1]))
    if cfg.allocation == "fisher":
        extra += batches(cal[:FISHER_SAMPLES], cfg.batch_size)
    return batches(cal, cfg.batch_size) + batches(val, cfg.batch_size) + extra + len(model.layers) * (
        int_candidates + cfg.int8_matmul
    )


def observe_variants(
    model: LatentModel, cal: torch.Tensor, cfg: CalibrateConfig, progress
) -> list[LayerVariants]:
    """Stage observe: per-layer latent ranges and row samples of the calibration tokens [n, seq_len] int64,
    plain and rotated; with `allocation: fisher`, each layer's sensitivity too (`latent_fisher`)."""
    progress.set_postfix_str("observing ranges")
    stats = observe(model, cal, cfg.batch_size, progress=progress)
    fisher = None
    if cfg.allocation == "fisher":
        progress.set_postfix_str("loss gradients")
        fisher = latent_fisher(model, cal, cfg.batch_size, progress)
    return layer_variants(model, stats, cfg, fisher)


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


def verify(model: LatentModel, evaluator: Evaluator, plan: Plan, loss_only: bool = False) -> EvalResult:
    """The whole plan (bound to `model`) through `evaluator` (every layer quantized, rotations applied)."""
    return evaluator.evaluate(plan.layer_codecs(), model=plan.apply(model), loss_only=loss_only)


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
