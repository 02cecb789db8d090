"""Tier 1: our MLA model and decode session agree with transformers' DeepSeek-V2/V3 in FP32."""

from __future__ import annotations

import pytest
import torch

from mlaquant import DecodeSession, load_model
from mlaquant.attention.reference import causal_attention

TOL = 1e-4

CONFIGS = {
    "v3-qlora-none-moe-interleave": (3, dict(q_lora_rank=None, n_group=2, topk_group=1)),
    "v3-qlora-yarn-noninterleave": (3, dict(q_lora_rank=24, yarn=True, rope_interleave=False, norm_topk_prob=False)),
    "v3-tied-dense-only": (3, dict(q_lora_rank=None, first_k_dense_replace=3, tie_word_embeddings=True)),
    "v2-yarn-greedy": (2, dict(q_lora_rank=None, yarn=True, topk_method="greedy", routed_scaling_factor=2.0)),
    "v2-qlora-group-limited": (2, dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=2, topk_group=1)),
}


def hf_step_logits(hf, prompt: list[int], steps: list[int]) -> list[torch.Tensor]:
    """transformers' own prefill + cached decode: [prefill logits [T, V], step logits [V], ...]."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        logits, cache = [out.logits[0]], out.past_key_values
        for t in steps:
            out = hf(torch.tensor([[t]]), cache=cache, use_cache=True)
            logits.append(out.logits[0, -1])
            cache = out.past_key_values
    return logits


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_prefill_and_decode_match_transformers(make_checkpoint, name):
    version, overrides = CONFIGS[name]
    hf, path = make_checkpoint(version, **overrides)
    model = load_model(path)
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 19))
    with torch.no_grad():
        ref = hf(ids).logits
    assert ref.abs().max() > 0.5  # logits are not trivially small
    assert (model(ids) - ref).abs().max() < TOL

    # batch 2 with prompts of different lengths, chunked prefill (chunk 5 < prompt), 4 decode steps
    prompts = [ids[0, :19].tolist(), ids[1, :11].tolist()]
    steps = torch.randint(0, 96, (4, 2))
    session = DecodeSession(model, plan="fp32", runtime={"prefill_chunks": [[0, 5]]})
    ours_prefill = session.prefill(prompts)
    ours_steps = [session.decode(steps[i]) for i in range(steps.shape[0])]
    for b, prompt in enumerate(prompts):
        expected = hf_step_logits(hf, prompt, steps[:, b].tolist())
        assert (ours_prefill[b, : len(prompt)] - expected[0]).abs().max() < TOL
        assert torch.isnan(ours_prefill[b, len(prompt) :]).all()
        for i, step in enumerate(ours_steps):
            assert (step[b] - expected[i + 1]).abs().max() < TOL, f"decode step {i} of sequence {b}"


def test_absorbed_attention_equals_expanded(make_checkpoint):
    hf, path = make_checkpoint(3, q_lora_rank=24, yarn=True)
    model = load_model(path)
    attn = model.layers[0].self_attn
    torch.manual_seed(2)
    x = torch.randn(1, 13, model.cfg.hidden_size)
    cos, sin = model.rotary(torch.arange(13)[None], torch.float32)
    expanded = attn.forward_sequence(x, cos, sin)
    q = attn.absorbed_query(x, cos, sin)
    rows = attn.latent(x, cos, sin)
    absorbed = attn.output_from_latent(causal_attention(q, rows, rows[..., : model.cfg.kv_lora_rank], attn.scale))
    assert (absorbed - expanded).abs().max() < 1e-5 * expanded.abs().max()


def test_auto_model_loads_same_directory(make_checkpoint):
    from transformers import AutoModelForCausalLM

    _, path = make_checkpoint(3)
    auto = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        assert (load_model(path)(ids) - auto(ids).logits).abs().max() < TOL
