"""The sweep's outputs: `report.md`, `report.json`, `sweep.png`, `memory.png`, written atomically.

A report is one dict (built by `mlaquant.calib.sweep`): `settings`, `versions`, `model` (path, fingerprint,
dims), `tokens`, `reference`, `rows`, `pareto`, `target`, `findings`, `seconds`. Each row carries its
measured numbers — `bytes_per_token_per_layer`, `bits_per_value`, `metrics` (loss = relative ppl
increase, KL, top-1, tokens), `decode_tokens_per_s` — and the columns derived from them here
(`cache_mib` per context, compression against the FP16 latent and against MHA's per-head K/V).
`metrics.by_position` holds the loss per bucket of target positions (`mlaquant.evaluation.eval.POSITION_EDGES`):
the report's by-position table and the right panel of sweep.png. A row that did not run has `status`
"not run: <why>" or "failed: <why>" and no numbers.

Pareto front: rows that no other row beats on both axes (bits per value, relative ppl increase),
i.e. no row has fewer-or-equal bits *and* lower-or-equal loss with one of them strictly better.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlaquant.atomic import atomic_write

MIB = 1 << 20


def is_measured(row: dict) -> bool:
    return row.get("status") == "ok"


def cache_bytes_per_layer(row: dict, context: int, bpt: float | None = None, residual_bpt: float | None = None):
    """One sequence's cache bytes per layer at `context` tokens: quantized rows + any full-precision residual
    (a window of `residual_tokens` rows at `residual_bytes_per_token_per_layer`)."""
    resident = min(context, row.get("residual_tokens", 0))
    bpt = row["bytes_per_token_per_layer"] if bpt is None else bpt
    res = row.get("residual_bytes_per_token_per_layer", 0) if residual_bpt is None else residual_bpt
    return (context - resident) * bpt + resident * res


def add_derived(row: dict, contexts: list[int], dims: dict, eval_len: int) -> dict:
    """Row + `cache_mib` per context, `eff_bits_per_value` (all bytes held at the evaluated length
    `eval_len`, residual included: the memory the measured loss was obtained with), `vs_fp16_latent` and
    `vs_mha_kv` (compression of bytes per token per layer)."""
    if not is_measured(row):
        return row
    bpt = row["bytes_per_token_per_layer"]
    width = dims["d_c"] + dims["d_r"]
    out = {
        **row,
        "eff_bits_per_value": round(8 * cache_bytes_per_layer(row, eval_len) / (eval_len * width), 4),
        "cache_mib": {str(c): round(dims["layers"] * cache_bytes_per_layer(row, c) / MIB, 4) for c in contexts},
        "vs_fp16_latent": round(dims["fp16_latent_bytes"] / bpt, 4),
        "vs_mha_kv": round(dims["mha_kv_bytes"] / bpt, 4),
    }
    if "bits_per_value_16bit_meta" in row:
        b16 = row["bits_per_value_16bit_meta"] * width / 8
        res16 = 2 * width if row.get("residual_tokens") else 0
        nbytes = cache_bytes_per_layer(row, eval_len, b16, res16)
        out["eff_bits_per_value_16bit_meta"] = round(8 * nbytes / (eval_len * width), 4)
    return out


BITS = "eff_bits_per_value"


def dominates(a: dict, b: dict, bits_key: str = BITS) -> bool:
    """a is at least as good as b on both axes (bits at the evaluated length, Δppl), strictly on one;
    `bits_key` (e.g. the 16-bit-scale count) is used where a row has it, else `eff_bits_per_value`."""
    ab, bb = a.get(bits_key, a[BITS]), b.get(bits_key, b[BITS])
    al, bl = a["metrics"]["loss"], b["metrics"]["loss"]
    return ab <= bb and al <= bl and (ab < bb or al < bl)


def pareto_front(rows: list[dict]) -> list[str]:
    """Ids of the measured rows no other measured row dominates, by increasing bits."""
    done = [r for r in rows if is_measured(r)]
    front = [r for r in done if not any(dominates(o, r) for o in done if o is not r)]
    return [r["id"] for r in sorted(front, key=lambda r: r[BITS])]


def target_verdict(rows: list[dict], target_id: str | None) -> dict:
    """Is the target plan on the Pareto front against every peer row? Checked with the peers' bytes as
    stored and, where they hold FP32 scales and residuals, as they would be at 16 bits (the stricter test);
    `dominated_by_nominal` compares rates without any residual window (what long contexts approach)."""
    by_id = {r["id"]: r for r in rows}
    target = by_id.get(target_id) if target_id else None
    if target is None or not is_measured(target):
        why = "no calibrated plan at the target budget" if target is None else target["status"]
        return {"row": target_id, "on_front": None, "reason": why, "dominated_by": []}
    peers = [r for r in rows if r["kind"] in ("peer", "engine") and is_measured(r)]
    beaten_by = [p["id"] for p in peers if dominates(p, target)]
    beaten_16 = [
        p["id"]
        for p in peers
        if "eff_bits_per_value_16bit_meta" in p and dominates(p, target, "eff_bits_per_value_16bit_meta")
    ]
    everyone = [o["id"] for o in rows if o is not target and is_measured(o) and dominates(o, target)]
    nominal = [p["id"] for p in peers if dominates(p, target, "bits_per_value")]
    return {
        "row": target_id,
        "on_front": not beaten_by,
        "on_front_16bit_peer_scales": not beaten_16,
        "dominated_by": beaten_by,
        "dominated_by_16bit_peer_scales": beaten_16,
        "dominated_by_any_row": everyone,
        "dominated_by_nominal": nominal,
        "peers_compared": [p["id"] for p in peers],
    }


def _pct(x: float) -> str:
    return f"{100 * x:+.3f} %"


def _ids(ids: list[str]) -> str:
    return ", ".join(i.split(":", 1)[1] for i in ids)


def _target_sentence(report: dict, t: dict) -> str:
    verdict, budget, T = report["target"], report["settings"]["target_budget"], report["tokens"]["seq_len"]
    line = (
        f"The calibrated {budget:.1%} plan ({t['bits_per_value']:.2f} bits/value, Δppl "
        f"{_pct(t['metrics']['loss'])}, KL {t['metrics']['kl']:.2e}, top-1 {t['metrics']['top1']:.2%}) "
    )
    if t["metrics"]["loss"] > budget:
        line += "is over its budget on the test split; it "
    peers = verdict["peers_compared"]
    if not peers:
        return line + "has no measured peer row to be compared with."
    if not verdict["on_front"]:
        line += (
            f"is NOT on the Pareto front against the peers: {_ids(verdict['dominated_by'])} hold(s) "
            f"fewer-or-equal bits at T={T} at lower-or-equal loss."
        )
    elif verdict["on_front_16bit_peer_scales"]:
        line += (
            f"lies on the Pareto front against every peer row ({len(peers)} measured): none holds fewer bits "
            f"at T={T} at equal or lower loss, even with the peers' scales and residuals counted at 16 bits."
        )
    else:
        line += (
            "lies on the Pareto front against the peers as stored, but not with their FP32 scales and "
            "residuals counted at 16 bits (then dominated by "
            f"{_ids(verdict['dominated_by_16bit_peer_scales'])})."
        )
    nominal = verdict["dominated_by_nominal"]
    if nominal and nominal != verdict["dominated_by"]:
        line += (
            f" Counting only the quantized rate (no residual window), {_ids(nominal)} would dominate it: "
            "their loss is lowered by the recent tokens they keep in full precision."
        )
    own = [i for i in verdict["dominated_by_any_row"] if not i.startswith("peer:")]
    if own:
        line += f" Among mlaquant's own rows, {_ids(own)} dominate(s) it."
    return line


def findings(report: dict) -> str:
    """A short paragraph generated from the numbers."""
    rows = [r for r in report["rows"] if is_measured(r)]
    budget = report["settings"]["target_budget"]
    ref, T = report["reference"], report["tokens"]["seq_len"]
    out = [
        f"FP16-latent reference: ppl {ref['ppl']:.3f} on {ref['tokens']} held-out test tokens "
        f"({report['tokens']['samples']} × {T})."
    ]
    ours = [r for r in rows if r["kind"] in ("ours", "calibrated", "window")]
    within = [r for r in ours if r["metrics"]["loss"] <= budget]
    if within:
        best = min(within, key=lambda r: r[BITS])
        out.append(
            f"Fewest bits within the {budget:.1%} budget among mlaquant rows: {best['label']} at "
            f"{best[BITS]:.2f} bits/value ({best['vs_fp16_latent']:.2f}× smaller than the FP16 latent, "
            f"{best['vs_mha_kv']:.1f}× smaller than MHA's per-head K/V), "
            f"Δppl {_pct(best['metrics']['loss'])}."
        )
    if report["target"]["on_front"] is None:
        out.append(f"Target plan: not measured ({report['target']['reason']}).")
    else:
        out.append(_target_sentence(report, next(r for r in rows if r["id"] == report["target"]["row"])))
    peers = [r for r in rows if r["kind"] in ("peer", "engine") and is_measured(r) and r[BITS] < 8]
    if peers:
        p = min(peers, key=lambda r: r["metrics"]["loss"])
        rate = f" ({p['bits_per_value']:.2f} without its residual)" if p.get("residual_tokens") else ""
        out.append(
            f"Most accurate peer under 8 bits at T={T}: {p['label']} at {p[BITS]:.2f} bits/value{rate}, "
            f"Δppl {_pct(p['metrics']['loss'])}."
        )
    speeds = {r["id"]: r["decode_tokens_per_s"] for r in rows if r.get("decode_tokens_per_s")}
    if "ours:fp16" in speeds and len(speeds) > 1:
        slow = min(speeds, key=speeds.get)
        s = report["settings"]
        out.append(
            f"Decode at context {s['decode_context']} (batch 1, {s['decode_backend']} backend, "
            f"{s['decode_threads']} thread(s)): FP16 cache {speeds['ours:fp16']:.0f} tok/s, slowest "
            f"{_ids([slow])} {speeds[slow]:.0f} tok/s."
        )
    skipped = [r for r in report["rows"] if not is_measured(r)]
    if skipped:
        out.append(f"{len(skipped)} row(s) did not run; the table says why.")
    return " ".join(out)


def _cell(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _table(report: dict) -> list[str]:
    contexts, T = report["settings"]["contexts"], report["tokens"]["seq_len"]
    front = set(report["pareto"])
    head = ["configuration", "kind", "B/token/layer", "bits/value", f"bits @T={T}"]
    head += [f"MiB @{c}" for c in contexts]
    head += ["vs FP16 latent", "vs MHA K/V", "Δppl", "KL", "top-1", "decode tok/s", "Pareto", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        if not is_measured(r):
            cells = [r["label"], r["kind"]] + ["—"] * (len(head) - 3) + [r["status"]]
        else:
            mt = r["metrics"]
            cells = [
                r["label"],
                r["kind"],
                f"{r['bytes_per_token_per_layer']:.1f}",
                f"{r['bits_per_value']:.2f}",
                f"{r[BITS]:.2f}",
                *(f"{r['cache_mib'][str(c)]:.3f}" for c in contexts),
                f"{r['vs_fp16_latent']:.2f}×",
                f"{r['vs_mha_kv']:.2f}×",
                _pct(mt["loss"]),
                f"{mt['kl']:.2e}",
                f"{mt['top1']:.2%}",
                _cell(r.get("decode_tokens_per_s"), ".0f"),
                "★" if r["id"] in front else "",
                "ok" + (f" ({r['notes']})" if r.get("notes") else ""),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _bucket_name(positions: list[int]) -> str:
    return f"{positions[0]}–{positions[1]}"


def _rows_by_position(rows: list[dict]) -> list[dict]:
    """The measured rows whose loss is split into more than one position bucket."""
    return [r for r in rows if is_measured(r) and len(r["metrics"].get("by_position", [])) > 1]


def _position_table(report: dict) -> list[str]:
    """Δppl per position bucket, one row per measured configuration (empty with fewer than two buckets)."""
    rows = _rows_by_position(report["rows"])
    if not rows:
        return []
    buckets = [b["positions"] for b in rows[0]["metrics"]["by_position"]]
    head = ["configuration", "bits/value", *(f"Δppl @ {_bucket_name(b)}" for b in buckets), "Δppl all"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [_pct(b["loss"]) for b in r["metrics"]["by_position"]]
        cells += ["—"] * (len(buckets) - len(cells))
        lines.append(
            f"| {r['label']} | {r['bits_per_value']:.2f} | " + " | ".join(cells) + f" | {_pct(r['metrics']['loss'])} |"
        )
    return lines


def _recall_table(report: dict) -> list[str]:
    """Exact recall per measured row that carries it, against the FP16 reference (empty when the check is off)."""
    rows = [r for r in report["rows"] if is_measured(r) and "recall" in r]
    fp16, s = report["reference"].get("recall"), report["settings"]
    if not rows or fp16 is None:
        return []
    lines = [
        "## Exact recall",
        "",
        f"{s['recall_prompts']} windows of the test text of {s['recall_seq_len']} tokens, each ending in the first "
        f"{s['recall_cue']} tokens of an earlier span; the share of the next {s['recall_span']} greedy tokens "
        f"(DecodeSession) that reproduce it. FP16 latent cache: {fp16:.1%}.",
        "",
        "| configuration | bits/value | recall | vs FP16 (points) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['label']} | {r['bits_per_value']:.2f} | {r['recall']:.1%} | {100 * (r['recall'] - fp16):+.1f} |"
        for r in rows
    ]
    return lines + [""]


def markdown(report: dict) -> str:
    s, m, tok, dims = report["settings"], report["model"], report["tokens"], report["model"]["dims"]
    T = tok["seq_len"]
    positions = _position_table(report)
    text = [
        "# mlaquant sweep: accuracy vs cache memory",
        "",
        f"Model `{m['path']}` (fingerprint `{m['fingerprint'][:16]}`): {dims['layers']} layers, "
        f"H={dims['heads']}, d_c={dims['d_c']}, d_r={dims['d_r']}, d_n={dims['d_n']}, d_v={dims['d_v']}. "
        f"FP16 latent {dims['fp16_latent_bytes']} B/token/layer; MHA with the same heads would cache "
        f"H×(d_n+d_r+d_v)×2 = {dims['mha_kv_bytes']} B/token/layer.",
        "",
        f"Test text `{s['data']}`: {tok['samples']} samples × {T} tokens (seed {s['seed']}), "
        f"{report['reference']['tokens']} predicted tokens, the same for every row including peers. "
        "Δppl = ppl/ppl_FP16 − 1, KL = mean KL(FP16 ‖ row), top-1 = agreement with the FP16-latent "
        "cache; "
        "teacher-forced, every token through the quantized cache. Calibrated plans were chosen on other "
        f"splits ({s['plan_source']}). Decode tok/s: batch 1, 1/median step time over {s['decode_steps']} "
        f"steps after a {s['decode_context']}-token prefill, {s['decode_backend']} backend, "
        f"{s['decode_threads']} thread(s) (accuracy rows ran with {s['threads']}).",
        "",
        *_table(report),
        "",
        *(f"- {r['label']}: {r['codec']}" for r in report["rows"] if r["kind"] == "calibrated" and is_measured(r)),
        "",
        *(
            [
                "## Δppl by position",
                "",
                "Each bucket: targets at those positions of their sample (0 = the "
                "first predicted token), against the FP16 latent cache on the same positions.",
                "",
                *positions,
                "",
            ]
            if positions
            else []
        ),
        *_recall_table(report),
        "## Findings",
        "",
        report["findings"],
        "",
        "## Notes",
        "",
        f"- bits/value = the quantized rows' rate (codes, scales, zero points); bits @T={T} = everything a "
        "sequence of the evaluated length holds, full-precision residual windows included — the memory the "
        "measured loss was obtained with, and the axis of the Pareto front (★: no other row has "
        "fewer-or-equal bits @T at lower-or-equal Δppl).",
        "- Peers run through transformers by teacher-forced step decoding over the same tokens. "
        "QuantizedCache "
        "keeps up to R−1 recent tokens in the model dtype and stores scales and zero points in the model "
        "dtype (FP32 here); the verdict also checks them counted at 16 bits. bnb NF4 is a fake-quantized "
        "codec with FP32 absmax per block counted.",
        "- Residual-window rows (`+w<R>`) keep each sequence's most recent R rows FP16.",
        f"- Wall time {report['seconds']:.0f} s; rows reused from an earlier run: {report['resumed_rows']}.",
        "",
        "![Δppl vs bits per value](sweep.png)",
        "",
        "![cache MiB vs context](memory.png)",
        "",
    ]
    return "\n".join(text)


MARKERS = {"ours": "o", "window": "D", "calibrated": "*", "engine": "^", "peer": "s"}
COLORS = {"ours": "tab:blue", "window": "tab:cyan", "calibrated": "tab:red", "engine": "tab:green", "peer": "tab:gray"}


def _place_labels(ax, points: list[tuple[float, float, str]], line_px: float = 9.0) -> None:
    """Label each (x, y) point, moving a label down in steps of one text line (with a leader line)
    while it would overlap one already placed: readable even where markers crowd."""
    ax.figure.canvas.draw()  # fix the limits so data → pixel transforms are final
    placed: list[tuple[float, float, float]] = []  # (x, y, width) of labels in pixels
    for x, y, text in sorted(points, key=lambda p: (-p[1], p[0])):
        px, py = ax.transData.transform((x, y))
        width = 4.2 * len(text)
        lx, ly = px + 5, py + 3
        while any(abs(ly - qy) < line_px and lx < qx + qw and qx < lx + width for qx, qy, qw in placed):
            ly -= line_px
        placed.append((lx, ly, width))
        ax.annotate(
            text,
            (x, y),
            xytext=(lx - px, ly - py),
            textcoords="offset pixels",
            fontsize=6.5,
            arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.5"} if ly < py - 2 else None,
        )


def plot_sweep(report: dict, path: Path) -> None:
    """Left: Δppl % against bits per value, a labelled marker per row, the budget line, the Pareto front.
    Right (where rows carry position buckets): Δppl % per position bucket, one line per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if is_measured(r)]
    by_pos = _rows_by_position(rows)
    if by_pos:
        fig, (ax, ax_pos) = plt.subplots(1, 2, figsize=(18, 7), gridspec_kw={"width_ratios": [11, 7]})
        _plot_positions(ax_pos, by_pos, report)
    else:
        fig, ax = plt.subplots(figsize=(11, 7))
    _plot_tradeoff(ax, rows, report)
    _save_png(fig, path)


def _plot_positions(ax, rows: list[dict], report: dict) -> None:
    """Δppl % per position bucket (x: the bucket's span of positions), a line per row; calibrated plans bold."""
    import matplotlib

    budget = 100 * report["settings"]["target_budget"]
    for r in rows:
        buckets = r["metrics"]["by_position"]
        xs = list(range(len(buckets)))
        calibrated = r["kind"] == "calibrated"
        ax.plot(
            xs,
            [100 * b["loss"] for b in buckets],
            marker=MARKERS[r["kind"]],
            lw=2.5 if calibrated else 1,
            ms=8 if calibrated else 4,
            alpha=1.0 if calibrated else 0.7,
            label=r["label"],
        )
    buckets = rows[0]["metrics"]["by_position"]
    ax.set_xticks(range(len(buckets)), [_bucket_name(b["positions"]) for b in buckets])
    ax.axhline(budget, color="tab:red", ls="--", lw=1)
    losses = [abs(100 * b["loss"]) for r in rows for b in r["metrics"]["by_position"] if b["loss"] != 0]
    ax.set_yscale("symlog", linthresh=max(min(losses, default=0.01), 1e-3))
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("target position in the sample (bucket)")
    ax.set_ylabel("Δppl against the FP16 latent cache on those positions (%)")
    ax.set_title("Δppl by context position")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _plot_tradeoff(ax, rows: list[dict], report: dict) -> None:
    """The sweep's main panel: Δppl % against bits per value at the evaluated length."""
    import matplotlib

    budget = 100 * report["settings"]["target_budget"]
    for kind, marker in MARKERS.items():
        pts = [r for r in rows if r["kind"] == kind]
        if pts:
            ax.scatter(
                [r[BITS] for r in pts],
                [100 * r["metrics"]["loss"] for r in pts],
                marker=marker,
                s=140 if kind == "calibrated" else 45,
                color=COLORS[kind],
                label=kind,
                zorder=3,
            )
    front = [next(r for r in rows if r["id"] == i) for i in report["pareto"]]
    if front:
        xs = [r[BITS] for r in front]
        ys = [100 * r["metrics"]["loss"] for r in front]
        ax.step(xs, ys, where="post", color="tab:green", lw=1.5, label="Pareto front", zorder=2)
        ax.scatter(xs, ys, s=220, facecolors="none", edgecolors="tab:green", lw=1.5, zorder=4)
    ax.axhline(budget, color="tab:red", ls="--", lw=1, label=f"budget {budget:g} %")
    losses = [abs(100 * r["metrics"]["loss"]) for r in rows if r["metrics"]["loss"] != 0]
    ax.set_yscale("symlog", linthresh=max(min(losses, default=0.01), 1e-3))
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel(
        f"bits per cached value at T={report['tokens']['seq_len']} (scales, zero points, FP residuals included)"
    )
    ax.set_ylabel("Δppl against the FP16 latent cache (%)")
    ax.set_title(f"mlaquant sweep — {report['reference']['tokens']} test tokens")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower left")
    _place_labels(ax, [(r[BITS], 100 * r["metrics"]["loss"], r["label"]) for r in rows])


def plot_memory(report: dict, path: Path) -> None:
    """Cache MiB of one sequence against context length, one line per measured row, MHA for reference
    (drawn on powers of two between the reported contexts, which are marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = report["settings"]["contexts"]
    lo, hi = min(contexts), max(contexts)
    xs = sorted(set(contexts) | {1 << k for k in range(lo.bit_length(), hi.bit_length()) if lo < 1 << k < hi})
    dims = report["model"]["dims"]
    rows = [r for r in report["rows"] if is_measured(r)]
    colors = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(10, 6.5))
    for i, r in enumerate(rows):
        ys = [dims["layers"] * cache_bytes_per_layer(r, c) / MIB for c in xs]
        ax.plot(xs, ys, color=colors(i % 20), lw=1.2, label=r["label"])
        ax.scatter(
            contexts,
            [r["cache_mib"][str(c)] for c in contexts],
            marker=MARKERS[r["kind"]],
            color=colors(i % 20),
        )
    ax.plot(
        xs,
        [dims["layers"] * dims["mha_kv_bytes"] * c / MIB for c in xs],
        "k--",
        lw=1.5,
        label="MHA K/V, FP16",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("cache MiB (one sequence, all layers)")
    ax.set_title("KV cache memory by configuration (markers at the reported contexts)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6.5, ncol=2, loc="upper left")
    _save_png(fig, path)


def _save_png(fig, path: Path) -> None:
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def write_report(report: dict, out_dir: Path) -> dict[str, Path]:
    """Write report.json, report.md, sweep.png and memory.png into out_dir (each atomically)."""
    out_dir = Path(out_dir)
    paths = {name: out_dir / name for name in ("report.json", "report.md", "sweep.png", "memory.png")}
    atomic_write(paths["report.json"], json.dumps(report, indent=1, allow_nan=False) + "\n")
    atomic_write(paths["report.md"], markdown(report))
    plot_sweep(report, paths["sweep.png"])
    plot_memory(report, paths["memory.png"])
    return paths
