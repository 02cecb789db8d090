"""Latent rotations: c_kv·R_c folded into W_UK/W_UV, k_pe·R_r and q_pe·R_r after RoPE — same function,
different cached rows; plans carry them through save/load, decode and the plan search."""

from __future__ import annotations

import pytest
import torch

from mlaquant import DecodeSession
from mlaquant.calib.calibrate import CalibrateConfig
from mlaquant.calib.candidates import LayerVariants, best_variant
from mlaquant.calib.observers import LatentStats
from mlaquant.errors import PlanError
from mlaquant.evaluation.eval import fake_quant_hook
from mlaquant.modeling.model import hadamard_signs, latent_rotation, with_latent_rotation
from mlaquant.runtime.plan import LayerPlan, Plan


def _rows(model, ids, layer):
    inputs = []
    model(ids, layer_inputs=inputs)
    attn = model.layers[layer].self_attn
    cos, sin = model.rotary(torch.arange(ids.shape[1])[None], model.dtype)
    return attn.latent(model.layers[layer].input_layernorm(inputs[layer]), cos, sin)[0]


@pytest.mark.parametrize("parts", ["ckv", "rope", "both"])
def test_rotation_keeps_logits_and_rotates_only_its_part(tiny_model, parts):
    d_c, d_r = tiny_model.cfg.latent_widths
    ckv = hadamard_signs(d_c, 1) if parts in ("ckv", "both") else None
    rope = hadamard_signs(d_r, 2) if parts in ("rope", "both") else None
    rot = latent_rotation(ckv, rope, d_c, d_r)
    rotated = with_latent_rotation(tiny_model, {1: rot})
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    assert (rotated(ids) - tiny_model(ids)).abs().max() < 1e-5
    plain, new = _rows(tiny_model, ids, 1), _rows(rotated, ids, 1)
    assert torch.allclose(new, plain @ rot, atol=1e-5)
    assert torch.equal(new[:, :d_c], plain[:, :d_c]) == (ckv is None)
    assert torch.equal(new[:, d_c:], plain[:, d_c:]) == (rope is None)
    assert torch.equal(_rows(rotated, ids, 0), _rows(tiny_model, ids, 0))  # other layers untouched


def _rotated_plan(model) -> Plan:
    d_c, d_r = model.cfg.latent_widths
    n = model.cfg.num_hidden_layers
    layers = [LayerPlan("int4-row", "int4-row", rotate=True, rotate_rope=True) for _ in range(n)]
    tensors = {}
    for i in range(n):
        tensors[f"layer{i}.rotation_signs"] = hadamard_signs(d_c, 10 + i)
        tensors[f"layer{i}.rope_rotation_signs"] = hadamard_signs(d_r, 20 + i)
    return Plan(layers=layers, fingerprint=model.fingerprint(), budget=0.01, tensors=tensors)


def test_rotated_plan_round_trips_and_decode_equals_teacher_forced(tiny_model, tmp_path):
    plan = _rotated_plan(tiny_model).bind(tiny_model.cfg)
    plan.save(tmp_path / "p")
    loaded = Plan.load(tmp_path / "p").bind(tiny_model.cfg)
    assert loaded.layers == plan.layers
    for i, r in plan.rotations().items():
        assert torch.equal(loaded.rotations()[i], r)
    session = DecodeSession(tiny_model, plan=tmp_path / "p")
    model = loaded.apply(tiny_model)
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    teacher = model(ids, fake_quant_hook(session.codecs))[0]
    unrotated = tiny_model(ids, fake_quant_hook(session.codecs))[0]
    assert (teacher - unrotated).abs().max() > 1e-4  # INT4 of rotated rows is not INT4 of plain rows
    steps = [session.prefill(ids[:, :1])[0, 0]]
    steps += [session.decode(ids[:, t])[0] for t in range(1, ids.shape[1])]
    assert (torch.stack(steps) - teacher).abs().max() < 1e-5


def test_plan_missing_rope_signs_is_refused(tiny_model, tmp_path):
    plan = _rotated_plan(tiny_model)
    del plan.tensors["layer1.rope_rotation_signs"]
    plan.save(tmp_path / "p")
    with pytest.raises(PlanError, match="layer1.rope_rotation_signs"):
        Plan.load(tmp_path / "p")


def test_plan_search_rotates_k_pe_with_an_outlier_pair():
    """A k_pe pair ten times larger than the others (what the bundled model's layer 2 shows) ruins
    row-wise INT4 for every other channel; the Hadamard-rotated variant spreads it and wins the proxy."""
    d_c, d_r = 16, 8
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4096, d_c + d_r, generator=g)
    angle = torch.rand(4096, generator=g) * 6.28
    rows[:, d_c + 1], rows[:, d_c + 1 + d_r // 2] = 10 * angle.cos(), 10 * angle.sin()
    stats = LatentStats(rows.min(0).values, rows.max(0).values, [rows], rows.shape[0])
    v = LayerVariants(stats, (d_c, d_r), CalibrateConfig(percentile=0.999, try_rotation=True), seed=0)
    assert set(v.rows) == {(False, False), (False, True), (True, False), (True, True)}
    _, rotate_rope, _ = best_variant(v, "int8-row/int4-row", try_clip=False)
    assert rotate_rope
    plain = v.codec("fp16/int4-row", False, (False, False)).relative_error(v.rows[False, False])
    spread = v.codec("fp16/int4-row", False, (False, True)).relative_error(v.rows[False, True])
    assert spread < 0.8 * plain
