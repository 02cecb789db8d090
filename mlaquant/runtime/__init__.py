"""Decoding with a plan: the `Plan` (per-layer codecs, calibrated ranges and guard bounds; saved and loaded;
`plan`), the paged per-layer-codec `LatentCache` (`cache`), `DecodeSession` (prefill + step decode, `generate`;
`session`) and the runtime guard that widens a layer's codec when its error breaks the bounds (`guard`). In the
data flow it follows calibration: it takes the plan `mlaquant.calib` writes and a model from `mlaquant.modeling`,
stores rows with `mlaquant.quant`'s codecs and calls the `mlaquant.attention` op every step.
"""
