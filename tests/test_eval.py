"""Teacher-forced evaluation by position bucket: buckets partition the targets, and a bucket's loss is
the loss of the samples cut at its end (attention is causal)."""

from __future__ import annotations

import math

import pytest
import torch

from mlaquant import load_model
from mlaquant.calib.data import split_path
from mlaquant.evaluation.eval import Evaluator
from mlaquant.evaluation.samples import token_samples
from mlaquant.runtime.plan import Plan


@pytest.fixture(scope="module")
def bundled():
    return load_model()


def test_position_buckets_partition_targets_and_match_the_cut_samples(bundled):
    ids = token_samples(bundled.tokenizer, split_path("test"), 2, 700, 0, bundled.cfg.eos_id)  # [2, 700]
    codecs = Plan.uniform("int4-row", 4).bind(bundled.cfg).layer_codecs()
    full = Evaluator(bundled, ids, 2).evaluate(codecs)
    assert [b["positions"] for b in full.by_position] == [[0, 512], [512, 699]]
    assert sum(b["tokens"] for b in full.by_position) == full.tokens == 2 * 699
    mean = sum(b["nll"] * b["tokens"] for b in full.by_position) / full.tokens
    assert math.isclose(mean, full.nll, rel_tol=1e-6)  # the total sums in FP32, the buckets in FP64
    head = Evaluator(bundled, ids[:, :513], 2).evaluate(codecs)  # targets 0..511 only
    assert [b["positions"] for b in head.by_position] == [[0, 512]]
    assert math.isclose(full.by_position[0]["nll"], head.nll, rel_tol=1e-5)
    # loss = exp(nll - nll_fp16) - 1: its absolute error is the NLLs' (tolerated above at 1e-5 relative); a relative
    # tolerance on the loss itself shrank with it (int4-row at 0.34 % here: 5e-6 apart, 1.5e-3 relative)
    assert math.isclose(full.by_position[0]["loss"], head.loss, abs_tol=1e-5 * head.nll)
    assert full.by_position[0]["loss"] != full.by_position[1]["loss"]


def test_the_fp16_reference_scores_zero_in_every_bucket(bundled):
    ids = torch.randint(0, bundled.cfg.vocab_size, (1, 600), generator=torch.Generator().manual_seed(0))
    r = Evaluator(bundled, ids).evaluate([None] * len(bundled.layers))
    assert [b["loss"] for b in r.by_position] == [0.0, 0.0]
