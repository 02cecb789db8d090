"""mlaquant: calibrated INT8/INT4 latent KV caches for Multi-head Latent Attention models.

Public API: `load_model`, `DecodeSession`, `generate` (imported lazily so that `import mlaquant`
stays cheap for the CLI).
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
