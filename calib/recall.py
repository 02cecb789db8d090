"""`mlaquant recall`: exact recall over a long context, FP16 against each plan (`mlaquant.evaluation.recall`).

    mlaquant recall [--model M] [--plans fp16,plans/default,...] [--prompts 64] [--seq-len 2048] [--cue 16]
                    [--span 64] [--seed 5] [--backend torch] [--json]

The prompts are windows of the bundled test split (held out from training and calibration); each plan decodes the
same prompts greedily through `DecodeSession` over its quantized cache. The table: the plan, its bits per cached
value, the share of the copied spans it reproduces, and the gap to FP16 in points.
"""

from __future__ import annotations

import argparse
import json

from tqdm import tqdm


def add_arguments(p: argparse.ArgumentParser) -> None:
    from mlaquant.attention.backends import Backend

    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--plans", default="fp16,int8,int4",
                   help="comma-separated plan directories or uniform codecs; fp16 (the reference) is always first")
    p.add_argument("--prompts", type=int, default=64, help="recall prompts (test-split windows)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per prompt, cue included")
    p.add_argument("--cue", type=int, default=16, help="tokens of the earlier span that end the prompt")
    p.add_argument("--span", type=int, default=64, help="greedy tokens scored against the earlier span")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--backend", default="torch", choices=Backend.choices(), help="decode attention (torch: FP32 ref.)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def measure(args: argparse.Namespace) -> dict:
    """{'prompts', 'seq_len', 'cue', 'span', 'rows': [{'plan', 'bits_per_value', 'share', 'vs_fp16_points'}]}."""
    from mlaquant.calib.data import split_path
    from mlaquant.evaluation.recall import recall_set, recall_share
    from mlaquant.evaluation.samples import token_samples
    from mlaquant.modeling.loader import load_model
    from mlaquant.runtime.plan import resolve_plan

    model = load_model(args.model)
    windows = token_samples(model.tokenizer, split_path("test"), args.prompts, args.seq_len, args.seed,
                            model.cfg.eos_id)
    rs = recall_set(windows, args.cue, args.span, args.seed)
    names = ["fp16", *(n for n in args.plans.split(",") if n and n != "fp16")]
    plans = {name: resolve_plan(name, model) for name in names}  # every plan checked before the first decodes
    rows = []
    for name, plan in tqdm(plans.items(), desc="recall", disable=args.quiet):
        share = recall_share(model, rs, plan, args.backend)
        rows.append({"plan": name, "bits_per_value": plan.bits_per_value(), "share": share,
                     "vs_fp16_points": 100 * (share - rows[0]["share"]) if rows else 0.0})
    return {"prompts": int(rs.prompts.shape[0]), "seq_len": args.seq_len, "cue": args.cue, "span": args.span,
            "rows": rows}


def table(report: dict) -> str:
    lines = [f"exact recall: {report['prompts']} test-split prompts of {report['seq_len']} tokens ending in the first "
             f"{report['cue']} tokens of an earlier span; share of the next {report['span']} greedy tokens that "
             "reproduce it", "", "| plan | bits per value | recall | vs FP16 (points) |", "|---|---|---|---|"]
    lines += [f"| {r['plan']} | {r['bits_per_value']:.2f} | {r['share']:.1%} | {r['vs_fp16_points']:+.1f} |"
              for r in report["rows"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = measure(args)
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0
