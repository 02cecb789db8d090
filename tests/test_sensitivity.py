"""The loss-weighted band allocation (`allocation: fisher`): the cache's loss gradients, the Fisher weighting of the
principal axes, and what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from mlaquant.calib.calibrate_config import CalibrateConfig
from mlaquant.calib.candidates import layer_variants
from mlaquant.calib.observers import observe
from mlaquant.calib.sensitivity import latent_fisher
from mlaquant.calib.transform import allocate_bands, loss_weighted_axes, principal_rotation
from mlaquant.config import ConfigError
from mlaquant.errors import MLAQuantError
from mlaquant.modeling.stream import StreamedModel

PCA = ("pca-1.0/int4-row", "fp16/fp16")


def _ids(model, n: int = 4, t: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.cfg.vocab_size, (n, t), generator=torch.Generator().manual_seed(seed))


def test_latent_gradients_are_the_loss_slope_along_any_direction_of_the_cache(tiny_model):
    ids = _ids(tiny_model, 2, 16)
    grads = tiny_model.latent_gradients(ids)
    assert [g.shape for g in grads] == [(2, 16, sum(tiny_model.cfg.latent_widths))] * tiny_model.cfg.num_hidden_layers
    g = torch.Generator().manual_seed(1)
    for layer in range(len(grads)):
        d = torch.randn(grads[layer].shape, generator=g)

        def loss(eps: float, layer: int = layer, d: torch.Tensor = d) -> float:
            hook = lambda i, rows: rows + eps * d if i == layer else rows
            logits = tiny_model(ids, hook).double()
            return float(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"))

        slope = (loss(1e-2) - loss(-1e-2)) / 2e-2  # central difference
        assert slope == pytest.approx(float((grads[layer] * d).sum()), rel=2e-2), layer


def test_fisher_allocation_gives_no_bits_to_a_direction_the_loss_cannot_see(tiny_model):
    """W_UK / W_UV blind to layer 0's principal axis: its variance is the largest, its loss weight nil. The variance
    allocation spends the most bits there, the Fisher allocation none."""
    model = copy.deepcopy(tiny_model)
    ids = _ids(model, 8, 32)
    d_c = model.cfg.kv_lora_rank
    stats = observe(model, ids, batch_size=4)
    axes, moments = principal_rotation(stats[0].sample()[:, :d_c])
    top = axes[:, 0]
    w = model.layers[0].self_attn.kv_b_proj.weight
    with torch.no_grad():
        w -= torch.outer(w @ top, top)  # every head's K and V ignore c_kv's component along `top`
    fisher = latent_fisher(model, ids, batch_size=4)
    assert float(top.double() @ fisher[0] @ top.double()) < 1e-9 * float(fisher[0].trace())
    cfg = CalibrateConfig(candidates=PCA, allocation="fisher", band_block=8)
    stats = observe(model, ids, batch_size=4)
    plain, weighted = layer_variants(model, stats, CalibrateConfig(candidates=PCA, band_block=8)), layer_variants(
        model, stats, cfg, fisher
    )
    assert torch.allclose(plain[0].pca[:, 0].abs(), top.abs(), atol=1e-4)  # the variance order starts there
    assert torch.allclose(weighted[0].pca[:, -1].abs(), top.abs(), atol=1e-4)  # the loss order ends there
    assert torch.allclose(weighted[0].pca.T @ weighted[0].pca, torch.eye(d_c), atol=1e-5)
    bands = lambda v: [tuple(map(int, b.split("x"))) for b in v.resolve(PCA[0]).split("/")[0].split("-")[1:]]
    assert bands(plain[0])[0][0] > 0  # the variance spends bits on the first block, the blind axis in it
    assert bands(weighted[0])[-1][0] == 0  # the loss spends none on the last, where the blind axis went


def test_loss_weighted_axes_with_a_uniform_fisher_keep_the_variance_order():
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(4096, 32, generator=g) * torch.logspace(1, -1, 32)
    axes, moments = principal_rotation(rows)
    same, weights = loss_weighted_axes(axes, moments, 3.0 * torch.eye(32, dtype=torch.float64))
    assert torch.equal(same, axes) and torch.allclose(weights, 3.0 * moments)
    assert allocate_bands(weights, 2.0, 8) == allocate_bands(moments, 2.0, 8)


def test_fisher_allocation_refuses_a_streamed_model_and_configs_it_cannot_serve(synthetic, tmp_path):
    ckpt = synthetic(tmp_path / "ckpt", 2)
    with pytest.raises(MLAQuantError, match=r"^calibrate: allocation 'fisher' needs the model loaded whole"):
        latent_fisher(StreamedModel(ckpt), torch.zeros(2, 8, dtype=torch.long), 2)
    with pytest.raises(ConfigError, match="allocation must be 'variance' or 'fisher', got 'loss'"):
        CalibrateConfig(candidates=PCA, allocation="loss")
    with pytest.raises(ConfigError, match="allocation 'fisher' allocates the bits of 'pca-<rate>' candidates"):
        CalibrateConfig(allocation="fisher")
