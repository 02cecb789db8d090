"""The FP32 references of attention over the latent cache, in one place: prefill and residual windows
(`masked_attention`, `causal_attention`: queries over rows given as tensors), decode over the paged, quantized cache
(`mla_decode_reference`, the "torch" backend of `mlaquant.attention.ops.mla_decode`), and the exact merge of
softmax partials over disjoint key sets (`merge_exact_lse`). Every fast path is tested against these.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mlaquant.attention.buffers import Buffers
from mlaquant.attention.decode_inputs import DecodeInputs, gather_pages


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    visible: torch.Tensor,
    near: tuple[torch.Tensor, torch.Tensor] | None = None,
    use_near: torch.Tensor | None = None,
    with_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of T queries over S keys, each query reading only its `visible` keys, all in FP32
    (q, k, v are upcast first; a no-op for FP32 inputs).

    q [B, T, H, D]; k [B, S, H, D] per head or [B, S, D] shared (MQA); v [B, S, H, E] or [B, S, E];
    visible: bool, broadcastable to [B, H, T, S]. With `near` = (k, v) of the last W keys (shapes as k, v
    with W for S), the (query, key) pairs of `use_near` (bool [T, S], False outside the last W keys) read
    them instead of k, v: a residual window of unquantized rows. Returns (out [B, T, H, E] float32,
    log-sum-exp of the scaled scores [B, H, T] float32 when `with_lse`, else None).
    """
    q, k, v = q.float(), k.float(), v.float()
    near = None if near is None else (near[0].float(), near[1].float())
    k_sub = "bshd" if k.dim() == 4 else "bsd"
    v_sub = "bshe" if v.dim() == 4 else "bse"
    scores = torch.einsum(f"bthd,{k_sub}->bhts", q, k) * scale  # [B, H, T, S]
    S = scores.shape[-1]
    if near is not None:
        W = near[0].shape[1]
        near_scores = torch.einsum(f"bthd,{k_sub}->bhts", q, near[0]) * scale  # [B, H, T, W]
        scores[..., S - W :] = torch.where(use_near[:, S - W :], near_scores, scores[..., S - W :])
    scores.masked_fill_(~visible, float("-inf"))
    lse = scores.logsumexp(-1) if with_lse else None
    probs = scores.softmax(-1, dtype=torch.float32)
    del scores  # [B, H, T, S]: free it before the weighted sums (long prefill chunks)
    if near is None:
        return torch.einsum(f"bhts,{v_sub}->bthe", probs, v), lse
    out = torch.einsum(f"bhts,{v_sub}->bthe", probs * ~use_near, v)
    return out + torch.einsum(f"bhts,{v_sub}->bthe", probs[..., S - W :] * use_near[:, S - W :], near[1]), lse


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    near: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal `masked_attention` of the last T positions of a sequence over all S of its keys.

    q [B, T, H, D] (positions S−T .. S−1); k, v as in `masked_attention`. With `near` = (k, v) of the
    last W positions and `window` R, the query at position p reads `near` for keys p − R < s ≤ p (within
    those W) and k, v for older keys. Returns [B, T, H, E].
    """
    T, S = q.shape[1], k.shape[1]
    q_pos = torch.arange(S - T, S, device=q.device)[:, None]
    k_pos = torch.arange(S, device=q.device)[None]
    visible = k_pos <= q_pos  # [T, S]
    use_near = None
    if near is not None:
        use_near = visible & (q_pos - k_pos < window) & (k_pos >= S - near[0].shape[1])
    return masked_attention(q, k, v, scale, visible, near, use_near)[0]


def merge_exact_lse(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Exact merge of softmax partials over disjoint key sets: outs [B, H, d], lses [B, H]."""
    if len(outs) == 1:
        return outs[0]
    lse = torch.stack(lses)  # [S, B, H]
    w = torch.softmax(lse, dim=0)[..., None]
    return (torch.stack(outs) * w).sum(0)


def mla_decode_reference(inputs: DecodeInputs, scale: float, scratch: Buffers | None = None) -> tuple[Tensor, Tensor]:
    """FP32 torch reference of `mla_decode` for checked inputs (`DecodeInputs`: q [B, H, d_c + d_r], the paged
    pool, block_table, seq_lens, codec) → out [B, H, d_c] float32, lse [B, H] float32: gathers only the rows
    t < seq_lens[b], decodes them with the codec, and runs exact attention. Keep TF32 matmuls off on CUDA when
    using it as a reference.

    The decoded FP32 rows and the scores go into the buffers of `scratch` (fresh ones when None), which a session
    reuses step after step (`mlaquant.attention.buffers`).
    """
    q, pool, codec, d_c = inputs.q, inputs.pool, inputs.codec, inputs.d_c
    scratch = Buffers() if scratch is None else scratch
    pages, lens = inputs.host_pages()
    t_max = max(lens, default=0)
    n_pages = -(-t_max // pool.shape[1])
    raw = gather_pages(pool, [row + [0] * (n_pages - len(row)) for row in pages])[:, :t_max]  # [B, T, row_bytes]
    batch, heads, _ = q.shape
    # the two parts are decoded apart and never concatenated: one less pass over the rows per step
    c_kv = scratch.take("c_kv", (batch, t_max, d_c), device=q.device)
    k_pe = scratch.take("k_pe", (batch, t_max, codec.kpe.width), device=q.device)
    codec.decode_parts(raw, out=(c_kv, k_pe))
    for b, n in enumerate(lens):
        if n < t_max:
            c_kv[b, n:] = 0.0  # slots past a sequence's end are undefined and may decode to NaN / Inf
            k_pe[b, n:] = 0.0
    q = q.float()
    # rows @ q^T runs several times faster on CPU than q @ rows^T (BLAS with a transposed large operand)
    scores = scratch.take("scores", (batch, t_max, heads), device=q.device)  # [B, T, H]
    torch.bmm(c_kv, q[..., :d_c].transpose(1, 2), out=scores).baddbmm_(k_pe, q[..., d_c:].transpose(1, 2))
    # the softmax on a contiguous [B, H, T] copy: reductions along a strided dim are far slower
    probs = scratch.take("probs", (batch, heads, t_max), device=q.device).copy_(scores.transpose(1, 2)).mul_(scale)
    for b, n in enumerate(lens):
        if n < t_max:
            probs[b, :, n:] = float("-inf")
    lse = torch.logsumexp(probs, dim=-1)  # [B, H]
    # an empty sequence has lse = -inf; subtracting 0 instead keeps its probabilities 0, not NaN
    probs.sub_(lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1)).exp_()
    return torch.bmm(probs, c_kv), lse  # [B, H, d_c], [B, H]
