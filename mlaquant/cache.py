"""`LatentCache`: the paged, growing, per-layer-codec latent cache of a batch of sequences.

Per layer the cache holds only latent rows `[c_kv | k_pe]` (d_c + d_r values per token), encoded by
that layer's `LayerCodec` into `row_bytes` bytes (byte layouts: `mlaquant.codecs`). Rows live in
paged blocks of `block_size` tokens (64, like FlashMLA):

    pool         uint8 [capacity_blocks, block_size, row_bytes]   one per (layer, segment)
    block table  per sequence, the pool blocks holding its rows in order
    token t of sequence b  →  pool[table_b[t // block_size], t % block_size]

Nothing is sized to a maximum length: a pool starts with the blocks the first write needs and doubles
its capacity when full; a sequence takes a new block each `block_size` tokens.

A layer whose codec is widened at run time (the guard's fallback) starts a new *segment* with the
wider codec: older rows stay in the old segment, new rows go to the new one, and attention merges the
two partial softmaxes by their log-sum-exp. Each segment records where every sequence's rows begin.

Memory accounting (exact, per `nbytes`):
    nbytes()          Σ rows stored × row_bytes      (codes + scales + zero points: the payload)
    padding_nbytes()  unused row slots in the blocks sequences hold (at most block_size − 1 rows each)
    reserved_nbytes() pool capacity actually allocated (includes blocks not yet handed out)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlaquant.codecs import LayerCodec


@dataclass
class Segment:
    """One codec's paged rows of one layer, for every sequence of the batch."""

    codec: LayerCodec
    block_size: int
    batch: int
    device: torch.device
    pool: torch.Tensor = field(init=False)
    tables: list[list[int]] = field(init=False)
    lens: list[int] = field(init=False)
    starts: list[int] = field(init=False)
    used_blocks: int = 0

    def __post_init__(self) -> None:
        self.pool = torch.empty(0, self.block_size, self.codec.row_bytes, dtype=torch.uint8, device=self.device)
        self.tables = [[] for _ in range(self.batch)]
        self.lens = [0] * self.batch
        self.starts = [0] * self.batch

    def _take_block(self) -> int:
        if self.used_blocks == self.pool.shape[0]:
            grow = max(1, self.pool.shape[0])
            extra = torch.empty(grow, *self.pool.shape[1:], dtype=torch.uint8, device=self.device)
            self.pool = torch.cat((self.pool, extra))
        self.used_blocks += 1
        return self.used_blocks - 1

    def append(self, b: int, codes: torch.Tensor) -> None:
        """Append encoded rows uint8 [n, row_bytes] to sequence b."""
        n, pos = codes.shape[0], self.lens[b]
        needed = -(-(pos + n) // self.block_size)
        while len(self.tables[b]) < needed:
            self.tables[b].append(self._take_block())
        table = torch.tensor(self.tables[b], device=self.device)
        slots = torch.arange(pos, pos + n, device=self.device)
        self.pool[table[slots // self.block_size], slots % self.block_size] = codes
        self.lens[b] = pos + n

    def read(self, b: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decoded rows of sequence b: [lens[b], d_c + d_r]."""
        n = self.lens[b]
        if n == 0:
            return torch.empty(0, self.codec.width, dtype=dtype, device=self.device)
        blocks = torch.tensor(self.tables[b][: -(-n // self.block_size)], device=self.device)
        codes = self.pool[blocks].reshape(-1, self.codec.row_bytes)[:n]
        return self.codec.decode(codes, dtype)

    def block_table(self) -> torch.Tensor:
        """int32 [B, max_blocks] (unused entries 0) for the paged attention op."""
        width = max(1, max(len(t) for t in self.tables))
        table = torch.zeros(self.batch, width, dtype=torch.int32)
        for b, t in enumerate(self.tables):
            table[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return table.to(self.device)

    def seq_lens(self) -> torch.Tensor:
        return torch.tensor(self.lens, dtype=torch.int32, device=self.device)


class LatentCache:
    """Paged latent cache for `batch` sequences, one codec per layer (see module docstring)."""

    def __init__(self, codecs: list[LayerCodec], batch: int, block_size: int = 64, device: str = "cpu") -> None:
        self.batch = batch
        self.block_size = block_size
        self.device = torch.device(device)
        self.layers: list[list[Segment]] = [[Segment(c, block_size, batch, self.device)] for c in codecs]

    def codec(self, layer: int) -> LayerCodec:
        """The codec new rows of `layer` are written with."""
        return self.layers[layer][-1].codec

    def length(self, b: int) -> int:
        last = self.layers[0][-1]
        return last.starts[b] + last.lens[b]

    def write(self, layer: int, b: int, rows: torch.Tensor) -> torch.Tensor:
        """Encode and append rows [n, d_c + d_r] to sequence b; returns the encoded bytes [n, row_bytes]."""
        seg = self.layers[layer][-1]
        codes = seg.codec.encode(rows)
        seg.append(b, codes)
        return codes

    def read(self, layer: int, b: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """All rows of sequence b in `layer`, decoded, in token order: [length, d_c + d_r]."""
        parts = [seg.read(b, dtype) for seg in self.layers[layer]]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def widen(self, layer: int, codec: LayerCodec) -> None:
        """Write `layer`'s future rows with `codec` (older rows keep theirs)."""
        seg = Segment(codec, self.block_size, self.batch, self.device)
        seg.starts = [self.length(b) for b in range(self.batch)]
        self.layers[layer].append(seg)

    def nbytes(self) -> int:
        return sum(sum(seg.lens) * seg.codec.row_bytes for segs in self.layers for seg in segs)

    def padding_nbytes(self) -> int:
        return sum(
            (seg.used_blocks * self.block_size - sum(seg.lens)) * seg.codec.row_bytes
            for segs in self.layers
            for seg in segs
        )

    def reserved_nbytes(self) -> int:
        return sum(seg.pool.numel() for segs in self.layers for seg in segs)
