"""Stages search, verify (fall back), narrow and int8: from the single-layer losses to a plan verified end to end.

`search` picks each layer's candidate by greedy upgrades on the summed single-layer losses; `fall_back` verifies
the whole plan and widens layer by layer (`wider`) while it is over `headroom × budget` (an error when every layer
is FP16 already, `over_at_fp16`); `narrow` tries cheaper candidates (`narrowing_moves`), each verified;
`int8_projections` adds W8A8 projections where the budget allows (`add_int8_matmul`). `build_plan` turns one
candidate per layer into a `Plan` with its tensors and guard bounds (`max_row_error`); `Verified` carries it with
its checks and the moves recorded.

With `max_bits` (a cap on bits per cached value, every byte of codes and scales counted) the plan never takes
more than `byte_cap` bytes per token: `check_cap` refuses a cap under the cheapest candidates before any loss is
measured, the search and the fallbacks make no move past it, and a cap that leaves no plan within the budget is
a `CapError` naming the layer of the largest loss alone and its best loss within the cap.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from mlaquant.calib.calibrate_config import CalibrateConfig
from mlaquant.calib.candidates import Choice
from mlaquant.calib.measure import Checked, Measurements, Validation
from mlaquant.errors import MLAQuantError
from mlaquant.modeling.model import MLAModel
from mlaquant.modeling.protocol import LatentModel
from mlaquant.quant.codecs import LayerCodec, split_pair
from mlaquant.runtime.plan import LayerPlan, Plan

log = logging.getLogger(__name__)


class CapError(MLAQuantError):
    """A `max_bits` no plan of the candidates meets within the budget (the message names the layer)."""


def byte_cap(max_bits: float | None, layers: int, width: int) -> int | None:
    """Bytes per token (all `layers`, rows of `width` = d_c + d_r values) a plan of at most `max_bits` bits per
    cached value may take; None without a cap."""
    return None if max_bits is None else math.floor(max_bits * layers * width / 8 + 1e-9)


def plan_bytes(table: list[list[Choice]], pick: list[int]) -> int:
    """Bytes per token of the plan that takes candidate pick[i] in layer i."""
    return sum(table[i][p].row_bytes for i, p in enumerate(pick))


def best_within(table: list[list[Choice]], i: int, cap: int) -> Choice:
    """Layer i's candidate of least single-layer loss (`Choice.worst`) that fits `cap` with every other layer at
    its cheapest (rows sorted by bytes: index 0)."""
    room = cap - sum(row[0].row_bytes for j, row in enumerate(table) if j != i)
    return min((c for c in table[i] if c.row_bytes <= room), key=lambda c: c.worst)


def check_cap(variants: list, candidates: tuple[str, ...], cap: int | None, max_bits: float | None) -> None:
    """Before any loss is measured: raise `CapError` when the cheapest of `candidates` in every layer (bytes from
    each layer's `LayerVariants`, band widths resolved) together take more than `cap` bytes per token."""
    if cap is None:
        return
    cheapest = [min((v.codec(name, False, (False, False)).row_bytes, name) for name in candidates) for v in variants]
    total = sum(b for b, _ in cheapest)
    if total <= cap:
        return
    i = max(range(len(cheapest)), key=lambda j: cheapest[j][0])
    raise CapError(
        f"calibrate: max_bits {max_bits} ({cap} B per token) is below the cheapest plan of the candidates "
        f"({total} B per token); layer {i}'s cheapest candidate is {cheapest[i][1]} at {cheapest[i][0]} B"
    )


def search(table: list[list[Choice]], target: float, cap: int | None = None) -> list[int]:
    """Index of the chosen candidate per layer: cheapest first, greedy upgrades by loss saved per byte (the
    single-layer losses `Choice.worst` of the two validation domains), none past `cap` bytes per token."""
    pick = [0] * len(table)
    while sum(table[i][p].worst for i, p in enumerate(pick)) > target:
        best, best_gain = None, 0.0
        total = plan_bytes(table, pick)
        for i, p in enumerate(pick):
            for q in range(p + 1, len(table[i])):
                if cap is not None and total - table[i][p].row_bytes + table[i][q].row_bytes > cap:
                    continue
                saved = table[i][p].worst - table[i][q].worst
                gain = saved / max(1, table[i][q].row_bytes - table[i][p].row_bytes)
                if saved > 0 and gain > best_gain:
                    best, best_gain = (i, q), gain
        if best is None:
            break
        pick[best[0]] = best[1]
    return pick


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


def max_row_error(rows: torch.Tensor, codec: LayerCodec) -> float:
    """Worst per-row relative quantization error of calibration rows [n, d_c + d_r] (the guard's bound)."""
    return float(codec.relative_error(rows, "none").max())


def fall_back(
    model: LatentModel, m: Measurements, pick: list[int], cfg: CalibrateConfig, cap: int | None = None
) -> Verified:
    """Stage fallback: verify the searched `pick` by every validation check; while over `headroom × budget`,
    the layer with the largest single-layer loss (`Choice.worst`) whose `wider` candidate fits `cap` bytes per
    token moves there, each move recorded; `CapError` when no layer's does."""
    target = cfg.headroom * cfg.budget
    pick, fallbacks = list(pick), []
    plan = build_plan(model, m, pick, {}, cfg.budget)
    checked = m.validation.check(model, plan)
    while checked.loss > target:
        total = plan_bytes(m.table, pick)
        moves = {}
        for i, p in enumerate(pick):
            room = None if cap is None else cap - total + m.table[i][p].row_bytes
            q = wider(m.table[i], p, room) if p + 1 < len(m.table[i]) else None
            if q is not None:
                moves[i] = q
        if not moves:
            raise over_cap(m.table, pick, cap, cfg, checked) if cap is not None else over_at_fp16(cfg, checked)
        i = max(moves, key=lambda j: m.table[j][pick[j]].worst)
        old = m.table[i][pick[i]]
        pick[i] = moves[i]
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


def wider(row: list[Choice], p: int, room: int | None = None) -> int | None:
    """The fallback from candidate p of a layer's row (sorted by bytes): the next wider candidate that
    measured a lower single-layer loss, else the last (FP16) — never one that measured worse alone; with
    `room`, only candidates of at most `room` bytes (None when none is left)."""
    last = len(row) - 1
    fits = [q for q in range(p + 1, last + 1) if room is None or row[q].row_bytes <= room]
    return next((q for q in fits if q < last and row[q].worst < row[p].worst), last if last in fits else None)


def over_cap(table: list[list[Choice]], pick: list[int], cap: int, cfg: CalibrateConfig, checked: Checked) -> CapError:
    """The error of a verified plan over `headroom × budget` that no fallback within `cap` can widen: it names
    the layer of the largest single-layer loss as picked and its best within the cap (`best_within`)."""
    i = max(range(len(pick)), key=lambda j: table[j][pick[j]].worst)
    now, best = table[i][pick[i]], best_within(table, i, cap)
    return CapError(
        f"calibrate: max_bits {cfg.max_bits} ({cap} B per token) leaves no plan within the budget: "
        f"{checked.describe()} > {cfg.headroom * cfg.budget:.4%} (headroom × budget) and no wider candidate fits; "
        f"layer {i} has the largest loss alone, {now.worst:+.4%} ({now.name}, {now.row_bytes} B), its best within "
        f"the cap {best.worst:+.4%} ({best.name}, {best.row_bytes} B, every other layer at its cheapest)"
    )


def over_at_fp16(cfg: CalibrateConfig, checked: Checked) -> MLAQuantError:
    """The error of a verified plan still over `headroom × budget` with every layer fallen back to FP16: the
    loss left is not the cache's codes."""
    return MLAQuantError(
        f"calibrate: over the budget with every layer at FP16: {checked.describe()} > {cfg.headroom * cfg.budget:.4%}"
        " (headroom × budget); what remains is not the cache's quantization (a rotation in FP16, or a budget below "
        "the evaluation's noise)"
    )


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


def int8_projections(model: LatentModel, m: Measurements, v: Verified, cfg: CalibrateConfig) -> Verified:
    """Stage int8: with `cfg.int8_matmul`, W8A8 projections on top of the verified cache plan
    (`add_int8_matmul`, which sets the flags on `v.plan`); without it, `v` unchanged."""
    if not cfg.int8_matmul:
        return v
    fallbacks = list(v.fallbacks)
    checked = add_int8_matmul(v.plan, model, m.validation, m.int8_costs, cfg.headroom * cfg.budget, fallbacks)
    return dataclasses.replace(v, fallbacks=fallbacks, checked=checked)


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
