"""Checks runs of `mlaquant bench decode --batch 1,16 --contexts 4096,16384 --codecs fp16,int8-row,int4-row,int8,int4
--out RUN.json` against issue 29's targets, and prints one markdown table per target.

Usage: python scripts/decode_bench_targets.py runs/cpu29/vnni-*.json

Targets: (1) `auto` ≤ 1.0x the reference (medians) for every codec, batch and context; (2) batch 16 at 4k and 16k:
the fast path's INT8-row ≤ 0.5x and INT4-row ≤ 0.4x fast FP16 on the fastest rounds, in ≥ 4 of the runs out of 5;
(3) the W8A8 projections (`int8_matmul`) ≤ their FP32 GEMMs (medians), per projection and summed over a layer;
and issue 28's: band codecs (when the runs have them) no slower than INT4-row at batch 16 (fastest rounds).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FAST_LIMITS = {"int8-row": 0.5, "int4-row": 0.4}


def _load(paths: list[str]) -> list[dict]:
    runs = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if not isinstance(data, dict) or "attention" not in data:
            raise SystemExit(f"{p}: not a `mlaquant bench decode --batch ... --out` file (no 'attention' key)")
        runs.append(data)
    return runs


def auto_table(runs: list[dict]) -> str:
    """Per (batch, context, codec): auto / reference (medians) in each run, what auto ran (the "runs" of bench rows
    since round 10: "torch" is the reference's own call, so its ratio is two timings of one function), how many
    runs were ≤ 1.00, and the largest share of the reference's call that auto spends choosing (the rows' "decide_s"
    since round 13: where auto ran torch, auto's call is the reference's plus this)."""
    cells: dict[tuple, list[tuple[float, str, float | None]]] = {}
    for run in runs:
        ref = {(r["batch"], r["context"], r["codec"]): r["s"] for r in run["attention"] if r["path"] == "reference"}
        for r in run["attention"]:
            if r["path"] == "auto":
                key = (r["batch"], r["context"], r["codec"])
                share = r["decide_s"] / ref[key] if "decide_s" in r else None
                cells.setdefault(key, []).append((r["vs_reference"], r.get("runs", "?"), share))
    lines = ["| batch | context | codec | auto ran | auto / reference (each run) | runs ≤ 1.00 | choosing, % of the "
             "reference's call (largest) |", "|---|---|---|---|---|---|---|"]
    for (b, c, codec), cell in cells.items():
        ok = sum(round(x, 2) <= 1.0 for x, _, _ in cell)
        ran = "/".join(sorted({name for _, name, _ in cell}))
        shares = [s for _, _, s in cell if s is not None]
        choosing = f"{100 * max(shares):.2f}" if shares else "-"
        lines.append(f"| {b} | {c} | {codec} | {ran} | {' '.join(f'{x:.2f}' for x, _, _ in cell)} | "
                     f"{ok} of {len(cell)} | {choosing} |")
    return "\n".join(lines)


def fast_table(runs: list[dict]) -> str:
    """Batch 16: the fast path's fastest-round ratio to fast FP16 per run, and how many runs meet FAST_LIMITS."""
    lines = ["| context | codec | limit | fastest / fast FP16 (each run) | runs within |", "|---|---|---|---|---|"]
    for context in sorted({r["context"] for run in runs for r in run["attention"]}):
        for codec, limit in FAST_LIMITS.items():
            ratios = [r["min_vs_base_fast"] for run in runs for r in run["attention"]
                      if (r["batch"], r["context"], r["codec"], r["path"]) == (16, context, codec, "fast")]
            if ratios:
                ok = sum(round(x, 2) <= limit for x in ratios)
                lines.append(f"| {context} | {codec} | {limit} | {' '.join(f'{x:.2f}' for x in ratios)} | "
                             f"{ok} of {len(ratios)} |")
    return "\n".join(lines)


def band_table(runs: list[dict]) -> str:
    """Batch 16: each band codec's fast-path fastest round / INT4-row's in the same run (issue 28: ≤ 1.00)."""
    cells: dict[tuple, list[float]] = {}
    for run in runs:
        fast = {(r["context"], r["codec"]): r["min_s"] for r in run["attention"]
                if r["batch"] == 16 and r["path"] == "fast"}
        for (context, codec), t in fast.items():
            if codec.startswith("band-") and (context, "int4-row") in fast:
                cells.setdefault((context, codec), []).append(t / fast[(context, "int4-row")])
    lines = ["| context | codec | fastest / INT4-row's (each run) | runs ≤ 1.00 |", "|---|---|---|---|"]
    for (context, codec), ratios in sorted(cells.items()):
        ok = sum(round(x, 2) <= 1.0 for x in ratios)
        lines.append(f"| {context} | {codec} | {' '.join(f'{x:.2f}' for x in ratios)} | {ok} of {len(ratios)} |")
    return "\n".join(lines)


def projection_table(runs: list[dict]) -> str:
    """Per (batch, projection): int8_matmul / FP32 GEMM (medians) per run."""
    cells: dict[tuple, list[float]] = {}
    for run in runs:
        for r in run.get("projections", []):
            cells.setdefault((r["batch"], r["projection"]), []).append(r["int8_s"] / r["fp32_s"])
    lines = ["| batch | projection | int8_matmul / FP32 (each run) | runs ≤ 1.00 |", "|---|---|---|---|"]
    for (b, name), ratios in cells.items():
        ok = sum(round(x, 2) <= 1.0 for x in ratios)
        lines.append(f"| {b} | {name} | {' '.join(f'{x:.2f}' for x in ratios)} | {ok} of {len(ratios)} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    runs = _load(argv)
    print(f"{len(runs)} runs: {', '.join(argv)}\n")
    tables = (("auto vs reference", auto_table(runs)), ("batch 16, fast path vs fast FP16", fast_table(runs)),
              ("batch 16, band codecs vs INT4-row", band_table(runs)),
              ("W8A8 projections vs FP32 GEMMs", projection_table(runs)))
    for title, table in tables:
        print(f"### {title}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
