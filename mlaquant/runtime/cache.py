"""`LatentCache`: the paged, growing, per-layer-codec latent cache of a batch of sequences.

Per layer the cache holds only latent rows `[c_kv | k_pe]` (d_c + d_r values per token), encoded by
that layer's `LayerCodec` into `row_bytes` bytes (sizes from the codec's `RowLayout`, byte layouts:
`mlaquant.quant.codecs`). Rows live in paged blocks of `block_size` tokens (64, like FlashMLA):

    pool         uint8 [capacity_blocks, block_size, row_bytes]   one per (layer, segment)
    block table  per sequence, the pool blocks holding its rows in order
    token t of sequence b  →  pool[table_b[t // block_size], t % block_size]

Nothing is sized to a maximum length: a pool starts with the blocks the first write needs and doubles
its capacity when full; a sequence takes a new block each `block_size` tokens.

With a residual window R (KIVI-style), the most recent R rows of each sequence stay FP16 in a small
per-layer buffer and are encoded into the paged pool only when they leave the window; rows are
rounded to FP16 on arrival, so a row is quantized from its FP16 value either way.

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

from mlaquant.quant.codecs import LayerCodec


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
    _table: torch.Tensor | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        row_bytes = self.codec.layout.row_bytes
        self.pool = torch.empty(0, self.block_size, row_bytes, dtype=torch.uint8, device=self.device)
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
            self._table = None
        done = 0
        while done < n:  # one slice copy per block the rows land in
            block, slot = divmod(pos + done, self.block_size)
            take = min(n - done, self.block_size - slot)
            self.pool[self.tables[b][block], slot : slot + take] = codes[done : done + take]
            done += take
        self.lens[b] = pos + n

    def read(self, b: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decoded rows of sequence b: [lens[b], d_c + d_r]."""
        n = self.lens[b]
        if n == 0:
            return torch.empty(0, self.codec.width, dtype=dtype, device=self.device)
        blocks = torch.tensor(self.tables[b][: -(-n // self.block_size)], device=self.device)
        codes = self.pool[blocks].reshape(-1, self.codec.layout.row_bytes)[:n]
        return self.codec.decode(codes, dtype)

    def block_table(self) -> torch.Tensor:
        """int32 [B, max_blocks] (unused entries 0) for the paged attention op; rebuilt only when a
        sequence took a new block."""
        if self._table is None:
            width = max(1, max(len(t) for t in self.tables))
            rows = [t + [0] * (width - len(t)) for t in self.tables]
            self._table = torch.tensor(rows, dtype=torch.int32, device=self.device)
        return self._table

    def seq_lens(self) -> torch.Tensor:
        return torch.tensor(self.lens, dtype=torch.int32, device=self.device)


class LatentCache:
    """Paged latent cache for `batch` sequences, one codec per layer (see module docstring)."""

    def __init__(
        self, codecs: list[LayerCodec], batch: int, block_size: int = 64, device: str = "cpu", window: int = 0
    ) -> None:
        self.batch = batch
        self.block_size = block_size
        self.device = torch.device(device)
        self.window = window
        self.layers: list[list[Segment]] = [[Segment(c, block_size, batch, self.device)] for c in codecs]
        self.recent: list[list[torch.Tensor]] = [
            [torch.empty(0, c.width, dtype=torch.float16, device=self.device) for _ in range(batch)] for c in codecs
        ]

    def codec(self, layer: int) -> LayerCodec:
        """The codec new rows of `layer` are written with."""
        return self.layers[layer][-1].codec

    def length(self, b: int) -> int:
        last = self.layers[0][-1]
        return last.starts[b] + last.lens[b] + self.recent[0][b].shape[0]

    def write(self, layer: int, b: int, rows: torch.Tensor) -> None:
        """Append rows [n, d_c + d_r] to sequence b (through the FP16 window when there is one)."""
        seg = self.layers[layer][-1]
        if not self.window:
            seg.append(b, seg.codec.encode(rows))
            return
        recent = torch.cat((self.recent[layer][b], rows.to(torch.float16)))
        leaving = recent.shape[0] - self.window
        if leaving > 0:
            seg.append(b, seg.codec.encode(recent[:leaving].float()))
            recent = recent[leaving:]
        self.recent[layer][b] = recent

    def recent_rows(self, layer: int, b: int) -> torch.Tensor:
        """The FP16 window rows of sequence b (oldest first) as float32 [≤ window, d_c + d_r]."""
        return self.recent[layer][b].float()

    def read(self, layer: int, b: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """All rows of sequence b in `layer` as attention sees them, in token order: [length, d_c + d_r]."""
        parts = [seg.read(b, dtype) for seg in self.layers[layer]] + [self.recent[layer][b].to(dtype)]
        return torch.cat(parts)

    def read_quantized(self, layer: int, b: int) -> torch.Tensor:
        """All rows of sequence b as they read once quantized (window rows through the current codec)."""
        parts = [seg.read(b) for seg in self.layers[layer]]
        if self.window:
            parts.append(self.codec(layer).fake_quant(self.recent_rows(layer, b)))
        return torch.cat(parts)

    def widen(self, layer: int, codec: LayerCodec) -> None:
        """Write `layer`'s future rows with `codec` (older rows keep theirs)."""
        last = self.layers[layer][-1]
        seg = Segment(codec, self.block_size, self.batch, self.device)
        seg.starts = [last.starts[b] + last.lens[b] for b in range(self.batch)]
        self.layers[layer].append(seg)

    def nbytes(self) -> int:
        paged = sum(sum(seg.lens) * seg.codec.layout.row_bytes for segs in self.layers for seg in segs)
        return paged + sum(r.numel() * 2 for rows in self.recent for r in rows)

    def padding_nbytes(self) -> int:
        return sum(
            (seg.used_blocks * self.block_size - sum(seg.lens)) * seg.codec.layout.row_bytes
            for segs in self.layers
            for seg in segs
        )

    def reserved_nbytes(self) -> int:
        return sum(seg.pool.numel() for segs in self.layers for seg in segs) + self.window * self.batch * sum(
            2 * segs[0].codec.width for segs in self.layers
        )
