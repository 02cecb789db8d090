"""Triton kernels of mlaquant, installed as `mlaquant.kernels` (never importable as top-level `kernels`).

    mla_decode   split-KV MLA decode over the paged FP16/INT8/INT4 latent cache (+ gated merge of partials)
    mla_decode_jit  its @triton.jit kernels and device functions (mla_decode launches them)
    int8_gemm    W8A8 GEMM with per-token / per-channel scales and LLM.int8() outlier columns
    aot          compile every kernel variant for sm_90a / sm_80 on the CPU: registers, spills, MMA, cost model

Importing this package is free; `mla_decode` and `int8_gemm` import triton, and decide at import time
whether they run compiled (CUDA) or in triton's CPU interpreter (TRITON_INTERPRET=1 set before triton is
first imported). Callers go through `mlaquant.attention.ops`, which picks the backend. `mlaquant bench kernels`
(`mlaquant.bench.kernels`; CUDA only, `--aot` compiles for a GPU on the CPU) times them.
"""
