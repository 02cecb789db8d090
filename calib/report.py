"""Stage report, and what `mlaquant calibrate` prints: `build_report` fills in the plan's fallbacks, metrics
and settings (what plan.yaml records) and the report dict; `summary_table` (with `long_context_lines`,
`shift_line` and `recall_line`) is the table printed, `json_summary` the `--json` line."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from mlaquant.calib.calibrate_config import CalibrateConfig, Sources
from mlaquant.calib.candidates import describe
from mlaquant.calib.data import shift_description
from mlaquant.calib.measure import Measurements
from mlaquant.calib.search import Verified
from mlaquant.config import to_dict
from mlaquant.device import peak_memory
from mlaquant.device import settings as device_settings
from mlaquant.modeling.protocol import LatentModel
from mlaquant.runtime.plan import Plan


def build_report(
    model: LatentModel,
    cfg: CalibrateConfig,
    sources: Sources,
    samples: tuple[torch.Tensor, torch.Tensor],
    m: Measurements,
    v: Verified,
    checks: dict,
    t0: float,
) -> tuple[Plan, dict]:
    """Stage report: the plan's fallbacks, metrics and settings filled in from the validation results and the
    held-out `checks` (`mlaquant.calib.checks.held_out`); returns the plan and the report dict. `samples`: the
    (calibration, validation) tokens; `t0`: the run's start (`time.perf_counter`)."""
    plan, (cal, val) = v.plan, samples
    report = {"validation": v.checked.result.as_dict()}
    if v.checked.second is not None:
        report["shift_validation"] = {
            "data": shift_description("validation"),
            "seq_len": v.checked.second_len,
            "loss": v.checked.second.loss,
        }
    report["candidates"] = [[dataclasses.asdict(c) for c in row] for row in m.table]
    report |= checks
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report |= peak_memory(model.device)
    plan.fallbacks = v.fallbacks
    kept = ("validation", "shift_validation", "test", "long_context", "shift", "recall")
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
    if "recall" in report:
        out += "\n" + recall_line(report["recall"])
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


def recall_line(recall: dict) -> str:
    """The summary's exact-recall line: the plan's share against FP16's, and on what prompts."""
    return (
        f"    recall: {recall['plan']:.1%} of copied spans vs FP16 {recall['fp16']:.1%} "
        f"({recall['vs_fp16_points']:+.1f} points); {recall['prompts']} test prompts of {recall['seq_len']} tokens, "
        f"{recall['cue']}-token cue, {recall['span']} greedy tokens"
    )


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
        **{
            k: report[k]
            for k in ("validation", "test", "long_context", "shift", "recall", "skipped_candidates")
            if k in report
        },
        "fallbacks": len(plan.fallbacks),
        "seconds": report["seconds"],
        "peak_rss_mib": report["peak_rss_mib"],
    }
