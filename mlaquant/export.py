"""`mlaquant export`: a calibrated plan → a model directory vLLM / SGLang serve with an FP8 latent cache.

What the engines can store: vLLM's MLA cache in `fp8` is one e4m3 row [c_kv | k_pe] per token and
layer (576 B for DeepSeek), quantized with ONE per-layer scale `k_scale` (x / k_scale on write, ×
k_scale on read; `v_scale` is loaded but V is a view of c_kv). So a plan exports exactly when every
layer is static `fp8` (mlaquant's codec with the same semantics, `mlaquant.codecs`). The exported `k_scale`
is absmax over c_kv AND k_pe of the layer's calibrated range / 448 — its clip range when the plan
clips the layer (then it is exactly the scale the plan's fp8 codec used), else the observed range
`range_lo/range_hi` of the latent itself (not of expanded K/V; an unclipped fp8 layer was measured
at scale 1.0 by calibration, so the export measurement below is what covers its exported scale).

Anything else — INT8/INT4 or grouped-fp8 or FP16 layers, a residual FP16 window — the engines cannot
represent. It is refused with an error naming the layers, unless `--map-to-fp8`: then those layers
become static fp8 with the k_scale above. Layers caching a Hadamard-rotated latent are always
refused: the engine caches the unrotated latent, whose range the plan does not hold.

Before anything is written, the exported cache is measured here: the test data the plan recorded
(`settings.test_data`, or `--test-data`) through the engine-equivalent codecs (and, for comparison,
at scale 1.0 — what an engine without scales does), streamed one layer at a time. An export over
the plan's budget is refused unless `--force`.

Output (written atomically to a temp dir, then renamed): every top-level file of the model directory
(safetensors hard-linked, or symlinked across file systems, or copied with `--copy`), plus

    kv_cache_scales.safetensors   per layer i, float32 [1], all four equal (k = v):
                                    model.layers.{i}.self_attn.k_proj.k_scale / v_proj.v_scale (read by the engines)
                                    model.layers.{i}.self_attn.k_scale / v_scale (compressed-tensors' own names)
    model.safetensors.index.json  the source index + the scale tensors
    config.json                   + quantization_config.kv_cache_scheme (compressed-tensors):
                                  {num_bits: 8, type: float, strategy: tensor, symmetric, static}
    mlaquant_export.json          per-layer scales and mapping, measured losses, engine notes

Scale names, read from the engines' DeepSeek loaders (ENGINE_SCALE_NAMES; versions in
ENGINE_VERSIONS). vLLM: `DeepseekV2Model.load_weights` (vllm/model_executor/models/deepseek_v2.py)
passes kv-scale names to `maybe_remap_kv_scale_name` (vllm/model_executor/model_loader/weight_utils.py);
the MLA layer's parameters are `self_attn.mla_attn.mla_attn.{k,v}_scale`, reached only from the exact
name or from the ModelOpt form `self_attn.{k,v}_proj.{k,v}_scale`; `self_attn.k_scale` is remapped to
`self_attn.attn.k_scale`, which MLA does not have: it is dropped with a warning. SGLang:
`DeepseekV2WeightLoaderMixin.do_load_weights` (sglang/srt/models/deepseek_common/deepseek_weight_loader.py)
rewrites `{k,v}_proj` to `attn_mqa` in a scale name it does not know, so `self_attn.k_proj.k_scale` →
`self_attn.attn_mqa.k_scale` (the MLA RadixAttention) and `self_attn.k_scale` is dropped ("not found in
params_dict"). Hence the `{k,v}_proj` names; the compressed-tensors names stay for tools that read that
format. Interleaved-RoPE checkpoints: mlaquant caches k_pe de-interleaved ([even | odd] channels); a
per-layer scalar scale does not depend on channel order.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mlaquant.atomic import atomic_directory
from mlaquant.codecs import LayerCodec, fp8_static_scale
from mlaquant.device import add_device_arguments, auto_batch_size
from mlaquant.device import from_args as device_from_args
from mlaquant.errors import CheckpointError, MLAQuantError, PlanError
from mlaquant.plan import Plan

SCALES_FILE = "kv_cache_scales.safetensors"
REPORT_FILE = "mlaquant_export.json"
FORMATS = ("compressed-tensors",)
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
_REWRITTEN = ("config.json", "model.safetensors.index.json", SCALES_FILE, REPORT_FILE)


# the engine releases whose DeepSeek weight loaders the names below were read from
ENGINE_VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}
# checkpoint name of a layer's scale → the engines that load it onto MLA attention
ENGINE_SCALE_NAMES = {
    "model.layers.{i}.self_attn.k_proj.k_scale": ("vllm", "sglang"),
    "model.layers.{i}.self_attn.v_proj.v_scale": ("vllm", "sglang"),
    "model.layers.{i}.self_attn.k_scale": (),  # compressed-tensors' name; both engines drop it for MLA
    "model.layers.{i}.self_attn.v_scale": (),
}
SCALE_SUFFIXES = tuple(n.split("{i}.")[1] for n in ENGINE_SCALE_NAMES) + ("self_attn.kv_scale",)


def scale_names(i: int) -> list[str]:
    """Checkpoint names of layer i's KV-cache scales (all hold the same value: V is a view of c_kv)."""
    return [n.format(i=i) for n in ENGINE_SCALE_NAMES]


@dataclasses.dataclass
class LayerExport:
    """How one layer's cache leaves mlaquant."""

    layer: int
    plan_codec: str
    k_scale: float
    mapped: bool  # False: the plan's own codec, exactly; True: converted to static fp8
    source: str  # where k_scale comes from


def engine_scales(plan: Plan, d_c: int, d_r: int, map_to_fp8: bool) -> list[LayerExport]:
    """Per layer, the static-fp8 scale the engine will use; PlanError for what cannot be exported."""
    rotated = [i for i, lp in enumerate(plan.layers) if lp.rotate or lp.rotate_rope]
    if rotated:
        raise PlanError(
            f"layers {_layer_list(rotated)} cache a Hadamard-rotated latent, which vLLM/SGLang cannot "
            "represent; re-calibrate with `try_rotation: false` to export"
        )
    out, unsupported = [], []
    for i, lp in enumerate(plan.layers):
        kind = "clip" if lp.clip else "range"
        lo, hi = plan.tensors.get(f"layer{i}.{kind}_lo"), plan.tensors.get(f"layer{i}.{kind}_hi")
        for t in (lo, hi):
            if t is not None and tuple(t.shape) != (d_c + d_r,):
                raise PlanError(f"plan tensors of layer {i}: {t.shape[0]} channels, model rows {d_c + d_r}")
        codec = plan.layer_codec(i, d_c, d_r)
        exact = codec.ckv.spec.is_static_fp8 and codec.kpe.spec.is_static_fp8 and not plan.window
        if not exact:
            unsupported.append(i)
        if lo is not None:
            source = "calibrated clip range" if lp.clip else "observed calibration range"
            out.append(LayerExport(i, lp.codec_name, fp8_static_scale(lo, hi), not exact, source))
        elif exact:  # a uniform "fp8" plan: nothing calibrated, the engines' default
            out.append(LayerExport(i, lp.codec_name, codec.ckv.fp8_scale, False, "uncalibrated (1.0)"))
        elif map_to_fp8:
            raise PlanError(f"layer {i} ({lp.codec_name}) has no calibrated range to map to fp8: calibrate")
    if unsupported and not map_to_fp8:
        codecs = sorted({plan.layers[i].codec_name for i in unsupported})
        window = f" and a residual FP16 window of {plan.window} tokens" if plan.window else ""
        raise PlanError(
            f"layers {_layer_list(unsupported)} use {', '.join(codecs)}{window}; vLLM/SGLang store an MLA "
            "cache only as FP8 with one scale per layer — pass --map-to-fp8 to export them as fp8 "
            "(loss measured)"
        )
    return out


def _layer_list(layers: list[int]) -> str:
    return ", ".join(map(str, layers[:12])) + (f" (+{len(layers) - 12} more)" if len(layers) > 12 else "")


def engine_codecs(scales: list[float], d_c: int, d_r: int) -> list[LayerCodec]:
    """What the engine does per layer: static e4m3 over [c_kv | k_pe] with one scale."""
    return [LayerCodec.from_names("fp8", "fp8", d_c, d_r, fp8_scale=s) for s in scales]


def quantization_config(existing: dict | None) -> tuple[dict, str]:
    """config.json's quantization_config with the kv_cache_scheme, and a note on what was done."""
    if existing is None:
        config = {
            "quant_method": "compressed-tensors",
            "format": "dense",
            "quantization_status": "compressed",
            "config_groups": {},
            "ignore": [],
            "kv_cache_scheme": dict(KV_CACHE_SCHEME),
        }
        return config, "added a compressed-tensors quantization_config holding only the kv_cache_scheme"
    method = existing.get("quant_method")
    if method == "compressed-tensors":
        return {**existing, "kv_cache_scheme": dict(KV_CACHE_SCHEME)}, "set kv_cache_scheme in its config"
    # e.g. official DeepSeek-V3 block-FP8 weights ("fp8"): that config must stay, the scales still load
    note = (
        f"kept quantization_config (quant_method {method!r}); engines read the k_scale/v_scale tensors "
        "through that method's KV-cache scales; no kv_cache_scheme written"
    )
    return existing, note


def _weight_map(model_dir: Path) -> tuple[dict[str, str], int]:
    """tensor → file, and the index's total_size (the file size for a single-file checkpoint)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        doc = json.loads(index.read_text())
        return dict(doc["weight_map"]), int(doc.get("metadata", {}).get("total_size", 0))
    single = model_dir / "model.safetensors"
    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors"), single.stat().st_size


def _place(src: Path, dst: Path, copy: bool) -> None:
    """Large weights are linked (hard link, else symlink); small files and `copy` are copied."""
    if copy or src.suffix != ".safetensors":
        shutil.copy2(src, dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        dst.symlink_to(src.resolve())


def source_weight_map(model_dir: Path) -> tuple[dict[str, str], int]:
    """The checkpoint's tensor → file map and total size; refuses one that already has KV-cache scales."""
    weight_map, total = _weight_map(model_dir)
    present = [n for n in weight_map if n.endswith(SCALE_SUFFIXES)]
    if present:
        raise CheckpointError(
            f"{model_dir}: already carries KV-cache scales ({present[0]} in {weight_map[present[0]]}); "
            "export from the checkpoint without them"
        )
    return weight_map, total


def write_export(
    model_dir: Path, out: Path, layers: list[LayerExport], report: dict, copy: bool = False
) -> tuple[Path, str]:
    """Write the exported model directory atomically; returns (out, note on quantization_config)."""
    weight_map, total = source_weight_map(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    raw["quantization_config"], note = quantization_config(raw.get("quantization_config"))
    with atomic_directory(out) as tmp:
        for src in sorted(model_dir.iterdir()):
            if src.is_file() and src.name not in _REWRITTEN:
                _place(src, tmp / src.name, copy)
        tensors = {}
        for lx in layers:
            for name in scale_names(lx.layer):
                tensors[name] = torch.tensor([lx.k_scale], dtype=torch.float32)
        save_file(tensors, str(tmp / SCALES_FILE), metadata={"format": "pt", "producer": "mlaquant export"})
        weight_map.update(dict.fromkeys(tensors, SCALES_FILE))
        meta = {"total_size": total + 4 * len(tensors)}
        index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        (tmp / REPORT_FILE).write_text(json.dumps({**report, "quantization_config": note}, indent=2) + "\n")
        # mkdtemp and safetensors create owner-only modes; a served model is read by other users too
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        for name in (SCALES_FILE, "model.safetensors.index.json", "config.json", REPORT_FILE):
            (tmp / name).chmod(0o666 & ~umask)
    return out, note


def _check_out(out: Path, model_dir: Path, plan_dir: Path) -> None:
    o = out.resolve()
    for d in (model_dir.resolve(), plan_dir.resolve()):
        if o == d or d in o.parents or o in d.parents:
            raise MLAQuantError(f"--out {out} overlaps {d}; choose a new directory")
    if out.exists() and not (out / REPORT_FILE).is_file():
        raise MLAQuantError(f"--out {out} exists and is not an mlaquant export; refusing to replace it")


def measure(model, plan: Plan, scales: list[float], args: argparse.Namespace) -> dict:
    """Test-split metrics of the engine-equivalent cache (and at scale 1.0), on the plan's test samples."""
    from mlaquant.eval import sample_bytes
    from mlaquant.samples import token_samples
    from mlaquant.stream import StreamedEvaluator

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
    evaluator = StreamedEvaluator(model, tokens, batch)
    d_c, d_r = model.cfg.kv_lora_rank, model.cfg.qk_rope_head_dim
    exported = evaluator.evaluate(engine_codecs(scales, d_c, d_r)).as_dict()
    unscaled = evaluator.evaluate(engine_codecs([1.0] * len(scales), d_c, d_r)).as_dict()
    return {
        "data": str(data),
        "samples": int(tokens.shape[0]),
        "seq_len": int(seq_len),
        "exported": exported,
        "scale_1": unscaled,
    }


def plan_model_dir(plan: Plan, plan_dir: Path, model: str | None) -> Path:
    """The checkpoint directory to export: `model` (a directory or Hugging Face id), else the one the plan
    records (`settings.model`, what it was calibrated on; its fingerprint is checked by the caller)."""
    from mlaquant.loader import resolve_model_path

    if model is not None:
        return resolve_model_path(model)
    recorded = plan.settings.get("model")
    if not recorded:
        raise PlanError(f"{plan_dir}: the plan records no model it was calibrated on; pass --model")
    path = resolve_model_path(recorded)
    if not path.is_dir():
        raise CheckpointError(f"--model defaults to the model {plan_dir} was calibrated on, {path}: not found")
    return path


def export(args: argparse.Namespace) -> dict:
    """The whole command; returns the report written as mlaquant_export.json."""
    from mlaquant.stream import StreamedModel

    if args.format not in FORMATS:
        raise MLAQuantError(f"--format {args.format!r} unknown (known: {', '.join(FORMATS)})")
    plan_dir, out = Path(args.plan), Path(args.out)
    plan = Plan.load(plan_dir)
    model_dir = plan_model_dir(plan, plan_dir, args.model)
    _check_out(out, model_dir, plan_dir)
    device, dtype = device_from_args(args)
    model = StreamedModel(model_dir, dtype, device=device)
    source_weight_map(model_dir)
    try:
        plan.check_model(model)
    except PlanError as e:
        if args.model is not None:
            raise
        raise PlanError(f"--model defaults to the model {plan_dir} was calibrated on, but {e}; pass --model") from e
    d_c, d_r = model.cfg.kv_lora_rank, model.cfg.qk_rope_head_dim
    layers = engine_scales(plan, d_c, d_r, args.map_to_fp8)
    metrics = measure(model, plan, [lx.k_scale for lx in layers], args)
    budget = plan.budget if plan.budget is not None else 0.01
    loss = metrics["exported"]["loss"]
    if loss > budget and not args.force:
        raise PlanError(
            f"exported FP8 cache measures {loss:+.3%} on {metrics['exported']['tokens']} test tokens, over "
            f"the plan's budget {budget:.2%}; pass --force to export anyway"
        )
    report = {
        "format": args.format,
        "plan": str(plan_dir),
        "model": str(model_dir),
        "budget": budget,
        "scale_names": {n: list(engines) for n, engines in ENGINE_SCALE_NAMES.items()},
        "plan_test": plan.metrics.get("test"),
        "measured": metrics,
        "layers": [dataclasses.asdict(lx) for lx in layers],
        "engines": {
            "vllm": f"{ENGINE_VERSIONS['vllm']}, --kv-cache-dtype fp8: loads self_attn.k_proj.k_scale onto "
            "self_attn.mla_attn.mla_attn.k_scale; writes x / k_scale as e4m3 (c_kv and k_pe), reads × k_scale",
            "sglang": f"{ENGINE_VERSIONS['sglang']}, --kv-cache-dtype fp8_e4m3: loads self_attn.k_proj.k_scale "
            "onto self_attn.attn_mqa.k_scale; its generic MLA pool casts rows at scale 1.0 (see "
            "measured.scale_1) — only backends that fold k_scale in apply it",
        },
    }
    written, note = write_export(model_dir, out, layers, report, args.copy)
    report["out"], report["quantization_config"] = str(written), note
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, help="plan directory from `mlaquant calibrate`")
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or Hugging Face id (default: the one the plan was calibrated on)",
    )
    p.add_argument("--format", default="compressed-tensors", help="output format (compressed-tensors)")
    p.add_argument("--out", required=True, help="directory to write (a model directory for vLLM / SGLang)")
    p.add_argument("--map-to-fp8", action="store_true", help="export other codecs as fp8 (loss measured)")
    p.add_argument("--force", action="store_true", help="export even if the measured loss is over the budget")
    p.add_argument("--copy", action="store_true", help="copy weight files instead of hard/sym-linking them")
    p.add_argument("--test-data", default=None, help="text to measure on (default: the test data the plan recorded)")
    p.add_argument("--samples", type=int, default=None, help="test samples (default: the plan's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the plan's)")
    add_device_arguments(p)


def run(args: argparse.Namespace) -> int:
    report = export(args)
    m = report["measured"]
    print("| layer | plan codec | exported | k_scale | from |")
    print("|---|---|---|---|---|")
    for lx in report["layers"]:
        kind = "fp8 (mapped)" if lx["mapped"] else "fp8"
        print(f"| {lx['layer']} | {lx['plan_codec']} | {kind} | {lx['k_scale']:.6g} | {lx['source']} |")
    e, u = m["exported"], m["scale_1"]
    print(
        f"measured on {e['tokens']} test tokens: exported scales loss {e['loss']:+.3%} (KL {e['kl']:.5f}, "
        f"top-1 {e['top1']:.2%}); at scale 1.0 loss {u['loss']:+.3%}"
    )
    print(f"{report['quantization_config']}")
    print(f"exported to {report['out']} (serve with --kv-cache-dtype fp8; see docs/serving.md)")
    return 0
