"""`mlaquant sweep`: accuracy against cache memory for many cache configurations on held-out text.

    mlaquant sweep [--model PATH] [--data PATH] [--codecs fp16,int8,int4,...] [--plan DIR ...]
                   [--contexts 512,2048,8192] [--peers transformers,quanto-int4,...] [--out DIR]

Rows, all on the same test tokens (`--data`, default the bundled test split — never a split a plan
was chosen on):
    ours        uniform codecs from `--codecs` (`<ckv>[/<kpe>]`, names as in `mlaquant.quant.codecs`; a `+i8mm`
                suffix also runs the absorbed projections in W8A8, `mlaquant.modeling.int8_proj`)
    window      `window_codecs` with a residual FP16 window of `window` tokens (`<codec>+w<R>`)
    calibrated  plans from `--plan DIR ...`, or calibrated here at each of `budgets` (bundled
                calibration / validation splits, sizes from `calibrate:` in configs/sweep.yaml)
    engine      `engines`: other engines' cache settings as mlaquant codecs (`mlaquant.integrations.engines.FORMATS`,
                values bit-exact with each engine's quantizer)
    peer        `mlaquant.calib.peers`: transformers' default cache, its QuantizedCache, bitsandbytes NF4,
                llama.cpp

Each row reports bytes/token/layer, bits/value, cache MiB at each context, compression against the
FP16 latent and against MHA's per-head K/V, Δppl, KL, top-1 (`mlaquant.evaluation.eval`, against the FP16
latent cache) and batch-1 decode tokens/s. Outputs (`mlaquant.evaluation.report`): DIR/report.md, report.json,
sweep.png, memory.png; calibrated plans go to DIR/plans/. Finished rows are kept in
DIR/.sweep-state.json, keyed by everything that determines them, so a rerun with the same settings
reuses them (an interrupted sweep resumes where it stopped).

This module runs the sweep: the plans (loaded from `--plan` or calibrated here), the resume key, the report and
the command; what it measures is `mlaquant.calib.sweep_config`, the rows and their resumption
`mlaquant.calib.sweep_rows`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import mlaquant
from mlaquant.calib.calibrate import calibrate
from mlaquant.calib.data import split_path
from mlaquant.calib.sweep_config import SweepConfig, calibrate_config, load_sweep_config
from mlaquant.calib.sweep_rows import SweepRun, row_specs, run_rows
from mlaquant.config import to_dict
from mlaquant.device import add_device_arguments, auto_batch_size
from mlaquant.device import from_args as device_from_args
from mlaquant.errors import MLAQuantError, PlanError
from mlaquant.evaluation import report as report_mod
from mlaquant.evaluation.eval import sample_bytes
from mlaquant.evaluation.recall import Recall
from mlaquant.evaluation.samples import token_samples
from mlaquant.modeling.model import MLAModel
from mlaquant.quant.codecs import CodecError
from mlaquant.runtime.plan import Plan
from mlaquant.versions import library_versions


def sweep(
    model: MLAModel,
    cfg: SweepConfig,
    out: str | Path,
    data: str | Path | None = None,
    plan_dirs: list[str] | None = None,
    quiet: bool = False,
) -> dict:
    """Measure every row and write the report into `out`; returns the report dict."""
    t0 = time.perf_counter()
    out = Path(out)
    check_output_dir(out)
    if model.tokenizer is None:
        raise MLAQuantError(f"{model.source}: no tokenizer.json; the sweep needs text → tokens")
    data = Path(data) if data is not None else split_path("test")
    batch = auto_batch_size(model.device, sample_bytes(model, cfg.seq_len), cfg.batch_size, default=8)
    cfg = dataclasses.replace(cfg, batch_size=batch)
    for name in (*cfg.codecs, *cfg.window_codecs):
        Plan.uniform(name, len(model.layers)).bind(model.cfg).layer_codecs()  # a codec that does not fit the widths
    plans, digests, plan_source = resolve_plans(model, cfg, out, data, plan_dirs, quiet)
    samples = token_samples(model.tokenizer, data, cfg.samples, cfg.seq_len, cfg.seed, model.cfg.eos_id)
    specs = row_specs(cfg, plans, digests)
    fingerprint = model.fingerprint()
    key_src = {
        "mlaquant": mlaquant.__version__,
        "torch": str(torch.__version__),
        "model": fingerprint,
        "data": digest(data),
        "tokens": hashlib.sha256(samples.numpy().tobytes()).hexdigest(),
        "eval": [
            cfg.batch_size,
            cfg.decode_context,
            cfg.decode_steps,
            cfg.decode_backend,
            cfg.decode_threads,
        ],
    }
    recall = None
    if cfg.recall_prompts:
        n, length, seed = cfg.recall_prompts, cfg.recall_seq_len, cfg.seed + 7
        recall = Recall(model, token_samples(model.tokenizer, data, n, length, seed, model.cfg.eos_id),
                        cfg.recall_cue, cfg.recall_span, seed)
        key_src["recall"] = [n, length, cfg.recall_cue, cfg.recall_span]
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()
    rows, reference, resumed = run_rows(SweepRun(model, samples, cfg, plans, recall), specs, out, key, quiet)
    dims = model_dims(model)
    final = [report_mod.add_derived(rows[s.id], list(cfg.contexts), dims, samples.shape[1]) for s in specs]
    target = next((pid for pid, p in plans.items() if p.budget == cfg.target_budget), None)
    report = {
        "version": 1,
        "settings": {
            **to_dict(cfg),
            "data": str(data),
            "plan_source": plan_source,
            "threads": torch.get_num_threads(),
            "decode_threads": cfg.decode_threads or torch.get_num_threads(),
        },
        "versions": library_versions("transformers", "bitsandbytes", "optimum-quanto", "hqq", "tokenizers",
                                      "llama-cpp-python"),
        "model": {"path": str(model.source), "fingerprint": fingerprint, "dims": dims},
        "tokens": {"samples": int(samples.shape[0]), "seq_len": int(samples.shape[1])},
        "reference": reference,
        "rows": final,
        "pareto": report_mod.pareto_front(final),
        "target": report_mod.target_verdict(final, target),
        "resumed_rows": resumed,
    }
    report["findings"] = report_mod.findings(report)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report_mod.write_report(report, out)
    return report


def resolve_plans(
    model: MLAModel, cfg: SweepConfig, out: Path, data: Path, plan_dirs: list[str] | None, quiet: bool
) -> tuple[dict[str, Plan], dict[str, str], str]:
    """(plans by row id, their content digests, a sentence on where they come from)."""
    if plan_dirs is not None:
        plans = load_plans(plan_dirs, model, data)
        paths = {f"plan:{Path(d).resolve().name}": Path(d) for d in plan_dirs}
        source = "plans from --plan: " + ", ".join(str(d) for d in plan_dirs)
    else:
        for key, split in (("calibration_data", "calibration"), ("validation_data", "validation")):
            if same_path(getattr(cfg, key) or split_path(split), data):
                raise MLAQuantError(
                    f"--data {data} is the {split} split the plans are chosen on; use held-out text"
                )
        plans = calibrated_plans(model, cfg, out, quiet)
        paths = {pid: out / "plans" / pid[len("plan:") :] for pid in plans}
        c = calibrate_config(cfg, cfg.target_budget)
        source = (
            f"calibrated here at budgets {', '.join(f'{b:.1%}' for b in cfg.budgets)}: "
            f"{c.samples}×{c.seq_len} calibration tokens, {c.val_samples}×{c.seq_len} validation tokens, "
            f"headroom {c.headroom}"
        )
    return plans, {pid: digest(p) for pid, p in paths.items()}, source


def load_plans(plan_dirs: list[str], model: MLAModel, data: Path) -> dict[str, Plan]:
    """`--plan DIR ...`: each checked against the model and against the test text, and bound to the model."""
    if not plan_dirs:
        raise MLAQuantError("--plan: empty plan list (give one or more plan directories)")
    plans = {}
    for d in plan_dirs:
        plan = Plan.load(d)
        plan.check_model(model)
        for key in ("data", "val_data"):
            if same_path(plan.settings.get(key), data):
                raise PlanError(f"{d}: plan was chosen on {data} ({key}); report on held-out text (--data)")
        plans[f"plan:{Path(d).resolve().name}"] = plan.bind(model.cfg)
    return plans


def calibrated_plans(model: MLAModel, cfg: SweepConfig, out: Path, quiet: bool) -> dict[str, Plan]:
    """Plans at each budget in DIR/plans/budget-<b>, and of each tier config at the target budget in
    DIR/plans/<tier>-<b>, reusing one calibrated earlier with the same settings; bound to `model`."""
    runs = [(f"budget-{b:g}", calibrate_config(cfg, b)) for b in cfg.budgets]
    runs += [(f"{Path(t).stem.removeprefix('calibrate-')}-{cfg.target_budget:g}",
              calibrate_config(cfg, cfg.target_budget, t)) for t in cfg.tiers]
    plans = {}
    fingerprint = model.fingerprint()
    for name, ccfg in runs:
        plan_dir = out / "plans" / name
        want = {
            **to_dict(ccfg),
            "data": str(cfg.calibration_data or split_path("calibration")),
            "val_data": str(cfg.validation_data or split_path("validation")),
        }
        plan = None
        if (plan_dir / "plan.yaml").is_file():
            old = Plan.load(plan_dir)
            if old.fingerprint == fingerprint and all(old.settings.get(k) == v for k, v in want.items()):
                plan = old
        if plan is None:
            plan, _ = calibrate(model, ccfg, cfg.calibration_data, cfg.validation_data, quiet=quiet)
            plan.save(plan_dir)
            plan = Plan.load(plan_dir)
        plans[f"plan:{name}"] = plan.bind(model.cfg)
    return plans


def same_path(a, b) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def digest(path: Path) -> str:
    """sha256 over a file, or over every file of a directory (relative names and contents, sorted)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def model_dims(model: MLAModel) -> dict:
    c = model.cfg
    return {
        "layers": c.num_hidden_layers,
        "heads": c.num_attention_heads,
        "d_c": c.kv_lora_rank,
        "d_r": c.qk_rope_head_dim,
        "d_n": c.qk_nope_head_dim,
        "d_v": c.v_head_dim,
        "fp16_latent_bytes": (c.kv_lora_rank + c.qk_rope_head_dim) * 2,
        "mha_kv_bytes": c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * 2,
    }


def check_output_dir(out: Path) -> None:
    """Create `out` and prove it writable before any work is done."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".write-test.", dir=out)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise MLAQuantError(f"{out}: output directory is not writable ({e.strerror or e})") from e


def parse_list(text: str | None, what: str, conv=str) -> list | None:
    """'a,b,c' → [conv(a), ...]; None stays None; an empty list is an error naming the option."""
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise MLAQuantError(f"{what}: empty list")
    try:
        return [conv(t) for t in items]
    except ValueError as e:
        raise MLAQuantError(f"{what}: cannot parse {text!r} ({e})") from e


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument(
        "--data", default=None, help="held-out text: file, directory or JSONL (default: bundled test)"
    )
    p.add_argument(
        "--codecs", default=None, help="comma-separated uniform codecs '<ckv>[/<kpe>]' (default: config)"
    )
    p.add_argument(
        "--plan", nargs="*", default=None, metavar="DIR", help="plan directories (default: calibrate)"
    )
    p.add_argument(
        "--budgets", default=None, help="comma-separated budgets to calibrate at (default 0.005,0.01,0.02)"
    )
    p.add_argument(
        "--contexts", default=None, help="context lengths for the cache MiB columns (default 512,2048,8192)"
    )
    p.add_argument("--peers", default=None, help="comma-separated peers, or 'none' (default: config)")
    p.add_argument("--samples", type=int, default=None, help="test samples (default 16)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per test sample (default 512)")
    p.add_argument("--config", default=None, help="sweep YAML (default: configs/sweep.yaml)")
    p.add_argument("--out", default="sweep", help="output directory (default: ./sweep)")
    add_device_arguments(p)


def run(args: argparse.Namespace) -> int:
    from mlaquant.modeling.loader import load_model

    overrides = {
        "codecs": parse_list(args.codecs, "--codecs"),
        "budgets": parse_list(args.budgets, "--budgets", float),
        "contexts": parse_list(args.contexts, "--contexts", int),
        "peers": [] if args.peers == "none" else parse_list(args.peers, "--peers"),
        "samples": args.samples,
        "seq_len": args.seq_len,
    }
    try:
        cfg = load_sweep_config(args.config, {k: v for k, v in overrides.items() if v is not None})
    except CodecError as e:
        raise MLAQuantError(f"--codecs: {e}") from e
    if args.plan is not None and not args.plan:
        raise MLAQuantError("--plan: empty plan list (give one or more plan directories)")
    device, dtype = device_from_args(args)  # before anything is written
    out = Path(args.out)
    check_output_dir(out)
    model = load_model(args.model, device, dtype)
    report = sweep(model, cfg, out, args.data, args.plan, quiet=args.quiet)
    print(report_mod.markdown(report).split("\n## Notes")[0])
    print(f"\nreport written to {out}/report.md (+ report.json, sweep.png, memory.png)")
    return 0
