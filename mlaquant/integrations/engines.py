"""What vLLM, SGLang and llama.cpp do with an MLA latent cache, and what each of their cache settings costs on
a model: `mlaquant engines`.

Facts, for the releases in ENGINE_VERSIONS (one place: upgrading is a one-line change, after which
tests/test_engines.py executes the new release's code and fails where a fact below no longer holds):

    SCALE_TARGETS    [executed] engine → checkpoint scale name (layer i) → the MLA attention parameter it loads
                     into; a name not listed is dropped. vLLM 0.33.0: none, under every quant config
                     (`mlaquant.integrations.engine_check.vllm_scale_loads`); SGLang 0.5.23:
                     `self_attn.{k,v}_proj.{k,v}_scale` → `self_attn.attn_mqa.{k,v}_scale`
                     (`engine_check.sglang_scale_loads`).
    MLA_KV_METHOD    [executed] vLLM quant config → whether it gives `MLAAttention` a KV-cache method at all.
    SGLANG_BACKENDS  [read] SGLang MLA attention backend → what it does with a loaded `k_scale`, and
    SGLANG_DEFAULTS  [read] the default backend for DeepSeek-V3 by GPU (sglang/srt/arg_groups/
                     model_override_base.py `get_default_attn_backend`, model_overrides/deepseek_v2.py).

So no checkpoint scale reaches an MLA cache and is applied by default in either engine: `mlaquant export`
writes none and prices the engines' fp8 at k_scale 1.0 (docs/engines.md has the executed steps, names in and
out, for a report upstream).

FORMATS: each engine cache setting as mlaquant codecs (`mlaquant.quant.engine_codecs`, values bit-exact with the
engine's quantizer); `mlaquant engines` (`mlaquant.calib.engines`) prices them on a model.
"""

from __future__ import annotations

import dataclasses

ENGINE_VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}

# the names a DeepSeek checkpoint can carry for layer i's KV-cache scale (ModelOpt, compressed-tensors, the
# deprecated fused one, the engines' own parameter names)
SCALE_NAMES = tuple(
    f"model.layers.{{i}}.self_attn.{n}"
    for n in ("k_proj.k_scale", "v_proj.v_scale", "k_scale", "v_scale", "kv_scale",
              "mla_attn.mla_attn.k_scale", "attn_mqa.k_scale", "attn.k_scale")
)
SCALE_TARGETS = {
    "vllm": {},
    "sglang": {
        "model.layers.{i}.self_attn.k_proj.k_scale": "model.layers.{i}.self_attn.attn_mqa.k_scale",
        "model.layers.{i}.self_attn.v_proj.v_scale": "model.layers.{i}.self_attn.attn_mqa.v_scale",
        "model.layers.{i}.self_attn.attn_mqa.k_scale": "model.layers.{i}.self_attn.attn_mqa.k_scale",
    },
}
MLA_KV_METHOD = {"compressed-tensors": False, "fp8": False, "modelopt": True}
SGLANG_BACKENDS = {
    "fa3": "ignored: head_dim 576 > 256 turns the descale off (flashattention_backend.py prepare_paged_mha_query)",
    "flashinfer": "ignored: keys read as a plain upcast (flashinfer_mla_backend.py forward_decode/extend)",
    "flashmla": "misapplied: written unscaled, read with descale_k = k_scale (flashmla_backend.py forward_decode)",
    "trtllm_mla": "misapplied: written unscaled, logits × k_scale (trtllm_mla_backend.py _compute_decode_bmm1_scale)",
    "cutedsl_mla": "misapplied: as trtllm_mla (cutedsl_mla_backend.py)",
    "triton": "misapplied for prefill rows: decode divides on write, the MHA prefill writes unscaled, every read "
    "× k_scale (triton_backend.py forward_decode, forward_mha.py _set_mla_kv_buffer)",
}
SGLANG_DEFAULTS = {"sm80": "triton", "sm90": "fa3", "sm100": "trtllm_mla"}


@dataclasses.dataclass(frozen=True)
class CacheFormat:
    """One engine cache setting: `codec` '<c_kv>/<k_pe>' in mlaquant codec names (`mlaquant.quant.engine_codecs`)."""

    name: str
    engine: str
    setting: str
    codec: str
    note: str


FORMATS = (
    CacheFormat("vllm fp8", "vllm", "--kv-cache-dtype fp8", "e4m3/e4m3",
                "k_scale 1.0: no checkpoint scale reaches MLAAttention in vLLM 0.33.0"),
    CacheFormat("vllm fp8_ds_mla", "vllm", "--kv-cache-dtype fp8_ds_mla", "fp8-ds/bf16",
                "sparse FlashMLA (DeepSeek-V3.2): e4m3, power-of-two FP32 scale per 128, RoPE BF16"),
    CacheFormat("vllm nvfp4_ds_mla", "vllm", "--kv-cache-dtype nvfp4_ds_mla", "nvfp4/e4m3",
                "sparse FlashMLA, SM100: e2m1 with an e4m3 scale per 16, RoPE e4m3 unscaled"),
    CacheFormat("sglang fp8_e4m3", "sglang", "--kv-cache-dtype fp8_e4m3", "e4m3/e4m3",
                "k_scale 1.0: the default backends ignore (fa3) or misapply (trtllm_mla) a checkpoint scale"),
    CacheFormat("sglang nvfp4", "sglang", "--kv-cache-dtype nvfp4 (or fp4_mx_block16)", "mxfp4/mxfp4",
                "MLATokenToKVPoolFP4: e2m1 with a UE8M0 scale per 16, RoPE too"),
    CacheFormat("llama.cpp f16", "llama.cpp", "-ctk f16", "fp16/fp16", "the FP16 latent"),
    CacheFormat("llama.cpp q8_0", "llama.cpp", "-ctk q8_0 -ctv q8_0 -fa", "q8_0/q8_0", "blocks of 32, FP16 scale"),
    CacheFormat("llama.cpp q4_0", "llama.cpp", "-ctk q4_0 -ctv q4_0 -fa", "q4_0/q4_0", "blocks of 32, FP16 scale"),
)


def vllm_serve_command(model_dir: str, skip_layers: list[int]) -> str:
    """The vLLM command serving `model_dir` with an fp8 latent cache, `skip_layers` kept in the model dtype
    (`--kv-cache-dtype-skip-layers` takes layer indices, nargs '+': vllm/engine/arg_utils.py)."""
    skip = f" --kv-cache-dtype-skip-layers {' '.join(map(str, skip_layers))}" if skip_layers else ""
    return f"vllm serve {model_dir} --kv-cache-dtype fp8{skip}"


def sglang_serve_command(model_dir: str) -> str:
    """The SGLang command serving `model_dir` with an fp8 latent cache (every layer: SGLang 0.5.23 has no
    per-layer KV dtype) on the GPU's default MLA backend, which ignores checkpoint scales or misapplies them:
    the exported checkpoint carries none."""
    return f"python -m sglang.launch_server --model-path {model_dir} --kv-cache-dtype fp8_e4m3"
