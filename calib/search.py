"""Stages search, verify (fall back), narrow and int8: from the single-layer losses to a plan verified end to end.

`search` picks each layer's candidate by greedy upgrades on the summed single-layer losses; `fall_back` verifies
the whole plan and widens layer by layer (`wider`) while it is over `headroom × budget`; `narrow` tries cheaper
candidates (`narrowing_moves`), each verified; `int8_projections` adds W8A8 projections where the budget allows
(`add_int8_matmul`). `build_plan` turns one candidate per layer into a `Plan` with its tensors and guard bounds
(`max_row_error`); `Verified` carries it with its checks and the moves recorded.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from mlaquant.calib.calibrate_config import CalibrateConfig
from mlaquant.calib.candidates import Choice
from mlaquant.calib.measure import Checked, Measurements, Validation
from mlaquant.modeling.model import MLAModel
from mlaquant.modeling.protocol import LatentModel
from mlaquant.quant.codecs import LayerCodec, split_pair
from mlaquant.runtime.plan import LayerPlan, Plan

log = logging.getLogger(__name__)


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


def wider(row: list[Choice], p: int) -> int:
    """The fallback from candidate p of a layer's row (sorted by bytes): the next wider candidate that
    measured a lower single-layer loss, else the last (FP16) — never one that measured worse alone."""
    last = len(row) - 1
    return next((q for q in range(p + 1, last) if row[q].worst < row[p].worst), last)


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
