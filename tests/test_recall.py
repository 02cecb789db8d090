"""Exact recall over a long context (`mlaquant.evaluation.recall`, `mlaquant recall`)."""

from __future__ import annotations

import json

import pytest
import torch

from mlaquant.cli import main
from mlaquant.errors import MLAQuantError
from mlaquant.evaluation.eval import fake_quant_hook
from mlaquant.evaluation.recall import Recall, RecallSet, recall_set, recall_share
from mlaquant.modeling.loader import load_model
from mlaquant.runtime.plan import Plan


@pytest.fixture(scope="module")
def model():
    return load_model()


def test_a_recall_prompt_ends_in_the_start_of_an_earlier_span_and_scores_its_continuation():
    windows = torch.arange(3 * 400).view(3, 400)
    rs = recall_set(windows, cue=8, span=32, seed=1)
    assert rs.prompts.shape == (3, 400) and rs.targets.shape == (3, 32)
    for w, p, s, t in zip(windows, rs.prompts, rs.sources, rs.targets):
        assert torch.equal(p[:392], w[:392])
        assert torch.equal(p[392:], w[s:s + 8])
        assert torch.equal(t, w[s + 8:s + 40])
        assert s + 40 <= 392 // 2
    assert torch.equal(recall_set(windows, 8, 32, seed=1).sources, rs.sources)


def test_windows_too_short_for_the_span_are_one_line():
    with pytest.raises(MLAQuantError, match="windows of 100 tokens cannot hold a cue of 16 and a span of 64"):
        recall_set(torch.zeros(2, 100, dtype=torch.long), cue=16, span=64)


def test_the_share_counts_the_greedy_tokens_that_reproduce_the_span(model):
    """Scored against FP16's own greedy continuation, in batches of 2 of 3 prompts, FP16 reproduces every token; with
    the second half of each target replaced by a token it never emits there, half; with all replaced, none."""
    from mlaquant.runtime.session import generate

    torch.manual_seed(0)
    rs = recall_set(torch.randint(100, 1000, (3, 160)), cue=8, span=16, seed=0)
    own = torch.tensor(generate(model, rs.prompts, 16, backend="torch"))
    half = own.clone()
    half[:, 8:] = -1
    shares = [recall_share(model, RecallSet(rs.prompts, t, rs.sources), "fp16", batch=2)
              for t in (own, half, torch.full_like(own, -1))]
    assert shares == [1.0, 0.5, 0.0]


def test_the_command_scores_fp16_first_and_each_plan_against_it(capsys):
    assert main(["recall", "--plans", "int4", "--prompts", "2", "--seq-len", "192", "--cue", "8", "--span", "16",
                 "--json", "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["plan"] for r in report["rows"]] == ["fp16", "int4"]
    assert report["rows"][0]["vs_fp16_points"] == 0.0 and report["rows"][0]["bits_per_value"] == 16.0
    fp16, int4 = (r["share"] for r in report["rows"])
    assert 0 <= int4 <= 1 and report["rows"][1]["vs_fp16_points"] == pytest.approx(100 * (int4 - fp16))


def test_an_unknown_plan_stops_the_command_before_any_decode(capsys):
    assert main(["recall", "--plans", "int3-nope", "--prompts", "2", "--seq-len", "192", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "plan 'int3-nope' is neither a plan directory nor codec names" in err and "\n" not in err


def greedy_by_recompute(model, plan: Plan, prompts: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy tokens [n, steps] by a full teacher-forced forward per step, every latent row through the plan's
    fake quantization (no cache, no DecodeSession): an independent path to the same tokens."""
    rotated, hook = plan.apply(model), fake_quant_hook(plan.layer_codecs())
    ids = prompts
    for _ in range(steps):
        logits = rotated(ids, hook)
        ids = torch.cat((ids, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return ids[:, prompts.shape[1]:]


def test_the_check_scores_fp16_and_a_plan_as_a_full_recompute_does(model):
    """`Recall.summary`: FP16's and a 2-bit plan's shares equal the share of target tokens that a cache-free greedy
    recompute reproduces, and the gap is their difference in points. The targets: FP16's recomputed tokens, the
    second half of each replaced by the plan's, so that both shares lie strictly between 0 and 1 where they differ."""
    torch.manual_seed(1)
    check = Recall(model, torch.randint(100, 1000, (3, 96)), cue=4, span=8, seed=3)
    low = Plan.uniform("band-2x128/band-2x32", len(model.layers)).bind(model.cfg)
    fp16 = Plan.uniform("fp16", len(model.layers)).bind(model.cfg)
    ref, got = (greedy_by_recompute(model, p, check.rs.prompts, 8) for p in (fp16, low))
    assert not torch.equal(ref, got)  # the plan changes some greedy tokens: the two shares can tell them apart
    targets = torch.cat((ref[:, :4], got[:, 4:]), dim=1)
    check.rs = RecallSet(check.rs.prompts, targets, check.rs.sources)
    summary = check.summary(low)
    want = {name: (tokens == targets).float().mean().item() for name, tokens in (("fp16", ref), ("plan", got))}
    assert summary["fp16"] == pytest.approx(want["fp16"]) and summary["plan"] == pytest.approx(want["plan"])
    assert 0 < summary["fp16"] < 1 and 0 < summary["plan"] < 1
    assert summary["vs_fp16_points"] == pytest.approx(100 * (want["plan"] - want["fp16"]))
    assert (summary["prompts"], summary["seq_len"], summary["cue"], summary["span"]) == (3, 96, 4, 8)
