"""Triton kernels of mlaquant, installed as `mlaquant.kernels`.

    mla_decode   split-KV MLA decode over the paged FP16/INT8/INT4 latent cache (+ gated merge of partials)
    mla_decode_jit  its @triton.jit kernels and device functions (mla_decode launches them)
    int8_gemm    W8A8 GEMM with per-token / per-channel scales and LLM.int8() outlier columns
    aot          compile every kernel variant for sm_90a / sm_80 on the CPU: registers, spills, MMA, cost model

Importing this package is free; `mla_decode` and `int8_gemm` import triton, and decide at import time
whether they run compiled (CUDA) or in triton's CPU interpreter (TRITON_INTERPRET=1 set before triton is
first imported). Callers go through `mlaquant.attention.ops`, which picks the backend. `mlaquant bench kernels`
(`mlaquant.bench.kernels`; CUDA only, `--aot` compiles for a GPU on the CPU) times them.

Top-level `kernels` is Hugging Face's package, which transformers 5.25 requires and imports. From a checkout's
root (`python -m mlaquant`, `python -c`) this directory comes first on sys.path under that name; imported so, it
loads the installed `kernels` in its place (`_hand_over`), or stays this package where none is installed.
"""

import sys
from pathlib import Path


def _hand_over() -> None:
    """Put the installed top-level `kernels` (found on sys.path without this checkout's root) into sys.modules
    under that name; the import that got here then returns it. Nothing where none is installed."""
    import importlib.machinery
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    path = [p for p in sys.path if Path(p or ".").resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec(__name__, path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over()
