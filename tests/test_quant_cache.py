"""Quantized latent cache: teacher-forced fake quantization equals decode; exact byte accounting."""

from __future__ import annotations

import pytest
import torch

from mlaquant import DecodeSession
from mlaquant.evaluation.eval import fake_quant_hook
from mlaquant.quant.codecs import LayerCodec
from mlaquant.runtime.session import generate

PLANS = ["int8", "int4", "int4-g32-asym/int8-row", "int4-row/fp16", "int4+w5", "int8-row/int4+w9"]


@pytest.mark.parametrize("plan", PLANS)
def test_teacher_forced_fake_quant_equals_step_decode(tiny_model, plan):
    cfg = tiny_model.cfg
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    session = DecodeSession(tiny_model, plan=plan, backend="torch")  # the exact path evaluation computes
    codecs, window = session.codecs, session.plan.window
    # expanded attention, every row fake-quantized (the most recent `window` rows per query FP16)
    teacher = tiny_model(ids, fake_quant_hook(codecs, window), window=window)[0]
    fp = tiny_model(ids)[0]
    assert (teacher - fp).abs().max() > 1e-4  # the codec really changes the logits
    steps = [session.prefill(ids[:, :1])[0, 0]]
    steps += [session.decode(ids[:, t])[0] for t in range(1, ids.shape[1])]
    # FP32 path differences (expanded vs absorbed, ~1e-7) can flip a value across an FP16 rounding
    # boundary when the window rounds rows to FP16 first; a wrong window would be off by ≫ 1e-3.
    tol = 1e-3 if window else 1e-5
    assert (torch.stack(steps) - teacher).abs().max() < tol
    # strict prefill (rows read back from the cache) equals the same teacher-forced logits
    strict = DecodeSession(tiny_model, plan=plan, runtime={"prefill_chunks": [[0, 7]]}).prefill(ids)[0]
    assert (strict - teacher).abs().max() < tol
    if window:  # the window really changes what queries read
        assert (tiny_model(ids, fake_quant_hook(codecs))[0] - teacher).abs().max() > 10 * tol


def test_fp16_cache_bytes_per_token_and_padding(tiny_model):
    cfg = tiny_model.cfg
    session = DecodeSession(tiny_model, plan="fp16")
    session.prefill([list(range(70)), list(range(5))])
    session.decode(torch.tensor([1, 2]))
    tokens, layers = 71 + 6, cfg.num_hidden_layers
    row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    assert session.cache_nbytes() == tokens * layers * row
    blocks = 2 + 1  # 71 tokens → 2 blocks of 64, 6 tokens → 1 block
    assert session.cache.padding_nbytes() == (blocks * 64 - tokens) * layers * row
    assert session.cache.reserved_nbytes() >= session.cache_nbytes() + session.cache.padding_nbytes()


def test_int4_cache_counts_codes_scales_and_zero_points(tiny_model):
    cfg = tiny_model.cfg
    session = DecodeSession(tiny_model, plan="int4-g16-asym/int8-row")
    session.prefill([list(range(10))])
    d_c, d_r = cfg.latent_widths
    row = (d_c // 2 + 4 * (d_c // 16)) + (d_r + 2)
    assert session.codecs[0].row_bytes == row
    assert session.cache_nbytes() == 10 * cfg.num_hidden_layers * row


def test_widened_layer_reads_both_segments(tiny_model):
    """After a runtime fallback, old rows keep the narrow codec and new rows use the wider one."""
    cfg = tiny_model.cfg
    d_c, d_r = cfg.latent_widths
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    session = DecodeSession(tiny_model, plan="int4", backend="torch")  # exact, as the teacher-forced hook
    session.prefill(ids[:, :12])
    assert session.widen_layer(1, "test")
    steps = [session.decode(ids[:, t])[0] for t in range(12, 20)]
    narrow = LayerCodec.from_names("int4", "int4", d_c, d_r)
    wide = LayerCodec.from_names("int8-g32", "int8-g32", d_c, d_r)

    def hook(layer, rows):
        out = narrow.fake_quant(rows)
        if layer == 1:
            out[:, 12:] = wide.fake_quant(rows[:, 12:])
        return out

    teacher = tiny_model(ids, hook)[0, 12:20]
    assert (torch.stack(steps) - teacher).abs().max() < 1e-5
    assert session.fallback_events[0]["to"] == wide.name == "int8-row/int8-row"
    assert len(session.cache.layers[1]) == 2 and len(session.cache.layers[0]) == 1


def test_generate_greedy_matches_argmax_of_full_forward(tiny_model):
    prompt = [3, 14, 15, 9, 2, 6]
    new = generate(tiny_model, prompt, 6, plan="fp32")[0]
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(tiny_model(torch.tensor([seq]))[0, -1].argmax()))
    assert new == seq[len(prompt) :]
    a = generate(tiny_model, prompt, 8, temperature=1.0, top_p=0.9, seed=3)[0]
    assert a == generate(tiny_model, prompt, 8, temperature=1.0, top_p=0.9, seed=3)[0]


def test_window_rows_stay_fp16_and_are_counted(tiny_model):
    cfg = tiny_model.cfg
    d = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    session = DecodeSession(tiny_model, plan="int4-row/int4-row+w8")
    session.prefill([list(range(20)), list(range(3))])
    quant_row = session.codecs[0].row_bytes
    # sequence 0: 12 rows quantized + 8 in the window; sequence 1: 3 rows, all in the window
    assert session.cache_nbytes() == cfg.num_hidden_layers * (12 * quant_row + (8 + 3) * d * 2)
    assert session.cache.recent_rows(0, 0).shape == (8, d)
    session.decode([1, 2])
    assert session.cache.layers[0][0].lens == [13, 0] and session.cache.recent_rows(0, 1).shape == (4, d)
