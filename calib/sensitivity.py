"""Stage observe, the loss's side: how much each cached channel matters to the loss (`latent_fisher`), for the
loss-weighted band allocation of `mlaquant.calib.transform` (config `allocation: fisher`).

To second order, independent errors e on a layer's cached rows raise the summed next-token loss ℓ by about
½·E[eᵀ H e], and the Fisher matrix E[g gᵀ] of the gradients g = ∂ℓ/∂row stands in for the Hessian H. Its
diagonal in a rotated basis weighs each channel's error: `transform.loss_weighted_axes` allocates bits by it.
The gradients need every layer at once, so this runs on a model loaded whole (`MLAModel`), not `--stream`.
"""

from __future__ import annotations

import torch

from mlaquant.errors import MLAQuantError
from mlaquant.modeling.model import MLAModel
from mlaquant.modeling.protocol import LatentModel

FISHER_SAMPLES = 32  # the first calibration samples: enough for a stable diagonal on the bundled model


def latent_fisher(model: LatentModel, samples: torch.Tensor, batch_size: int, progress=None) -> list[torch.Tensor]:
    """Per layer the Fisher matrix of its c_kv, E[g gᵀ] over the cached positions of samples[:FISHER_SAMPLES]
    [n, T] int64: [d_c, d_c] float64 on the CPU (g the c_kv part of ∂ℓ/∂row, module docstring)."""
    if not isinstance(model, MLAModel):
        raise MLAQuantError(
            "calibrate: allocation 'fisher' needs the model loaded whole (its gradients run through every layer); "
            "drop --stream or use allocation: variance"
        )
    d_c = model.cfg.kv_lora_rank
    fisher = [torch.zeros(d_c, d_c, dtype=torch.float64) for _ in model.layers]
    count = 0
    for batch in samples[:FISHER_SAMPLES].split(batch_size):
        for total, g in zip(fisher, model.latent_gradients(batch)):
            c = g[..., :d_c].reshape(-1, d_c).double().cpu()
            total += c.T @ c
        count += batch.numel()
        if progress is not None:
            progress.update(1)
    return [f / count for f in fisher]
