"""The MLA model and its checkpoints: the model (config, RoPE/YaRN, attention, MLP/MoE, latent rotation;
`model`), the Hugging Face DeepSeek-V2/V3 checkpoint loader (`loader`), a checkpoint run one decoder layer at a
time (`stream`), the one protocol both run under (`protocol.LatentModel`), the W8A8 absorbed projections
(`int8_proj`) and a random DeepSeek-shaped checkpoint writer (`synthetic`). The start of the data flow: a
checkpoint becomes an `MLAModel` here, which calibration (`mlaquant.calib`), evaluation (`mlaquant.evaluation`)
and the decode runtime (`mlaquant.runtime`) then run.
"""
