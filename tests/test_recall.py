"""Exact recall over a long context (`mlaquant.evaluation.recall`, `mlaquant recall`)."""

from __future__ import annotations

import json

import pytest
import torch

from mlaquant.cli import main
from mlaquant.errors import MLAQuantError
from mlaquant.evaluation.recall import RecallSet, recall_set, recall_share
from mlaquant.modeling.loader import load_model


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
