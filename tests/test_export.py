"""`mlaquant export --engine vllm|sglang`: the layer mapping, the serving command, the measured loss, the files.

What the engines do with KV scales is established by executing their code (tests/test_engines.py); these
tests check that the exporter acts on it: no scale tensors, config.json untouched, fp8 at k_scale 1.0 measured
with the engines' own `e4m3` codec, vLLM's skip layers for the plan's float layers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import torch

from mlaquant.calib.calibrate import CalibrateConfig, calibrate
from mlaquant.calib.data import split_path
from mlaquant.cli import main
from mlaquant.errors import MLAQuantError, PlanError
from mlaquant.evaluation.eval import Evaluator
from mlaquant.evaluation.samples import token_samples
from mlaquant.integrations import export as export_module
from mlaquant.integrations.engines import ENGINE_VERSIONS, sglang_serve_command, vllm_serve_command
from mlaquant.integrations.export import engine_plan
from mlaquant.modeling.loader import load_model
from mlaquant.modeling.stream import StreamedModel
from mlaquant.runtime.plan import LayerPlan, Plan

D_C, D_R = 32, 8  # kv_lora_rank, rope_dim of conftest.SYNTH_DIMS


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, synthetic) -> Path:
    return synthetic(tmp_path_factory.mktemp("synth") / "m", 3, shards=2)


@pytest.fixture(scope="module")
def fp8_plan(ckpt, tmp_path_factory) -> Path:
    """A plan calibrated with the engines' own fp8 (generous budget, so no layer falls back to FP16)."""
    cfg = CalibrateConfig(
        samples=6, seq_len=32, val_samples=3, test_samples=3, batch_size=3, budget=0.5, long_test_samples=0,
        shift_samples=0, shift_long_samples=0, shift_val_samples=0,
        candidates=("e4m3/e4m3", "fp16/fp16"), try_rotation=False, try_clip=False,
    )  # fmt: skip
    plan, _ = calibrate(load_model(ckpt), cfg, quiet=True)
    assert all(lp.codec_name == "e4m3/e4m3" for lp in plan.layers)
    return plan.save(tmp_path_factory.mktemp("plans") / "fp8")


def _export(plan: Path, model: Path, out: Path, *flags: str, engine: str = "vllm") -> int:
    return main(["export", "--plan", str(plan), "--model", str(model), "--out", str(out), "--engine", engine, *flags])


def _variant(plan_dir: Path, tmp_path: Path, name: str, **changes) -> Path:
    """The plan with some layers changed (layer index → LayerPlan) or other fields replaced."""
    plan = Plan.load(plan_dir)
    for i, lp in changes.pop("layers", {}).items():
        plan.layers[i] = lp
    return (dataclasses.replace(plan, **changes) if changes else plan).save(tmp_path / name)


def _measured(ckpt: Path, plan_dir: Path, cached: Plan) -> dict:
    """What the exporter should report: `cached` on the plan's test samples, streamed."""
    plan = Plan.load(plan_dir)
    s = plan.settings
    model = StreamedModel(ckpt)
    tokens = token_samples(model.tokenizer, split_path("test"), s["test_samples"], s["seq_len"], s["seed"] + 2, 256)
    return Evaluator(model, tokens, s["batch_size"]).evaluate(cached.bind(model.cfg).layer_codecs()).as_dict()


def test_vllm_export_links_the_model_writes_no_scales_and_the_command(ckpt, fp8_plan, tmp_path, capsys):
    out = tmp_path / "served"
    assert _export(fp8_plan, ckpt, out) == 0
    printed = capsys.readouterr().out
    assert f"serve: vllm serve {out} --kv-cache-dtype fp8" in printed
    # the model, unchanged: weights linked, every other file copied, no scale tensors, config.json as it was
    src = sorted(p.name for p in ckpt.iterdir() if p.is_file())
    assert sorted(p.name for p in out.iterdir()) == sorted([*src, "mlaquant_export.json", "serve.sh"])
    for shard in ckpt.glob("*.safetensors"):
        assert os.path.samefile(out / shard.name, shard)
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (ckpt / name).read_bytes()
    assert load_model(out).fingerprint() == load_model(ckpt).fingerprint()
    report = json.loads((out / "mlaquant_export.json").read_text())
    assert (report["engine"], report["engine_version"]) == ("vllm", ENGINE_VERSIONS["vllm"])
    assert report["serve"] == vllm_serve_command(str(out), []) and report["skip_layers"] == []
    assert [lx["engine"] for lx in report["layers"]] == ["fp8"] * 3 and not any(lx["mapped"] for lx in report["layers"])
    # measured: the engine's cache (e4m3 at k_scale 1.0) on the plan's test samples, = the plan's own test number
    every = Plan.uniform("e4m3/e4m3", 3)
    assert report["measured"]["engine"] == _measured(ckpt, fp8_plan, every) == report["measured"]["every_layer_fp8"]
    assert report["measured"]["engine"]["loss"] == pytest.approx(Plan.load(fp8_plan).metrics["test"]["loss"], abs=1e-7)
    serve = (out / "serve.sh").read_text()
    assert os.access(out / "serve.sh", os.X_OK) and f'exec {report["serve"]} "$@"' in serve


def test_float_layers_become_vllm_skip_layers_and_sglang_needs_force(ckpt, fp8_plan, tmp_path, capsys):
    mixed = _variant(fp8_plan, tmp_path, "mixed", layers={1: LayerPlan("fp16", "fp16")})
    assert _export(mixed, ckpt, tmp_path / "v") == 0
    report = json.loads((tmp_path / "v/mlaquant_export.json").read_text())
    assert report["skip_layers"] == [1]
    assert report["serve"] == vllm_serve_command(str(tmp_path / "v"), [1]).strip()
    assert report["serve"].endswith("--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 1")
    cached = Plan(layers=[LayerPlan("e4m3", "e4m3"), LayerPlan("fp16", "fp16"), LayerPlan("e4m3", "e4m3")])
    assert report["measured"]["engine"] == _measured(ckpt, mixed, cached)
    capsys.readouterr()

    assert _export(mixed, ckpt, tmp_path / "s", engine="sglang") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "layers 1 stay in a float cache" in err and "no per-layer KV dtype" in err
    assert not (tmp_path / "s").exists()
    assert _export(mixed, ckpt, tmp_path / "s", "--force", engine="sglang") == 0
    report = json.loads((tmp_path / "s/mlaquant_export.json").read_text())
    assert report["serve"] == sglang_serve_command(str(tmp_path / "s")) and report["skip_layers"] == []
    assert [lx["mapped"] for lx in report["layers"]] == [False, True, False]
    assert report["measured"]["engine"] == report["measured"]["every_layer_fp8"]


def test_other_codecs_are_refused_by_name_or_mapped(ckpt, fp8_plan, tmp_path, capsys):
    plan = Plan.load(fp8_plan)
    plan.layers[0], plan.layers[2] = LayerPlan("int4-g32", "int4-g32"), LayerPlan("fp8", "fp8", rotate=True)
    plan.tensors["layer2.rotation_signs"] = torch.ones(D_C)
    mixed = plan.save(tmp_path / "mixed")
    assert _export(mixed, ckpt, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--map-to-fp8" in err
    assert "layers 0, 2 use fp8/fp8 (rotated), int4-g32/int4-g32" in err
    assert not (tmp_path / "out").exists()
    assert _export(mixed, ckpt, tmp_path / "out", "--map-to-fp8") == 0
    report = json.loads((tmp_path / "out/mlaquant_export.json").read_text())
    assert [lx["mapped"] for lx in report["layers"]] == [True, False, True]
    assert report["measured"]["engine"] == _measured(ckpt, mixed, Plan.uniform("e4m3/e4m3", 3))


def test_a_calibrated_fp8_scale_is_exported_as_k_scale_one(ckpt, fp8_plan, tmp_path):
    """A static fp8 layer with a calibrated scale: the engine cannot apply it (tests/test_engines.py), so the
    export maps it to e4m3 at k_scale 1.0 and measures that."""
    static = _variant(fp8_plan, tmp_path, "static", layers={0: LayerPlan("fp8", "fp8")})
    report = _run_export(static, ckpt, tmp_path / "o")
    assert report["layers"][0]["mapped"] and "cannot reach the engine" in report["layers"][0]["why"]
    assert engine_plan(Plan.load(static), [export_module.LayerExport(i, "", "fp8", True, "") for i in range(3)]
                       ).layers[0].codec_name == "e4m3/e4m3"


@pytest.mark.parametrize("engine", ["tgi", ""])
def test_unknown_engine_and_all_float_plan_are_one_line(ckpt, fp8_plan, tmp_path, capsys, engine):
    assert _export(fp8_plan, ckpt, tmp_path / "o", engine=engine) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--engine {engine!r} unknown (known: vllm, sglang)" in err
    fp16 = _variant(fp8_plan, tmp_path, "fp16", layers={i: LayerPlan("fp16", "fp16") for i in range(3)})
    assert _export(fp16, ckpt, tmp_path / "o") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "nothing to export as fp8" in err
    assert not (tmp_path / "o").exists()


def _run_export(plan, model, out, **flags):
    from argparse import Namespace

    from mlaquant.integrations.export import export

    args = dict(engine="vllm", map_to_fp8=False, force=False, copy=False, test_data=None, device="auto", dtype="auto")
    paths = dict(plan=str(plan), model=str(model), out=str(out))
    return export(Namespace(**paths, samples=None, seq_len=None, **{**args, **flags}))


def test_export_over_budget_is_refused_unless_forced(ckpt, fp8_plan, tmp_path, monkeypatch):
    # random weights make perplexity meaningless (destroying attention can lower it), so the
    # measurement is replaced: the decision on its number is what is tested here
    measured = {"loss": 0.05, "kl": 0.1, "top1": 0.5, "tokens": 93}
    monkeypatch.setattr(export_module, "measure", lambda *a: {"engine": measured, "every_layer_fp8": measured})
    tight = _variant(fp8_plan, tmp_path, "tight", budget=0.01)
    with pytest.raises(PlanError, match=r"measures \+5.000% on 93 test tokens, over the plan's budget 1.00%"):
        _run_export(tight, ckpt, tmp_path / "o")
    assert not (tmp_path / "o").exists()
    assert _run_export(tight, ckpt, tmp_path / "o", force=True)["measured"]["engine"] == measured


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
    _run_export(fp8_plan, ckpt, tmp_path / "o")  # an earlier export is replaced
    assert json.loads((tmp_path / "o/mlaquant_export.json").read_text())["engine"] == "vllm"


def test_measures_on_the_recorded_test_data_or_asks_for_test_data(ckpt, fp8_plan, tmp_path, capsys):
    plan = Plan.load(fp8_plan)
    assert plan.settings["test_data"] == str(split_path("test"))  # what export measures on by default
    bare = _variant(fp8_plan, tmp_path, "bare", settings={k: v for k, v in plan.settings.items() if k != "test_data"})
    assert _export(bare, ckpt, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "records no test data; pass --test-data PATH" in err
    assert not (tmp_path / "out").exists()
    assert _export(bare, ckpt, tmp_path / "out", "--test-data", str(split_path("test")), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["measured"]["data"] == str(split_path("test"))
    assert report == json.loads((tmp_path / "out/mlaquant_export.json").read_text()) | {"out": report["out"]}


def test_model_defaults_to_the_plans_own_when_its_fingerprint_matches(ckpt, fp8_plan, tmp_path, synthetic, capsys):
    plan = Plan.load(fp8_plan)
    assert plan.settings["model"] == str(ckpt)
    assert main(["export", "--plan", str(fp8_plan), "--engine", "vllm", "--out", str(tmp_path / "served")]) == 0
    report = json.loads((tmp_path / "served" / "mlaquant_export.json").read_text())
    assert report["model"] == str(ckpt)
    capsys.readouterr()
    other = synthetic(tmp_path / "other", 3, shards=2, seed=1)  # same shapes, other weights
    cases = {
        str(other): r"--model defaults to the model .* was calibrated on, but plan fingerprint \w+ does not match",
        str(tmp_path / "gone"): r"--model defaults to the model .* was calibrated on, .*gone: not found",
        "": "the plan records no model it was calibrated on; pass --model",
    }
    for recorded, message in cases.items():
        variant = _variant(fp8_plan, tmp_path, f"v{len(recorded)}", settings={**plan.settings, "model": recorded})
        assert main(["export", "--plan", str(variant), "--engine", "vllm", "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and re.search(message, err), err
        assert not (tmp_path / "o").exists()


def test_e4m3_is_the_unit_scale_fp8_of_the_engines():
    """The engines' fp8 at k_scale 1.0 is mlaquant's static fp8 with scale 1.0 (and unlike a calibrated one)."""
    from mlaquant.quant.codecs import LayerCodec

    x = torch.randn(64, D_C + D_R) * 3
    unit = LayerCodec.from_names("fp8", "fp8", D_C, D_R, fp8_scale=1.0)
    assert torch.equal(LayerCodec.from_names("e4m3", "e4m3", D_C, D_R).encode(x), unit.encode(x))


def test_window_clip_and_w8a8_are_refused_by_name_or_dropped_and_recorded(ckpt, fp8_plan, tmp_path, capsys):
    """No engine runs a residual FP16 window, clipped ranges or W8A8 projections: refused by name, or with
    --map-to-fp8 exported without them, the layer counted as mapped and the dropped window recorded."""
    windowed = _variant(fp8_plan, tmp_path, "windowed", window=64)
    assert _export(windowed, ckpt, tmp_path / "o") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "last 64 rows of every layer in FP16 (a residual window)" in err
    assert "--map-to-fp8" in err
    assert not (tmp_path / "o").exists()
    assert _export(windowed, ckpt, tmp_path / "o", "--map-to-fp8") == 0
    assert json.loads((tmp_path / "o/mlaquant_export.json").read_text())["dropped"] == {"window": 64}

    extra = _variant(fp8_plan, tmp_path, "extra", layers={1: LayerPlan("e4m3", "e4m3", int8_matmul=True),
                                                          2: LayerPlan("e4m3", "e4m3", clip=True)})
    assert _export(extra, ckpt, tmp_path / "x") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "layer 1: W8A8 projections (int8_matmul); layer 2: clipped ranges" in err
    assert _export(extra, ckpt, tmp_path / "x", "--map-to-fp8") == 0
    layers = json.loads((tmp_path / "x/mlaquant_export.json").read_text())["layers"]
    assert [lx["mapped"] for lx in layers] == [False, True, True]
    assert "W8A8 projections (int8_matmul) dropped" in layers[1]["why"] and "clipped ranges dropped" in layers[2]["why"]


def test_checkpoint_kv_scales_are_found_and_refused_for_sglang(ckpt, fp8_plan, tmp_path, monkeypatch, capsys):
    index = {"weight_map": {"model.layers.0.self_attn.k_proj.k_scale": "a.safetensors",
                            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": "a.safetensors"}}
    (tmp_path / "src").mkdir()
    (tmp_path / "src/model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "src/a.safetensors").touch()  # the shard the index names (only the index is read)
    assert export_module.checkpoint_kv_scales(tmp_path / "src") == ["model.layers.0.self_attn.k_proj.k_scale"]
    assert export_module.checkpoint_kv_scales(ckpt) == []
    monkeypatch.setattr(export_module, "checkpoint_kv_scales", lambda d: ["model.layers.0.self_attn.k_proj.k_scale"])
    assert _export(fp8_plan, ckpt, tmp_path / "s", engine="sglang") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds 1 KV-cache scale tensors (e.g. model.layers.0.self_attn.k_proj.k_scale)" in err
    assert not (tmp_path / "s").exists()
    assert _export(fp8_plan, ckpt, tmp_path / "v") == 0  # vLLM drops them (tests/test_engines.py): recorded
    report = json.loads((tmp_path / "v/mlaquant_export.json").read_text())
    assert report["checkpoint_kv_scales"] == ["model.layers.0.self_attn.k_proj.k_scale"]


def test_serve_command_names_the_export_by_absolute_path(ckpt, fp8_plan, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _export(fp8_plan, ckpt, Path("relative")) == 0
    report = json.loads((tmp_path / "relative/mlaquant_export.json").read_text())
    assert report["serve"] == vllm_serve_command(str((tmp_path / "relative").resolve()), [])
