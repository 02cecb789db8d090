"""One layer's planned cache in vLLM's pages, without vLLM: what the plugin's backend writes and reads.

vLLM hands an MLA layer `uint8 [num_blocks, block_size, row_bytes]` pages (the plugin's `customize_spec` sets
`row_bytes` to the layer's codec), a flat slot per new token (block · block_size + offset; −1 for padding) and, per
sequence, a block table. `LayerPages` turns vLLM's tensors into mlaquant's cache rows and back:

    row      = C.encode([c_kv·R_c | k_pe[P]·R_r])        C the layer's codec, P the RoPE de-interleave
    decode   = mla_decode([q_lat | q_pe[P]·R_r], pages, block_table, seq_lens, C)   (q_lat = q_nope·W_UK·R_c)

P: vLLM's DeepSeek applies RoPE interleaved (pairs (x0, x1), (x2, x3) …), mlaquant caches k_pe as [even | odd]
dims (`mlaquant.modeling.loader` de-interleaves at load): the plan's k_pe rotation, groups and clip ranges are in that
order. Scores are unchanged by a permutation or an orthogonal R applied to both sides. R_c is folded into the
weights (W_UK, W_UV) by the backend, so it appears here only on the written rows.

Decode requests may carry several query tokens (speculative decoding's verify step, a short extend): `decode_rows`
makes each token a decode row of its own over its request's pages, attending up to its own position — on the codes,
like every decode. Prefill attention over the rows read back (`causal_sdpa`) runs in torch's fused kernels, never
its math path.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from mlaquant.attention import ops
from mlaquant.quant.codecs import LayerCodec


def cuda_codec_problem(codec: LayerCodec, device: str = "cuda") -> str | None:
    """Why the Triton decode kernel cannot read `codec` on `device`, or None: on CUDA the plugin decodes with the
    kernel only (its torch reference would be a silent slowdown), so a problem stops vLLM."""
    from mlaquant.attention.backends import TritonBackend

    return TritonBackend().supports(codec, torch.device(device))


def decode_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None,
                tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's decode requests → one decode row per query token.

    block_table [B, max_blocks], seq_lens [B] (each request's length with its new tokens), query_start_loc [B + 1]
    (request r's query tokens are tokens query_start_loc[r] .. [r + 1] − 1; None: one token each), `tokens` = N the
    query tokens → block_table [N, max_blocks] (token i reads its request's pages) and seq_lens [N]: token j of
    request r (of q_r) sees its first seq_lens[r] − q_r + 1 + j rows, itself last."""
    if query_start_loc is None or tokens == block_table.shape[0]:
        return block_table, seq_lens
    starts = query_start_loc.long()
    lens = starts[1:] - starts[:-1]  # [B]
    req = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)  # [N]
    if req.numel() != tokens:
        raise ValueError(f"decode query_start_loc covers {req.numel()} tokens, the query has {tokens}")
    position = torch.arange(tokens, device=lens.device) - starts[req]
    return block_table[req], (seq_lens.long()[req] - lens[req] + 1 + position).to(seq_lens.dtype)


def rope_order(d_r: int, interleaved: bool) -> torch.Tensor | None:
    """Channel order taking vLLM's interleaved-RoPE k_pe / q_pe to mlaquant's [even | odd] (None: same order)."""
    if not interleaved:
        return None
    return torch.cat((torch.arange(0, d_r, 2), torch.arange(1, d_r, 2)))


@dataclasses.dataclass
class LayerPages:
    """A layer's codec and latent transforms: r_c [d_c, d_c] / r_r [d_r, d_r] float32 or None (identity), order the
    RoPE permutation or None."""

    codec: LayerCodec
    d_c: int
    r_c: torch.Tensor | None = None
    r_r: torch.Tensor | None = None
    order: torch.Tensor | None = None

    def rows(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """vLLM's kv_c_normed [T, d_c] and k_pe [T, (1,) d_r] → the rows mlaquant caches, float32 [T, d_c + d_r]."""
        c_kv = kv_c_normed.float()
        if self.r_c is not None:
            c_kv = c_kv @ self.r_c.to(c_kv.device)
        return torch.cat((c_kv, self.rope(k_pe.reshape(k_pe.shape[0], -1).float())), dim=-1)

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        """q_pe / k_pe [..., d_r] in vLLM's order → mlaquant's order, rotated by R_r (float32)."""
        x = x.float()
        if self.order is not None:
            x = x[..., self.order.to(x.device)]
        return x if self.r_r is None else x @ self.r_r.to(x.device)

    def write(self, pages: torch.Tensor, slots: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Encode the new tokens' rows into their slots of `pages` (slot −1: padding, skipped)."""
        slots = slots.flatten().long()
        keep = slots >= 0
        flat = pages.view(-1, self.codec.row_bytes)
        flat[slots[keep]] = self.codec.encode(self.rows(kv_c_normed[keep], k_pe[keep]))

    def read(self, pages: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
        """One sequence's first `length` rows, decoded: float32 [length, d_c + d_r]."""
        block = pages.shape[1]
        blocks = block_table_row[: -(-length // block)].long()
        return self.codec.decode(pages[blocks].reshape(-1, self.codec.row_bytes)[:length])

    def decode(self, q_lat: torch.Tensor, q_pe: torch.Tensor, pages: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed decode: q_lat [B, H, d_c] (q_nope·W_UK·R_c), q_pe [B, H, d_r] in vLLM's order → out [B, H, d_c]
        float32 in R_c's space, lse [B, H], by `mlaquant.attention.ops.mla_decode` on `backend`."""
        query = torch.cat((q_lat.float(), self.rope(q_pe)), dim=-1).contiguous()
        return ops.mla_decode(query, pages, block_table.to(torch.int32), seq_lens.to(torch.int32), self.codec,
                              self.d_c, scale, backend)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last T positions of a sequence over its L keys: q [T, H, D], k [L, H, D], v [L, H, E]
    → [T, H, E], by torch's fused SDPA only (flash on CPU, flash or memory-efficient on CUDA), never its math
    fallback: that one holds the [H, T, L] FP32 scores (16 × 16,384² × 4 B = 17 GB for one 16k-token prompt of 16
    heads). The fused CPU kernel takes 4-D inputs with V as wide as K, so V is zero-padded to D and the output cut
    back to E."""
    T, L, E = q.shape[0], k.shape[0], v.shape[-1]
    positions = torch.arange(L, device=q.device)
    mask = None if T == L else positions[None] <= positions[L - T :, None]  # [T, L]: key before or at the query
    if E < q.shape[-1]:
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - E))
    heads_first = [x.transpose(0, 1)[None] for x in (q, k, v)]  # [1, H, ·, D]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        o = torch.nn.functional.scaled_dot_product_attention(*heads_first, attn_mask=mask, is_causal=mask is None,
                                                             scale=scale)
    return o[0, ..., :E].transpose(0, 1)
