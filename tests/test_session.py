"""Decode session: chunked long prefill with bounded memory, chunk sizes from configs/, input checks."""

from __future__ import annotations

import pytest
import torch

from mlaquant import DecodeSession
from mlaquant.config import ConfigError, load_runtime_config
from mlaquant.errors import MLAQuantError


def test_chunk_sizes_follow_context_length():
    rt = load_runtime_config()
    assert [rt.chunk_for(n) for n in (100, 2047, 2048, 8191, 8192, 16384)] == [512, 512, 768, 768, 1024, 1024]
    with pytest.raises(ConfigError, match="unknown key 'chunk'"):
        load_runtime_config({"chunk": 3})


def test_16k_token_prompt_prefills_in_chunks(tiny_model, monkeypatch):
    session = DecodeSession(tiny_model, plan="int8")
    seen = []
    original = session._prefill_chunk
    monkeypatch.setattr(
        session, "_prefill_chunk", lambda b, ids, start, w: seen.append(ids.shape[1]) or original(b, ids, start, w)
    )
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (1, 16384), generator=torch.Generator().manual_seed(0))
    logits = session.prefill(ids)
    assert seen == [1024] * 16
    assert torch.isfinite(logits).all() and session.cache.length(0) == 16384
    # the cache holds exactly the prompt's rows, paged in 64-token blocks, and decoding continues
    assert session.cache.layers[0][0].used_blocks == 16384 // 64
    step = session.decode([5])
    assert torch.isfinite(step).all()


def test_bad_session_input(tiny_model):
    session = DecodeSession(tiny_model)
    with pytest.raises(MLAQuantError, match="call prefill"):
        session.decode([1])
    with pytest.raises(MLAQuantError, match="lengths"):
        session.prefill(torch.zeros(2, 5, dtype=torch.long), lengths=[5, 0])
    session.prefill([[1, 2], [3, 4, 5]])
    with pytest.raises(MLAQuantError, match="got 1 tokens for a batch of 2"):
        session.decode([1])
