"""Plans: uniform names, save/load round trip, refusal of foreign or corrupt plans."""

from __future__ import annotations

import pytest
import torch

from mlaquant import DecodeSession
from mlaquant.errors import PlanError
from mlaquant.runtime.plan import LayerPlan, Plan


def make_plan(model) -> Plan:
    d = model.cfg.kv_lora_rank + model.cfg.qk_rope_head_dim
    n = model.cfg.num_hidden_layers
    layers = [LayerPlan("int4-g16", "int8-row", clip=True, loss=0.001, max_rel_error=0.2)] * n
    tensors = {}
    for i in range(n):
        tensors[f"layer{i}.clip_lo"] = -torch.rand(d) - 1
        tensors[f"layer{i}.clip_hi"] = torch.rand(d) + 1
    return Plan(layers=layers, fingerprint=model.fingerprint(), budget=0.01, tensors=tensors)


def test_round_trip_gives_identical_codecs(tiny_model, tmp_path):
    plan = make_plan(tiny_model)
    plan.save(tmp_path / "p")
    loaded = Plan.load(tmp_path / "p")
    assert loaded.layers == plan.layers and loaded.fingerprint == plan.fingerprint
    rows = torch.randn(9, tiny_model.cfg.latent_dim) * 3
    for a, b in zip(plan.bind(tiny_model.cfg).layer_codecs(), loaded.bind(tiny_model.cfg).layer_codecs()):
        assert torch.equal(a.encode(rows), b.encode(rows))
    assert DecodeSession(tiny_model, plan=tmp_path / "p").codecs[0].name == "int4-g16/int8-row"
    # saving again over an existing plan replaces it atomically and leaves no temp dirs
    plan.save(tmp_path / "p")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]


def test_a_plan_reads_codecs_once_bound_and_the_binding_is_not_saved(tiny_model, tmp_path):
    plan = make_plan(tiny_model)
    with pytest.raises(PlanError, match=r"not bound .*plan.bind\(model.cfg\)"):
        plan.layer_codecs()
    plan.save(tmp_path / "unbound")
    plan.bind(tiny_model.cfg).save(tmp_path / "bound")
    for name in ("plan.yaml", "scales.safetensors"):
        assert (tmp_path / "bound" / name).read_bytes() == (tmp_path / "unbound" / name).read_bytes()
    assert Plan.load(tmp_path / "bound").latent_widths is None
    assert DecodeSession(tiny_model, plan="int4").plan.latent_widths == tiny_model.cfg.latent_widths


def test_plan_from_another_model_is_refused(tiny_model, tmp_path):
    plan = make_plan(tiny_model)
    plan.fingerprint = "0" * 64
    plan.save(tmp_path / "p")
    with pytest.raises(PlanError, match="calibrated for another model"):
        DecodeSession(tiny_model, plan=tmp_path / "p")


def test_fingerprint_sees_a_modified_weight(tiny_model):
    before = tiny_model.fingerprint()
    w = tiny_model.layers[1].self_attn.kv_a_layernorm.weight
    with torch.no_grad():
        w[3] += 1.0
        after = tiny_model.fingerprint()
        w[3] -= 1.0
    assert before != after and tiny_model.fingerprint() == before


def test_corrupt_plan_files(tiny_model, tmp_path):
    make_plan(tiny_model).save(tmp_path / "p")
    (tmp_path / "p" / "plan.yaml").write_text("layers: [unclosed")
    with pytest.raises(PlanError, match="plan.yaml: corrupt plan"):
        Plan.load(tmp_path / "p")
    make_plan(tiny_model).save(tmp_path / "q")
    (tmp_path / "q" / "scales.safetensors").write_bytes(b"garbage")
    with pytest.raises(PlanError, match="scales.safetensors: corrupt scales file"):
        Plan.load(tmp_path / "q")
    make_plan(tiny_model).save(tmp_path / "r")
    text = (tmp_path / "r" / "plan.yaml").read_text().replace("ckv: int4-g16", "ckv: int5", 1)
    (tmp_path / "r" / "plan.yaml").write_text(text)
    with pytest.raises(PlanError, match="int5"):
        Plan.load(tmp_path / "r")


def test_unknown_plan_name(tiny_model):
    with pytest.raises(PlanError, match="neither a plan directory nor codec names"):
        DecodeSession(tiny_model, plan="int3")
