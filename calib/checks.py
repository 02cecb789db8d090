"""Stage check: the verified plan on text that chose nothing — the test split at `seq_len`, test windows of
`long_seq_len` tokens (`long_context`, with the fixes measured where it breaks the budget there), off-distribution
text (`off_distribution`) and exact recall over test windows (`exact_recall`). Measured and reported, never used to
choose."""

from __future__ import annotations

import copy

from mlaquant.calib.calibrate_config import CalibrateConfig, Sources
from mlaquant.calib.measure import long_batch, verify
from mlaquant.evaluation.eval import Evaluator
from mlaquant.evaluation.recall import Recall
from mlaquant.evaluation.samples import token_samples
from mlaquant.modeling.protocol import LatentModel
from mlaquant.runtime.plan import Plan


def held_out(model: LatentModel, cfg: CalibrateConfig, sources: Sources, plan: Plan) -> dict:
    """Stage check: `plan` (bound to `model`) on the test split's `test_samples` windows of `seq_len` tokens,
    then `long_context`, `off_distribution` and `exact_recall`, each when on; keyed as in the report ('test',
    'long_context', 'shift', 'recall')."""
    out = {}
    if cfg.test_samples:
        test = token_samples(
            model.tokenizer, sources.test, cfg.test_samples, cfg.seq_len, cfg.seed + 2, model.cfg.eos_id
        )
        out["test"] = verify(model, Evaluator(model, test, cfg.batch_size), plan).as_dict()
    if cfg.test_samples and cfg.long_seq_len and cfg.long_test_samples:
        out["long_context"] = long_context(model, cfg, sources, plan)
    if cfg.shift_samples or cfg.shift_long_samples:
        out["shift"] = off_distribution(model, cfg, sources, plan)
    if cfg.recall_prompts:
        out["recall"] = exact_recall(model, cfg, sources, plan)
    return out


def exact_recall(model: LatentModel, cfg: CalibrateConfig, sources: Sources, plan: Plan) -> dict:
    """Stage recall: FP16's and `plan`'s share of copied spans reproduced (`Recall.summary`) on `recall_prompts`
    test windows of `long_seq_len` tokens (greedy decode through `DecodeSession`, torch reference attention)."""
    windows = token_samples(
        model.tokenizer, sources.test, cfg.recall_prompts, cfg.long_seq_len, cfg.seed + 7, model.cfg.eos_id
    )
    return Recall(model, windows, cfg.recall_cue, cfg.recall_span, cfg.seed + 7).summary(plan)


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
