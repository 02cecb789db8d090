"""Shared fixtures: tiny random DeepSeek-V2/V3 checkpoints built offline with transformers."""

from __future__ import annotations

import os

import pytest
import torch

BASE = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=12,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    n_group=1,
    topk_group=1,
)
# Triton kernels run on the CPU under the interpreter; it must be chosen before triton is imported,
# and any test module may be the first to import it.
os.environ.setdefault("TRITON_INTERPRET", "1")

YARN = {
    "rope_theta": 10000.0,
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


def build_hf_model(version: int, seed: int = 0, **overrides):
    """A random transformers DeepseekV{2,3}ForCausalLM with weights large enough for O(1) logits."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg_cls, model_cls = {2: (DeepseekV2Config, DeepseekV2ForCausalLM), 3: (DeepseekV3Config, DeepseekV3ForCausalLM)}[
        version
    ]
    kwargs = {**BASE, **overrides}
    if kwargs.pop("yarn", False):
        kwargs["rope_parameters"] = YARN
    model = model_cls(cfg_cls(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "layernorm" in name or name.endswith("norm.weight") else 0.08))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    return model


@pytest.fixture
def make_checkpoint(tmp_path):
    """make_checkpoint(version, **config) → (hf_model, checkpoint_dir)."""
    counter = iter(range(1000))

    def make(version: int, seed: int = 0, **overrides):
        model = build_hf_model(version, seed, **overrides)
        path = tmp_path / f"ckpt{next(counter)}"
        model.save_pretrained(path)
        return model, path

    return make


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Our MLAModel loaded from a random DeepSeek-V3 checkpoint (3 layers, d_c 32, d_r 8, MoE)."""
    from mlaquant import load_model

    path = tmp_path_factory.mktemp("tiny")
    build_hf_model(3, q_lora_rank=None).save_pretrained(path)
    return load_model(path)


# dimensions of the tiny synthetic checkpoints written by mlaquant.modeling.synthetic
SYNTH_DIMS = dict(
    hidden=48, heads=4, kv_lora_rank=32, rope_dim=8, nope_dim=12, v_dim=12, q_lora_rank=24,
    intermediate=64, experts=4, moe_intermediate=16,
)  # fmt: skip


@pytest.fixture(scope="session")
def synthetic():
    """write(path, layers, **overrides) → a checkpoint dir from mlaquant.modeling.synthetic with
    SYNTH_DIMS (overrides: shards, seed, dtype, any dimension)."""
    from mlaquant.modeling.synthetic import write_checkpoint

    return lambda path, layers, **kw: write_checkpoint(path, **{**SYNTH_DIMS, "layers": layers, **kw})


@pytest.fixture
def fresh_native_build(monkeypatch):
    """`mlaquant.attention.native` unbuilt and the routing of "auto" unread (both are cached per process:
    `backends.cpu_routing`) under this test's monkeypatches (the fixture's value: set MLAQUANT_NATIVE / CC with it),
    rebuilt as they were afterwards."""
    from mlaquant.attention import backends, native

    native._library.cache_clear()
    backends.cpu_routing.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    native._library.cache_clear()
    backends.cpu_routing.cache_clear()
