"""The vLLM plugin's entry point: what it registers with vLLM, in every process.

vLLM loads `register` from the `vllm.general_plugins` entry point (pyproject.toml) in every process — front end,
engine core, each worker before the model (vllm/plugins/__init__.py `load_general_plugins`); a plugin whose import
fails is logged and skipped (`load_plugins_by_group`), which is why a plan travels *declared* in the model
directory: a vLLM that did not load the plugin refuses the directory instead of serving it unquantized.

How a model gets its plan:

    declared         config.json's `quantization_config.quant_method` "mlaquant" (`mlaquant export --engine vllm
                     --codecs plan` writes it; `declaration`): vLLM builds `quant_config.MLAQuantConfig`, which
                     gives every MLA layer the plan backend, on every platform, with no flag or variable. Without
                     the plugin vLLM stops: "Unknown quantization method: mlaquant".
    MLAQUANT_PLAN    a plan directory for every MLA model of the process (plan directories never exported): the plan
                     backend (`backend.PlanMLABackend`) registered under every dense MLA backend name vLLM can
                     choose on CPU or CUDA (`settings.DENSE_MLA_BACKENDS`), so whatever vLLM selects is the plan's.

`--kv-cache-dtype` stays `auto`: the codecs come from the plan, one per layer.
"""

from __future__ import annotations

import os

from mlaquant.integrations.vllm.settings import (
    BACKEND_PATH,
    DENSE_MLA_BACKENDS,
    PLAN_ENV,
    PREFILL_ROWS_ENV,
    ROPE_FIX_ENV,
    check_vllm_version,
    plan_directory,
    supported,
)


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point.

    On a supported vLLM (`settings.SUPPORTED_VLLM`), always: the quantization method "mlaquant"
    (`register_quantization_config`) and the MLA layer with the CPU RoPE fix for planned layers
    (`patches.register_mla_wrapper`) — neither changes a model that declares no plan. With MLAQUANT_PLAN: the
    plan backend under every dense MLA backend name (`register_backend`, vllm/v1/attention/backends/registry.py);
    with MLAQUANT_VLLM_ROPE_FIX=1 the RoPE fix on vLLM's own backends; with MLAQUANT_VLLM_PREFILL_ROWS=N vLLM's
    own CPU MLA prefill N query rows at a time (`patches.bound_cpu_prefill`). Any of those on another vLLM:
    VLLMPluginError naming the supported versions. On another vLLM without them: nothing (a declared model is then
    refused by vLLM itself)."""
    import vllm

    plan, rope_only, rows = os.environ.get(PLAN_ENV), os.environ.get(ROPE_FIX_ENV) == "1", os.environ.get(
        PREFILL_ROWS_ENV)
    if plan or rope_only or rows:
        check_vllm_version(vllm.__version__)
    elif not supported(vllm.__version__):
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from mlaquant.integrations.vllm import patches
    from mlaquant.integrations.vllm.declaration import QUANT_METHOD
    from mlaquant.integrations.vllm.quant_config import MLAQuantConfig

    register_quantization_config(QUANT_METHOD)(MLAQuantConfig)
    patches.register_mla_wrapper()
    if rows:
        patches.bound_cpu_prefill(patches.prefill_rows(rows))
    if plan:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        plan_directory()
        for name in DENSE_MLA_BACKENDS:
            register_backend(AttentionBackendEnum[name], BACKEND_PATH)
