"""What the plugin changes in vLLM besides adding its backend and quantization method: the CPU RoPE of MLA layers
(per layer, through vLLM's out-of-tree layer hook) and, opt-in, vLLM's own CPU MLA prefill (bounded memory).

**The CPU RoPE.** vLLM 0.32's plain `RotaryEmbedding.forward_cpu` (vllm/model_executor/layers/rotary_embedding/
base.py) calls the C op `rotary_embedding`, which reads the query and key as `[tokens, heads · head_size]` rows:
right for the flattened inputs attention layers pass, wrong for the `[T, H, d_r]` query slice and the strided
`[T, 1, d_r]` key that the MLA layer passes (vllm/model_executor/layers/mla.py
`MultiHeadLatentAttentionWrapper.forward`: `q[..., d_n:]`, `k_pe`). It runs only where custom ops are on
(eager mode, `enforce_eager`; compiled mode sets `custom_ops` to none and takes `forward_native`) and only for
plain RoPE: DeepSeek's YaRN configs build `DeepseekScalingRotaryEmbedding` (rotary_embedding/
deepseek_scaling_rope.py), which has no `forward_cpu` and runs `forward_native` everywhere. `fix_mla_rope` sends
one MLA layer's rotary embedding to vLLM's own `forward_native` where it would run that C op; `PlanMLAWrapper`,
registered as vLLM's out-of-tree `MultiHeadLatentAttentionWrapper` (`PluggableLayer.register_oot`,
vllm/model_executor/custom_op.py), applies it to the layers mlaquant serves (and, with MLAQUANT_VLLM_ROPE_FIX=1, to
vLLM's own MLA layers) and is vLLM's class otherwise. Other models' rotary embeddings are never touched.

**The bounded prefill** (`bound_cpu_prefill`, MLAQUANT_VLLM_PREFILL_ROWS): for `mlaquant bench vllm`'s baseline,
vLLM's own CPU_MLA at long contexts.
"""

from __future__ import annotations

import os

from mlaquant.integrations.vllm.settings import (
    PREFILL_ROWS_ENV,
    ROPE_FIX_ENV,
    SUPPORTED_VLLM,
    VLLMPluginError,
)

WRAPPER = "MultiHeadLatentAttentionWrapper"  # the class name vLLM keys its out-of-tree layers by


def fix_mla_rope(rope) -> bool:
    """Dispatch `rope` (one MLA layer's rotary embedding, a vLLM `CustomOp`) to vLLM's `forward_native` where it
    would run plain `RotaryEmbedding.forward_cpu` (the C op); True if it did. VLLMPluginError when `rope` is not the
    CustomOp vLLM 0.32 builds (no `_forward_method`, vLLM's per-instance dispatch)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if rope is None:
        return False
    if "_forward_method" not in vars(rope):
        raise VLLMPluginError(f"this vLLM's rotary embedding ({type(rope).__name__}) has no _forward_method: the CPU "
                          f"RoPE fix was written for vLLM {', '.join(SUPPORTED_VLLM)}")
    method = rope._forward_method
    if getattr(method, "__func__", None) is not RotaryEmbedding.__dict__.get("forward_cpu"):
        return False
    rope._forward_method = rope.forward_native
    return True


def mla_wrapper_class() -> type:
    """vLLM's MLA layer class with the RoPE fix for the layers the plugin serves (module docstring)."""
    from vllm.model_executor.layers import mla

    base = getattr(mla, WRAPPER, None)
    if base is None:
        raise VLLMPluginError(f"this vLLM has no {WRAPPER}: the plugin was written for vLLM "
                              f"{', '.join(SUPPORTED_VLLM)}")

    class PlanMLAWrapper(base):
        """vLLM's `MultiHeadLatentAttentionWrapper`; its rotary embedding on `forward_native` on CPU where the plan
        backend serves the layer, or where the fix is asked for alone (MLAQUANT_VLLM_ROPE_FIX=1)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            from mlaquant.integrations.vllm.backend import PlanMLAImpl

            if isinstance(self.mla_attn.impl, PlanMLAImpl) or os.environ.get(ROPE_FIX_ENV) == "1":
                fix_mla_rope(self.rotary_emb)

    PlanMLAWrapper.__name__ = PlanMLAWrapper.__qualname__ = "PlanMLAWrapper"
    return PlanMLAWrapper


def register_mla_wrapper() -> None:
    """Register `mla_wrapper_class()` as vLLM's out-of-tree MLA layer; VLLMPluginError if another one is registered
    (another plugin replaces the layer: the RoPE fix could not reach it)."""
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    if WRAPPER in op_registry_oot:
        if op_registry_oot[WRAPPER].__name__ == "PlanMLAWrapper":
            return
        raise VLLMPluginError(f"another plugin replaces vLLM's {WRAPPER} ({op_registry_oot[WRAPPER].__qualname__}): "
                          "mlaquant's plugin cannot fix its CPU RoPE")
    PluggableLayer.register_oot(mla_wrapper_class(), name=WRAPPER)


def bound_cpu_prefill(rows: int) -> None:
    """Run vLLM's own CPU MLA prefill attention `rows` query rows at a time.

    vLLM 0.32's CPU MLA prefill (`CPUSDPAMLAPrefillBackend._ragged_sdpa`,
    vllm/v1/attention/backends/mla/prefill/cpu_sdpa.py) forms each request's whole FP32 score matrix, heads × T × T
    (16 × 16,384² × 4 B = 17 GB, and as much again for the softmax), and its CPU platform turns chunked prefill off
    for MLA (vllm/platforms/cpu.py), so a 16k prompt is OOM-killed on a 24 GB machine. This replacement keeps its
    math row for row — FP32 scores, its top-left causal mask, softmax, its log-sum-exp — on blocks of `rows`
    queries against the keys they can see, so memory is heads × rows × T. Decode (`forward_mqa`) is untouched: this
    is what lets `mlaquant bench vllm` time vLLM's own decode at long contexts. VLLMPluginError when this vLLM has
    no `_ragged_sdpa` to replace."""
    import torch

    try:
        from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend as backend
    except ImportError:
        backend = None
    if backend is None or "_ragged_sdpa" not in backend.__dict__:
        raise VLLMPluginError(f"{PREFILL_ROWS_ENV}: this vLLM has no CPUSDPAMLAPrefillBackend._ragged_sdpa to bound: "
                          f"written for vLLM {', '.join(SUPPORTED_VLLM)}")

    def _ragged_sdpa(self, q, k, v, q_cu_seq_lens, kv_cu_seq_lens, causal, return_softmax_lse):
        outs, lses = [], []
        for r in range(q_cu_seq_lens.numel() - 1):
            q0, q1, k0, k1 = (int(x) for x in (q_cu_seq_lens[r], q_cu_seq_lens[r + 1], kv_cu_seq_lens[r],
                                               kv_cu_seq_lens[r + 1]))
            q_r, k_r, v_r = (t.transpose(0, 1).float() for t in (q[q0:q1], k[k0:k1], v[k0:k1]))  # [NH, S, d]
            for a in range(0, q1 - q0, rows):
                b = min(a + rows, q1 - q0)
                keys = min(b, k1 - k0) if causal else k1 - k0  # query i sees keys ≤ i (vLLM's triu(1) mask)
                scores = torch.matmul(q_r[:, a:b], k_r[:, :keys].transpose(-2, -1)) * self.scale
                if causal:
                    mask = torch.ones((b - a, keys), dtype=torch.bool, device=scores.device).triu(1 + a)
                    scores.masked_fill_(mask.unsqueeze(0), float("-inf"))
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
                outs.append(torch.matmul(probs, v_r[:, :keys]).transpose(0, 1).to(v.dtype))  # [rows, NH, d_v]
                if return_softmax_lse:
                    lses.append(torch.logsumexp(scores, dim=-1))  # [NH, rows]
        out = torch.cat(outs, dim=0)
        return (out, torch.cat(lses, dim=1)) if return_softmax_lse else out

    _ragged_sdpa.mlaquant_rows = rows
    backend._ragged_sdpa = _ragged_sdpa


def prefill_rows(value: str) -> int:
    """`MLAQUANT_VLLM_PREFILL_ROWS`'s value as a positive int; VLLMPluginError (one line) otherwise."""
    if not value.isdigit() or int(value) < 1:
        raise VLLMPluginError(f"{PREFILL_ROWS_ENV}={value}: expected a positive number of query rows")
    return int(value)
