"""Triton MLA decode over a paged, quantized latent cache (one query token per sequence): the host side. The
kernels and their device contract (what each computes, tile shapes, the row bytes they read, the scoring and
merge arithmetic) are `mlaquant.kernels.mla_decode_jit`; this module checks the inputs, turns a codec into the
kernels' constexprs, schedules the split-KV chunks and launches the three stages.

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

Rows: `codec_parts` reads each part's byte layout off the codec (`mlaquant.quant.codecs`; a band part's bands
from `mlaquant.quant.band_codecs`) into a `_Part`, the constexprs the kernels take: kind, offsets of the codes,
scales and zero points; `band_segments` cuts a band part into the tiles the kernel reads. fp32 / bf16 parts are
refused (BackendError): they exist for exactness checks on the torch path.

Scores. Each row part is scored one of two ways (mla_decode_jit's docstring): FP16 dots on the dequantized tile,
or INT8 dots on the query that stage 0 quantizes once per call with the part's grouping. `KernelConfig.dequant_scores`
chooses per block shape and part family (`scored_parts`; configs/kernels.yaml says which and why): every FP16
part of a narrow block and the integer families listed are FP16-scored, a band c_kv part always; no query kernel
runs when no part is INT8-scored.

GPU layout: per target a block shape (`KernelConfig.tile_for`: above 16 heads on sm_90a 128 heads on 8 warps in
two value halves, wgmma; on sm_80 32 heads on 8 warps; up to 16 heads one 16-row block on 4 warps), the parts
scored in FP16 (`scored_parts`), tiles of 32 tokens in one stage, lazy rescaling by 2^RESCALE_LOG2, page-aligned
tiles (`page_rows`, else `tile_rows`), one program per head block for a band part that fits one value half
(`value_split`). Each choice and the compile report behind it: docs/kernels.md, "GPU layout".

Split-KV. The context is cut into chunks of `chunk_tokens` (a multiple of the 64-token page). By default, on
a GPU, `schedule_chunk` sizes them to fill the SMs (waves x pages per program within 10 % of the best, the
longest such chunk); under the interpreter they come from `configs/kernels.yaml` by the batch's longest
context: 512 below 2k tokens, 768 for 2k-8k, 1024 above. Stage 1 runs one program per (head block [x value
half when `d_split` is 2], chunk, sequence) — head blocks fastest, so the programs reading one tile run side
by side and all but the first hit L2; `KernelConfig.tile_for` gives the block (128 heads on 8 warps in two
value halves, wgmma, above 16 heads on sm_90a; 32 heads on 8 warps on sm_80; one 16-row block on 4 warps up
to 16) — with an FP32 online softmax (base 2, lazily rescaled) and writes the chunk's
normalized partial output h_k [d_c] and its natural-log LSE λ_k. Stage 2 folds the chunks of each sequence
left to right with an FP16 sigmoid gate (mla_decode_jit's docstring): g = σ(λ_a − λ_b) computed in FP32 and
rounded to FP16 (ĝ), h = ĝ·h_a + (1 − ĝ)·h_b on FP32 accumulators, λ the exact FP32 log-sum-exp of the two.

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
from mlaquant.kernels.mla_decode_jit import (
    KIND_BAND,
    KIND_FP16,
    KIND_INT4,
    KIND_INT8,
    merge_kernel,
    partial_kernel,
    query_kernel,
)

PAGE_TOKENS = 64
TARGETS = {8: "sm_80", 9: "sm_90a"}  # `KernelConfig.targets` keys by compute capability major
# c_kv parts by how the kernel reads them (`KernelConfig.wide_block_n`, `dequant_scores`)
CKV_FAMILIES = ("fp16", "row", "grouped", "band")
_LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: qk_scale = scale · log2(e)
QUERY_BLOCK_H = 16  # heads per program of the query kernel (stage 0)
MERGE_BLOCK_D = 128  # channels per program of the merge (stage 2): 16 x 512 spent all 255 registers


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
        if self.kind == KIND_FP16:
            return "fp16"
        if self.kind == KIND_BAND:
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
    return _Part(KIND_BAND, False, lay.width, lay.width, offset, lay.scale_offset or 0, 0, tuple(bands))


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
        {"fp16": KIND_FP16, "int8": KIND_INT8, "int4": KIND_INT4}[kind],
        not lay.spec.symmetric, width, group, offset, scale_off, lay.zero_offset or 0,
    )


def _interpret_state() -> tuple[bool, bool]:
    """(our kernels interpreted, triton's library functions interpreted); triton.jit decides per function
    at decoration time."""
    from triton.runtime.interpreter import InterpretedFunction

    ours = isinstance(partial_kernel, InterpretedFunction)
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
    return sum(p.width // p.group for p in (c, r) if p.kind != KIND_FP16)


def scored_parts(codec, heads: int, config: KernelConfig, on_gpu: bool) -> tuple[_Part, _Part, bool, bool]:
    """(c_kv part, k_pe part, c_kv scored in FP16, k_pe scored in FP16) for a block of `heads` heads: a part
    whose family `config.fp16_scores` lists is scored as FP16 dots on its dequantized tile, with the query
    rounded to FP16; the others (integer) with INT8 dots on the query `query_kernel` quantizes."""
    c, r = codec_parts(codec, on_gpu)
    return c, r, config.fp16_scores(heads, c.family), config.fp16_scores(heads, c.family, r.family)


def value_split(codec, heads: int, config: KernelConfig, on_gpu: bool) -> int:
    """Programs per head block that split the value channels: `tile_for`'s D_SPLIT, except 1 for a band c_kv part
    whose coded channels fit in one program's half (`band_segments`)."""
    d_split = config.tile_for(heads, on_gpu)[2]
    c, _ = codec_parts(codec, on_gpu)
    if c.kind == KIND_BAND and d_split == 2 and not band_segments(c, 2)[1]:
        return 1
    return d_split


def _as_int_scored(c: _Part, r: _Part, fp16_c: bool, fp16_r: bool) -> tuple[_Part, _Part]:
    """The parts as the query kernel sees them: an FP16-scored part counts as FP16 (no query codes)."""
    return (dataclasses.replace(c, kind=KIND_FP16) if fp16_c else c,
            dataclasses.replace(r, kind=KIND_FP16) if fp16_r else r)


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
    return Launch(query_kernel, (triton.cdiv(heads, block_h), bsz, 1), args, kwargs), (q8, qs, qsum)


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
    seg0, seg1, zero0, zero1 = band_segments(c, d_split) if c.kind == KIND_BAND else ((), (), (), ())
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
    return Launch(partial_kernel, grid, args, kwargs), parts, lse


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
    return Launch(merge_kernel, grid, args, dict(BLOCK_H=block_h, BLOCK_D=block_d)), out, lse


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
