"""The plan as vLLM's quantization method "mlaquant": how a model directory that declares its plan gets it served.

vLLM builds a model's quantization config from `config.json`'s `quantization_config` (its `quant_method` names a
registered method: vllm/model_executor/layers/quantization/__init__.py `register_quantization_config`,
`get_quantization_config`) and asks it, layer by layer, for the layer's method (`get_quant_method`). The MLA
layer asks while it is built — after vLLM's platform chose its attention backend, before the backend's impl is
made (vllm/model_executor/layers/attention/mla_attention.py `MLAAttention.__init__` → `_init_kv_cache_quant`,
then `impl_cls(...)`) — so the method for an MLA layer sets that layer's backend to the plan backend sized to the
layer's codec, whichever backend the platform chose (CPU_MLA / AMX_MLA on CPU, FlashInfer-MLA / FlashMLA /
CUTLASS-MLA / Triton-MLA by capability on CUDA). It asks again after the weights are loaded
(`MLAAttention.process_weights_after_loading`): there the impl must be the plan's, or vLLM stops.

Every other layer gets the checkpoint's own method (`base`, e.g. DeepSeek-V3's fp8) or vLLM's unquantized one.

    declared       config.json's quantization_config (`mlaquant.integrations.vllm.declaration`): the plan
                   directory inside the model directory, and the checkpoint sample it was exported with
    --quantization mlaquant on an undeclared model: the plan MLAQUANT_PLAN names (vLLM builds the config
                   with no arguments: `get_quant_config`, no config file named)

A user-chosen `--attention-backend` is refused with one line: the plan chooses its layers' backend.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import vllm
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import get_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from mlaquant.integrations.vllm.backend import PlanMLABackend, PlanMLAImpl, served_plan
from mlaquant.integrations.vllm.declaration import QUANT_METHOD, Declaration
from mlaquant.integrations.vllm.settings import PLAN_ENV, VLLMPluginError, check_vllm_version, plan_directory


class MLAQuantConfig(QuantizationConfig):
    """vLLM's quantization config for a model served with a mlaquant plan (module docstring)."""

    def __init__(self, declaration: Declaration | None = None, base: QuantizationConfig | None = None) -> None:
        super().__init__()
        check_vllm_version(vllm.__version__)
        self.declaration, self.base = declaration, base
        if base is not None:
            self.packed_modules_mapping = base.packed_modules_mapping  # the model fills it for both
        self.plan_dir: Path | None = None if declaration is not None else plan_directory()
        self.model_dir: Path | None = None

    @property
    def checkpoint_sample(self) -> str | None:
        return None if self.declaration is None else self.declaration.checkpoint_sample

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return self.base.get_supported_act_dtypes() if self.base else [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # the Triton decode kernel is compiled and checked for sm_80 and sm_90a (docs/kernels.md)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict) -> MLAQuantConfig:
        """config.json's quantization_config → the config; the base method's config built by vLLM."""
        declaration = Declaration.parse(config, "config.json")
        base = None
        if declaration.base is not None:
            base = get_quantization_config(declaration.base["quant_method"]).from_config(declaration.base)
        return cls(declaration, base)

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """The model directory is known here: the declared plan is found inside it; a different MLAQUANT_PLAN
        beside a declared plan is one line (two plans for one model)."""
        self.model_dir = Path(model_name)
        if self.declaration is not None:
            if not self.model_dir.is_dir():
                raise VLLMPluginError(f"{model_name}: a model that declares a mlaquant plan is served from its "
                                      "directory (a local path)")
            self.plan_dir = plan_directory(str(self.model_dir / self.declaration.plan))
            other = plan_directory() if os.environ.get(PLAN_ENV) else None
            if other is not None and other.resolve() != self.plan_dir.resolve():
                raise VLLMPluginError(f"{model_name} declares its plan {self.plan_dir}; {PLAN_ENV} names another "
                                      f"({other}): unset {PLAN_ENV}")
        if self.base is not None:
            self.base.maybe_update_config(model_name, hf_config=hf_config, revision=revision)

    def get_cache_scale_mapper(self):
        return self.base.get_cache_scale_mapper() if self.base else super().get_cache_scale_mapper()

    def get_checkpoint_weight_mapper(self):
        return self.base.get_checkpoint_weight_mapper() if self.base else super().get_checkpoint_weight_mapper()

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.base is not None:
            self.base.apply_vllm_mapper(hf_to_vllm_mapper)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, MLAAttention):
            self._serve(layer, prefix)
            return None
        if self.base is not None:
            return self.base.get_quant_method(layer, prefix)
        return UnquantizedLinearMethod() if isinstance(layer, LinearBase) else None

    def _serve(self, layer: MLAAttention, prefix: str) -> None:
        """While the layer is built: its backend becomes the plan backend of its codec. Once built: its impl must
        be the plan's."""
        if hasattr(layer, "impl"):
            if not isinstance(layer.impl, PlanMLAImpl):
                raise VLLMPluginError(f"{prefix}: built with {type(layer.impl).__name__}, not the plan's backend: this "
                                      "vLLM builds MLA layers in an order the plugin was not written for")
            return
        vllm_config = get_current_vllm_config()
        chosen = vllm_config.attention_config.backend
        if chosen is not None:
            raise VLLMPluginError(f"--attention-backend {chosen.name}: {self.model_dir} is served by its mlaquant "
                                  "plan, whose backend every MLA layer takes; leave --attention-backend unset")
        served = served_plan(str(self.plan_dir), str(self.model_dir), self.checkpoint_sample)
        layer.attn_backend = PlanMLABackend.for_row_bytes(served.row_bytes(prefix))

