"""Calibration on the bundled model: plans under budget, real fallback, clear errors."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import torch

from mlaquant import DecodeSession, load_model
from mlaquant.calib.calibrate import CalibrateConfig, calibrate
from mlaquant.calib.data import split_path
from mlaquant.config import ConfigError
from mlaquant.errors import MLAQuantError
from mlaquant.evaluation.samples import token_samples
from mlaquant.runtime.plan import Plan

SMALL = dict(
    samples=16, seq_len=128, val_samples=8, test_samples=4, batch_size=8, long_seq_len=256, long_test_samples=2,
    shift_samples=2, shift_long_samples=1, shift_val_samples=2,
)


@pytest.fixture(scope="module")
def bundled():
    return load_model()


@pytest.fixture(scope="module")
def plan_1pct(bundled):
    return calibrate(bundled, CalibrateConfig(**SMALL, budget=0.01), quiet=True)


def test_plan_is_under_budget_on_validation_and_loads(bundled, plan_1pct, tmp_path):
    plan, report = plan_1pct
    assert report["validation"]["loss"] <= 0.8 * 0.01
    cfg = bundled.cfg
    fp16 = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * cfg.num_hidden_layers
    assert plan.bytes_per_token() < fp16 / 2
    plan.save(tmp_path / "plan")
    # plan.yaml lists every measured candidate per layer; the chosen one with the loss the layer records
    listed = Plan.load(tmp_path / "plan").metrics["candidates"]
    for i, lp in enumerate(plan.layers):
        assert len(listed[f"layer{i}"]) == len(CalibrateConfig().candidates)
        assert any(line.startswith(f"{lp.codec_name}: ") and f"{lp.loss:+.4%}" in line for line in listed[f"layer{i}"])
    session = DecodeSession(bundled, plan=tmp_path / "plan")
    assert [c.name for c in session.codecs] == [
        c.name for c in Plan.load(tmp_path / "plan").bind(cfg).layer_codecs()
    ]


def test_tighter_budget_gives_wider_plan(bundled, plan_1pct):
    tight, report = calibrate(bundled, CalibrateConfig(**SMALL, budget=0.0001), quiet=True)
    assert tight.bytes_per_token() > plan_1pct[0].bytes_per_token()
    assert report["validation"]["loss"] <= 0.8 * 0.0001


def test_outlier_layer_falls_back_while_others_stay_narrow(bundled):
    """8 outlier channels in one layer's c_kv, the model unchanged: the norm scales them up 20x and kv_b_proj's
    columns scale them back down (W·c = (W/20)·(20c)), so only the cache sees them — INT4 steps sized by them
    drown the other channels, and that layer alone must leave INT4 c_kv. (Scaling the norm alone changes the
    model: with every-level codes its INT4 cache then measured better than its own FP16 one.)"""
    layer = 2
    attn = bundled.layers[layer].self_attn
    norm, up = attn.kv_a_layernorm.weight, attn.kv_b_proj.weight
    original = norm.detach().clone(), up.detach().clone()
    with torch.no_grad():
        norm[:8] *= 20.0
        up[:, :8] /= 20.0
    try:
        plan, _ = calibrate(bundled, CalibrateConfig(**SMALL, budget=0.01), quiet=True)
    finally:
        with torch.no_grad():
            norm.copy_(original[0])
            up.copy_(original[1])
    assert not plan.layers[layer].ckv.startswith("int4")
    assert all(lp.ckv.startswith("int4") for i, lp in enumerate(plan.layers) if i != layer)


def test_bad_inputs(bundled, tmp_path):
    with pytest.raises(ConfigError, match="budget must be in"):
        CalibrateConfig(budget=1.5)
    with pytest.raises(ConfigError, match="samples must be > 0"):
        CalibrateConfig(samples=0)
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    with pytest.raises(MLAQuantError, match="no text"):
        calibrate(bundled, CalibrateConfig(**SMALL), data=empty, quiet=True)
    short = tmp_path / "short.txt"
    short.write_text("def f(x):\n    return x + 1\n" * 40)
    with pytest.warns(UserWarning, match="using"):
        samples = token_samples(bundled.tokenizer, short, 100, 64)
    assert 0 < samples.shape[0] < 100


def test_nan_activation_names_the_layer(bundled):
    w = bundled.layers[1].self_attn.kv_a_proj_with_mqa.weight
    original = w.detach().clone()
    with torch.no_grad():
        w[0, 0] = float("nan")
    try:
        with pytest.raises(MLAQuantError, match="layer 1: latent rows contain NaN"):
            calibrate(bundled, CalibrateConfig(**SMALL), quiet=True)
    finally:
        with torch.no_grad():
            w.copy_(original)


def test_cli_errors_are_one_line_and_leave_no_plan_dir(tmp_path):
    out = tmp_path / "plan"
    for args, message in [
        (["--budget", "2"], "budget must be in (0, 1)"),
        (["--samples", "0"], "samples must be > 0"),
        (["--data", str(tmp_path / "missing.txt")], "data not found"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "mlaquant.cli", "calibrate", "--out", str(out), *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("mlaquant calibrate: error:")
        assert message in proc.stderr
        assert not out.exists()


def test_interrupted_save_leaves_no_partial_directory(plan_1pct, tmp_path, monkeypatch):
    import mlaquant.runtime.plan as plan_module

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_module, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        plan_1pct[0].save(tmp_path / "plan")
    assert list(tmp_path.iterdir()) == []


def test_int8_matmul_enters_the_search_and_falls_back(bundled):
    from mlaquant.calib.measure import Validation, int8_matmul_costs
    from mlaquant.calib.search import add_int8_matmul
    from mlaquant.evaluation.eval import Evaluator

    # an INT8 cache leaves most of the budget to the projections
    cfg = CalibrateConfig(**SMALL, budget=0.01, int8_matmul=True, candidates=("int8-g64/int8-g32", "fp16/fp16"))
    plan, report = calibrate(bundled, cfg, quiet=True)
    assert report["validation"]["loss"] <= 0.8 * 0.01
    assert any(lp.int8_matmul for lp in plan.layers)
    # over a target no plan can meet, every layer goes back to FP matmuls, costliest first, each recorded
    n = bundled.cfg.num_hidden_layers
    ev = Evaluator(bundled, token_samples(bundled.tokenizer, split_path("validation"), 4, 64, 0, 0))
    costs = int8_matmul_costs(bundled, ev)
    fallbacks = []
    plan = Plan.uniform("fp16", n).bind(bundled.cfg)
    add_int8_matmul(plan, bundled, Validation(ev), costs, -1.0, fallbacks)
    assert not any(lp.int8_matmul for lp in plan.layers)
    assert [f["layer"] for f in fallbacks] == sorted(range(n), key=costs.__getitem__, reverse=True)
    assert all(f["from"] == "int8_matmul" for f in fallbacks)


def test_fallback_skips_wider_candidates_that_measured_worse():
    from mlaquant.calib.candidates import Choice
    from mlaquant.calib.search import wider

    row = [Choice(f"c{i}", False, False, False, b, loss) for i, (b, loss) in enumerate(
        [(84, 0.0055), (86, 0.0050), (86, 0.0059), (90, 0.0060), (92, 0.0039), (320, 0.0)]
    )]  # fmt: skip
    assert [wider(row, p) for p in range(5)] == [1, 4, 4, 4, 5]
    assert wider([Choice("a", False, False, False, 84, -0.001), *row[3:]], 0) == 3  # nothing better: FP16


def test_narrowing_moves_rank_bytes_saved_per_loss_added():
    from mlaquant.calib.candidates import Choice
    from mlaquant.calib.search import narrowing_moves

    row = lambda *losses: [Choice(f"c{b}", False, False, False, b, loss) for b, loss in zip((84, 90, 106, 320), losses)]
    table = [row(0.004, 0.002, 0.001, 0.0), row(0.0002, 0.0001, 0.00005, 0.0), row(0.01, 0.001, 0.0, 0.0)]
    pick = [2, 2, 3]
    moves = narrowing_moves(table, pick, frozen={2})
    assert {i for i, _ in moves} == {0, 1}  # the frozen (fallen-back) layer is never narrowed
    assert moves[0] == (1, 1)  # 16 bytes saved for +0.00005: the least loss added per byte saved
    ratios = [(table[i][pick[i]].row_bytes - table[i][q].row_bytes) / (table[i][q].loss - table[i][pick[i]].loss)
              for i, q in moves]  # fmt: skip
    assert ratios == sorted(ratios, reverse=True)
    assert all(q < pick[i] for i, q in moves)


def test_long_context_check_reports_buckets_and_measures_fixes_when_over_budget(bundled, plan_1pct):
    plan, report = plan_1pct
    long = report["long_context"]
    assert long["seq_len"] == 256 and long["result"]["tokens"] == 2 * 255
    assert [b["positions"] for b in long["result"]["by_position"]] == [[0, 255]]
    assert long["holds"] == (long["result"]["loss"] <= 0.01)
    assert plan.metrics["long_context"] == long
    # a plan over its budget at 256 tokens (uniform int4-row, unrotated, held to 0.001 %: on 8 x 128 validation
    # tokens a searched plan can read below 0, so the stage is called on a plan known to break it)
    from mlaquant.calib.calibrate_config import Sources
    from mlaquant.calib.checks import long_context

    tight = dataclasses.replace(Plan.uniform("int4-row", len(bundled.layers)), budget=0.00001).bind(bundled.cfg)
    over = long_context(bundled, CalibrateConfig(**SMALL, budget=0.00001), Sources.resolve(None, None, None), tight)
    assert not over["holds"] and over["result"]["loss"] > 0.00001  # so the fixes must be measured
    fixes = {f["fix"]: f for f in over["fixes"]}
    assert set(fixes) == {"residual FP16 window of 128 rows (+w128)", "k_pe int8-row in every INT4 layer"}
    assert fixes["residual FP16 window of 128 rows (+w128)"]["loss"] < over["result"]["loss"]


def test_off_distribution_text_is_reported_and_the_second_domain_enters_the_search(bundled, plan_1pct, tmp_path):
    """The plan on third-party Python at both lengths (reported, never chosen on), and the second validation
    domain (other third-party files at long_seq_len) measured for every candidate and held by the plan."""
    from mlaquant.calib.data import SHIFT_PACKAGES, shift_description, shift_source

    plan, report = plan_1pct
    shift = report["shift"]
    assert shift["data"] == shift_description() and [r["seq_len"] for r in shift["runs"]] == [128, 256]
    assert [r["result"]["tokens"] for r in shift["runs"]] == [2 * 127, 255]
    assert shift["holds"] == all(r["result"]["loss"] <= 0.01 for r in shift["runs"])
    assert plan.metrics["shift"] == shift and plan.settings["shift_data"] == shift_description()
    second = report["shift_validation"]
    assert second["seq_len"] == 256 and second["loss"] <= 0.6 * 0.01  # held by the search, like validation
    listed = plan.save(tmp_path / "p") and Plan.load(tmp_path / "p").metrics["candidates"]
    assert all("third-party" in line for lines in listed.values() for line in lines if not line.startswith("fp16"))
    # the two domains are disjoint files of installed torch
    assert not set(SHIFT_PACKAGES["validation"]) & set(SHIFT_PACKAGES["test"])
    assert {p.name for p in shift_source("test")} == {"nn", "optim", "fx"}


def test_search_weighs_the_worse_domain():
    """A candidate cheap on the validation split but costly on the second domain is upgraded: the search,
    the fallback order and the narrowing ratios read `Choice.worst`."""
    from mlaquant.calib.candidates import Choice
    from mlaquant.calib.search import search, wider

    row = [Choice("int4", False, False, False, 84, 0.001, 0.009), Choice("int8", False, False, False, 164, 0.0005,
                                                                         0.0006), Choice("fp16/fp16", False, False,
                                                                                         False, 320, 0.0, 0.0)]
    assert row[0].worst == 0.009 and Choice("x", False, False, False, 1, 0.002).worst == 0.002
    assert search([row], target=0.006) == [1]  # 0.001 alone would pass; the second domain's 0.009 does not
    assert search([row], target=0.01) == [0]
    assert wider(row, 0) == 1


def test_candidates_that_do_not_fit_the_widths_are_skipped_not_fatal(synthetic, tmp_path):
    """A DeepSeek-V3-style checkpoint with kv_lora_rank 48 and qk_rope_head_dim 12: group-32 candidates do not
    divide 48, so they are skipped and named (summary, report, plan.yaml); the others calibrate. Only when no
    candidate but FP16 fits is it an error, in one line."""
    from mlaquant.calib.candidates import fitting_candidates
    from mlaquant.calib.report import summary_table

    odd = load_model(synthetic(tmp_path / "odd", 2, kv_lora_rank=48, rope_dim=12))
    cfg = CalibrateConfig(**SMALL, budget=0.05, try_rotation=False, narrow_trials=0)
    plan, report = calibrate(odd, cfg, quiet=True)
    skipped = {s["candidate"]: s["reason"] for s in report["skipped_candidates"]}
    assert set(skipped) == {"int4-g32/int4-g32", "int4-g32/int4-row-asym", "int4-g32/int8-g32"}
    assert all("group size 32 does not divide width 48" in r for r in skipped.values())
    assert not {lp.codec_name for lp in plan.layers} & set(skipped)
    assert plan.metrics["skipped_candidates"] == report["skipped_candidates"]
    assert "skipped: int4-g32/int4-g32" in summary_table(plan, odd, report)
    assert all(lp.codec_name in cfg.candidates for lp in plan.layers)
    with pytest.raises(MLAQuantError, match=r"no candidate codec fits latent widths d_c 48, d_r 12 \(int4-g32"):
        fitting_candidates(("int4-g32/int4-g32", "fp16/fp16"), 48, 12)


def test_exact_recall_is_a_line_of_the_report_measured_on_held_out_windows(bundled, plan_1pct):
    """With recall_prompts the check stage scores FP16 and the plan on test windows of long_seq_len tokens (the same
    numbers `Recall` gives on those windows), plan.yaml keeps them and the summary prints them; off by default."""
    from mlaquant.calib.calibrate_config import Sources
    from mlaquant.calib.checks import held_out
    from mlaquant.calib.report import recall_line
    from mlaquant.evaluation.recall import Recall

    plan, report = plan_1pct
    assert "recall" not in report and "recall" not in plan.metrics
    cfg = CalibrateConfig(**{**SMALL, "test_samples": 0, "shift_samples": 0, "shift_long_samples": 0},
                          recall_prompts=2, recall_cue=4, recall_span=8)
    got = held_out(bundled, cfg, Sources.resolve(None, None, None), plan)["recall"]
    windows = token_samples(bundled.tokenizer, split_path("test"), 2, 256, cfg.seed + 7, bundled.cfg.eos_id)
    again = Recall(bundled, windows, 4, 8, cfg.seed + 7)
    assert got == {"prompts": 2, "seq_len": 256, "cue": 4, "span": 8, "fp16": again.fp16, "plan": again.share(plan),
                   "vs_fp16_points": pytest.approx(100 * (again.share(plan) - again.fp16))}
    line = recall_line(got)
    assert line.startswith(f"    recall: {got['plan']:.1%} of copied spans vs FP16 {got['fp16']:.1%}")
    assert "2 test prompts of 256 tokens, 4-token cue, 8 greedy tokens" in line


def test_a_recall_window_too_short_for_its_span_is_one_line():
    with pytest.raises(ConfigError, match="recall needs long_seq_len ≥ 176 for a cue of 16 and a span of 64, got 128"):
        CalibrateConfig(long_seq_len=128, recall_prompts=4)
    with pytest.raises(ConfigError, match="recall_prompts must be ≥ 0"):
        CalibrateConfig(recall_prompts=-1)


def test_a_cap_on_bits_bounds_the_search_and_the_fallback_to_its_bytes():
    """`max_bits`: the search makes no upgrade past the cap (the uncapped one does), and the fallback from a
    candidate only widens to one that fits the room the cap leaves (None when nothing does)."""
    from mlaquant.calib.candidates import Choice
    from mlaquant.calib.search import byte_cap, search, wider

    c = lambda name, b, loss: Choice(name, False, False, False, b, loss)  # noqa: E731
    table = [[c("a", 10, 0.01), c("b", 20, 0.001)], [c("c", 10, 0.005), c("d", 30, 0.0)]]
    assert search(table, target=0.0005) == [1, 1]  # 50 B
    assert search(table, target=0.0005, cap=30) == [1, 0]  # d would take 40 B
    assert search(table, target=0.0005, cap=20) == [0, 0]
    row = [c("x", 10, 0.01), c("y", 20, 0.02), c("z", 25, 0.005), c("fp16/fp16", 40, 0.0)]
    got = [wider(row, 0), wider(row, 0, 40), wider(row, 0, 24), wider(row, 2), wider(row, 2, 39)]
    assert got == [2, 2, None, 3, None]
    assert byte_cap(2.3, 4, 160) == 184 and byte_cap(None, 4, 160) is None


def test_a_cap_below_the_cheapest_candidates_is_one_line_before_any_loss_is_measured(bundled):
    cfg = CalibrateConfig(**SMALL, candidates=("int4-row/int4-row", "fp16/fp16"), max_bits=4.0)
    with pytest.raises(MLAQuantError) as e:  # 4 layers x 84 B = 336 B > 4.0 bits x 4 x 160 / 8 = 320 B
        calibrate(bundled, cfg, quiet=True)
    assert str(e.value) == (
        "calibrate: max_bits 4.0 (320 B per token) is below the cheapest plan of the candidates (336 B per token); "
        "layer 0's cheapest candidate is int4-row/int4-row at 84 B"
    )
    with pytest.raises(ConfigError, match="max_bits must be in"):
        CalibrateConfig(max_bits=0)


def test_a_cap_that_leaves_no_plan_within_the_budget_names_the_layer_and_its_best_loss(bundled, plan_1pct):
    """A budget the 1 % plan's bytes cannot meet, capped at those bytes: the fallback has nowhere to go, and the
    error names the layer of the largest loss with its best loss alone within the cap; a cap that does not bind
    (16 bits) changes nothing (the same plan as without one)."""
    plan = plan_1pct[0]
    bits = 8 * plan.bytes_per_token() / (len(plan.layers) * sum(bundled.cfg.latent_widths))
    loose, _ = calibrate(bundled, CalibrateConfig(**SMALL, budget=0.01, max_bits=16), quiet=True)
    assert [lp.codec_name for lp in loose.layers] == [lp.codec_name for lp in plan.layers]
    with pytest.raises(MLAQuantError) as e:
        calibrate(bundled, CalibrateConfig(**SMALL, budget=0.0001, max_bits=bits), quiet=True)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"calibrate: max_bits {bits} ({plan.bytes_per_token()} B per token) leaves no plan")
    loss = r"[+-]\d\.\d{4}% \(\S+, \d+ B"
    assert re.search(rf"layer \d has the largest loss alone, {loss}\), its best within the cap {loss}, every other "
                     r"layer at its cheapest\)$", message)


def test_a_plan_over_the_budget_with_every_layer_at_fp16_is_one_line(bundled, monkeypatch):
    """A validation that never comes under the budget (stubbed at +50 %): the fallback widens every layer to FP16,
    then stops in one line that says the loss left is not the codes' (no TypeError from the uncapped cap)."""
    import types

    from mlaquant.calib.measure import Checked, Validation

    monkeypatch.setattr(Validation, "check", lambda self, *a, **k: Checked(types.SimpleNamespace(loss=0.5), None))
    cfg = CalibrateConfig(**{**SMALL, "shift_val_samples": 0}, candidates=("int4-row/int4-row", "fp16/fp16"),
                          try_clip=False, try_rotation=False)
    with pytest.raises(MLAQuantError) as e:
        calibrate(bundled, cfg, quiet=True)
    assert str(e.value) == (
        "calibrate: over the budget with every layer at FP16: plan validation loss 50.0000% > 0.6000% (headroom × "
        "budget); what remains is not the cache's quantization (a rotation in FP16, or a budget below the "
        "evaluation's noise)"
    )
