"""`mlaquant calibrate`: the smallest latent-cache plan whose measured loss stays under the budget.

Pipeline (three disjoint splits; numbers reported on the one that chose nothing):

1. observe   calibration split, `samples` × `seq_len` tokens → per-layer, per-channel ranges of the
             latent rows (min/max and the `percentile` quantile) and a row subsample; with
             `allocation: fisher`, the loss gradients on the rows (`mlaquant.calib.sensitivity`).
2. measure   validation split: for every layer and candidate codec the loss with only that layer
             quantized, in the variant (clipped to the calibrated ranges or not; c_kv and k_pe each
             Hadamard-rotated or not) with the lowest row error on the calibration rows.
3. search    every layer starts at its cheapest candidate; while the summed single-layer losses
             exceed `headroom × budget`, upgrade the layer/candidate with the best loss saved per
             byte added (with `max_bits`, none past the cap; a cap under the cheapest plan is an error).
4. verify    the whole plan on validation; while over `headroom × budget`, fall back layer by layer —
             the layer with the largest single-layer loss moves to its next wider candidate that
             measured a lower loss alone (e.g. INT4 → INT8 → FP16) — and record why; with `max_bits`
             only within the cap, and an error naming the layer when nothing within it fits.
   narrow    the search's sum of single-layer losses is only an estimate: while measured loss is
             left under the target, try cheaper candidates (most bytes saved per single-layer loss
             added first; never a layer that fell back), each verified end to end on validation,
             and keep those that stay under `headroom × budget` (at most `narrow_trials` checks).
   int8      with `int8_matmul`, every layer's absorbed projections (q_nope·W_UK, W_UV, o_proj) go
             W8A8 on top of the verified cache plan; while the plan is over `headroom × budget`, the
             layer whose projections cost most alone (validation loss, FP16 cache) goes back to FP
             matmuls, and the fallback is recorded.
5. check     test split: the plan's loss on `test_samples` windows of `seq_len` tokens.
   long      the plan on test windows of `long_seq_len` tokens (4× the default sample length), loss by
             position bucket; where it breaks the budget there, the fixes measured on the same tokens
             (a residual FP16 window, INT8 RoPE keys) are reported — offered, not applied.
   shift     the plan on off-distribution text (`shift_samples` windows of `seq_len`, `shift_long_samples`
             of `long_seq_len` tokens); reported, never used to choose.
   recall    with `recall_prompts`, exact recall (`mlaquant.evaluation.recall`): test windows of `long_seq_len`
             tokens ending in the first tokens of an earlier span, the share of the span FP16 and the plan
             reproduce greedily; reported, never used to choose.
6. report    the plan's metrics (validation and checks, every candidate measured) and settings, guard
             bounds from the calibration rows, and an atomically written plan directory (plan.yaml +
             scales.safetensors).

Each step is a function, its inputs and outputs in its signature, in a room of one job: `observe_variants` and
`measure` (`mlaquant.calib.measure`, over the candidates of `mlaquant.calib.candidates`); `search`, `fall_back`
(verify), `narrow` and `int8_projections` (`mlaquant.calib.search`); `held_out` (`mlaquant.calib.checks`: the
test split, `long_context`, `off_distribution`, `exact_recall`); `build_report` (`mlaquant.calib.report`).
`calibrate` runs them in that order; this module is also the `mlaquant calibrate` command (`add_arguments`,
`run`). What a run is given: `mlaquant.calib.calibrate_config` (`CalibrateConfig`, `Sources`).

Loss = relative perplexity increase against the FP16 cache, teacher-forced, every token through the
quantized cache (`mlaquant.evaluation.eval`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mlaquant.calib.calibrate_config import CalibrateConfig, Sources
from mlaquant.calib.candidates import fitting_candidates
from mlaquant.calib.checks import held_out
from mlaquant.calib.measure import calibration_batch_size, measure, observe_variants, progress_total
from mlaquant.calib.report import build_report, json_summary, summary_table
from mlaquant.calib.search import byte_cap, check_cap, fall_back, int8_projections, narrow, search
from mlaquant.config import load_config, to_dict
from mlaquant.device import add_device_arguments, place
from mlaquant.device import from_args as device_from_args
from mlaquant.errors import MLAQuantError
from mlaquant.evaluation.samples import token_samples
from mlaquant.modeling.protocol import LatentModel
from mlaquant.modeling.stream import StreamedModel
from mlaquant.runtime.plan import Plan


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
    """Run the whole pipeline (observe → measure → search → fallback → narrow → int8 → check → report);
    returns the plan and a report dict (timings, per-split metrics, peak RSS and peak GPU memory).

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
        variants = observe_variants(model, cal, cfg, bar)
        cap = byte_cap(cfg.max_bits, len(variants), sum(model.cfg.latent_widths))
        check_cap(variants, cfg.candidates, cap, cfg.max_bits)
        measured = measure(model, val, variants, cfg, bar, second)
    pick = search(measured.table, cfg.headroom * cfg.budget, cap)
    verified = fall_back(model, measured, pick, cfg, cap)
    verified = narrow(model, measured, verified, cfg)
    verified = int8_projections(model, measured, verified, cfg)
    checks = held_out(model, cfg, sources, verified.plan)
    plan, report = build_report(model, cfg, sources, (cal, val), measured, verified, checks, t0)
    if skipped:
        report["skipped_candidates"] = plan.metrics["skipped_candidates"] = skipped
    return plan, report


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
    p.add_argument(
        "--max-bits", type=float, default=None, help="cap on the plan's bits per cached value (config: max_bits)"
    )
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


def run(args: argparse.Namespace) -> int:
    from mlaquant.modeling.loader import load_model

    base = load_config(CalibrateConfig, args.config, "calibrate.yaml")
    overrides = {
        k: v
        for k, v in {
            "samples": args.samples,
            "seq_len": args.seq_len,
            "budget": args.budget,
            "max_bits": args.max_bits,
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
