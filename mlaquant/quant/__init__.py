"""Quantization of the latent cache and of weights: the row codecs (one token's `[c_kv | k_pe]` row ↔ bytes;
`codecs`), the band packing of the sub-4-bit tier (`band_codecs`), other engines' cache formats reproduced
(`engine_codecs`), per-channel value ranges of latent rows (`ranges`) and the W8A8 rules (`int8_quant`). In the
data flow it sits between the model's latent and everything that stores or reads it: the cache
(`mlaquant.runtime`), the decode op (`mlaquant.attention`, `mlaquant.kernels`), calibration and evaluation all
encode and decode through these codecs; it imports nothing of mlaquant but its top-level helpers.
"""
