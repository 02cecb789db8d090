"""The MLA decode-attention op over the paged, quantized latent cache: the op and its backend choice (`ops`),
its one input contract (`decode_inputs`), the fast CPU path on the codes (`cpu_decode`) and its C helper
(`native`, which builds the C sources in `csrc/`). In the data flow it is the step after the cache: the decode
session (`mlaquant.runtime`) and the W8A8 projections (`mlaquant.modeling.int8_proj`) call it on rows stored by
`mlaquant.quant`'s codecs; its Triton backend is `mlaquant.kernels`.
"""
