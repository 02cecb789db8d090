"""The jitted side of the Triton MLA decode: the three kernels `mlaquant.kernels.mla_decode` launches and the
device functions they call. Every shape, offset and scoring choice arrives as a constexpr of the launch; the
host module derives them from the codec and `KernelConfig`.

Decode absorbs W_UK into the query, so attention is MQA with one KV head whose row is the cached latent
`[c_kv (d_c) | k_pe (d_r)]`; V is `c_kv` itself. With qk_scale = scale · log2(e) (the host folds it in):

    s[h, t]  = qk_scale · (q[h, :d_c] · c_kv[t] + q[h, d_c:] · k_pe[t])      base-2 scores, FP32
    out[h]   = Σ_t 2^(s[h, t] − m) · c_kv[t] / Σ_t 2^(s[h, t] − m)           FP32
    lse[h]   = ln 2 · (m + log2 Σ_t 2^(s[h, t] − m))                        natural log, FP32

Kernels (grids as the host launches them; H heads, B sequences, S chunks of `chunk_tokens`):

    query_kernel    stage 0, grid (cdiv(H, BLOCK_H), B): each INT8-scored part's query quantized once per
                    (sequence, head) into q8 int8 [B, H, d_c + d_r] (in dot order), qs fp32 [B, H, NG] (times
                    qk_scale) and Σq8 int32 [B, H, NG], NG the integer parts' groups, c_kv's first
                    (`_stage_query_part`); a float part stores nothing
    partial_kernel  stage 1, grid (cdiv(H, BLOCK_H) · D_SPLIT, S, B), program_id(0) fastest: one (head block,
                    value half when D_SPLIT = 2, chunk, sequence) -> the chunk's normalized partial output
                    [BLOCK_H, d_c] fp32 (its half of the channels; of a band part its segments' channels and
                    its share of the 0-bit ones) at out[b, h, chunk] and its LSE at lse[b, h, chunk] (written
                    by value half 0); heads whose chunk starts at or past the sequence's end write nothing
    merge_kernel    stage 2, grid (B, cdiv(H, BLOCK_H), D / BLOCK_D): a sequence's first cdiv(len, chunk_tokens)
                    partials folded left to right (below) into out [B, H, D] fp32, the first channel block
                    storing lse [B, H]; an empty sequence gives 0, −inf

Kind codes: a part's KIND constexpr is KIND_FP16 (0), KIND_INT8 (1), KIND_INT4 (2) or KIND_BAND (3, c_kv only);
ASYM marks asymmetric integer codes. A part of width W in groups of G channels (n_g = W / G) is read at these
bytes of its row (little-endian; c_kv at byte 0, k_pe at byte R_OFF; scales at SOFF and zero points at LOFF
inside the part):

    fp16            W fp16 values                       2W bytes
    int8 sym        W int8 codes (q in [-128, 127]) | n_g fp16 s (signed)           x = q * s
    int8 asym       W uint8 codes (q in [0, 255]) | n_g fp16 s | n_g fp16 lo         x = q * s + lo
    int4 sym        W/2 bytes (low nibble = channel 2j, high = 2j+1, stored q + 8, q in [-8, 7]) | n_g fp16 s (signed)
    int4 asym       W/2 bytes (nibbles q in [0, 15]) | n_g fp16 s | n_g fp16 lo
    band (c_kv)     the bands' codes in band order (b bits x w channels: w·b/8 bytes, channel c of the band at bit
                    b·c of its little-endian byte string, stored u = q + 2^(b-1), q in [-2^(b-1), 2^(b-1) - 1],
                    an 8-bit band the int8 byte) | one fp16 s per band of > 0 bits (signed)      x = q * s
                    (b in 8/4/3/2/0; a 0-bit band stores nothing, x = 0)

A band part reaches the kernel as segments (C_SEG0 for value half 0, C_SEG1 for half 1; the host's
`band_segments`): (channel, W, V, bits, byte offset of its codes, byte offset of its FP16 scale), one [BN, W]
tile of channels channel .. channel + V − 1 of one band, W a power of two ≥ 16, columns ≥ V zero and unread;
C_ZERO0 / C_ZERO1 list the (channel, width) pieces of 0-bit channels a program stores as zeros.

Scores. Each part is scored one of two ways, chosen by the constexprs C_F16 / R_F16 (a band part always the first):
- FP16 dots on the dequantized tile: the part's tile is dequantized once per tile (`half_values`, exactly the
  codec's decode rounded to FP16, as for P·V), in two halves of contiguous channels, and each half feeds an
  FP16 x FP16 `tl.dot` (FP32 accumulation) with the query rounded to FP16, times qk_scale; for c_kv the same
  halves are the V tiles of P·V (an integer part's pass an identity Triton may not duplicate, `_computed_once`,
  so they are computed once and converted into each dot's layout). A band part is scored per segment, every
  coded segment of both value halves (`band_values`); its 0-bit channels are neither read nor scored. No query
  kernel runs for these parts; the scores differ from the exact decode by the FP16 rounding of q and of the
  decoded keys.
- INT8 dots (the other integer parts): the query kernel quantizes the query per (token, head, group) with the
  cache part's grouping: `qs = absmax(q_group) / 127` (FP32, IEEE division), `q8 = round_half_even(q_group / qs)`
  (an all-zero group gets qs = 1, q8 = 0); then per group one INT8 x INT8 -> INT32 `tl.dot` with the group's
  codes, exact, scaled into FP32: `qs * s * dot8` (+ `qs * lo' * Σq8` for asymmetric groups), qk_scale folded
  into qs (a float part's dot is multiplied by it instead). Asymmetric INT8 codes (0..255) enter the dot as
  `q - 128` (the byte XOR 0x80) with `lo' = lo + 128 * s`; asymmetric INT4 codes enter unchanged (lo' = lo).
  INT4 groups of ≥ 64 channels run as two dots over the unsigned nibbles, low (even channels) and high (odd
  channels), against the query's even and odd channels, and symmetric ones subtract 8·Σq8 (the same INT32 value
  as Σ q8·(n − 8)); smaller INT4 groups interleave the nibbles into one INT8 tile (`dot_codes`).
  `group_dot` (tests/test_kernel_mla_decode.py) is the reference path for one group, checked there bit-exactly
  against torch; tests/test_kernel_dequant.py checks the in-loop `group_dot_int32` against it.

Codes to numbers. With ASM (compiled for the GPU) nibbles are unpacked by inline PTX four bytes per 32-bit
instruction, INT8 codes reach FP16 by moving the byte XOR 0x80 into the mantissa of FP16 1024 and subtracting
1152 (`_int8_f16`, exact for every code, −128 included), INT4 nibbles likewise (`_nibble_f16`), 2- and 3-bit band
codes by shifts and masks into the mantissa of FP16 1024 (`_code_f16`; a 3-bit band as three byte planes), all
interleaved into channel order; without ASM (the interpreter) the same values by per-element operations.

P·V: V is dequantized in-kernel (`half_values`, in two halves of the channels: contiguous for fp16 / int8 and
for FP16-scored int4, else the low and high nibbles; `half_channels` lists them) exactly as the codec's decode
rounded to FP16 — asymmetric codes in FP32 (`q * s + lo`), symmetric ones in FP16 (|q| ≤ 128 times an FP16 scale
of either sign is exact in FP32, so FP16's rounded product is the same bits; tests/test_kernel_dequant.py checks
every codec bit for bit, codes −128 / −8 and negative scales included) — and multiplied with P rounded to FP16
(FP32 accumulation), once per tile for all heads of the program.

Stage-1 tiles. A tile is BLOCK_N consecutive tokens of one sequence x BLOCK_H heads; the accumulators are
[BLOCK_H, d_c/2] FP32 per value half (HALF, a constexpr: a program compiles its own half's dequantization only;
both halves when D_SPLIT is 1), or for a band part one [BLOCK_H, W] per segment. When BLOCK_N divides PAGE (and
chunks start at multiples of it) a tile lies in one page: one block-table entry gives a scalar base and every
load is that base plus loop-invariant offsets (`page_rows`); other page sizes look up each token's page
(`tile_rows`). Whole tiles run with a constant all-true mask; the one partial tile of a chunk runs first, its
tokens past the range reading the tile's first token, their scores set to −inf. The softmax is online in base 2
and lazily rescaled: the running max (and the accumulators) move only when a tile's max exceeds it by more than
RESCALE_LOG2, so p ≤ 2^RESCALE_LOG2 in FP16.

Stage 2 folds the chunks of each sequence left to right:

    g = σ(λ_a − λ_b)             computed in FP32, then rounded to FP16 (ĝ)
    h = ĝ·h_a + (1 − ĝ)·h_b       FP16 gate applied to FP32 accumulators (1 − ĝ is exact in FP32)
    λ = max + log(e^(λ_a−max) + e^(λ_b−max))   FP32, unaffected by the gate rounding

(its error bound: `mlaquant.kernels.mla_decode`'s docstring).
"""

from __future__ import annotations

import triton
import triton.language as tl

# the values of a part's KIND constexpr (the kernels spell them as the literals 0..3)
KIND_FP16, KIND_INT8, KIND_INT4, KIND_BAND = 0, 1, 2, 3
RESCALE_LOG2 = tl.constexpr(8.0)  # lazy softmax rescaling threshold (base-2 exponent): p ≤ 2^8 in FP16


# Helpers are few and large on purpose: the CPU interpreter re-patches triton.language on every call of a
# jitted helper, which dominated the test time when the code was split finer. Some public helpers
# (`half_values`, `band_values`, `tile_rows`, the INT8 score path's pieces) are also launched by the exactness
# tests, from probe kernels of their own.


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
def query_kernel(
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
    `query_kernel` stored (so its qs include qk_scale)."""
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
def partial_kernel(
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
    part's as `query_kernel` quantized it); each tile's values are dequantized once per program, into the
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
def merge_kernel(
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
    first = (tl.program_id(2) + tl.zeros_like(offs_h)) == 0  # broadcast first: see `partial_kernel`
    tl.store(lse_ptr + b * stride_lb + offs_h * stride_lh, lse, mask=h_mask & first)

