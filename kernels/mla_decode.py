"""Triton MLA decode over a paged, quantized latent cache (one query token per sequence).

Decode absorbs W_UK into the query, so attention is MQA with one KV head whose row is the cached latent
`[c_kv (d_c) | k_pe (d_r)]`; V is `c_kv` itself:

    score[b, h, t] = scale * (q[b, h, :d_c] · c_kv[t] + q[b, h, d_c:] · k_pe[t])
    out[b, h]      = Σ_t softmax_t(score[b, h, :]) · c_kv[t]            -> [B, H, d_c] float32
    lse[b, h]      = log Σ_t exp(score[b, h, t])                        -> [B, H] float32 (natural log)

Inputs: `q` [B, H, d_c + d_r] fp16/bf16/fp32, `pool` uint8 [num_blocks, P, row_bytes] with pages of
P = 64 tokens (any P works), `block_table` int32 [B, max_blocks] (token t of sequence b is row t % P of block
`block_table[b, t // P]`; entries past the sequence are never read), `seq_lens` int32 [B] (0 gives out 0,
lse −inf; other integer dtypes of the two index tensors are converted), `codec` a
`mlaquant.quant.codecs.LayerCodec`; checked by the one decode contract, `mlaquant.attention.decode_inputs.DecodeInputs`
(`check_kernel_layout` for what only this kernel needs). Slots past a sequence's end are never read, so they
may hold anything (NaN included).

Bytes read per row (little-endian; the c_kv part at byte 0, the k_pe part at byte `codec.ckv.row_bytes`;
each part of width W in groups of G channels, n_g = W / G, see `mlaquant.quant.codecs`):

    fp16            W fp16 values                       2W bytes
    int8 sym        W int8 codes (q in [-128, 127]) | n_g fp16 s (signed)           x = q * s
    int8 asym       W uint8 codes (q in [0, 255]) | n_g fp16 s | n_g fp16 lo         x = q * s + lo
    int4 sym        W/2 bytes (low nibble = channel 2j, high = 2j+1, stored q + 8, q in [-8, 7]) | n_g fp16 s (signed)
    int4 asym       W/2 bytes (nibbles q in [0, 15]) | n_g fp16 s | n_g fp16 lo
    band (c_kv)     the bands' codes in band order (b bits x w channels: w·b/8 bytes, channel c of the band at bit
                    b·c of its little-endian byte string, stored u = q + 2^(b-1), q in [-2^(b-1), 2^(b-1) - 1],
                    an 8-bit band the int8 byte) | one fp16 s per band of > 0 bits (signed)      x = q * s
                    (b in 8/4/3/2/0, w a multiple of 8; a 0-bit band stores nothing, x = 0;
                    `mlaquant.quant.band_codecs`)
    fp32 / bf16     refused here (BackendError): they exist for exactness checks on the torch path.

Scores. Each row part is scored one of two ways, chosen per block shape and part family by
`KernelConfig.dequant_scores` (`scored_parts`; configs/kernels.yaml says which and why):
- FP16 dots on the dequantized tile: the part's tile is dequantized once per tile (`half_values`, exactly the
  codec's decode rounded to FP16, as for P·V), in two halves of contiguous channels, and each half feeds an
  FP16 x FP16 `tl.dot` (FP32 accumulation) with the query rounded to FP16, times the score scale; for c_kv the
  same halves are the V tiles of P·V, reaching both dots through shared memory (`_computed_once`). Every FP16
  part of a narrow block, and the integer families listed, are scored this way; no query kernel runs for them.
  The scores then differ from the exact decode by the FP16 rounding of q and of the decoded keys only.
  A band c_kv part is always scored this way, per segment instead of per half (`band_segments`: tiles of one
  band, of power-of-two widths ≥ 16, an 8-channel remainder padded with zeros); its 0-bit channels are
  neither read nor scored, and the programs store 0 there.
- INT8 dots (the other integer parts): the query is quantized once per call by the query kernel (stage 0) per
  (token, head, group) with the cache part's grouping:
`qs = absmax(q_group) / 127` (FP32, IEEE division), `q8 = round_half_even(q_group / qs)` (an all-zero group
gets qs = 1, q8 = 0); then per group one INT8 x INT8 -> INT32 `tl.dot` with the group's codes, exact, scaled
into FP32: `qs * s * dot8` (+ `qs * lo' * Σq8` for asymmetric groups), with the score scale folded into
qs once (a float part's dot is multiplied by it instead). Asymmetric INT8 codes (0..255)
enter the dot as `q - 128` (the byte XOR 0x80) with `lo' = lo + 128 * s`; asymmetric INT4 codes enter
unchanged (lo' = lo). INT4 groups of ≥ 64 channels run as two dots over the unsigned nibbles, low (even
channels) and high (odd channels), against the query's even and odd channels, and symmetric ones subtract
8·Σq8 (the same INT32 value as Σ q8·(n − 8)); smaller INT4 groups interleave the nibbles into one INT8 tile.
On the GPU nibbles are unpacked by inline PTX four bytes per 32-bit instruction (`ASM`); the interpreter runs
the same bit operations per element; INT8 codes reach FP16 the same way (byte XOR 0x80 moved into the
mantissa of FP16 1024, 1152 subtracted: exact for every code, −128 included). `group_dot` is the reference
path for one group;
tests/test_kernel_mla_decode.py checks it bit-exactly against torch, tests/test_kernel_dequant.py checks the
in-loop `group_dot_int32` against it.

P·V: V is dequantized in-kernel (`half_values`, in two halves of the channels: contiguous for fp16 / int8 and
for FP16-scored int4, else the low and high nibbles) exactly as the codec's decode rounded to FP16 — asymmetric
codes in FP32 (`q * s + lo`), symmetric ones in FP16 (|q| ≤ 128 times an FP16 scale of either sign is exact in
FP32, so FP16's rounded product is the same bits; tests/test_kernel_dequant.py checks every codec bit for bit,
codes −128 / −8 and negative scales included) — and multiplied with P rounded to FP16 (FP32
accumulation), once per tile for all heads of the program (not INT8 P·V, which must fold the per-token V
scales into P and re-quantize it per head and group every tile: why, with its measured error, in
docs/kernels.md).

GPU layout (each choice compiled with `mlaquant bench kernels --aot`, Triton 3.9; "loop" counts the main
loop's static instructions, (n) of them in the lazy-rescale branch; docs/aot_round3.md has the tables):
- Stage 0 (`_query_kernel`) quantizes an INT8-scored part's query once per (sequence, head) into q8,
  qs·qk_scale and Σq8; stage 1 loads them, and Triton keeps the loaded int8 query in shared memory as the
  wgmma operand (quantized inside stage 1, the 64 x 576 query was held in registers: 36 per thread, spills).
- Above 16 heads on sm_90a, blocks of 128 heads on 8 warps with the 512 value channels in two programs
  (`d_split` 2): each warpgroup owns 64 heads (one M = 64 wgmma), so a head's scores, softmax and P stay inside
  one warpgroup, and the accumulator is 128 x 256 FP32. Both programs of a head block compute its scores (the
  QK MMA work doubles). On sm_80 (`targets.sm_80`: no wgmma) blocks of 32 heads on 8 warps, unsplit: the
  128-head mma.sync blocks spilled 272-3088 B per thread.
- Grouped parts at 128 heads are FP16-scored: one INT8 dot and one FP32 rescale per group made int8-g64 /
  int4-g32 issue-bound at 196 / 301 cycles per token (loop 782 / 1204 for 16 tokens); scored in FP16 on the
  dequantized tile they are MMA-bound (100 / 104 cycles, loop 799 (138) / 772 (138) for 32 tokens). Integer
  k_pe parts too (int4-row-asym 422 -> 388 µs predicted), except a row-wise k_pe beside a grouped c_kv, which
  spilled 104 B. Narrow blocks FP16-score every integer part: the V tile is dequantized anyway, and the INT8
  path's separate nibble unpack and rescale cost more (INT4-row at 16 heads: loop 960 -> 772).
- A tile dequantized for two dots passes an identity that Triton may not duplicate (`_computed_once`): without
  it Triton recomputed the dequantization in each dot's register layout (INT4-row, 16 heads: loop 1401 -> 765).
  INT8 codes become FP16 by a PRMT (`_int8_f16`), not I2F (a quarter-rate conversion).
- FP16-scored int4 parts split their channels into contiguous halves (`half_values(..., NIBBLES=False)`), so the
  FP16 query halves load contiguously: the strided loads of even / odd channels spilled 8-80 B in the prologue.
- Lazy rescaling: the running max (and the accumulators) move only when a tile's max exceeds it by more than
  2^RESCALE_LOG2 (p ≤ 256 in FP16); the rescale of the 128 x 256 accumulator was 128 FMULs per thread and tile,
  now a branch taken about twice per program (kernels/aot.py: RESCALES_PER_PROGRAM).
- A program owns one value half, a constexpr in `_chunk_loop`, so it compiles that half's dequantization only.
- A tile is BLOCK_N consecutive tokens of one sequence; when BLOCK_N divides the pool's page (32 or 16 of 64)
  it lies in one page, so one block-table entry gives a scalar base and every load of the tile is that base
  plus loop-invariant offsets (`page_rows`); other page sizes look up each token's page (`tile_rows`).
- Whole tiles run with a constant all-true mask that Triton folds away; the one partial tile of a chunk runs
  first, its tokens past the range reading the tile's first token instead (no masked loads, fewer live
  predicates: int4-g32 at 128 heads 16 -> 8 B of stack) with their scores set to −inf.
- Tiles of 32 tokens in every family (64 spill 24-104 B at 128 heads); one pipeline stage (two need 208-376
  KiB of shared memory at 128 heads). The cost model ignores latency, which more stages would hide.
- The merge (stage 2) runs 128 channels per program: 16 x 512 used all 255 registers (now 72).
- Band c_kv parts (`band_values`): codes reach FP16 without conversions — 8-bit by `_int8_f16`, 4-bit by
  `_nibble_f16`, 2- and 3-bit by shifts and masks into the mantissa of FP16 1024 (`_code_f16`), one element-wise
  plane per code position (a 3-bit band as three byte planes), interleaved into channel order like the nibbles.
  Compiled for a 256-channel band at 128 heads: loop 639 instructions at 3 bits, 583 at 2 (549 at 4, 539 at 8);
  written as one shift by a broadcast [BN, U, 8] and a reshape they were 909 / 723 (the byte loads lost their
  vectorization and the reshape went through shared memory).
- A band part whose coded channels fit in one value half (at most d_c / 2) runs one program per head block
  (`value_split`), which holds them all and computes the scores once: band-8x64-4x64-2x128-0x256 at 128 heads
  36 MMA cycles per token instead of 56 with two programs (188 instead of 276 µs predicted). With more coded
  channels the two programs share them evenly (a multiple of 16 channels near the middle, not d_c / 2).
- The band epilogue stores each segment after the loop (Triton 3.6 hoisted the pointers of a store computed
  before the loop and spilled 104 B), and the 0-bit channels as power-of-two pieces (a masked [BH, d_c] store
  of zeros spilled too).

Split-KV. The context is cut into chunks of `chunk_tokens` (a multiple of the 64-token page). By default, on
a GPU, `schedule_chunk` sizes them to fill the SMs (waves x pages per program within 10 % of the best, the
longest such chunk); under the interpreter they come from `configs/kernels.yaml` by the batch's longest
context: 512 below 2k tokens, 768 for 2k-8k, 1024 above. Stage 1 runs one program per (head block [x value
half when `d_split` is 2], chunk, sequence) — head blocks fastest, so the programs reading one tile run side
by side and all but the first hit L2; `KernelConfig.tile_for` gives the block (128 heads on 8 warps in two
value halves, wgmma, above 16 heads on sm_90a; 32 heads on 8 warps on sm_80; one 16-row block on 4 warps up
to 16) — with an FP32 online softmax (base 2, lazily rescaled: see GPU layout) and writes the chunk's
normalized partial output h_k [d_c] and its natural-log LSE λ_k. Stage 2 folds the
chunks of each sequence left to right:

    g = σ(λ_a − λ_b)             computed in FP32, then rounded to FP16 (ĝ)
    h = ĝ·h_a + (1 − ĝ)·h_b       FP16 gate applied to FP32 accumulators (1 − ĝ is exact in FP32)
    λ = max + log(e^(λ_a−max) + e^(λ_b−max))   FP32, unaffected by the gate rounding

Gate error bound. ĝ = fl16(g) has |ĝ − g| ≤ 2^-11·g for g ≥ 2^-14 and ≤ 2^-25 below (FP16 subnormals),
so one merge is off by (ĝ − g)(h_a − h_b), at most (2^-11 + 2^-25)·|h_a − h_b| per channel. Every partial is a
softmax average of V rows, so |h_a − h_b|_c ≤ R_c = max_t v[t, c] − min_t v[t, c] (the channel's spread over
the context), and an error already in h_a is multiplied by ĝ ≤ 1, never amplified. After S chunks
(S − 1 merges), against one exact softmax over the whole context:

    |h_c − h_exact,c| ≤ (S − 1) · 2^-11 · (1 + 2^-10) · R_c  +  S · 2^-20 · max_t |v[t, c]|

The (1 + 2^-10) absorbs the FP32 sigmoid's few-ulp error before the FP16 rounding and the subnormal term;
the second term covers the FP32 products and sums of each merge and the FP32 partials themselves.
`merge_error_bound` in tests/reference.py computes it (a worst case: neighbouring chunks' partials are usually
much closer than R_c).

GPU limits (checked, BackendError): power-of-two widths and groups; integer groups of ≥ 32 channels (INT8
`tl.dot` needs K ≥ 32); fp16 parts ≥ 16 wide; FP16 scales 2-byte aligned, so rows of an even number of bytes
and band parts with an even number of code bytes (always so when every band is a multiple of 16 channels;
odd only with an odd number of 3-bit bands of 8 mod 16 channels); band parts for c_kv only. Under
TRITON_INTERPRET=1 any power-of-two width/group runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field

import torch
import triton  # an ImportError here is what mlaquant.attention.ops turns into "backend 'triton' unavailable"
import triton.language as tl
from torch import Tensor

from mlaquant.attention.decode_inputs import DecodeInputs
from mlaquant.config import ConfigError, chunk_for_context, load_config
from mlaquant.errors import BackendError

PAGE_TOKENS = 64
TARGETS = {8: "sm_80", 9: "sm_90a"}  # `KernelConfig.targets` keys by compute capability major
# c_kv parts by how the kernel reads them (`KernelConfig.wide_block_n`, `dequant_scores`)
CKV_FAMILIES = ("fp16", "row", "grouped", "band")
_KIND_FP16, _KIND_INT8, _KIND_INT4, _KIND_BAND = 0, 1, 2, 3
_LOG2E = 1.4426950408889634
QUERY_BLOCK_H = 16  # heads per program of the query kernel (stage 0)
MERGE_BLOCK_D = 128  # channels per program of the merge (stage 2): 16 x 512 spent all 255 registers
RESCALE_LOG2 = tl.constexpr(8.0)  # lazy softmax rescaling threshold (base-2 exponent): p ≤ 2^8 in FP16


@dataclass
class KernelConfig:
    """Launch settings of the decode kernels (`configs/kernels.yaml`).

    `split_kv_chunks` lists `[up_to_context, chunk_tokens]` pairs, read by `mlaquant.config.chunk_for_context`
    with the batch's longest context.
    `block_h` heads and `block_n` tokens per tile of a stage-1 program, on `num_warps` warps, the values split
    over `d_split` programs; at most `narrow_heads` heads run as one narrow block (`tile_for`). Wide blocks
    take their tile length by the c_kv part's family from `wide_block_n` (`block_n_for`).
    `dequant_scores` lists, for narrow and for wide blocks, the c_kv families whose scores are FP16 dots on the
    dequantized tile (band always: it has no other path), and by c_kv family the k_pe families scored so
    (`fp16_scores`); the others score an integer part with INT8 dots and read an FP16 part whole.
    `targets` maps a GPU target (`TARGETS`: sm_80 for compute capability 8.x, sm_90a for 9.x) to overrides of
    these settings (`for_target`); devices of other capabilities, and the interpreter, use the settings as
    written.
    """

    version: int = 1
    split_kv_chunks: tuple = ((2048, 512), (8192, 768), (0, 1024))
    block_h: int = 128
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 1
    d_split: int = 2
    narrow_heads: int = 16
    wide_block_n: dict = field(default_factory=lambda: {"fp16": 16, "row": 32, "grouped": 16, "band": 32})
    dequant_scores: dict = field(default_factory=lambda: {
        "narrow": {"c_kv": ["fp16", "row", "grouped", "band"],
                   "k_pe": {"fp16": ["row", "grouped"], "row": ["row", "grouped"], "grouped": ["row", "grouped"],
                            "band": ["row", "grouped"]}},
        "wide": {"c_kv": ["grouped", "band"],
                 "k_pe": {"fp16": ["row", "grouped"], "row": ["row", "grouped"], "grouped": ["grouped"],
                          "band": ["row", "grouped"]}},
    })
    targets: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        pairs = self.split_kv_chunks
        if not pairs or any(len(p) != 2 or not _valid_chunk(p[1]) for p in pairs):
            raise ConfigError(
                f"kernels: split_kv_chunks must be [bound, chunk] pairs with chunk a positive multiple of "
                f"{PAGE_TOKENS}, got {pairs}"
            )
        if self.d_split not in (1, 2):
            raise ConfigError(f"kernels: d_split must be 1 or 2, got {self.d_split}")
        tiles = self.wide_block_n
        if not isinstance(tiles, dict) or set(tiles) != set(CKV_FAMILIES):
            raise ConfigError(f"kernels: wide_block_n must map each of {', '.join(CKV_FAMILIES)} to a tile length, "
                              f"got {tiles!r}")
        checks = [("block_h", self.block_h), ("block_n", self.block_n), ("narrow_heads", self.narrow_heads)]
        for name, v in checks + [(f"wide_block_n.{k}", v) for k, v in tiles.items()]:
            if not isinstance(v, int) or v <= 0 or v & (v - 1) or ("block_n" in name and PAGE_TOKENS % v):
                raise ConfigError(f"kernels: {name} must be a power of two (block_n dividing 64), got {v}")
        deq = self.dequant_scores
        fams = set(CKV_FAMILIES)
        if (not isinstance(deq, dict) or set(deq) != {"narrow", "wide"}
                or any(not isinstance(v, dict) or set(v) != {"c_kv", "k_pe"} or not isinstance(v["k_pe"], dict)
                       or set(v["k_pe"]) != fams for v in deq.values())
                or any(not isinstance(f, (list, tuple)) or set(f) - fams
                       for v in deq.values() for f in [v["c_kv"], *v["k_pe"].values()])):
            raise ConfigError(f"kernels: dequant_scores must map narrow and wide to {{c_kv: [families], k_pe: {{c_kv "
                              f"family: [families]}}}} over {', '.join(CKV_FAMILIES)}, got {deq!r}")
        if any("band" not in v["c_kv"] or "band" in f for v in deq.values() for f in v["k_pe"].values()):
            raise ConfigError(f"kernels: dequant_scores must list band under every c_kv (a band part is read only as "
                              f"FP16-scored tiles) and under no k_pe (band parts are c_kv only), got {deq!r}")
        if not isinstance(self.targets, dict) or set(self.targets) - set(TARGETS.values()):
            raise ConfigError(f"kernels: targets must map some of {', '.join(TARGETS.values())} to overrides, "
                              f"got {self.targets!r}")
        fields = {f.name for f in dataclasses.fields(self)} - {"version", "targets"}
        for name, over in self.targets.items():
            if not isinstance(over, dict) or set(over) - fields:
                raise ConfigError(f"kernels: targets.{name} may override {', '.join(sorted(fields))}, got {over!r}")
            self.for_target(name)  # its values are checked as the config they make

    def for_target(self, target: str | None) -> KernelConfig:
        """The settings for GPU target `target` (a key of `TARGETS`, or None: as written)."""
        over = self.targets.get(target) if target else None
        return dataclasses.replace(self, targets={}, **over) if over else self

    def fp16_scores(self, heads: int, ckv_family: str, kpe_family: str | None = None) -> bool:
        """True when a block of `heads` query heads scores a c_kv part of `ckv_family` (fp16, row, grouped) as
        FP16 dots on its dequantized tile (`dequant_scores`); with `kpe_family`, the same question for the k_pe
        part of that family beside such a c_kv part."""
        deq = self.dequant_scores["narrow" if heads <= self.narrow_heads else "wide"]
        return ckv_family in deq["c_kv"] if kpe_family is None else kpe_family in deq["k_pe"][ckv_family]

    def block_n_for(self, heads: int, ckv_family: str) -> int:
        """Tokens per tile: `block_n` for a narrow block, else `wide_block_n[ckv_family]` (a family of
        `CKV_FAMILIES`: fp16, row-wise integer, grouped integer, band c_kv)."""
        return self.block_n if heads <= self.narrow_heads else self.wide_block_n[ckv_family]

    def tile_for(self, heads: int, on_gpu: bool) -> tuple[int, int, int]:
        """(BLOCK_H, num_warps, D_SPLIT) for `heads` query heads. At most `narrow_heads` heads run as one
        block of that many rows, 4 warps, unsplit (mma.sync: wgmma needs 64 rows, and padding to 64 would
        multiply the MMA work); more run in blocks of `block_h` with `num_warps` and the values split in
        `d_split` programs (64 heads too run as one padded 128-row block: compiled for sm_90a, 64-row blocks
        predicted no faster for the integer caches and spilled for FP16). Under the interpreter a block is at
        most the next power of two of `heads`."""
        if heads <= self.narrow_heads:
            block_h, warps, d_split = self.narrow_heads, 4, 1
        else:
            block_h, warps, d_split = self.block_h, self.num_warps, self.d_split
        if not on_gpu:
            block_h = min(block_h, max(1, triton.next_power_of_2(heads)))
        return block_h, warps, d_split

    def chunk_for(self, context_len: int) -> int:
        """Split-KV chunk length for a longest context of `context_len` tokens."""
        return chunk_for_context(self.split_kv_chunks, context_len)


def _valid_chunk(chunk: object) -> bool:
    return isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0 and chunk % PAGE_TOKENS == 0


def load_kernel_config(source: str | os.PathLike | dict | KernelConfig | None = None) -> KernelConfig:
    """KernelConfig from a path/mapping, or the packaged `kernels.yaml`."""
    return load_config(KernelConfig, source, "kernels.yaml")


@functools.lru_cache(maxsize=1)
def _packaged_config() -> KernelConfig:
    """The packaged config, read once (decode calls this every step)."""
    return load_kernel_config()


# ----------------------------------------------------------------------------------------------- Triton


# Helpers are few and large on purpose: the CPU interpreter re-patches triton.language on every call of a
# jitted helper, which dominated the test time when the code was split finer. `group_dot` and `tile_rows`
# are public: the exactness test of the INT32 score path launches them from a probe kernel of its own.


@triton.jit
def quantize_query_group(q_row, h_mask, g, G: tl.constexpr):
    """Query channels [g*G, (g+1)*G) of each head -> (q8 int8 [BH, G], qs [BH] fp32, Σq8 [BH] int32)."""
    cg = g * G + tl.arange(0, G)
    qf = tl.load(q_row[:, None] + cg[None, :], mask=h_mask[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(qf), axis=1)
    qs = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), 1.0)
    q8 = _round_codes(tl.math.div_rn(qf, tl.broadcast_to(qs[:, None], qf.shape)))
    return q8, qs, tl.sum(q8.to(tl.int32), axis=1)


@triton.jit
def _round_codes(x):
    """round_half_even(x) clamped to [-127, 127] as int8, exactly: x − floor(x) is representable, while
    floor(x + 0.5) would misround 0.49999997."""
    r = tl.floor(x)
    f = x - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)
    return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)


@triton.jit
def dot_codes(row, t_mask, g, KIND: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr):
    """Codes [BN, G] int8 of group g as they enter the INT8 dot (sym int8 q, asym int8 q − 128, int4 nibbles
    interleaved, q − 8 when sym); `row` [BN] points at the part's first byte."""
    if KIND == 1:
        raw = tl.load(row[:, None] + (g * G + tl.arange(0, G))[None, :], mask=t_mask[:, None], other=0)
        if ASYM:
            k = (raw.to(tl.int32) - 128).to(tl.int8)
        else:
            k = raw.to(tl.int8, bitcast=True)
    else:
        raw = tl.load(row[:, None] + (g * (G // 2) + tl.arange(0, G // 2))[None, :], mask=t_mask[:, None],
                      other=0)
        lo = (raw & 15).to(tl.int8)
        hi = (raw >> 4).to(tl.int8)
        if not ASYM:
            lo = lo - 8
            hi = hi - 8
        k = tl.interleave(lo, hi)
    return k


@triton.jit
def group_dot(q_row, h_mask, row, t_mask, g, KIND: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr):
    """Group g of one integer part: (INT32 dot [BH, BN], qs [BH] fp32, Σq8 [BH] int32).

    `q_row` [BH] points at the part's first query channel, `row` [BN] at the part's first byte. The codes
    enter the dot as int8: sym int8 q, asym int8 q − 128, int4 nibbles interleaved (q − 8 when sym)."""
    q8, qs, qsum = quantize_query_group(q_row, h_mask, g, G)
    k = dot_codes(row, t_mask, g, KIND, ASYM, G)
    return tl.dot(q8, tl.trans(k), out_dtype=tl.int32), qs, qsum


@triton.jit
def _quantize_query_int4(q_row, h_mask, g, G: tl.constexpr):
    """Group g of an INT4 part's query split by channel parity (the nibble order of the codes): (q8 of the
    even channels [BH, G/2], q8 of the odd ones, qs [BH] fp32, Σq8 [BH] int32) — the same codes as
    `quantize_query_group`, which sees the group whole."""
    j = g * G + 2 * tl.arange(0, G // 2)
    qe = tl.load(q_row[:, None] + j[None, :], mask=h_mask[:, None], other=0.0).to(tl.float32)
    qo = tl.load(q_row[:, None] + (j + 1)[None, :], mask=h_mask[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(qe), axis=1), tl.max(tl.abs(qo), axis=1))
    qs = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), 1.0)
    q8e = _round_codes(tl.math.div_rn(qe, tl.broadcast_to(qs[:, None], qe.shape)))
    q8o = _round_codes(tl.math.div_rn(qo, tl.broadcast_to(qs[:, None], qo.shape)))
    return q8e, q8o, qs, tl.sum(q8e.to(tl.int32), axis=1) + tl.sum(q8o.to(tl.int32), axis=1)


@triton.jit
def query_part(q_row, h_mask, KIND: tl.constexpr, W: tl.constexpr, G: tl.constexpr):
    """The query's part as tuples (computed by the query kernel, and for a float part by stage 1): fp16 ->
    ((q fp16 [BH, W],), (), ());
    int8 (and int4 groups under 64) -> per group g (q8_g [BH, G]), (qs_g [BH]), (Σq8_g [BH]); int4 ->
    (even_0, odd_0, even_1, ...), (qs_g), (Σq8_g)."""
    if KIND == 0:
        c = tl.arange(0, W)
        qh = tl.load(q_row[:, None] + c[None, :], mask=h_mask[:, None], other=0.0).to(tl.float16)
        q8s, qss, qsums = (qh,), (), ()
    else:
        q8s, qss, qsums = (), (), ()
        for g in tl.static_range(W // G):
            if KIND == 1 or G < 64:
                q8, qs, qsum = quantize_query_group(q_row, h_mask, g, G)
                q8s = q8s + (q8,)
            else:
                q8e, q8o, qs, qsum = _quantize_query_int4(q_row, h_mask, g, G)
                q8s = q8s + (q8e, q8o)
            qss, qsums = qss + (qs,), qsums + (qsum,)
    return q8s, qss, qsums


@triton.jit
def _nibble_codes(raw, HIGH: tl.constexpr, ASM: tl.constexpr):
    """The low (HIGH False) or high nibbles of uint8 `raw` as int8 0..15. ASM: one 32-bit op per 4 bytes
    (inline PTX, compiled only); else per-element shifts and masks, the same values (the interpreter)."""
    if ASM:
        if HIGH:
            n = tl.inline_asm_elementwise("{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }",
                                          "=r,r", [raw], dtype=tl.int8, is_pure=True, pack=4)
        else:
            n = tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [raw], dtype=tl.int8,
                                          is_pure=True, pack=4)
    else:
        if HIGH:
            n = (raw >> 4).to(tl.int8, bitcast=True)
        else:
            n = (raw & 15).to(tl.int8, bitcast=True)
    return n


@triton.jit
def _int8_f16(raw, ASM: tl.constexpr):
    """The bytes of `raw` (uint8) read as int8 codes q, as FP16 q, exact. ASM: q + 128 (the byte XOR 0x80)
    is moved into the mantissa of FP16 1024 (prmt with 0x64) and 1152 subtracted, two values per
    instruction; else a per-element conversion (the interpreter)."""
    if ASM:
        v = tl.inline_asm_elementwise(
            "{ .reg .b32 t, a, b, c; xor.b32 t, $2, 0x80808080; prmt.b32 a, t, 0x64646464, 0x4140; "
            "prmt.b32 b, t, 0x64646464, 0x4342; mov.b32 c, 0x64806480; sub.f16x2 $0, a, c; sub.f16x2 $1, b, c; }",
            "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
    else:
        v = raw.to(tl.int8, bitcast=True).to(tl.float16)
    return v


@triton.jit
def _nibble_f16(raw, HIGH: tl.constexpr, SYM: tl.constexpr, ASM: tl.constexpr):
    """The low or high nibbles n of uint8 `raw` as FP16 n − 8 (SYM) or n, exact. ASM: each nibble pair is
    moved into the mantissas of FP16 1024 (prmt + lop3) and 1024 (+ 8) subtracted, two values per
    instruction; else a per-element conversion (the interpreter)."""
    if ASM:
        if HIGH:
            if SYM:
                v = tl.inline_asm_elementwise(
                    "{ .reg .b32 a, b, c; prmt.b32 a, $2, 0, 0x4140; prmt.b32 b, $2, 0, 0x4342; shr.u32 a, a, 4; "
                    "shr.u32 b, b, 4; lop3.b32 a, a, 0x000F000F, 0x64006400, 0xEA; "
                    "lop3.b32 b, b, 0x000F000F, 0x64006400, 0xEA; mov.b32 c, 0x64086408; "
                    "sub.f16x2 $0, a, c; sub.f16x2 $1, b, c; }",
                    "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
            else:
                v = tl.inline_asm_elementwise(
                    "{ .reg .b32 a, b, c; prmt.b32 a, $2, 0, 0x4140; prmt.b32 b, $2, 0, 0x4342; shr.u32 a, a, 4; "
                    "shr.u32 b, b, 4; lop3.b32 a, a, 0x000F000F, 0x64006400, 0xEA; "
                    "lop3.b32 b, b, 0x000F000F, 0x64006400, 0xEA; mov.b32 c, 0x64006400; "
                    "sub.f16x2 $0, a, c; sub.f16x2 $1, b, c; }",
                    "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
        else:
            if SYM:
                v = tl.inline_asm_elementwise(
                    "{ .reg .b32 a, b, c; prmt.b32 a, $2, 0, 0x4140; prmt.b32 b, $2, 0, 0x4342; "
                    "lop3.b32 a, a, 0x000F000F, 0x64006400, 0xEA; "
                    "lop3.b32 b, b, 0x000F000F, 0x64006400, 0xEA; mov.b32 c, 0x64086408; "
                    "sub.f16x2 $0, a, c; sub.f16x2 $1, b, c; }",
                    "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
            else:
                v = tl.inline_asm_elementwise(
                    "{ .reg .b32 a, b, c; prmt.b32 a, $2, 0, 0x4140; prmt.b32 b, $2, 0, 0x4342; "
                    "lop3.b32 a, a, 0x000F000F, 0x64006400, 0xEA; "
                    "lop3.b32 b, b, 0x000F000F, 0x64006400, 0xEA; mov.b32 c, 0x64006400; "
                    "sub.f16x2 $0, a, c; sub.f16x2 $1, b, c; }",
                    "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
    else:
        v = _nibble_codes(raw, HIGH, False).to(tl.float16)
        if SYM:
            v = v - 8.0
    return v


@triton.jit
def group_dot_int32(q8s, qsums, row, t_mask, g, KIND: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr,
                     ASM: tl.constexpr):
    """The exact INT32 dot [BH, BN] of group g, equal to `group_dot`'s: asym INT8 codes enter as
    (byte ^ 0x80) = q − 128; INT4 nibbles enter unsigned as two dots, over the even and the odd channels,
    and a symmetric part subtracts 8·Σq8 afterwards (Σ q8·(n − 8) = Σ q8·n − 8·Σq8)."""
    if KIND == 1:
        raw = tl.load(row[:, None] + (g * G + tl.arange(0, G))[None, :], mask=t_mask[:, None], other=0)
        if ASYM:
            raw = raw ^ 0x80
        dot = tl.dot(q8s[g], tl.trans(raw.to(tl.int8, bitcast=True)), out_dtype=tl.int32)
    elif G < 64:  # a split dot would have K = G/2 < 32, under the INT8 tl.dot minimum: interleave instead
        dot = tl.dot(q8s[g], tl.trans(dot_codes(row, t_mask, g, KIND, ASYM, G)), out_dtype=tl.int32)
    else:
        raw = tl.load(row[:, None] + (g * (G // 2) + tl.arange(0, G // 2))[None, :], mask=t_mask[:, None],
                      other=0)
        lo = _nibble_codes(raw, False, ASM)
        hi = _nibble_codes(raw, True, ASM)
        dot = tl.dot(q8s[2 * g], tl.trans(lo), out_dtype=tl.int32)
        dot = tl.dot(q8s[2 * g + 1], tl.trans(hi), dot, out_dtype=tl.int32)
        if not ASYM:
            dot -= 8 * qsums[g][:, None]
    return dot


@triton.jit
def _part_scores(
    q8s, qss, qsums, row, t_mask,
    KIND: tl.constexpr, ASYM: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
    SCALE_OFF: tl.constexpr, LO_OFF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    ASM: tl.constexpr, qk_scale,
):
    """Scores [BH, BN] fp32 of one row part, times qk_scale: a float part multiplies its dot by it, an
    integer part's qs (`staged_query_part`) include it."""
    if KIND == 0:
        c = tl.arange(0, W)
        k = tl.load(row.to(tl.pointer_type(tl.float16))[:, None] + c[None, :], mask=t_mask[:, None], other=0.0)
        s = tl.dot(q8s[0], tl.trans(k), out_dtype=tl.float32) * qk_scale
    else:
        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for g in tl.static_range(W // G):
            dot = group_dot_int32(q8s, qsums, row, t_mask, g, KIND, ASYM, G, ASM)
            ks = tl.load((row + SCALE_OFF + 2 * g).to(tl.pointer_type(tl.float16)), mask=t_mask, other=0.0)
            ks = ks.to(tl.float32)
            s += dot.to(tl.float32) * (qss[g][:, None] * ks[None, :])
            if ASYM:
                lo = tl.load((row + LO_OFF + 2 * g).to(tl.pointer_type(tl.float16)), mask=t_mask, other=0.0)
                lo = lo.to(tl.float32)
                if KIND == 1:
                    lo = lo + 128.0 * ks
                s += (qsums[g].to(tl.float32) * qss[g])[:, None] * lo[None, :]
    return s


@triton.jit
def half_values(
    row, t_mask, half, KIND: tl.constexpr, ASYM: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
    SCALE_OFF: tl.constexpr, LO_OFF: tl.constexpr, ASM: tl.constexpr, NIBBLES: tl.constexpr = True,
):
    """Half `half` (0 or 1) of a dequantized row part, [BN, W/2] FP16, computed in FP32 as the codec's decode
    and then rounded: channels half·W/2 + j for fp16 / int8, and for int4 channels 2j + half (one nibble of
    every byte; NIBBLES) or half·W/2 + j (both nibbles of half the bytes, interleaved; NIBBLES False), as
    `half_channels` lists them. `row` [BN] points at each token's first byte of the part."""
    j = tl.arange(0, W // 2)
    if KIND == 0:
        # cast the row pointers before adding channels: the loads stay contiguous (128-bit) along them
        v = tl.load(row.to(tl.pointer_type(tl.float16))[:, None] + (half * (W // 2) + j)[None, :],
                    mask=t_mask[:, None], other=0.0)
    else:
        # Symmetric codes are multiplied in FP16: q (|q| ≤ 127) times an FP16 scale is exact in FP32, so
        # FP16's correctly rounded product equals the FP32 decode rounded to FP16, bit for bit.
        ctype: tl.constexpr = tl.float32 if ASYM else tl.float16
        # Column j's group: (half·W/2 + j) // G for int8, (2j + half) // G = j // (G/2) for int4; the half's
        # columns fall into NG runs of GJ, so one scale (and zero point) per run is loaded and broadcast.
        GJ: tl.constexpr = min(G if KIND == 1 or not NIBBLES else G // 2, W // 2)
        NG: tl.constexpr = W // 2 // GJ
        if KIND == 1:
            raw = tl.load(row[:, None] + (half * (W // 2) + j)[None, :], mask=t_mask[:, None], other=0)
            if ASYM:
                q = raw.to(ctype)
            else:
                q = _int8_f16(raw, ASM)
            grp = (half * (W // 2) + tl.arange(0, NG) * GJ) // G
        elif not NIBBLES:
            raw = tl.load(row[:, None] + (half * (W // 4) + tl.arange(0, W // 4))[None, :], mask=t_mask[:, None],
                          other=0)
            lo = _nibble_f16(raw, False, not ASYM, ASM)
            hi = _nibble_f16(raw, True, not ASYM, ASM)
            q = tl.interleave(lo, hi).to(ctype)
            grp = (half * (W // 2) + tl.arange(0, NG) * GJ) // G
        else:
            raw = tl.load(row[:, None] + j[None, :], mask=t_mask[:, None], other=0)
            if half == 0:
                q = _nibble_f16(raw, False, not ASYM, ASM).to(ctype)
            else:
                q = _nibble_f16(raw, True, not ASYM, ASM).to(ctype)
            grp = tl.arange(0, NG)
        par = row[:, None] + 2 * grp[None, :]  # [BN, NG] byte addresses of the runs' group parameters
        s = tl.load((par + SCALE_OFF).to(tl.pointer_type(tl.float16)), mask=t_mask[:, None], other=0.0)
        v = tl.reshape(q, [q.shape[0], NG, GJ]) * s.to(ctype)[:, :, None]
        if ASYM:
            lo = tl.load((par + LO_OFF).to(tl.pointer_type(tl.float16)), mask=t_mask[:, None], other=0.0)
            v = v + lo.to(tl.float32)[:, :, None]
        v = tl.reshape(v, [q.shape[0], W // 2])
    return v.to(tl.float16)


@triton.jit
def _computed_once(v, ASM: tl.constexpr):
    """`v` unchanged. ASM: through an identity that Triton may not duplicate (inline PTX with side effects), so
    a dequantized tile feeding two dots is computed once and reaches both dot layouts by conversion (shared
    memory), instead of being recomputed in each dot's register layout."""
    if ASM:
        v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.float16, is_pure=False, pack=2)
    return v


@triton.jit
def half_channels(half, KIND: tl.constexpr, W: tl.constexpr, NIBBLES: tl.constexpr = True):
    """Output channels [W/2] of `half_values`' columns."""
    j = tl.arange(0, W // 2)
    if KIND == 2 and NIBBLES:
        return 2 * j + half
    return half * (W // 2) + j


@triton.jit
def _query_halves(q_row, h_mask, KIND: tl.constexpr, W: tl.constexpr):
    """The query channels of a part's two contiguous halves (`half_values` with NIBBLES False), FP16
    ([BH, W/2], [BH, W/2]); `q_row` [BH] points at the part's first channel."""
    c = tl.arange(0, W // 2)
    qa = tl.load(q_row[:, None] + c[None, :], mask=h_mask[:, None], other=0.0).to(tl.float16)
    qb = tl.load(q_row[:, None] + (c + W // 2)[None, :], mask=h_mask[:, None], other=0.0).to(tl.float16)
    return qa, qb


@triton.jit
def _code_f16(u, BITS: tl.constexpr):
    """Unsigned codes u (int16, < 2^BITS) as FP16 q = u − 2^(BITS−1), exact: u is put in the mantissa of FP16 1024
    (u | 0x6400) and 1024 + 2^(BITS−1) subtracted (no int → float conversion)."""
    return (u | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + (1 << (BITS - 1)))


@triton.jit
def band_values(row, t_mask, OFF: tl.constexpr, W: tl.constexpr, V: tl.constexpr, BITS: tl.constexpr,
                SOFF: tl.constexpr, ASM: tl.constexpr):
    """One segment of a band part (`band_segments`): [BN, W] FP16, column j the channel whose code starts at bit
    8·OFF + BITS·j of the part, decoded as the codec does (q · s, q = u − 2^(BITS−1), s the band's FP16 scale at
    byte SOFF) and rounded to FP16: |q| ≤ 128 times an FP16 scale is exact in FP32, so FP16's product is the same
    bits. Columns ≥ V are 0 and their bytes are not read. `row` [BN] points at each token's part."""
    s = tl.load((row + SOFF).to(tl.pointer_type(tl.float16)), mask=t_mask, other=0.0)
    if BITS == 3:  # 8 channels in 3 bytes (a little-endian 24-bit word), read as three byte planes
        j = tl.arange(0, W // 8)
        if V < W:
            m = t_mask[:, None] & (j < V // 8)[None, :]
        else:
            m = t_mask[:, None]
        p = row[:, None] + OFF + 3 * j[None, :]
        b0 = tl.load(p, mask=m, other=0).to(tl.int16)
        b1 = tl.load(p + 1, mask=m, other=0).to(tl.int16)
        b2 = tl.load(p + 2, mask=m, other=0).to(tl.int16)
        c0 = _code_f16(b0 & 7, 3)
        c1 = _code_f16((b0 >> 3) & 7, 3)
        c2 = _code_f16((b0 >> 6) | ((b1 & 1) << 2), 3)
        c3 = _code_f16((b1 >> 1) & 7, 3)
        c4 = _code_f16((b1 >> 4) & 7, 3)
        c5 = _code_f16((b1 >> 7) | ((b2 & 3) << 1), 3)
        c6 = _code_f16((b2 >> 2) & 7, 3)
        c7 = _code_f16(b2 >> 5, 3)
        q = tl.interleave(tl.interleave(tl.interleave(c0, c4), tl.interleave(c2, c6)),
                          tl.interleave(tl.interleave(c1, c5), tl.interleave(c3, c7)))
    else:
        j = tl.arange(0, W * BITS // 8)
        if V < W:
            m = t_mask[:, None] & (j < V * BITS // 8)[None, :]
        else:
            m = t_mask[:, None]
        raw = tl.load(row[:, None] + OFF + j[None, :], mask=m, other=0)
        if BITS == 8:
            q = _int8_f16(raw, ASM)
        elif BITS == 4:
            q = tl.interleave(_nibble_f16(raw, False, True, ASM), _nibble_f16(raw, True, True, ASM))
        else:
            raw = raw.to(tl.int16)
            q = tl.interleave(tl.interleave(_code_f16(raw & 3, 2), _code_f16((raw >> 4) & 3, 2)),
                              tl.interleave(_code_f16((raw >> 2) & 3, 2), _code_f16(raw >> 6, 2)))
    v = q * s.to(tl.float16)[:, None]
    if V < W:
        v = tl.where((tl.arange(0, W) < V)[None, :], v, 0.0)
    return v


@triton.jit
def _band_tiles(row, t_mask, SEGS: tl.constexpr, ASM: tl.constexpr):
    """The dequantized tiles of segments `SEGS` (`band_values`), each computed once for QK and P·V."""
    vs = ()
    for i in tl.static_range(len(SEGS)):
        v = band_values(row, t_mask, SEGS[i][4], SEGS[i][1], SEGS[i][2], SEGS[i][3], SEGS[i][5], ASM)
        vs = vs + (_computed_once(v, ASM),)
    return vs


@triton.jit
def _band_query_segment(q_row, h_mask, CH: tl.constexpr, W: tl.constexpr, V: tl.constexpr):
    c = tl.arange(0, W)
    return tl.load(q_row[:, None] + CH + c[None, :], mask=h_mask[:, None] & (c < V)[None, :], other=0.0).to(tl.float16)


@triton.jit
def _band_query(q_row, h_mask, SEGS: tl.constexpr):
    """The FP16 query channels of segments `SEGS`, [BH, W] each (0 in padded columns)."""
    qs = ()
    for i in tl.static_range(len(SEGS)):
        qs = qs + (_band_query_segment(q_row, h_mask, SEGS[i][0], SEGS[i][1], SEGS[i][2]),)
    return qs


@triton.jit
def _band_dots(qs, vs, s):
    """s + Σ_i qs[i] · vs[i]ᵀ (FP16 dots, FP32 accumulation)."""
    for i in tl.static_range(len(vs)):
        s = tl.dot(qs[i], tl.trans(vs[i]), s, out_dtype=tl.float32)
    return s


@triton.jit
def _band_pv(p16, vs, accs):
    """Each segment's accumulator plus P · its V tile."""
    out = ()
    for i in tl.static_range(len(vs)):
        out = out + (tl.dot(p16, vs[i], accs[i], out_dtype=tl.float32),)
    return out


@triton.jit
def _band_rescaled(accs, alpha):
    out = ()
    for i in tl.static_range(len(accs)):
        out = out + (accs[i] * alpha[:, None],)
    return out


@triton.jit
def _zeros_acc(BLOCK_H: tl.constexpr, W: tl.constexpr):
    return tl.zeros([BLOCK_H, W], dtype=tl.float32)


@triton.jit
def _band_accumulators(BLOCK_H: tl.constexpr, SEGS: tl.constexpr):
    accs = ()
    for i in tl.static_range(len(SEGS)):
        accs = accs + (_zeros_acc(BLOCK_H, SEGS[i][1]),)
    return accs


@triton.jit
def _band_store_segment(out, acc, safe_l, live, CH: tl.constexpr, W: tl.constexpr, V: tl.constexpr):
    c = tl.arange(0, W)
    if V < W:
        tl.store(out + CH + c[None, :], acc / safe_l[:, None], mask=live[:, None] & (c < V)[None, :])
    else:
        tl.store(out + CH + c[None, :], acc / safe_l[:, None], mask=live[:, None])


@triton.jit
def _band_store(out, accs, l_i, live, SEGS: tl.constexpr):
    """Store each segment's normalized accumulator at its channels of `out` [BH] (row pointers)."""
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    for i in tl.static_range(len(SEGS)):
        _band_store_segment(out, accs[i], safe_l, live, SEGS[i][0], SEGS[i][1], SEGS[i][2])


@triton.jit
def _store_zeros(out, live, CH: tl.constexpr, W: tl.constexpr, BLOCK_H: tl.constexpr):
    tl.store(out + CH + tl.arange(0, W)[None, :], tl.zeros([BLOCK_H, W], dtype=tl.float32), mask=live[:, None])


@triton.jit
def _band_store_zeros(out, live, ZERO: tl.constexpr, BLOCK_H: tl.constexpr):
    """Zeros at the channels of this program's pieces of 0-bit bands (`ZERO`: (channel, width) each)."""
    for i in tl.static_range(len(ZERO)):
        _store_zeros(out, live, ZERO[i][0], ZERO[i][1], BLOCK_H)


@triton.jit
def tile_rows(pool_ptr, bt_ptr, b, stride_pool, stride_bt, offs_t, t_mask, PAGE: tl.constexpr,
              ROW_BYTES: tl.constexpr):
    """Byte pointers [BN] of tokens `offs_t` of sequence b (masked tokens point at block 0)."""
    block = tl.load(bt_ptr + b * stride_bt + offs_t // PAGE, mask=t_mask, other=0).to(tl.int64)
    return pool_ptr + block * stride_pool + (offs_t % PAGE) * ROW_BYTES


@triton.jit
def page_rows(pool_ptr, bt_ptr, b, stride_pool, stride_bt, t0, idx, PAGE: tl.constexpr, ROW_BYTES: tl.constexpr):
    """Byte pointers [BN] of tokens t0 + idx (idx [BN] in [0, BN)) of sequence b when the tile lies in one page
    (BN divides PAGE, t0 a multiple of BN): one block-table entry, a scalar base plus loop-invariant row
    offsets, so the addresses of the tile's loads cost no per-token arithmetic."""
    block = tl.load(bt_ptr + b * stride_bt + t0 // PAGE).to(tl.int64)
    return pool_ptr + block * stride_pool + (t0 % PAGE) * ROW_BYTES + idx * ROW_BYTES


@triton.jit
def _stage_query_part(q_row, q8_row, qs_row, qsum_row, h_mask, qk_scale, KIND: tl.constexpr, W: tl.constexpr,
                      G: tl.constexpr):
    """Store an integer part's `query_part` for stage 1: q8 at `q8_row` [BH] in dot order (per group its
    channels, or for int4 groups of ≥ 64 its even then its odd channels), per group qs · qk_scale at
    `qs_row` and Σq8 at `qsum_row`. A float part stores nothing (stage 1 reads the query itself)."""
    if KIND != 0:
        q8s, qss, qsums = query_part(q_row, h_mask, KIND, W, G)
        for g in tl.static_range(W // G):
            if KIND == 1 or G < 64:
                c = g * G + tl.arange(0, G)
                tl.store(q8_row[:, None] + c[None, :], q8s[g], mask=h_mask[:, None])
            else:
                c = g * G + tl.arange(0, G // 2)
                tl.store(q8_row[:, None] + c[None, :], q8s[2 * g], mask=h_mask[:, None])
                tl.store(q8_row[:, None] + (c + G // 2)[None, :], q8s[2 * g + 1], mask=h_mask[:, None])
            tl.store(qs_row + g, qss[g] * qk_scale, mask=h_mask)
            tl.store(qsum_row + g, qsums[g], mask=h_mask)


@triton.jit
def _query_kernel(
    q_ptr, q8_ptr, qs_ptr, qsum_ptr, stride_qb, stride_qh, H, qk_scale,
    D_C: tl.constexpr, C_KIND: tl.constexpr, C_G: tl.constexpr, R_KIND: tl.constexpr, R_W: tl.constexpr,
    R_G: tl.constexpr, NG: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Stage 0: the query of sequence b quantized once for every program of stage 1 (`query_part` per
    integer part) into q8 int8 [B, H, d_c + d_r], qs fp32 [B, H, NG] (times qk_scale) and Σq8 int32
    [B, H, NG], NG the integer parts' groups (c_kv's first). Stage 1 reads them as plain loads, which
    Triton stages in shared memory for the wgmma (quantized inside stage 1, the 64 x 576 int8 query was
    held in registers: 36 per thread, the spills of the 64-head variants)."""
    b = tl.program_id(1)
    offs_h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    q_row = q_ptr + b * stride_qb + offs_h * stride_qh
    bh = (b * H + offs_h).to(tl.int64)
    q8_row = q8_ptr + bh * (D_C + R_W)
    s_row = bh * NG
    NC: tl.constexpr = D_C // C_G if C_KIND != 0 else 0
    _stage_query_part(q_row, q8_row, qs_ptr + s_row, qsum_ptr + s_row, h_mask, qk_scale, C_KIND, D_C, C_G)
    _stage_query_part(q_row + D_C, q8_row + D_C, qs_ptr + s_row + NC, qsum_ptr + s_row + NC, h_mask, qk_scale,
                      R_KIND, R_W, R_G)


@triton.jit
def staged_query_part(q_row, q8_row, qs_row, qsum_row, h_mask, KIND: tl.constexpr, W: tl.constexpr,
                      G: tl.constexpr):
    """`query_part`'s tuples in stage 1: a float part's query loaded as FP16, an integer part's read from what
    `_query_kernel` stored (so its qs include qk_scale)."""
    if KIND == 0:
        q8s, qss, qsums = query_part(q_row, h_mask, KIND, W, G)
    else:
        q8s, qss, qsums = (), (), ()
        for g in tl.static_range(W // G):
            if KIND == 1 or G < 64:
                c = g * G + tl.arange(0, G)
                q8s = q8s + (tl.load(q8_row[:, None] + c[None, :], mask=h_mask[:, None], other=0),)
            else:
                c = g * G + tl.arange(0, G // 2)
                q8e = tl.load(q8_row[:, None] + c[None, :], mask=h_mask[:, None], other=0)
                q8o = tl.load(q8_row[:, None] + (c + G // 2)[None, :], mask=h_mask[:, None], other=0)
                q8s = q8s + (q8e, q8o)
            qss = qss + (tl.load(qs_row + g, mask=h_mask, other=0.0),)
            qsums = qsums + (tl.load(qsum_row + g, mask=h_mask, other=0),)
    return q8s, qss, qsums


@triton.jit
def _tile_step(
    m_i, l_i, acc_a, acc_b, t0, t_mask,
    qc8, qcs, qcsum, qr8, qrs, qrsum, pool_ptr, bt_ptr, b, stride_pool, stride_bt, qk_scale,
    PAGE: tl.constexpr, ROW_BYTES: tl.constexpr, D_C: tl.constexpr,
    C_KIND: tl.constexpr, C_ASYM: tl.constexpr, C_G: tl.constexpr, C_SOFF: tl.constexpr,
    C_LOFF: tl.constexpr, C_F16: tl.constexpr, C_SEG0: tl.constexpr, C_SEG1: tl.constexpr,
    R_KIND: tl.constexpr, R_ASYM: tl.constexpr, R_W: tl.constexpr, R_G: tl.constexpr, R_OFF: tl.constexpr,
    R_SOFF: tl.constexpr, R_LOFF: tl.constexpr, R_F16: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, BOTH: tl.constexpr, ASM: tl.constexpr,
):
    """Fold tokens t0 .. t0 + BN − 1 (those in `t_mask` [BN]) into the online softmax (m_i, l_i, acc_a, acc_b):
    see `_chunk_loop`."""
    # A token past the range reads the tile's first token instead (always in range), so no load is masked
    # (fewer live predicates in the partial tile) and nothing past the sequence is read; its score is −inf.
    idx = tl.where(t_mask, tl.arange(0, BLOCK_N), 0)
    every = tl.full([BLOCK_N], 1, dtype=tl.int1)
    if PAGE % BLOCK_N == 0:
        row = page_rows(pool_ptr, bt_ptr, b, stride_pool, stride_bt, t0, idx, PAGE, ROW_BYTES)
    else:
        row = tile_rows(pool_ptr, bt_ptr, b, stride_pool, stride_bt, t0 + idx, every, PAGE, ROW_BYTES)
    if C_KIND == 3:
        # every coded segment dequantized once: K for the scores, and the program's own ones V for P·V
        v0 = _band_tiles(row, every, C_SEG0, ASM)
        v1 = _band_tiles(row, every, C_SEG1, ASM)
        s = _band_dots(qc8[0], v0, tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32))
        s = _band_dots(qc8[1], v1, s) * qk_scale
    elif C_F16:
        # the c_kv tile is read (and dequantized) once, as its two halves: K for the scores and V for P·V
        va = half_values(row, every, 0, C_KIND, C_ASYM, D_C, C_G, C_SOFF, C_LOFF, ASM, False)
        if C_KIND != 0:
            va = _computed_once(va, ASM)
        s = tl.dot(qc8[0], tl.trans(va), out_dtype=tl.float32)
        vb = half_values(row, every, 1, C_KIND, C_ASYM, D_C, C_G, C_SOFF, C_LOFF, ASM, False)
        if C_KIND != 0:
            vb = _computed_once(vb, ASM)
        s = tl.dot(qc8[1], tl.trans(vb), s, out_dtype=tl.float32) * qk_scale
    else:
        s = _part_scores(qc8, qcs, qcsum, row, every, C_KIND, C_ASYM, D_C, C_G, C_SOFF, C_LOFF,
                         BLOCK_H, BLOCK_N, ASM, qk_scale)
    if R_F16:
        ka = half_values(row + R_OFF, every, 0, R_KIND, R_ASYM, R_W, R_G, R_SOFF, R_LOFF, ASM, False)
        kb = half_values(row + R_OFF, every, 1, R_KIND, R_ASYM, R_W, R_G, R_SOFF, R_LOFF, ASM, False)
        sr = tl.dot(qr8[0], tl.trans(ka), out_dtype=tl.float32)
        s += tl.dot(qr8[1], tl.trans(kb), sr, out_dtype=tl.float32) * qk_scale
    else:
        s += _part_scores(qr8, qrs, qrsum, row + R_OFF, every, R_KIND, R_ASYM, R_W, R_G, R_SOFF, R_LOFF,
                          BLOCK_H, BLOCK_N, ASM, qk_scale)
    s = tl.where(t_mask[None, :], s, float("-inf"))
    m_tile = tl.max(s, axis=1)
    # Lazy rescaling: the running max m_i moves (and the accumulators are rescaled) only when some head's
    # tile max exceeds it by more than RESCALE_LOG2, so p = 2^(s - m_i) ≤ 2^RESCALE_LOG2 stays far inside FP16.
    grow = tl.max((m_tile > m_i + RESCALE_LOG2).to(tl.int32), axis=0)
    if grow > 0:
        m_new = tl.maximum(m_i, m_tile)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        if C_KIND == 3:
            acc_a = _band_rescaled(acc_a, alpha)
            acc_b = _band_rescaled(acc_b, alpha)
        else:
            acc_a = acc_a * alpha[:, None]
            if BOTH:
                acc_b = acc_b * alpha[:, None]
        m_i = m_new
    p = tl.exp2(s - m_i[:, None])
    l_i = l_i + tl.sum(p, axis=1)
    p16 = p.to(tl.float16)
    if C_KIND == 3:
        if BOTH:
            acc_a = _band_pv(p16, v0, acc_a)
            acc_b = _band_pv(p16, v1, acc_b)
        elif HALF == 0:
            acc_a = _band_pv(p16, v0, acc_a)
        else:
            acc_a = _band_pv(p16, v1, acc_a)
    elif C_F16:
        if BOTH:
            acc_a = tl.dot(p16, va, acc_a, out_dtype=tl.float32)
            acc_b = tl.dot(p16, vb, acc_b, out_dtype=tl.float32)
        elif HALF == 0:
            acc_a = tl.dot(p16, va, acc_a, out_dtype=tl.float32)
        else:
            acc_a = tl.dot(p16, vb, acc_a, out_dtype=tl.float32)
    else:
        v = half_values(row, t_mask, HALF, C_KIND, C_ASYM, D_C, C_G, C_SOFF, C_LOFF, ASM)
        acc_a = tl.dot(p16, v, acc_a, out_dtype=tl.float32)
        if BOTH:
            v = half_values(row, t_mask, 1, C_KIND, C_ASYM, D_C, C_G, C_SOFF, C_LOFF, ASM)
            acc_b = tl.dot(p16, v, acc_b, out_dtype=tl.float32)
    return m_i, l_i, acc_a, acc_b


@triton.jit
def _chunk_loop(
    qc8, qcs, qcsum, qr8, qrs, qrsum, pool_ptr, bt_ptr, b, stride_pool, stride_bt, start, end, qk_scale,
    PAGE: tl.constexpr, ROW_BYTES: tl.constexpr, D_C: tl.constexpr,
    C_KIND: tl.constexpr, C_ASYM: tl.constexpr, C_G: tl.constexpr, C_SOFF: tl.constexpr,
    C_LOFF: tl.constexpr, C_F16: tl.constexpr, C_SEG0: tl.constexpr, C_SEG1: tl.constexpr,
    R_KIND: tl.constexpr, R_ASYM: tl.constexpr, R_W: tl.constexpr, R_G: tl.constexpr, R_OFF: tl.constexpr,
    R_SOFF: tl.constexpr, R_LOFF: tl.constexpr, R_F16: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, BOTH: tl.constexpr, ASM: tl.constexpr,
):
    """The token loop of one stage-1 program over tokens [start, end): (m_i [BH] base 2, l_i [BH], acc_a
    [BH, d_c/2] of value half HALF, acc_b [BH, d_c/2] of half 1 when BOTH, else zeros), unnormalized; for a
    band part acc_a / acc_b are tuples, one [BH, W] accumulator per segment of C_SEG0 (or C_SEG1 for HALF 1)
    and, when BOTH, of C_SEG1 (else ()).
    HALF is a constexpr, so a program that owns one half compiles that half's dequantization only. Whole
    tiles run with a constant all-true mask, which Triton folds away (no predicates, no −inf select in the
    loop); the partial tile at the end of the range runs first, masked (the softmax is order-free)."""
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if C_KIND == 3:
        if BOTH:
            acc_a = _band_accumulators(BLOCK_H, C_SEG0)
            acc_b = _band_accumulators(BLOCK_H, C_SEG1)
        elif HALF == 0:
            acc_a = _band_accumulators(BLOCK_H, C_SEG0)
            acc_b = ()
        else:
            acc_a = _band_accumulators(BLOCK_H, C_SEG1)
            acc_b = ()
    else:
        acc_a = tl.zeros([BLOCK_H, D_C // 2], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_H, D_C // 2], dtype=tl.float32)
    whole = start + (end - start) // BLOCK_N * BLOCK_N
    # The two calls spell out their arguments: packed in a tuple and splatted, the constexprs compile as
    # tensors (Triton 3.9; the interpreter accepts it), so `_tile_step` could not specialize on them.
    if whole < end:
        m_i, l_i, acc_a, acc_b = _tile_step(
            m_i, l_i, acc_a, acc_b, whole, (whole + tl.arange(0, BLOCK_N)) < end, qc8, qcs, qcsum, qr8, qrs, qrsum,
            pool_ptr, bt_ptr, b, stride_pool, stride_bt, qk_scale, PAGE, ROW_BYTES, D_C, C_KIND, C_ASYM, C_G,
            C_SOFF, C_LOFF, C_F16, C_SEG0, C_SEG1, R_KIND, R_ASYM, R_W, R_G, R_OFF, R_SOFF, R_LOFF, R_F16, BLOCK_H,
            BLOCK_N, HALF, BOTH, ASM)
    every = tl.full([BLOCK_N], 1, dtype=tl.int1)
    for t0 in range(start, whole, BLOCK_N):
        m_i, l_i, acc_a, acc_b = _tile_step(
            m_i, l_i, acc_a, acc_b, t0, every, qc8, qcs, qcsum, qr8, qrs, qrsum, pool_ptr, bt_ptr, b, stride_pool,
            stride_bt, qk_scale, PAGE, ROW_BYTES, D_C, C_KIND, C_ASYM, C_G, C_SOFF, C_LOFF, C_F16, C_SEG0, C_SEG1,
            R_KIND, R_ASYM, R_W, R_G, R_OFF, R_SOFF, R_LOFF, R_F16, BLOCK_H, BLOCK_N, HALF, BOTH, ASM)
    return m_i, l_i, acc_a, acc_b


@triton.jit
def _live_rows_out(out_ptr, b, offs_h, h_mask, start, seq_len, split, stride_ob, stride_oh, stride_os):
    """(heads whose chunk holds tokens [BH], their partial rows [BH, 1]), computed after the token loop: Triton 3.6
    hoisted the output pointers of a band program and spilled them across the loop."""
    # Broadcast before comparing: the interpreter mistypes `bool tensor & bool scalar`.
    live = h_mask & ((start + tl.zeros_like(offs_h)) < seq_len)
    return live, out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + split * stride_os


@triton.jit
def _partial_kernel(
    q_ptr, q8_ptr, qs_ptr, qsum_ptr, pool_ptr, bt_ptr, lens_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh, stride_pool, stride_bt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    H, chunk_tokens, qk_scale,
    PAGE: tl.constexpr, ROW_BYTES: tl.constexpr, D_C: tl.constexpr,
    C_KIND: tl.constexpr, C_ASYM: tl.constexpr, C_G: tl.constexpr, C_SOFF: tl.constexpr,
    C_LOFF: tl.constexpr, C_F16: tl.constexpr, C_SEG0: tl.constexpr, C_SEG1: tl.constexpr, C_ZERO0: tl.constexpr,
    C_ZERO1: tl.constexpr,
    R_KIND: tl.constexpr, R_ASYM: tl.constexpr, R_W: tl.constexpr, R_G: tl.constexpr, R_OFF: tl.constexpr,
    R_SOFF: tl.constexpr, R_LOFF: tl.constexpr, R_F16: tl.constexpr, NG: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D_SPLIT: tl.constexpr, ASM: tl.constexpr,
):
    """Stage 1: one (head block, value half when D_SPLIT = 2, chunk, sequence) -> normalized partial
    [BH, d_c] (its half of the channels when split; of a band part its segments' channels, C_SEG0 or C_SEG1,
    and its share of the 0-bit channels, `band_segments`) and the LSE [BH].

    program_id(0) varies fastest, so the programs of one sequence and chunk (head blocks x halves) run side by
    side and all but the first read the tile from L2. The query is read once, before the loop (an integer
    part's as `_query_kernel` quantized it); each tile's values are dequantized once per program, into the
    halves it accumulates (an FP16 c_kv tile: its halves are read once and serve the scores too)."""
    b = tl.program_id(2)
    split = tl.program_id(1)
    half0 = tl.program_id(0) % D_SPLIT
    offs_h = (tl.program_id(0) // D_SPLIT) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    seq_len = tl.load(lens_ptr + b)
    start = split * chunk_tokens
    end = tl.minimum(start + chunk_tokens, seq_len)
    q_row = q_ptr + b * stride_qb + offs_h * stride_qh
    bh = (b * H + offs_h).to(tl.int64)
    q8_row = q8_ptr + bh * (D_C + R_W)
    NC: tl.constexpr = D_C // C_G if C_KIND != 0 and not C_F16 else 0
    if C_KIND == 3:  # the FP16 query of every coded segment (both programs' segments feed the scores)
        qc8 = (_band_query(q_row, h_mask, C_SEG0), _band_query(q_row, h_mask, C_SEG1))
        qcs, qcsum = (), ()
    elif C_F16:  # the FP16 query in the two halves the c_kv tile is read in
        qc8 = _query_halves(q_row, h_mask, C_KIND, D_C)
        qcs, qcsum = (), ()
    else:
        qc8, qcs, qcsum = staged_query_part(q_row, q8_row, qs_ptr + bh * NG, qsum_ptr + bh * NG, h_mask, C_KIND,
                                            D_C, C_G)
    if R_F16:
        qr8 = _query_halves(q_row + D_C, h_mask, R_KIND, R_W)
        qrs, qrsum = (), ()
    else:
        qr8, qrs, qrsum = staged_query_part(q_row + D_C, q8_row + D_C, qs_ptr + bh * NG + NC,
                                            qsum_ptr + bh * NG + NC, h_mask, R_KIND, R_W, R_G)
    loop_args = (qc8, qcs, qcsum, qr8, qrs, qrsum, pool_ptr, bt_ptr, b, stride_pool, stride_bt, start, end,
                 qk_scale)
    if C_KIND == 3:
        # a band program's accumulators are its segments' (of other shapes in each program): stored where they
        # are made
        if D_SPLIT == 1:
            m_i, l_i, acc_a, acc_b = _chunk_loop(*loop_args, PAGE, ROW_BYTES, D_C, C_KIND, C_ASYM, C_G, C_SOFF,
                                                 C_LOFF, C_F16, C_SEG0, C_SEG1, R_KIND, R_ASYM, R_W, R_G, R_OFF,
                                                 R_SOFF, R_LOFF, R_F16, BLOCK_H, BLOCK_N, 0, True, ASM)
            live, out = _live_rows_out(out_ptr, b, offs_h, h_mask, start, seq_len, split, stride_ob, stride_oh,
                                       stride_os)
            _band_store(out, acc_a, l_i, live, C_SEG0)
            _band_store(out, acc_b, l_i, live, C_SEG1)
            _band_store_zeros(out, live, C_ZERO0 + C_ZERO1, BLOCK_H)
        elif half0 == 0:
            m_i, l_i, acc0, _ = _chunk_loop(*loop_args, PAGE, ROW_BYTES, D_C, C_KIND, C_ASYM, C_G, C_SOFF, C_LOFF,
                                            C_F16, C_SEG0, C_SEG1, R_KIND, R_ASYM, R_W, R_G, R_OFF, R_SOFF, R_LOFF,
                                            R_F16, BLOCK_H, BLOCK_N, 0, False, ASM)
            live, out = _live_rows_out(out_ptr, b, offs_h, h_mask, start, seq_len, split, stride_ob, stride_oh,
                                       stride_os)
            _band_store(out, acc0, l_i, live, C_SEG0)
            _band_store_zeros(out, live, C_ZERO0, BLOCK_H)
        else:
            m_i, l_i, acc1, _ = _chunk_loop(*loop_args, PAGE, ROW_BYTES, D_C, C_KIND, C_ASYM, C_G, C_SOFF, C_LOFF,
                                            C_F16, C_SEG0, C_SEG1, R_KIND, R_ASYM, R_W, R_G, R_OFF, R_SOFF, R_LOFF,
                                            R_F16, BLOCK_H, BLOCK_N, 1, False, ASM)
            live, out = _live_rows_out(out_ptr, b, offs_h, h_mask, start, seq_len, split, stride_ob, stride_oh,
                                       stride_os)
            _band_store(out, acc1, l_i, live, C_SEG1)
            _band_store_zeros(out, live, C_ZERO1, BLOCK_H)
    else:
        if D_SPLIT == 1:
            m_i, l_i, acc_a, acc_b = _chunk_loop(*loop_args, PAGE, ROW_BYTES, D_C, C_KIND, C_ASYM, C_G, C_SOFF,
                                                 C_LOFF, C_F16, C_SEG0, C_SEG1, R_KIND, R_ASYM, R_W, R_G, R_OFF,
                                                 R_SOFF, R_LOFF, R_F16, BLOCK_H, BLOCK_N, 0, True, ASM)
        elif half0 == 0:
            m_i, l_i, acc_a, acc_b = _chunk_loop(*loop_args, PAGE, ROW_BYTES, D_C, C_KIND, C_ASYM, C_G, C_SOFF,
                                                 C_LOFF, C_F16, C_SEG0, C_SEG1, R_KIND, R_ASYM, R_W, R_G, R_OFF,
                                                 R_SOFF, R_LOFF, R_F16, BLOCK_H, BLOCK_N, 0, False, ASM)
        else:
            m_i, l_i, acc_a, acc_b = _chunk_loop(*loop_args, PAGE, ROW_BYTES, D_C, C_KIND, C_ASYM, C_G, C_SOFF,
                                                 C_LOFF, C_F16, C_SEG0, C_SEG1, R_KIND, R_ASYM, R_W, R_G, R_OFF,
                                                 R_SOFF, R_LOFF, R_F16, BLOCK_H, BLOCK_N, 1, False, ASM)
        live, out = _live_rows_out(out_ptr, b, offs_h, h_mask, start, seq_len, split, stride_ob, stride_oh, stride_os)
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        tl.store(out + half_channels(half0, C_KIND, D_C, not C_F16)[None, :], acc_a / safe_l[:, None],
                 mask=live[:, None])
        if D_SPLIT == 1:
            tl.store(out + half_channels(1, C_KIND, D_C, not C_F16)[None, :], acc_b / safe_l[:, None],
                     mask=live[:, None])
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    lse = (m_i + tl.log2(safe_l)) * 0.6931471805599453
    tl.store(lse_ptr + b * stride_lb + offs_h * stride_lh + split, lse,
             mask=live & ((half0 + tl.zeros_like(offs_h)) == 0))


@triton.jit
def _merge_kernel(
    part_ptr, plse_ptr, lens_ptr, out_ptr, lse_ptr,
    stride_pb, stride_ph, stride_ps, stride_plb, stride_plh, stride_pls,
    stride_ob, stride_oh, stride_lb, stride_lh,
    H, chunk_tokens, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Stage 2: fold a sequence's chunk partials with the FP16 sigmoid gate (module docstring), BLOCK_D of the
    channels per program (program_id(2)); the first channel block stores the LSE."""
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    c = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    n_chunks = tl.cdiv(tl.load(lens_ptr + b), chunk_tokens)
    have = h_mask & ((n_chunks + tl.zeros_like(offs_h)) > 0)
    part = part_ptr + b * stride_pb + offs_h[:, None] * stride_ph + c[None, :]
    plse = plse_ptr + b * stride_plb + offs_h * stride_plh
    h = tl.load(part, mask=have[:, None], other=0.0)
    lse = tl.load(plse, mask=have, other=float("-inf"))
    for k in range(1, n_chunks):
        lse_b = tl.load(plse + k * stride_pls, mask=h_mask, other=0.0)
        h_b = tl.load(part + k * stride_ps, mask=h_mask[:, None], other=0.0)
        gate = tl.sigmoid(lse - lse_b).to(tl.float16).to(tl.float32)
        h = gate[:, None] * h + (1.0 - gate)[:, None] * h_b
        mx = tl.maximum(lse, lse_b)
        lse = mx + tl.log(tl.exp(lse - mx) + tl.exp(lse_b - mx))
    tl.store(out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + c[None, :], h, mask=h_mask[:, None])
    first = (tl.program_id(2) + tl.zeros_like(offs_h)) == 0  # broadcast first: see `_partial_kernel`
    tl.store(lse_ptr + b * stride_lb + offs_h * stride_lh, lse, mask=h_mask & first)


# ------------------------------------------------------------------------------------------ host side


@dataclass(frozen=True)
class _Part:
    """Constexpr description of one row part for the kernels."""

    kind: int
    asym: bool
    width: int
    group: int
    offset: int  # byte offset of the part inside the row
    scale_offset: int  # byte offset of the FP16 scales inside the part (0 for fp16 parts)
    lo_offset: int
    # band parts: (bits, first channel, channels, byte offset of its codes, byte offset of its FP16 scale or -1
    # for 0 bits) per band, in channel order
    bands: tuple = ()

    @property
    def family(self) -> str:
        """fp16, row (an integer part with one group), grouped or band (`CKV_FAMILIES`)."""
        if self.kind == _KIND_FP16:
            return "fp16"
        if self.kind == _KIND_BAND:
            return "band"
        return "row" if self.group == self.width else "grouped"


def _band_part(rc, offset: int, label: str) -> _Part:
    """The kernel's view of a band part: its bands' byte offsets read off the codec's layout (codes in band
    order, then one FP16 scale per band of > 0 bits)."""
    lay = rc.layout
    if label != "c_kv":
        raise BackendError(f"triton mla_decode: {label} codec {rc.spec.name}: band parts are read as c_kv only")
    if lay.width & (lay.width - 1):
        raise BackendError(f"triton mla_decode: c_kv codec {rc.spec.name}: width {lay.width} must be a power of two")
    if lay.code_bytes % 2:
        raise BackendError(
            f"triton mla_decode: c_kv codec {rc.spec.name}: {lay.code_bytes} bytes of codes put the FP16 scales (and "
            "the k_pe part) at odd byte offsets, which the kernel does not read; bands whose widths are multiples "
            "of 16 channels (calibration's 16-channel blocks) always give an even number")
    bands, ch, byte, k = [], 0, 0, 0
    for bits, w in lay.spec.bands:
        bands.append((bits, ch, w, byte, lay.code_bytes + 2 * k if bits else -1))
        ch, byte, k = ch + w, byte + bits * w // 8, k + (1 if bits else 0)
    return _Part(_KIND_BAND, False, lay.width, lay.width, offset, lay.scale_offset or 0, 0, tuple(bands))


def band_segments(part: _Part, d_split: int) -> tuple[tuple, tuple, tuple, tuple]:
    """How the programs of one head block read a band part: (segments of program 0, segments of program 1,
    0-bit channels program 0 stores as zeros, those program 1 stores), the last two as (channel, width) pieces
    of power-of-two widths.

    A segment (channel, W, V, bits, byte offset of its codes, byte offset of its band's FP16 scale) is one tile
    [BN, W] of channels channel .. channel + V − 1 of one band, W a power of two ≥ 16 (the FP16 `tl.dot`'s
    minimum K) and at most half the part, V ≤ W (V < W pads an 8-channel remainder). With `d_split` 2 the coded
    channels are split between the two programs at a multiple of 16 channels near their middle; when they fit
    in half the part's channels (the accumulator one program holds for other codecs) one program owns them all
    (program 1's segments are empty, `value_split` 1)."""
    coded = sum(w for bits, _, w, _, _ in part.bands if bits)
    split, first = part.width, 16 * (coded // 32)
    if d_split == 2 and coded > part.width // 2 and first:
        seen = 0
        for bits, ch, w, _, _ in part.bands:
            if bits and seen + w >= first:
                split = ch + first - seen
                break
            seen += w if bits else 0
    cap = max(16, part.width // 2)
    segs, zeros = ([], []), ([], [])
    for bits, ch, w, byte, soff in part.bands:
        for lo, hi in ((ch, min(ch + w, split)), (max(ch, split), ch + w)):
            pos = lo
            while pos < hi:
                rem = hi - pos
                width = min(cap, 1 << (rem.bit_length() - 1))
                if bits:
                    width = max(width, 16)
                    segs[pos >= split].append((pos, width, min(width, rem), bits, byte + (pos - ch) * bits // 8, soff))
                else:
                    zeros[pos >= split].append((pos, width))
                pos += min(width, rem)
    return tuple(segs[0]), tuple(segs[1]), tuple(zeros[0]), tuple(zeros[1])


def _part(rc, offset: int, on_gpu: bool, label: str) -> _Part:
    lay = rc.layout  # the codec's `PartLayout`: offsets are read from it, never recomputed here
    kind = lay.spec.kind
    width, group = lay.width, lay.group_size
    if kind == "band":
        return _band_part(rc, offset, label)
    if kind not in ("fp16", "int8", "int4"):
        raise BackendError(f"triton mla_decode: {label} codec {rc.spec.name} is not supported "
                           "(fp16/int8/int4 and band c_kv only)")
    if width & (width - 1) or group & (group - 1):
        raise BackendError(f"triton mla_decode: {label} codec {rc.spec.name}: width {width} and group "
                           f"{group} must be powers of two")
    if on_gpu and (group < 32 if kind != "fp16" else width < 16):
        raise BackendError(f"triton mla_decode: {label} codec {rc.spec.name}: on GPU integer groups need "
                           "≥ 32 channels and fp16 parts ≥ 16 (tl.dot minimum K)")
    scale_off = lay.scale_offset or 0
    if (offset + scale_off) % 2 or (kind == "fp16" and offset % 2):
        raise BackendError(f"triton mla_decode: {label} FP16 data at an odd byte offset (row layout {rc})")
    return _Part(
        {"fp16": _KIND_FP16, "int8": _KIND_INT8, "int4": _KIND_INT4}[kind],
        not lay.spec.symmetric, width, group, offset, scale_off, lay.zero_offset or 0,
    )


def _interpret_state() -> tuple[bool, bool]:
    """(our kernels interpreted, triton's library functions interpreted); triton.jit decides per function
    at decoration time."""
    from triton.runtime.interpreter import InterpretedFunction

    ours = isinstance(_partial_kernel, InterpretedFunction)
    return ours, isinstance(tl.standard.zeros_like, InterpretedFunction)


def interpreter_active() -> bool:
    """True when the kernels run in triton's CPU interpreter (TRITON_INTERPRET=1 set before importing
    triton)."""
    return all(_interpret_state())


def _check_device(t: Tensor) -> bool:
    """True for CUDA, False for the interpreter; BackendError when neither can run."""
    ours, library = _interpret_state()
    if ours != library:
        raise BackendError("TRITON_INTERPRET=1 must be set before triton is first imported, not in between")
    if ours:
        if t.is_cuda:
            raise BackendError("triton mla_decode: TRITON_INTERPRET=1 runs on CPU tensors only")
        return False
    if not t.is_cuda:
        raise BackendError("triton backend needs a CUDA device (or TRITON_INTERPRET=1 set before importing "
                           "triton, for the CPU interpreter)")
    return True


def _int32(t: Tensor) -> Tensor:
    """Integer index tensors as the int32 the kernels read (other integer dtypes are converted)."""
    if t.dtype in (torch.int64, torch.int16, torch.uint8, torch.int8):
        return t.to(torch.int32)
    return t


def schedule_chunk(config: KernelConfig, batch: int, heads: int, longest: int, n_sm: int | None,
                   codec=None) -> int:
    """Split-KV chunk for `batch` sequences of up to `longest` tokens on `n_sm` SMs (`codec`: the layer codec,
    whose c_kv part may run fewer value programs than `config.d_split`, `value_split`).

    With SMs (a GPU, or the AOT cost model): a chunk of c pages gives s = ceil(pages / c) splits and
    programs(s) stage-1 programs, which take ceil(programs / n_sm) waves of c pages each; the chunk is the
    longest whose waves x pages stays within 10 % of the shortest (fewest partials to write and merge).
    Without (n_sm None: the interpreter) the configured `split_kv_chunks`."""
    if not n_sm:
        return config.chunk_for(longest)
    block_h, _, d_split = config.tile_for(heads, on_gpu=True)
    if codec is not None:
        d_split = value_split(codec, heads, config, on_gpu=True)
    per_split = max(1, batch * triton.cdiv(heads, block_h) * d_split)
    pages = max(1, triton.cdiv(longest, PAGE_TOKENS))
    cost = {c: triton.cdiv(per_split * triton.cdiv(pages, c), n_sm) * c for c in range(1, pages + 1)}
    best = min(cost.values())
    return max(c for c, t in cost.items() if t <= 1.1 * best) * PAGE_TOKENS


def device_target(device: torch.device) -> str | None:
    """The `KernelConfig.targets` key of a CUDA device (by compute capability major), None if none."""
    return TARGETS.get(_capability(device.index or 0)[0])


@functools.lru_cache(maxsize=8)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@functools.lru_cache(maxsize=8)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device `device_index` (read once)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _resolve_chunk(chunk_tokens: int | None, q: Tensor, longest: int, config: KernelConfig, codec) -> int:
    if chunk_tokens is None:
        n_sm = sm_count(q.device.index or 0) if q.is_cuda else None
        return schedule_chunk(config, q.shape[0], q.shape[1], longest, n_sm, codec)
    if not _valid_chunk(chunk_tokens):
        raise ConfigError(f"mla_decode: chunk_tokens must be a positive multiple of {PAGE_TOKENS}, "
                          f"got {chunk_tokens!r}")
    return int(chunk_tokens)


def codec_parts(codec, on_gpu: bool) -> tuple[_Part, _Part]:
    """The kernel's view of a layer codec's row (c_kv part, k_pe part); BackendError when it cannot read it."""
    parts = _part(codec.ckv, 0, on_gpu, "c_kv"), _part(codec.kpe, codec.layout.kpe_offset, on_gpu, "k_pe")
    if codec.row_bytes % 2:
        raise BackendError(f"triton mla_decode: a row of {codec.row_bytes} bytes ({codec.name}) misaligns "
                           "the FP16 values of every other row")
    return parts


def supports(codec, on_gpu: bool = True) -> str | None:
    """None when the kernel reads `codec`'s rows, else why not (the dispatcher's "auto" then uses torch)."""
    try:
        codec_parts(codec, on_gpu)
    except BackendError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Launch:
    """One kernel launch, built without running it: `fn[grid](*args, **kwargs)`. `mlaquant.kernels.aot`
    compiles the same launch for a GPU on the CPU (meta tensors carry shapes and strides)."""

    fn: object
    grid: tuple[int, int, int]
    args: tuple
    kwargs: dict

    def run(self) -> None:
        self.fn[self.grid](*self.args, **self.kwargs)


def _int_groups(c: _Part, r: _Part) -> int:
    """Groups of the integer parts of a row (the query kernel's qs / Σq8 entries per head)."""
    return sum(p.width // p.group for p in (c, r) if p.kind != _KIND_FP16)


def scored_parts(codec, heads: int, config: KernelConfig, on_gpu: bool) -> tuple[_Part, _Part, bool, bool]:
    """(c_kv part, k_pe part, c_kv scored in FP16, k_pe scored in FP16) for a block of `heads` heads: a part
    whose family `config.fp16_scores` lists is scored as FP16 dots on its dequantized tile, with the query
    rounded to FP16; the others (integer) with INT8 dots on the query `_query_kernel` quantizes."""
    c, r = codec_parts(codec, on_gpu)
    return c, r, config.fp16_scores(heads, c.family), config.fp16_scores(heads, c.family, r.family)


def value_split(codec, heads: int, config: KernelConfig, on_gpu: bool) -> int:
    """Programs per head block that split the value channels: `tile_for`'s D_SPLIT, except 1 for a band c_kv part
    whose coded channels fit in one program's half (`band_segments`)."""
    d_split = config.tile_for(heads, on_gpu)[2]
    c, _ = codec_parts(codec, on_gpu)
    if c.kind == _KIND_BAND and d_split == 2 and not band_segments(c, 2)[1]:
        return 1
    return d_split


def _as_int_scored(c: _Part, r: _Part, fp16_c: bool, fp16_r: bool) -> tuple[_Part, _Part]:
    """The parts as the query kernel sees them: an FP16-scored part counts as FP16 (no query codes)."""
    return (dataclasses.replace(c, kind=_KIND_FP16) if fp16_c else c,
            dataclasses.replace(r, kind=_KIND_FP16) if fp16_r else r)


def query_launch(q: Tensor, codec, d_c: int, scale: float, config: KernelConfig, on_gpu: bool
                 ) -> tuple[Launch | None, tuple]:
    """Stage 0 for checked inputs: (launch, (q8 int8 [B, H, d_c + d_r], qs fp32 [B, H, NG], Σq8 int32
    [B, H, NG])), allocated on q's device unwritten; (None, (q, q, q)) when no part is scored with INT8
    dots (`scored_parts`; stage 1 then reads q only; the three are placeholders)."""
    c, r = _as_int_scored(*scored_parts(codec, q.shape[1], config, on_gpu))
    n_groups = _int_groups(c, r)
    if not n_groups:
        return None, (q, q, q)
    bsz, heads, width = q.shape
    q8 = torch.empty(bsz, heads, width, dtype=torch.int8, device=q.device)
    qs = torch.empty(bsz, heads, n_groups, dtype=torch.float32, device=q.device)
    qsum = torch.empty(bsz, heads, n_groups, dtype=torch.int32, device=q.device)
    block_h = min(QUERY_BLOCK_H, max(1, triton.next_power_of_2(heads)))
    args = (q, q8, qs, qsum, q.stride(0), q.stride(1), heads, float(scale) * _LOG2E)
    kwargs = dict(D_C=d_c, C_KIND=c.kind, C_G=c.group, R_KIND=r.kind, R_W=r.width, R_G=r.group, NG=n_groups,
                  BLOCK_H=block_h, num_warps=4)
    return Launch(_query_kernel, (triton.cdiv(heads, block_h), bsz, 1), args, kwargs), (q8, qs, qsum)


def stage1_launch(
    q: Tensor, staged: tuple, pool: Tensor, block_table: Tensor, seq_lens: Tensor, codec, d_c: int,
    scale: float, chunk: int, longest: int, config: KernelConfig, on_gpu: bool,
) -> tuple[Launch, Tensor, Tensor]:
    """The stage-1 launch for checked inputs (q contiguous along channels, `staged` = `query_launch`'s
    buffers, int32 indices, `chunk` resolved): (launch, partials [B, H, S, d_c] fp32, lse [B, H, S] fp32),
    both allocated on q's device unwritten."""
    bsz, heads = q.shape[:2]
    c, r, fp16_c, fp16_r = scored_parts(codec, heads, config, on_gpu)
    n_split = max(1, triton.cdiv(longest, chunk))
    parts = torch.empty(bsz, heads, n_split, d_c, dtype=torch.float32, device=q.device)
    lse = torch.empty(bsz, heads, n_split, dtype=torch.float32, device=q.device)
    block_h, warps, _ = config.tile_for(heads, on_gpu)
    d_split = value_split(codec, heads, config, on_gpu)
    seg0, seg1, zero0, zero1 = band_segments(c, d_split) if c.kind == _KIND_BAND else ((), (), (), ())
    grid = (triton.cdiv(heads, block_h) * d_split, n_split, bsz)
    args = (
        q, *staged, pool, block_table, seq_lens, parts, lse,
        q.stride(0), q.stride(1), pool.stride(0), block_table.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
        heads, chunk, float(scale) * _LOG2E,
    )
    kwargs = dict(
        PAGE=pool.shape[1], ROW_BYTES=codec.row_bytes, D_C=d_c,
        C_KIND=c.kind, C_ASYM=c.asym, C_G=c.group, C_SOFF=c.scale_offset, C_LOFF=c.lo_offset, C_F16=fp16_c,
        C_SEG0=seg0, C_SEG1=seg1, C_ZERO0=zero0, C_ZERO1=zero1,
        R_KIND=r.kind, R_ASYM=r.asym, R_W=r.width, R_G=r.group, R_OFF=r.offset,
        R_SOFF=r.scale_offset, R_LOFF=r.lo_offset, R_F16=fp16_r, NG=_int_groups(*_as_int_scored(c, r, fp16_c, fp16_r)),
        BLOCK_H=block_h, BLOCK_N=config.block_n_for(heads, c.family), D_SPLIT=d_split, ASM=on_gpu, num_warps=warps,
        num_stages=config.num_stages,
    )
    return Launch(_partial_kernel, grid, args, kwargs), parts, lse


def mla_decode_partials(
    q: Tensor, pool: Tensor, block_table: Tensor, seq_lens: Tensor, codec, d_c: int, scale: float,
    chunk_tokens: int | None = None, config: KernelConfig | None = None, max_seq_len: int | None = None,
) -> tuple[Tensor, Tensor, int]:
    """Stage 1 only: (partials [B, H, S, d_c] fp32, lse [B, H, S] fp32, chunk_tokens).

    Chunk k of sequence b covers tokens [k*chunk, min((k+1)*chunk, len_b)); entries of chunks at or past
    a sequence's end are left unwritten (garbage), `merge_gated_fp16` never reads them."""
    on_gpu = _check_device(q)
    config = (config or _packaged_config()).for_target(device_target(q.device) if on_gpu else None)
    inputs = DecodeInputs(q, pool, _int32(block_table), _int32(seq_lens), codec, d_c)
    inputs.check_kernel_layout()
    block_table, seq_lens = inputs.block_table, inputs.seq_lens
    longest = inputs.longest(max_seq_len)
    chunk = _resolve_chunk(chunk_tokens, q, longest, config, codec)
    codec_parts(codec, on_gpu)
    if q.dtype == torch.bfloat16 and not on_gpu:
        q = q.float()  # the interpreter has no bf16 arithmetic
    if q.stride(-1) != 1:
        q = q.contiguous()
    stage0, staged = query_launch(q, codec, d_c, scale, config, on_gpu)
    launch, parts, lse = stage1_launch(q, staged, pool, block_table, seq_lens, codec, d_c, scale, chunk, longest,
                                       config, on_gpu)
    if q.shape[0] and q.shape[1]:
        if stage0 is not None:
            stage0.run()
        launch.run()
    return parts, lse, chunk


def merge_launch(parts: Tensor, lse_parts: Tensor, seq_lens: Tensor, chunk_tokens: int, block_h: int = 16,
                 block_d: int = MERGE_BLOCK_D) -> tuple[Launch, Tensor, Tensor]:
    """The stage-2 launch: (launch, out [B, H, D] fp32, lse [B, H] fp32) for [B, H, S, D] partials, in programs
    of `block_h` heads x `block_d` channels."""
    bsz, heads, _, dim = parts.shape
    if dim & (dim - 1):
        raise BackendError(f"merge_gated_fp16: width {dim} must be a power of two")
    out = torch.empty(bsz, heads, dim, dtype=torch.float32, device=parts.device)
    lse = torch.empty(bsz, heads, dtype=torch.float32, device=parts.device)
    block_h = min(block_h, max(1, triton.next_power_of_2(heads)))
    block_d = min(block_d, dim)
    args = (
        parts, lse_parts, seq_lens, out, lse,
        parts.stride(0), parts.stride(1), parts.stride(2),
        lse_parts.stride(0), lse_parts.stride(1), lse_parts.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        heads, int(chunk_tokens),
    )
    grid = (bsz, triton.cdiv(heads, block_h), dim // block_d)
    return Launch(_merge_kernel, grid, args, dict(BLOCK_H=block_h, BLOCK_D=block_d)), out, lse


def merge_gated_fp16(
    parts: Tensor, lse_parts: Tensor, seq_lens: Tensor, chunk_tokens: int, block_h: int = 16
) -> tuple[Tensor, Tensor]:
    """Stage 2 in Triton, the FP16-gated merge of the module docstring (not an exact LSE merge): fold
    [B, H, S, D] partials -> (out [B, H, D] fp32, lse [B, H] fp32).

    Sequence b merges its first cdiv(seq_lens[b], chunk_tokens) chunks; an empty sequence gives 0, -inf."""
    _check_device(parts)
    launch, out, lse = merge_launch(parts, lse_parts, _int32(seq_lens), chunk_tokens, block_h)
    if out.numel():
        launch.run()
    return out, lse


def mla_decode(
    q: Tensor, pool: Tensor, block_table: Tensor, seq_lens: Tensor, codec, d_c: int, scale: float,
    chunk_tokens: int | None = None, config: KernelConfig | None = None, max_seq_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Split-KV decode: (out [B, H, d_c] fp32, lse [B, H] fp32); see the module docstring.

    `chunk_tokens` overrides the split-KV chunk (a multiple of 64); `config` the launch settings;
    `max_seq_len` (≥ max(seq_lens), known on the host) skips the device sync that finds the longest
    context."""
    config = config or _packaged_config()
    block_table, seq_lens = _int32(block_table), _int32(seq_lens)
    parts, lse, chunk = mla_decode_partials(q, pool, block_table, seq_lens, codec, d_c, scale, chunk_tokens,
                                            config, max_seq_len)
    if parts.shape[2] == 1:
        empty = seq_lens == 0
        out, lse = parts[:, :, 0], lse[:, :, 0]
        return out.masked_fill(empty[:, None, None], 0.0), lse.masked_fill(empty[:, None], float("-inf"))
    return merge_gated_fp16(parts, lse, seq_lens, chunk)


__all__ = [
    "supports", "Launch", "query_launch", "stage1_launch", "merge_launch", "scored_parts", "device_target",
    "KernelConfig", "load_kernel_config", "mla_decode", "mla_decode_partials", "merge_gated_fp16",
    "interpreter_active", "PAGE_TOKENS", "TARGETS",
]
