"""Runtime guard: rows far outside the calibrated range widen that layer, and only that layer."""

from __future__ import annotations

import torch

from mlaquant import DecodeSession
from mlaquant.calib.observers import observe
from mlaquant.calib.search import max_row_error
from mlaquant.quant.codecs import LayerCodec
from mlaquant.runtime.guard import Guard
from mlaquant.runtime.plan import LayerPlan, Plan


def calibrated_plan(model, codec: str = "int4") -> Plan:
    cfg = model.cfg
    d_c, d_r = cfg.latent_widths
    ids = torch.randint(0, cfg.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
    stats = observe(model, ids)
    layers, tensors = [], {}
    for i, s in enumerate(stats):
        tensors[f"layer{i}.range_lo"], tensors[f"layer{i}.range_hi"] = s.min, s.max
        c = LayerCodec.from_names(codec, codec, d_c, d_r)
        layers.append(LayerPlan(c.ckv.spec.name, c.kpe.spec.name, max_rel_error=max_row_error(s.sample(), c)))
    return Plan(layers=layers, tensors=tensors)


def test_in_distribution_prompt_raises_no_event(tiny_model):
    plan = calibrated_plan(tiny_model)
    session = DecodeSession(tiny_model, plan=plan, guard=Guard({"check_every": 2}))
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    session.prefill(ids)
    for t in range(4):
        session.decode(ids[:, t])
    assert session.fallback_events == []


def test_rows_scaled_past_calibrated_range_widen_that_layer(tiny_model):
    plan = calibrated_plan(tiny_model)
    guard = Guard()
    session = DecodeSession(tiny_model, plan=plan, guard=guard)
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(6))
    session.prefill(ids)
    assert session.fallback_events == []
    rows = [session.cache.read(i, 0) for i in range(tiny_model.cfg.num_hidden_layers)]
    rows[1] = rows[1] * 50
    guard.check(session, rows, "test")
    assert [e["layer"] for e in session.fallback_events] == [1]
    assert "outside 1.5× the calibrated range" in session.fallback_events[0]["reason"]
    assert session.cache.codec(1).name == "int8-row/int8-row" and session.cache.codec(0).name == "int4-row/int4-row"
    # once widened, the range signal no longer widens further; the error bound still would
    guard.check(session, rows, "again")
    assert len(session.fallback_events) == 1


def test_check_every_counts_decode_steps(tiny_model):
    plan = calibrated_plan(tiny_model)
    checks = []

    class Spy(Guard):
        def check(self, session, rows, when):
            checks.append(when)

    session = DecodeSession(tiny_model, plan=plan, guard=Spy({"check_every": 3}))
    session.prefill([[1, 2, 3]])
    for _ in range(7):
        session.decode([4])
    assert checks == ["prefill", "decode step 3", "decode step 6"]


def test_uniform_plans_are_not_guarded(tiny_model):
    session = DecodeSession(tiny_model, plan="int4", guard=Guard({"check_every": 1}))
    session.prefill([[1, 2, 3]])
    rows = [session.cache.read(i, 0) * 100 for i in range(tiny_model.cfg.num_hidden_layers)]
    session.guard.check(session, rows, "test")
    assert session.fallback_events == []


def test_recalibration_widens_only_drifted_channels_of_clipped_layers(tiny_model):
    cfg = tiny_model.cfg
    d_c, d_r = cfg.latent_widths
    plan = calibrated_plan(tiny_model)
    for i, lp in enumerate(plan.layers):
        lp.clip = i == 1  # only layer 1 clips, to ranges far too narrow for channel 3
        hi = torch.full((d_c + d_r,), 100.0)
        hi[3] = 1e-3
        plan.tensors[f"layer{i}.clip_hi"], plan.tensors[f"layer{i}.clip_lo"] = hi, -hi
    guard = Guard({"recalibrate_every": 4, "check_every": 1000})
    session = DecodeSession(tiny_model, plan=plan, guard=guard)
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(8))
    session.prefill(ids[:, :30])
    before = session.cache.codec(1)
    for t in range(30, 34):
        session.decode(ids[:, t])
    assert [e["layer"] for e in guard.recalibrations] == [1]
    after = session.cache.codec(1)
    assert after.name == before.name and after.ckv.clip_hi[3] > 1e-3  # the clipped channel opened up
    assert torch.equal(after.ckv.clip_hi[4:], before.ckv.clip_hi[4:])  # the others kept their ranges
    old_rows = session.cache.read(1, 0)[:30]
    session.decode(ids[:, 34])
    assert torch.equal(session.cache.read(1, 0)[:30], old_rows)  # stored rows read back unchanged


def test_generate_cli_runs_the_guard(tmp_path, capsys):
    """`mlaquant generate` attaches a Guard (bounds no row can meet widen every layer after prefill);
    `--no-guard` decodes without one."""
    from mlaquant.cli import main
    from mlaquant.modeling.loader import load_model

    model = load_model()
    n = model.cfg.num_hidden_layers
    layers = [LayerPlan("int4-row", "int4-row", max_rel_error=1e-9) for _ in range(n)]
    Plan(layers=layers, fingerprint=model.fingerprint()).save(tmp_path / "plan")
    args = ["generate", "--prompt", "The cat", "--max-new-tokens", "3", "--plan", str(tmp_path / "plan")]
    assert main(args) == 0
    assert f"-- guard: {n} fallback event(s)" in capsys.readouterr().out
    assert main([*args, "--no-guard"]) == 0
    assert "-- guard:" not in capsys.readouterr().out
