"""Transform coding of the latent for calibration: a per-layer rotation that decorrelates c_kv (its principal
axes on the calibration rows) and the bits per channel band that the rotated variances call for.

Any orthogonal R on c_kv folds exactly into W_UK / W_UV (`mlaquant.modeling.model.with_latent_rotation`), so a layer
may cache c_kv·R. With R the eigenvectors of the rows' second moment E[c cᵀ] (largest eigenvalue first) the
rotated channels are uncorrelated and their variances σ_i² fall steeply; at a given rate the squared error
of independent scalar codes is least when b_i ≈ b̄ + ½·log2(σ_i² / geometric-mean σ²) (reverse
water-filling). `allocate_bands` does that greedily on blocks of `block` channels with the band codec's
bit widths (`mlaquant.quant.band_codecs.BAND_BITS`): each step gives the next width to the block whose squared
error falls most per bit spent, σ_b²·2^(-2b) for b bits (σ_b² for 0), while the budget lasts.

With `allocation: fisher` the bits follow the loss instead of the row error (`loss_weighted_axes`): channel i of
the rotated rows costs about ½·F_ii·E[e_i²] of loss (F the layer's Fisher matrix in the rotated basis,
`mlaquant.calib.sensitivity`), and E[e_i²] ∝ σ_i²·2^(-2b_i), so the water-filling runs on σ_i²·F_ii, the axes
reordered by it (a permutation keeps R orthogonal; the bands are contiguous in the new order).

Candidate names: `pca-<rate>` for the c_kv part ('pca-2.5/int4-row'), rate = code bits per c_kv value
(scales not counted: the plan's bytes count them); a layer resolves it to the band codec of its own
variances (`band_spec`).
"""

from __future__ import annotations

import torch

from mlaquant.quant.band_codecs import BAND_BITS

PCA = "pca-"


def is_transform_candidate(ckv: str) -> bool:
    """A c_kv candidate name of this module ('pca-<rate>')."""
    return ckv.startswith(PCA)


def principal_rotation(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """c_kv rows [n, d_c] → (R [d_c, d_c] orthogonal, columns the principal axes, largest second moment first;
    the second moments of rows·R [d_c], descending). FP64 eigendecomposition, R returned FP32."""
    c = rows.double()
    moments, axes = torch.linalg.eigh(c.T @ c / c.shape[0])
    order = moments.argsort(descending=True)
    return axes[:, order].float(), moments[order].clamp_min(0).float()


def loss_weights(axes: torch.Tensor, moments: torch.Tensor, fisher: torch.Tensor) -> torch.Tensor:
    """σ_i²·(Rᵀ F R)_ii [d_c] float64 for the principal `axes` R [d_c, d_c] (columns), their second `moments` σ²
    [d_c] and the layer's Fisher matrix F of c_kv [d_c, d_c] (`latent_fisher`): each axis's loss weight."""
    a = axes.double()
    return moments.double() * ((a.T @ fisher.double()) * a.T).sum(1)


def loss_weighted_axes(
    axes: torch.Tensor, moments: torch.Tensor, fisher: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The principal `axes` reordered by their `loss_weights`, largest first, and those weights [d_c] descending:
    what `allocate_bands` then spends the bits on (module docstring)."""
    weights = loss_weights(axes, moments, fisher)
    order = weights.argsort(descending=True)
    return axes[:, order], weights[order].clamp_min(0).float()


def allocate_bands(variances: torch.Tensor, rate: float, block: int = 16,
                   widths: tuple[int, ...] = BAND_BITS) -> tuple[tuple[int, int], ...]:
    """Bits for channels of descending `variances` [d] in blocks of `block` (module docstring) spending at most
    rate·d code bits → bands ((bits, channels), ...), adjacent blocks of equal bits merged."""
    d = variances.numel()
    if d % block:
        raise ValueError(f"band allocation: block {block} does not divide width {d}")
    energy = variances.view(-1, block).sum(1).double()  # [d / block]
    bits = [0] * energy.numel()
    budget, spent = int(rate * d), 0
    while True:
        best, best_gain, best_step = None, 0.0, 0
        for k, b in enumerate(bits):
            nxt = next((w for w in widths if w > b), None)
            if nxt is None or spent + (nxt - b) * block > budget:
                continue
            gain = float(energy[k]) * ((2.0 ** (-2 * b) if b else 1.0) - 2.0 ** (-2 * nxt)) / ((nxt - b) * block)
            if gain > best_gain:
                best, best_gain, best_step = k, gain, nxt - b
        if best is None:
            break
        bits[best] += best_step
        spent += best_step * block
    bands: list[list[int]] = []
    for b in bits:
        if bands and bands[-1][0] == b:
            bands[-1][1] += block
        else:
            bands.append([b, block])
    return tuple((b, w) for b, w in bands)


def band_spec(name: str, variances: torch.Tensor, block: int, widths: tuple[int, ...]) -> str:
    """The band codec name a layer with these rotated `variances` [d_c] gets for candidate `name` ('pca-2.5')."""
    rate = float(name[len(PCA):])
    return "band" + "".join(f"-{b}x{w}" for b, w in allocate_bands(variances, rate, block, widths))
