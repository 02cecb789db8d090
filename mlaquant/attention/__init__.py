"""Attention over the latent cache: the MLA decode op over the paged, quantized cache (`ops`) and its backends
(`backends`: one `supports` question each, the CPU routing rule), the FP32 references of every attention over the
cache — prefill, residual windows, decode — (`reference`), its one input contract (`decode_inputs`), the buffers the
decode paths reuse (`buffers`), the fast CPU path on the codes (`cpu_decode`) and its C helper (`native`, which
builds the C sources in `csrc/`). In the data flow it is the step after the cache: the decode
session (`mlaquant.runtime`) and the W8A8 projections (`mlaquant.modeling.int8_proj`) call it on rows stored by
`mlaquant.quant`'s codecs; its Triton backend is `mlaquant.kernels`.
"""
