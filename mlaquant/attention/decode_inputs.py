"""The input contract of `mla_decode`, declared once: every backend (the torch reference in `mlaquant.attention.ops`,
the Triton kernel in `mlaquant.kernels.mla_decode`) builds a `DecodeInputs` from its arguments, which
checks them the same way for all.

    q            float [B, H, d_c + d_r]                 absorbed query (d_c + d_r = codec.width)
    pool         uint8 [num_blocks, block_size, R]       R = codec.row_bytes, block_size ≥ 1
    block_table  integer [B, max_blocks]                 token t of sequence b: block_table[b, t // block_size]
    seq_lens     integer [B], 0 ≤ seq_lens[b] ≤ max_blocks · block_size
    codec        the layer's `LayerCodec`, d_c = codec.ckv.width
    all four tensors on one device

Construction checks shapes, dtypes and devices only (no device synchronisation); `check_lens` /
`longest` check the lengths once the caller has them on the host. The Triton kernel reads a narrower
layout on top (`check_kernel_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mlaquant.quant.codecs import LayerCodec

KERNEL_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class DecodeInputs:
    """The arguments of one `mla_decode` call, checked on construction (ValueError naming the argument)."""

    q: Tensor
    pool: Tensor
    block_table: Tensor
    seq_lens: Tensor
    codec: LayerCodec
    d_c: int

    def __post_init__(self) -> None:
        q, pool, table, lens, codec = self.q, self.pool, self.block_table, self.seq_lens, self.codec
        if q.dim() != 3 or q.shape[-1] != codec.width or not q.is_floating_point():
            raise ValueError(f"mla_decode: q must be float [B, H, {codec.width}], got {q.dtype} {list(q.shape)}")
        if self.d_c != codec.ckv.width:
            raise ValueError(f"mla_decode: d_c={self.d_c} but codec {codec.name} has c_kv width {codec.ckv.width}")
        if pool.dtype != torch.uint8 or pool.dim() != 3 or pool.shape[-1] != codec.row_bytes or not pool.shape[1]:
            raise ValueError(
                f"mla_decode: pool must be uint8 [num_blocks, block_size, {codec.row_bytes}] for {codec.name}, "
                f"got {pool.dtype} {list(pool.shape)}"
            )
        batch = q.shape[0]
        if table.dim() != 2 or table.shape[0] != batch or table.is_floating_point():
            got = f"{table.dtype} {list(table.shape)}"
            raise ValueError(f"mla_decode: block_table must be int [{batch}, max_blocks], got {got}")
        if tuple(lens.shape) != (batch,) or lens.is_floating_point():
            raise ValueError(f"mla_decode: seq_lens must be int [{batch}], got {lens.dtype} {list(lens.shape)}")
        devices = {t.device for t in (q, pool, table, lens)}
        if len(devices) != 1:
            raise ValueError(f"mla_decode: q, pool, block_table, seq_lens must share a device, got {devices}")

    @property
    def capacity(self) -> int:
        """The most tokens the block table can address: max_blocks · block_size."""
        return self.block_table.shape[1] * self.pool.shape[1]

    def check_lens(self, lo: int, hi: int) -> int:
        """`hi` after checking that [lo, hi] (the smallest and the largest seq_lens) lies in [0, capacity]."""
        if lo < 0 or hi > self.capacity:
            raise ValueError(
                f"mla_decode: seq_lens must lie in [0, {self.capacity}] (max_blocks x block_size), got [{lo}, {hi}]"
            )
        return hi

    def longest(self, max_seq_len: int | None = None) -> int:
        """The longest context, checked: `max_seq_len` when given (a host-side bound ≥ max(seq_lens), no
        device sync), else max(seq_lens) read from the device."""
        if max_seq_len is not None:
            return self.check_lens(0, int(max_seq_len))
        if not self.q.shape[0]:
            return 0
        lo, hi = (int(v) for v in torch.stack([self.seq_lens.min(), self.seq_lens.max()]).tolist())
        return self.check_lens(lo, hi)

    def host_pages(self) -> tuple[list[list[int]], list[int]]:
        """(the block ids of each sequence's pages, seq_lens) read to the host and checked: lengths within
        capacity, every block id a sequence reads within [0, num_blocks). A few hundred ints, read without
        per-element device ops; entries past a sequence's pages are never read (they may be anything)."""
        num_blocks, block_size = self.pool.shape[0], self.pool.shape[1]
        lens = self.seq_lens.tolist()
        t_max = self.check_lens(min(lens), max(lens)) if lens else 0
        n_pages = -(-t_max // block_size)
        pages = [row[: -(-n // block_size)] for row, n in zip(self.block_table[:, :n_pages].tolist(), lens)]
        read = [row for row in pages if row]
        if read and (min(map(min, read)) < 0 or max(map(max, read)) >= num_blocks):
            raise ValueError(f"mla_decode: block_table names blocks outside [0, {num_blocks}) within seq_lens")
        return pages, lens

    def check_kernel_layout(self) -> None:
        """What the Triton kernel reads beyond the contract: q fp16/bf16/fp32, int32 index tensors, and pool
        blocks whose rows are contiguous."""
        if self.q.dtype not in KERNEL_Q_DTYPES:
            raise ValueError(f"mla_decode: q must be fp16/bf16/fp32, got {self.q.dtype}")
        for name, t in (("block_table", self.block_table), ("seq_lens", self.seq_lens)):
            if t.dtype != torch.int32:
                raise ValueError(f"mla_decode: the Triton kernel reads {name} as int32, got {t.dtype}")
        if self.pool.stride(2) != 1 or self.pool.stride(1) != self.codec.row_bytes:
            raise ValueError("mla_decode: each pool block must be contiguous")


def gather_pages(pool: Tensor, pages: list[list[int]], out: Tensor | None = None) -> Tensor:
    """Pages `pages[b]` (block ids, n per sequence) of pool uint8 [num_blocks, block_size, row_bytes], in
    order → uint8 [B, n * block_size, row_bytes]: a view of the pool when there is one sequence and its
    pages are consecutive (a sequence filled in order), else whole-page copies, written into `out` (uint8,
    contiguous, that shape) when given."""
    num_blocks, block_size, row_bytes = pool.shape
    batch, n = len(pages), len(pages[0])
    first = pages[0][0] if n else 0
    if batch == 1 and pages[0] == list(range(first, first + n)) and pool.is_contiguous():
        return pool[first : first + n].view(1, n * block_size, row_bytes)
    # whole pages as flat rows of 8-byte words: index_select copies them several times faster than pool[pages]
    flat = pool.reshape(num_blocks, block_size * row_bytes)
    words = flat.shape[1] % 8 == 0 and flat.is_contiguous()
    flat = flat.view(torch.int64) if words else flat
    index = torch.tensor(pages, dtype=torch.long, device=pool.device).flatten()
    if out is not None:
        dest = out.view(batch * n, block_size * row_bytes)
        torch.index_select(flat, 0, index, out=dest.view(torch.int64) if words else dest)
        return out
    return flat.index_select(0, index).view(torch.uint8).view(batch, n * block_size, row_bytes)
