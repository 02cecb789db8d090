"""mlaquant: calibrated low-bit latent KV caches for Multi-head Latent Attention models (DeepSeek-V2/V3).

Public API (imported lazily, so `import mlaquant` stays cheap for the CLI):

    load_model(path=None, device="cpu", dtype="auto") -> MLAModel
        a Hugging Face DeepSeek-V2/V3 checkpoint directory or Hub id; None: the bundled model
    DecodeSession(model, plan="fp16" | "int8" | "int4[+i8mm]" | PLAN_DIR | Plan, backend="auto", guard=None)
        prefill(ids [B, T]) -> logits; decode(next_ids [B]) -> logits, over a paged latent cache in the plan's
        codecs
    generate(model, prompt_ids, max_new_tokens, plan="fp16", guard=None, ...) -> list[list[int]]
        the new tokens of each prompt (greedy at temperature 0, else nucleus sampling)

Subpackages, in the order the data flows: modeling (model, loader, streamed layers), mlaquant.calib (plan
search), quant (codecs), runtime (plan, cache, session, guard), attention (the decode op: torch, C fast path,
Triton in mlaquant.kernels), evaluation, integrations (transformers, lm-eval, vLLM / SGLang export, llama.cpp),
bench, bundled. The command line: `mlaquant --help`.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "mlaquant.modeling.loader",
    "DecodeSession": "mlaquant.runtime.session",
    "generate": "mlaquant.runtime.session",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mlaquant' has no attribute {name!r}")
