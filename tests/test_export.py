"""`mlaquant export --format compressed-tensors`: tensor names, shapes, dtypes, scale values, config JSON.

Pinned from the engines (compressed-tensors 0.20 and vLLM's CompressedTensorsKVCacheMethod):
- `quantization_config.kv_cache_scheme` = {num_bits: 8, type: float, strategy: tensor, symmetric: true,
  dynamic: false}; vLLM refuses any other type/num_bits, a strategy other than "tensor", or asymmetric.
- per-layer scales float32 of shape (1,) (what compressed-tensors registers for the tensor strategy;
  engines fill their scalar from it) under the names the engines' DeepSeek loaders map onto MLA attention
  (`self_attn.k_proj.k_scale` / `v_proj.v_scale`, vLLM 0.33.0 and SGLang 0.5.23, restated below) and
  compressed-tensors' own `self_attn.k_scale` / `v_scale`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mlaquant import export as export_module
from mlaquant.calib.calibrate import CalibrateConfig, calibrate
from mlaquant.calib.data import split_path
from mlaquant.cli import main
from mlaquant.codecs import FP8_MAX, fp8_static_scale
from mlaquant.errors import CheckpointError, MLAQuantError, PlanError
from mlaquant.eval import Evaluator
from mlaquant.export import ENGINE_SCALE_NAMES, ENGINE_VERSIONS, KV_CACHE_SCHEME, engine_codecs, quantization_config
from mlaquant.loader import load_model
from mlaquant.plan import LayerPlan, Plan
from mlaquant.samples import token_samples
from mlaquant.stream import StreamedEvaluator, StreamedModel

D_C, D_R = 32, 8  # kv_lora_rank, rope_dim of conftest.SYNTH_DIMS


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, synthetic) -> Path:
    return synthetic(tmp_path_factory.mktemp("synth") / "m", 3, shards=2)


@pytest.fixture(scope="module")
def fp8_plan(ckpt, tmp_path_factory) -> Path:
    """A calibrated all-fp8 plan (generous budget, so no layer falls back to FP16)."""
    cfg = CalibrateConfig(
        samples=6, seq_len=32, val_samples=3, test_samples=3, batch_size=3, budget=0.5, long_test_samples=0,
        candidates=("fp8/fp8", "fp16/fp16"), try_rotation=False,
    )  # fmt: skip
    plan, _ = calibrate(load_model(ckpt), cfg, quiet=True)
    assert all(lp.codec_name == "fp8/fp8" for lp in plan.layers)
    return plan.save(tmp_path_factory.mktemp("plans") / "fp8")


def _export(plan: Path, model: Path, out: Path, *flags: str) -> int:
    return main(["export", "--plan", str(plan), "--model", str(model), "--out", str(out), *flags])


def _variant(plan_dir: Path, tmp_path: Path, name: str, **changes) -> Path:
    """The plan with some layers changed (layer index → LayerPlan) or other fields replaced."""
    plan = Plan.load(plan_dir)
    for i, lp in changes.pop("layers", {}).items():
        plan.layers[i] = lp
    return (dataclasses.replace(plan, **changes) if changes else plan).save(tmp_path / name)


def _test_tokens(tokenizer, settings: dict) -> torch.Tensor:
    """The test samples calibration reported on (and export measures on)."""
    s = settings
    return token_samples(tokenizer, split_path("test"), s["test_samples"], s["seq_len"], s["seed"] + 2, 256)


ENGINE_NAMES = ["k_proj.k_scale", "v_proj.v_scale"]  # under model.layers.{i}.self_attn.
CT_NAMES = ["k_scale", "v_scale"]  # compressed-tensors' own


def vllm_remap(name: str, params: set[str]) -> str | None:
    """vLLM 0.33.0 for a DeepSeek MLA checkpoint: AutoWeightsLoader strips `model.`, then
    DeepseekV2Model.load_weights → maybe_remap_kv_scale_name (weight_utils.py), restated for the patterns
    a `self_attn.*scale` name can meet (`mla_attn` is in the parameter names, so attn_str is
    "mla_attn.mla_attn" in the ModelOpt pattern only). None: dropped with a warning."""
    import re

    name = name.removeprefix("model.")
    if name in params:
        return name
    if name.endswith(".kv_scale"):
        remapped = name.replace(".kv_scale", ".attn.k_scale")
        return remapped if remapped in params else None
    for pattern, repl in (
        (r"\.self_attn\.([kv])_proj\.([kv])_scale$", r".self_attn.mla_attn.mla_attn.\2_scale"),
        (r"\.self_attn\.qkv_proj\.([kv])_scale$", r".self_attn.attn.\1_scale"),
        (r"\.([qkv])_scale$", r".attn.\1_scale"),
    ):
        if re.search(pattern, name):
            remapped = re.sub(pattern, repl, name)
            return remapped if remapped in params else None
    return name


def sglang_remap(name: str, params: set[str]) -> str | None:
    """SGLang 0.5.23, DeepseekV2WeightLoaderMixin.do_load_weights (deepseek_common/deepseek_weight_loader.py):
    a k/v scale name not among the parameters has `{k,v}_proj` replaced by `attn_mqa`; still unknown → dropped."""
    if ("k_scale" in name or "v_scale" in name) and name not in params:
        scale = "k_scale" if "k_scale" in name else "v_scale"
        name = name.replace(f"{scale[0]}_proj", "attn_mqa")
    return name if name in params else None


def test_scale_names_load_onto_mla_attention_in_vllm_and_sglang():
    """Each exported name, through each engine's DeepSeek loader, lands on that layer's MLA attention scale
    (vLLM: MLAAttention at self_attn.mla_attn.mla_attn; SGLang: RadixAttention attn_mqa) — or is dropped
    where ENGINE_SCALE_NAMES says no engine reads it."""
    assert ENGINE_VERSIONS == {"vllm": "0.33.0", "sglang": "0.5.23"}
    layer = 7
    vllm_params = {f"layers.{layer}.self_attn.mla_attn.mla_attn.{x}_scale" for x in "qkv"}
    sglang_params = {f"model.layers.{layer}.self_attn.{a}.{x}_scale" for a in ("attn_mqa", "attn_mha") for x in "kv"}
    expected = {
        "vllm": lambda x: f"layers.{layer}.self_attn.mla_attn.mla_attn.{x}_scale",
        "sglang": lambda x: f"model.layers.{layer}.self_attn.attn_mqa.{x}_scale",
    }
    remaps = {"vllm": (vllm_remap, vllm_params), "sglang": (sglang_remap, sglang_params)}
    loaded = {"vllm": set(), "sglang": set()}
    for template, engines in ENGINE_SCALE_NAMES.items():
        name = template.format(i=layer)
        kind = name[-7]  # "k" or "v" of {k,v}_scale
        for engine, (remap, params) in remaps.items():
            target = remap(name, params)
            if engine in engines:
                assert target == expected[engine](kind), (engine, name, target)
                loaded[engine].add(kind)
            else:
                assert target is None, (engine, name, target)
    assert loaded == {"vllm": {"k", "v"}, "sglang": {"k", "v"}}  # both scales reach both engines
    assert [n.format(i=layer) for n in ENGINE_SCALE_NAMES] == export_module.scale_names(layer)
    assert set(export_module.scale_names(layer)) == {
        f"model.layers.{layer}.self_attn.{x}" for x in ENGINE_NAMES + CT_NAMES
    }


def vllm_accepts(scheme: dict) -> bool:
    """vLLM's CompressedTensorsKVCacheMethod.validate_kv_cache_scheme, restated."""
    return (
        scheme.get("type") == "float"
        and scheme.get("num_bits") == 8
        and scheme.get("strategy") == "tensor"
        and scheme.get("symmetric") is True
    )


def test_export_round_trip(ckpt, fp8_plan, tmp_path, capsys):
    out = tmp_path / "served"
    assert _export(fp8_plan, ckpt, out) == 0
    assert "exported to" in capsys.readouterr().out
    plan = Plan.load(fp8_plan)
    n, d_c, d_r = len(plan.layers), D_C, D_R

    # scale tensors: names, shapes, dtypes, values = absmax of the calibrated latent range / 448
    scales = []
    with safe_open(out / "kv_cache_scales.safetensors", "pt") as f:
        names = set(f.keys())
        assert names == {f"model.layers.{i}.self_attn.{name}" for i in range(n) for name in ENGINE_NAMES + CT_NAMES}
        for i, lp in enumerate(plan.layers):
            k, *others = (f.get_tensor(f"model.layers.{i}.self_attn.{x}") for x in ENGINE_NAMES + CT_NAMES)
            assert k.dtype == torch.float32 and k.shape == (1,) and all(torch.equal(k, o) for o in others)
            key = "clip" if lp.clip else "range"  # the range the plan calibrated: clip bounds, else min/max
            lo, hi = plan.tensors[f"layer{i}.{key}_lo"], plan.tensors[f"layer{i}.{key}_hi"]
            absmax = torch.maximum(lo.abs(), hi.abs()).max()  # over c_kv AND k_pe
            assert k.item() == (absmax / FP8_MAX).item() == fp8_static_scale(lo, hi)
            if lp.clip:  # exactly the scale of the plan's own fp8 codec
                assert k.item() == plan.layer_codec(i, d_c, d_r).ckv.fp8_scale
            scales.append(k.item())

    # config.json: the compressed-tensors quantization_config vLLM / SGLang read
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["kv_cache_scheme"] == KV_CACHE_SCHEME
    assert vllm_accepts(qc["kv_cache_scheme"])
    src_cfg = json.loads((ckpt / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == src_cfg

    # index: every source tensor still mapped to its shard, plus the scales; shards linked, not rewritten
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    src = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == {**src, **dict.fromkeys(names, "kv_cache_scales.safetensors")}
    for shard in set(src.values()):
        assert os.path.samefile(out / shard, ckpt / shard)
    assert (out / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    assert load_model(out).fingerprint() == load_model(ckpt).fingerprint()

    # the accuracy measured before export: the engine-equivalent cache on the plan's test samples,
    # equal to the full-load evaluator's number for the same codecs
    report = json.loads((out / "mlaquant_export.json").read_text())
    s = plan.settings
    full = load_model(ckpt)
    tokens = _test_tokens(full.tokenizer, s)
    evaluator = Evaluator(full, tokens, s["batch_size"])
    assert report["measured"]["exported"] == evaluator.evaluate(engine_codecs(scales, d_c, d_r)).as_dict()
    assert report["measured"]["scale_1"] == evaluator.evaluate(engine_codecs([1.0] * n, d_c, d_r)).as_dict()
    if all(lp.clip for lp in plan.layers):
        assert report["measured"]["exported"] == plan.metrics["test"]
    assert not any(lx["mapped"] for lx in report["layers"])


def test_config_validates_with_compressed_tensors():
    ct = pytest.importorskip("compressed_tensors.quantization")
    qc, _ = quantization_config(None)
    parsed = ct.QuantizationConfig.model_validate(qc)
    kv = parsed.kv_cache_scheme
    assert (kv.num_bits, kv.type, kv.strategy) == (8, "float", "tensor") and kv.symmetric and not kv.dynamic
    assert parsed.config_groups == {} and parsed.quant_method == "compressed-tensors"


def test_existing_quantization_configs_are_merged_or_kept():
    ct_cfg = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"targets": ["Linear"]}}}
    merged, _ = quantization_config(ct_cfg)
    assert merged["config_groups"] == ct_cfg["config_groups"] and merged["kv_cache_scheme"] == KV_CACHE_SCHEME
    official = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    kept, note = quantization_config(official)
    assert kept == official and "kept quantization_config" in note


def test_integer_layers_refused_by_name_or_mapped_with_measured_loss(ckpt, fp8_plan, tmp_path, capsys):
    mixed = _variant(
        fp8_plan, tmp_path, "mixed",
        layers={0: LayerPlan("int4-g32", "int4-g32"), 2: LayerPlan("int8-g64", "int8-g32", clip=True)},
    )  # fmt: skip
    assert _export(mixed, ckpt, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--map-to-fp8" in err
    assert "layers 0, 2 use int4-g32/int4-g32, int8-g64/int8-g32" in err
    assert not (tmp_path / "out").exists()

    assert _export(mixed, ckpt, tmp_path / "out", "--map-to-fp8") == 0
    report = json.loads((tmp_path / "out/mlaquant_export.json").read_text())
    plan = Plan.load(mixed)
    scales = []
    for lx in report["layers"]:
        i = lx["layer"]
        key = "clip" if plan.layers[i].clip else "range"
        assert lx["mapped"] == (i in (0, 2))
        assert lx["k_scale"] == fp8_static_scale(*(plan.tensors[f"layer{i}.{key}_{b}"] for b in ("lo", "hi")))
        scales.append(lx["k_scale"])
    # the reported loss is the engine-equivalent cache (fp8, these scales) measured on the test split
    model = StreamedModel(ckpt)
    s = plan.settings
    tokens = _test_tokens(model.tokenizer, s)
    want = StreamedEvaluator(model, tokens, s["batch_size"]).evaluate(engine_codecs(scales, 32, 8)).as_dict()
    assert report["measured"]["exported"] == want


@pytest.mark.parametrize("part", ["rotate", "rotate_rope"])
def test_rotated_layers_refused(ckpt, fp8_plan, tmp_path, part):
    plan = Plan.load(fp8_plan)
    setattr(plan.layers[1], part, True)
    plan.tensors["layer1.rotation_signs"] = torch.ones(D_C)
    plan.tensors["layer1.rope_rotation_signs"] = torch.ones(D_R)
    rotated = plan.save(tmp_path / "rot")
    with pytest.raises(PlanError, match="layers 1 cache a Hadamard-rotated latent"):
        _run_export(rotated, ckpt, tmp_path / "o", map_to_fp8=True)


def _run_export(plan, model, out, **flags):
    from argparse import Namespace

    from mlaquant.export import export

    args = dict(format="compressed-tensors", map_to_fp8=False, force=False, copy=False, test_data=None)
    paths = dict(plan=str(plan), model=str(model), out=str(out))
    return export(Namespace(**paths, samples=None, seq_len=None, **{**args, **flags}))


def test_export_over_budget_is_refused_unless_forced(ckpt, fp8_plan, tmp_path, monkeypatch):
    # random weights make perplexity meaningless (destroying attention can lower it), so the
    # measurement is replaced: the decision on its number is what is tested here
    measured = {"loss": 0.05, "kl": 0.1, "top1": 0.5, "tokens": 93}
    monkeypatch.setattr(export_module, "measure", lambda *a: {"exported": measured, "scale_1": measured})
    tight = _variant(fp8_plan, tmp_path, "tight", budget=0.01)
    with pytest.raises(PlanError, match=r"measures \+5.000% on 93 test tokens, over the plan's budget 1.00%"):
        _run_export(tight, ckpt, tmp_path / "o")
    assert not (tmp_path / "o").exists()
    assert _run_export(tight, ckpt, tmp_path / "o", force=True)["measured"]["exported"] == measured


def test_plan_model_mismatch_and_bad_outputs(ckpt, fp8_plan, tmp_path, synthetic):
    other = synthetic(tmp_path / "other", 3, shards=2, seed=1)
    with pytest.raises(PlanError, match="calibrated for another model"):
        _run_export(fp8_plan, other, tmp_path / "o")
    deeper = synthetic(tmp_path / "deeper", 4, shards=2)
    with pytest.raises(PlanError, match="plan has 3 layers, model has 4"):
        _run_export(fp8_plan, deeper, tmp_path / "o")
    with pytest.raises(MLAQuantError, match="overlaps"):
        _run_export(fp8_plan, ckpt, ckpt / "inside")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken/precious.txt").write_text("x")
    with pytest.raises(MLAQuantError, match="not an mlaquant export"):
        _run_export(fp8_plan, ckpt, tmp_path / "taken")
    _run_export(fp8_plan, ckpt, tmp_path / "o")
    with pytest.raises(CheckpointError, match="already carries KV-cache scales"):
        _run_export(fp8_plan, tmp_path / "o", tmp_path / "o2")
    broken = tmp_path / "o"
    (broken / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        _run_export(fp8_plan, broken, tmp_path / "o3")


def test_measures_on_the_recorded_test_data_or_asks_for_test_data(ckpt, fp8_plan, tmp_path, capsys):
    plan = Plan.load(fp8_plan)
    assert plan.settings["test_data"] == str(split_path("test"))  # what export measures on by default
    bare = _variant(fp8_plan, tmp_path, "bare", settings={k: v for k, v in plan.settings.items() if k != "test_data"})
    assert _export(bare, ckpt, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "records no test data; pass --test-data PATH" in err
    assert not (tmp_path / "out").exists()

    assert _export(bare, ckpt, tmp_path / "out", "--test-data", str(split_path("test"))) == 0
    report = json.loads((tmp_path / "out/mlaquant_export.json").read_text())
    assert report["measured"]["data"] == str(split_path("test"))


def test_model_defaults_to_the_plans_own_when_its_fingerprint_matches(ckpt, fp8_plan, tmp_path, synthetic, capsys):
    plan = Plan.load(fp8_plan)
    assert plan.settings["model"] == str(ckpt)
    assert main(["export", "--plan", str(fp8_plan), "--out", str(tmp_path / "served")]) == 0
    report = json.loads((tmp_path / "served" / "mlaquant_export.json").read_text())
    assert report["model"] == str(ckpt)
    assert os.path.samefile(
        tmp_path / "served" / "model-00001-of-00002.safetensors", ckpt / "model-00001-of-00002.safetensors"
    )
    capsys.readouterr()

    other = synthetic(tmp_path / "other", 3, shards=2, seed=1)  # same shapes, other weights
    cases = {
        str(other): r"--model defaults to the model .* was calibrated on, but plan fingerprint \w+ does not match",
        str(tmp_path / "gone"): r"--model defaults to the model .* was calibrated on, .*gone: not found",
        "": "the plan records no model it was calibrated on; pass --model",
    }
    for recorded, message in cases.items():
        variant = _variant(fp8_plan, tmp_path, f"v{len(recorded)}", settings={**plan.settings, "model": recorded})
        assert main(["export", "--plan", str(variant), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and re.search(message, err), err
        assert not (tmp_path / "o").exists()
