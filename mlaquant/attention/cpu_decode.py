"""Fast CPU decode attention over a paged, quantized latent cache: integer scores and P·V on the stored codes, no
FP32 copy of the context. Same op and arguments as `mlaquant.attention.ops.mla_decode` (backend "cpu"):

    score[b, h, t] = scale * (q[b, h, :d_c] · c_kv[b, t] + q[b, h, d_c:] · k_pe[b, t])   t < seq_lens[b]
    out[b, h]      = softmax_t(score[b, h]) @ c_kv[b]            lse[b, h] = logsumexp_t(score[b, h])

Blocks. Where the C kernels read every part (`mlaquant.attention.native`: both parts integer), the whole call is one
`Kernels.decode`: each sequence's rows are read in place from its pages, block by block (t = `block_tokens_for`),
scores then P·V, the online softmax (running max and sum in base 2, flash-style) inside the kernels. Otherwise
sequences run longest first in groups of `GROUP_SEQUENCES`; block j of a group holds tokens [j·t, (j+1)·t) of its
sequences still running (whole pages), copied out of the pool in one `index_select` (a shorter sequence's missing
pages padded with its own, the rows past its end zeroed and their scores masked), and torch ops run the softmax,
batched over the group; buffers come from a per-thread `Buffers`.

Scores of an integer part (int8/int4, sym/asym, any grouping). The query is quantized per (token, head, group)
exactly as the Triton kernel does (`quantize_query`: qs = absmax / 127, q8 = round_half_even(q / qs)). The C
kernels (`mlaquant/attention/csrc/decode_kernels.c`, the ISA variant `mlaquant.attention.native` picks) sum q8 · c'
exactly in INT32 per group on the codes as stored (c' = q for int8 sym, q − 128 asym, nibble − 8 int4 sym, nibble asym)
and fuse the FP32 epilogue Σ_g (qs_g · s_g) · dot_g (+ (Σq8 · qs_g) · lo'_g, lo' = lo + 128 s for int8 asym, lo for int4
asym), reading the FP16 scales and zero points themselves. Without them (`c_kernels=False`, or no compiler):
`torch._int_mm` per sequence and group on int8 codes (sym int8 a view, asym int8 XOR 0x80, int4 by the C unpack
or `unpack_nibbles`, channel order `_CpuPart.perm`), then the same epilogue in torch. A float part is decoded into an
FP32 block and multiplied in FP32 (fp16/fp16: one [t, d_c + d_r] block, one GEMM).

P·V. An integer c_kv part (row-wise or grouped) read by the C kernels is never dequantized: per group g of a block
P[h, t] = rint(p · s_t,g · 32767 / M_g) in int16, M_g = max_t |s_t,g|, S = Σ_t P · c' exact (INT32 per 256-token
chunk, |P| ≤ 32767, |c'| ≤ 128; FP64 across chunks, exact below 2^53), acc += M_g / 32767 · S + Σ_t p · lo'.
With torch ops a row-wise part takes two int8 digits of p·s in one `torch._int_mm` (`split_probs`: |error| ≤
m / 256, m = max_t |s_t| / 127), a grouped part is dequantized block by block into FP32; a float part is its FP32
block from the scores.

Error against the FP32 reference (`mla_decode_reference`, the same quantized cache):

  scores   the query's quantization: |q − q8·qs| ≤ qs/2 per channel, so |Δscore| ≤ scale · Σ_groups (qs_g / 2) ·
           Σ_c∈g |k_c| (the same as the kernel); the integer sums are exact; the FP32 epilogue sums the G groups
           of both parts in order: ≤ (G + 4) · 2^-24 · Σ_c |q_c k_c| (at least the 2^-20 of FP32 GEMMs).
  P·V      a score error Δs moves each probability by a factor within e^(±2Δs), so |Δout[h, c]| ≤ (e^(2 Δs) − 1)
           · max_t |v[t, c]|; FP32 P·V and the online rescaling add ≤ 2^-12 · max_t |v[t, c]| (this covers the
           kernels' own exp2 too: relative error ≤ 2^-21, tests/test_native_kernels.py); P on the codes adds
           ≤ e^(4Δs) · step · M_g(c) · Σ_t |c'_t,c| / Σ_t p_t, p_t = e^(score_t − max score): step = (1/2 + 2^-7) /
           32767 for the kernels' int16 P (rounding, plus the FP32 product p · s · 32767 / M), 1 / (127 · 256) for
           the torch ops' two int8 digits.
  lse      |Δlse| ≤ Δs = max_t |Δscore[t]| (+ FP32 rounding and the kernels' exp2: 2^-21 relative in the sum).

A band c_kv part read by the C kernels (`native_parts`) is one integer part per stored band (row-wise, its own
FP16 scale): the query quantized per band, the bands' INT32 dots summed in the epilogue in band order, P·V on each
band's codes into its channels (0-bit bands: zeros) — the terms above with one group per band.

`cpu_error_bound` (tests/reference.py) computes the lse and output bounds of a call for the path that runs
(`pv_kind`); tests/test_cpu_decode.py checks the outputs against them (ragged batch, NaN-filled free slots and
blocks, permuted block tables), both with the C kernels and with torch ops.
"""

from __future__ import annotations

import functools
import math
import threading
import time

import torch
from torch import Tensor

from mlaquant.attention import native
from mlaquant.attention.buffers import Buffers
from mlaquant.attention.decode_inputs import DecodeInputs, gather_pages
from mlaquant.quant.codecs import CodecSpec, LayerCodec, RowCodec, packed_as

BLOCK_TOKENS = 1024  # tokens per sequence and block of a float c_kv (an FP32 block: 2.25 MiB at d 576)
GROUPED_BLOCK_TOKENS = 2048  # a grouped integer c_kv: int8 codes in, FP32 values only for P·V
INT_BLOCK_TOKENS = 4096  # row-wise integer c_kv: P·V on the codes, no FP32 values, so fewer and larger blocks
GROUP_SEQUENCES = 2  # sequences whose blocks run as one batch of torch ops, split by torch's intra-op threads
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453  # scores run in base 2 (`_Group`)


def block_tokens_for(codec: LayerCodec, c_kernels: bool = True) -> int:
    """Tokens per sequence and block for `codec` (`mlaquant bench decode --batch 16 --fast-blocks`): an integer
    c_kv read by the C kernels needs no FP32 block, so it takes `INT_BLOCK_TOKENS` grouped or not."""
    ckv = codec.ckv
    if _c_reads(ckv, c_kernels) or (ckv.spec.kind in _INT_KINDS and ckv.layout.n_groups == 1):
        return INT_BLOCK_TOKENS
    return GROUPED_BLOCK_TOKENS if ckv.spec.kind in _INT_KINDS else BLOCK_TOKENS
_INT_KINDS = ("int8", "int4")


def _c_reads(rc: RowCodec, c_kernels: bool = True) -> bool:
    """Whether the C kernels read part `rc` on its codes here (`native_parts`; `c_kernels` and built)."""
    return c_kernels and native.kernels() is not None and native_parts(rc) is not None


def native_parts(rc: RowCodec) -> list[tuple[native.Part, int, int]] | None:
    """How the C kernels read part `rc`: [(part, its byte offset in `rc`'s bytes, its first channel)] — one for an
    integer part, one per stored band of a band part (row-wise codes of 8, 4, 3 or 2 bits, its FP16 scale after
    every band's codes; 0-bit bands have none); None where they cannot (a float part, or more bands than a call
    takes beside k_pe)."""
    lay = rc.layout
    if rc.spec.kind in _INT_KINDS:
        kind = native.KINDS[(rc.spec.kind, rc.spec.symmetric)]
        return [(native.Part(kind, rc.width, lay.group_size, lay.scale_offset, lay.zero_offset or 0), 0, 0)]
    if rc.spec.kind != "band":
        return None
    parts, offset, channel = [], 0, 0
    for bits, w in rc.spec.bands:
        if bits:
            scale = lay.code_bytes + 2 * len(parts)
            parts.append((native.Part(native.BAND_KINDS[bits], w, w, scale - offset, 0), offset, channel))
            offset += bits * w // 8
        channel += w
    return parts if 0 < len(parts) < native.MAX_PARTS else None


def quantize_query(q: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """The Triton kernel's query quantization, bit-identical (tests/test_kernel_mla_decode.py compares the
    kernel's scales and INT32 dots against it):
    q [..., W] float → (q8 int8 [..., W], qs fp32 [..., W / group_size]); qs = absmax / 127 per group
    (1 for an all-zero group), q8 = round_half_even(q / qs)."""
    x = q.float().unflatten(-1, (-1, group_size))
    amax = x.abs().amax(-1)
    qs = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q8 = torch.round(x / qs.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q8.flatten(-2), qs


PROB_STEP = 128.0  # the low int8 digit of a probability weighs 1/128 of the high one


_LOCAL = threading.local()


def _workspace() -> Buffers:
    """This thread's buffers (threads calling the fast path at once never share them)."""
    if not hasattr(_LOCAL, "workspace"):
        _LOCAL.workspace = Buffers()
    return _LOCAL.workspace


def split_probs(probs: Tensor, s: Tensor, ws: Buffers) -> tuple[Tensor, Tensor]:
    """The scaled probabilities p·s of a block in two int8 digits: probs fp32 [a, H, t] in [0, 1] (scores
    less a running max at least their own), signed row scales s fp32 [a, t, 1] → (digits int8 [a, 2H, t] =
    [hi; lo], m fp32 [a, 1, 1]) with p·s ≈ m · (hi + lo / 128): m = max_t |s_t| / 127 ≥ max_t p_t |s_t| / 127
    (the smallest normal FP32 number for all-zero scales), hi = round(p·s / m) ∈ [−127, 127], lo = round((p·s
    / m − hi) · 128) ∈ [−64, 64], so |p·s − m · (hi + lo / 128)| ≤ m / 256 per entry. m from the scales alone
    spares the pass over [a, H, t] that max_t p_t |s_t| would take, and the division folds into the product."""
    m = s.abs().amax(1, keepdim=True).div_(127.0).clamp_min_(torch.finfo(torch.float32).tiny)  # [a, 1, 1]
    a, heads, t = probs.shape
    digits = ws.take("digits", (a, 2 * heads, t), torch.float32)  # [hi; lo] in FP32, converted once
    hi, lo = digits[:, :heads], digits[:, heads:]
    torch.mul(probs, (s / m).transpose(1, 2), out=lo)
    torch.round(lo, out=hi)
    lo.sub_(hi).mul_(PROB_STEP).round_()
    return ws.take("digits8", digits.shape, torch.int8).copy_(digits), m


class _CpuPart:
    """How one row part (c_kv, k_pe, or a whole float row) is read: its byte range in the row, its codes,
    scales and zero points, and the query's form for it."""

    def __init__(self, rc: RowCodec, offset: int, device: torch.device, name: str, c_unpack: bool = True,
                 c_kernels: bool = True) -> None:
        self.rc, self.offset, self.name = rc, offset, name
        self.is_int = rc.spec.kind in _INT_KINDS
        self.asym = self.is_int and not rc.spec.symmetric  # values codes · s + lo', lo' per row and group
        # the C kernels (`mlaquant.attention.native`) read the part's stored codes, scales and zero points themselves:
        # channels in their stored order, no unpack, no bias; a band part as one C part per stored band (`cparts`)
        self.cparts = native_parts(rc) if c_kernels and device.type == "cpu" else None
        self.kern = native.kernels() if self.cparts is not None else None
        if self.kern is not None:
            self.native, self.bias, self.perm = None, 0, None
            return
        # int4 codes from the C unpack (None: not asked for or not built, torch ops); symmetric ones read
        # unsigned by torch ops are q + 8, and the GEMMs' INT32 sums take − 8 · Σ (exact)
        self.native = native.unpack_int4() if c_unpack and rc.spec.kind == "int4" else None
        self.bias = 8 if rc.spec.kind == "int4" and not self.asym and self.native is None else 0
        lay = rc.layout
        self.n_g, self.g = (lay.n_groups, lay.group_size) if self.is_int else (1, rc.width)
        # int4 codes are unpacked as [low nibbles | high nibbles]: channel order `perm` (even channels, then
        # odd), one contiguous pass instead of an interleaving one; each group splits into two half-groups
        # that share its scale (a row-wise part stays one group: every channel has the same scale)
        self.perm = None
        if rc.spec.kind == "int4":
            even, odd = (torch.arange(start, rc.width, 2, device=device) for start in (0, 1))
            self.perm = torch.cat([even, odd])
            if self.n_g > 1:
                self.n_g, self.g = 2 * self.n_g, self.g // 2

    def bytes_of(self, raw: Tensor) -> Tensor:
        """The part's bytes of block rows raw uint8 [n, row_bytes] → [n, part bytes] (a view)."""
        return raw[:, self.offset : self.offset + self.rc.row_bytes]

    def _stored(self, part: Tensor, offset: int) -> Tensor:
        """The FP16 array at byte `offset` of the part (one value per stored group) → fp32 [n, n_g]."""
        n = self.rc.layout.n_groups
        stored = part[:, offset : offset + 2 * n]
        try:  # a strided FP16 view of the rows where the byte offsets are even: one pass, no copy
            vals = stored.view(torch.float16).float()
        except RuntimeError:  # an odd offset (a band c_kv of odd bytes before k_pe): a fresh copy
            vals = packed_as(stored, torch.float16).float()
        return vals if n == self.n_g else torch.cat([vals, vals], dim=1)  # half-groups share their group's

    def params(self, part: Tensor) -> tuple[Tensor, Tensor | None]:
        """FP16 scales and the zero points lo' of the codes as `codes` gives them (asym only, else None) of
        an integer part's bytes → fp32 [n, n_g] each."""
        lay = self.rc.layout
        s = self._stored(part, lay.scale_offset)
        if not self.asym:
            return s, None
        lo = self._stored(part, lay.zero_offset)
        return s, lo if lay.spec.kind == "int4" else lo + 128.0 * s

    def codes(self, part: Tensor, ws: Buffers) -> Tensor:
        """int8 codes [n, W] of an integer part (sym int8: a strided view of the block; asym int8: q − 128;
        int4: the nibbles in the channel order `perm`, [low nibbles | high nibbles], signed q for symmetric
        codes from the C unpack, else unsigned). A dense copy of the sym int8 codes made the GEMMs faster but
        the call slower (batch 16 x 4k, wall clock)."""
        rc, raw = self.rc, part[:, : self.rc.layout.code_bytes]
        if rc.spec.symmetric and rc.spec.kind == "int8":
            return raw.view(torch.int8)
        dense = ws.take(self.name + ".codes", (raw.shape[0], rc.width), torch.uint8)
        if self.native is not None:
            return self.native(raw, dense, not self.asym)
        if rc.spec.kind == "int4":
            return unpack_nibbles(raw, dense)
        return torch.bitwise_xor(raw, 0x80, out=dense).view(torch.int8)

    def c_args(self, query: list[tuple[Tensor, Tensor]]) -> list[tuple[native.Part, int, Tensor, Tensor]]:
        """The C kernels' (part, byte offset in the row, q8, qs) of each C part, for its slice of `query`."""
        return [(cp, self.offset + off, q8, qs) for (cp, off, _), (q8, qs) in zip(self.cparts, query)]

    def quantized_query(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """`quantize_query` of the part's query x [..., H, W] with the stored grouping, in the codes' channel
        order: (q8 int8 [..., H, W], qs fp32 [..., H, n_g])."""
        q8, qs = quantize_query(x, self.rc.layout.group_size)
        if self.perm is None:
            return q8, qs
        return q8.index_select(-1, self.perm), (qs if qs.shape[-1] == self.n_g else torch.cat([qs, qs], dim=-1))

    def query(self, x: Tensor, factor: float) -> Tensor | tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """The part's query x [B, H, W] as the blocks use it, for all sequences at once, with the score
        factor folded in: FP32 x · factor [B, H, W] for a float part; for an integer part (q8 int8
        [B, n_g, H, G], qs · factor fp32 [B, n_g, H, 1], qlo = Σq8 · qs fp32 [B, H, n_g] (asym, else None),
        bias · Σq8 int32 [B, n_g, H, 1] (unsigned int4, else None)); q8 is quantized from x itself, so it
        stays the kernel's."""
        if self.kern is not None:  # per C part: (q8 int8 [B, H, w], qs · factor fp32 [B, H, n_g]), stored order
            return [self.kern.quantize(x[..., ch : ch + cp.width], cp.group_size, factor) for cp, _, ch in self.cparts]
        if not self.is_int:
            return (x * factor).contiguous()
        batch, heads, _ = x.shape
        q8, qs = self.quantized_query(x)  # [B, H, W], [B, H, n_g]
        qs = qs * factor
        groups = q8.view(batch, heads, self.n_g, self.g)
        sums = groups.sum(-1, dtype=torch.int32) if self.asym or self.bias else None  # [B, H, n_g]
        qlo = (sums.float() * qs).contiguous() if self.asym else None
        shift = (sums * self.bias).transpose(1, 2).unsqueeze(-1).contiguous() if self.bias else None
        return groups.transpose(1, 2).contiguous(), qs.transpose(1, 2).unsqueeze(-1).contiguous(), qlo, shift


NIBBLES = {torch.int64: 0x0F0F0F0F0F0F0F0F, torch.int32: 0x0F0F0F0F, torch.int16: 0x0F0F}  # low nibble per byte


def _words(raw: Tensor) -> Tensor:
    """Packed bytes uint8 [n, b] as machine words [n, b / w]: a view as int64, int32 or int16, the widest
    the rows' stride, offset and width allow (no copy; the k_pe codes of an int4-row row start at byte 258),
    else an aligned int64 copy."""
    rows, n = raw.shape
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if n % size == 0 and raw.stride(0) % size == 0 and raw.storage_offset() % size == 0:
            return raw.view(dtype)
    return torch.empty(rows, n, dtype=torch.uint8, device=raw.device).copy_(raw).view(torch.int64)


def unpack_nibbles(raw: Tensor, out: Tensor | None = None) -> Tensor:
    """Packed int4 codes uint8 [n, b] (channel 2i in the low nibble of byte i) → unsigned codes int8
    [n, 2b] = [low nibbles | high nibbles] (written into `out`, uint8 [n, 2b] contiguous, when given), a 16-
    to 64-bit word per operation where b % 8 == 0 (a right shift of a signed word brings in sign bits only
    where the mask then clears them)."""
    rows, n = raw.shape
    if n % 8:
        codes = torch.cat([raw & 0x0F, raw >> 4], dim=1)
        return (codes if out is None else out.copy_(codes)).view(torch.int8)
    words = _words(raw)
    w = words.shape[1]
    out = torch.empty(rows, 2 * n, dtype=torch.uint8, device=raw.device) if out is None else out
    dest = out.view(words.dtype)
    torch.bitwise_and(words, NIBBLES[words.dtype], out=dest[:, :w])
    torch.bitwise_right_shift(words, 4, out=dest[:, w:])
    dest[:, w:].bitwise_and_(NIBBLES[words.dtype])
    return out.view(torch.int8)


def _int_scores(part: _CpuPart, codes: Tensor, s: Tensor, lo: Tensor | None, query: tuple, ws: Buffers,
                into: Tensor | None = None) -> Tensor:
    """Unscaled base-2 scores [a, H, t] fp32 of an integer part for a sequences (added into `into`, the
    other part's, when given): codes int8 [a, t, W], s/lo fp32 [a, t, n_g], `query` the a sequences' (q8
    [a, n_g, H, G], qs [a, n_g, H, 1], qlo [a, H, n_g] | None, shift [a, n_g, H, 1] | None); one
    `torch._int_mm` per sequence and group (CPU torch has no batched one), the unsigned int4 codes' bias
    taken off the INT32 dots."""
    q8, qs, qlo, shift = query
    a, t = codes.shape[:2]
    heads = q8.shape[2]
    dots = ws.take(part.name + ".dots", (a, part.n_g, heads, t), torch.int32)
    for i in range(a):
        for g in range(part.n_g):
            torch._int_mm(q8[i, g], codes[i, :, g * part.g : (g + 1) * part.g].t(), out=dots[i, g])
    if shift is not None:
        dots.sub_(shift)
    scaled = torch.mul(dots, qs, out=ws.take(part.name + ".scores", dots.shape, torch.float32))  # int32 x fp32
    s_t = s.transpose(1, 2).unsqueeze(2)  # [a, n_g, 1, t]
    if part.n_g == 1:
        scores = scaled[:, 0].mul_(s_t[:, 0]) if into is None else into.addcmul_(scaled[:, 0], s_t[:, 0])
    else:
        scores = scaled.mul_(s_t).sum(1)
        scores = scores if into is None else into.add_(scores)
    if lo is None:
        return scores
    return scores.addcmul_(qlo, lo.transpose(1, 2)) if part.n_g == 1 else scores.baddbmm_(qlo, lo.transpose(1, 2))


class _BlockRows:
    """The gathered rows of one block of a group's first a sequences: raw uint8 [a, t, row_bytes], n_valid[i] of
    sequence i's own; invalid bool [a, t] | None marks rows past a sequence's end (their bytes zero)."""

    def __init__(self, t: int, n_valid: list[int], raw: Tensor, invalid: Tensor | None = None) -> None:
        self.a, self.t, self.n_valid, self.raw, self.invalid = len(n_valid), t, n_valid, raw, invalid

    def rows(self, i: int, offset: int = 0) -> native.Rows:
        """Where sequence i's rows lie (their byte `offset`), for the C kernels."""
        return native.Rows(self.raw[i], offset, self.raw.stride(1))


class _Group:
    """Online-softmax state of a group of sequences, longest first, over their blocks: running max
    m [A, H], sum l [A, H], acc [A, H, d_c]. Block j holds tokens [j·t, (j+1)·t) of the group's first a
    sequences (those still running), so every op of a block serves them all: one Python thread issues
    few, large ops and torch's intra-op threads share each (the C kernels: OpenMP, per sequence)."""

    def __init__(self, queries: list, parts: tuple[_CpuPart, ...], d_c: int, ws: Buffers,
                 state: tuple[Tensor, Tensor, Tensor]) -> None:
        """`parts`: `row_parts`, the first holding the d_c values; `queries`: the group's slice of each
        part's `_CpuPart.query` with factor scale · log2(e): the blocks' scores come out in base 2 (`exp2` is
        faster than `exp` in torch on CPU: docs/cpu.md), so m is the running max of score · log2(e); `state`: the
        group's (m, l, acc), set by its first block (every sequence has one) and acc zero before."""
        self.parts, self.q, self.d_c, self.ws = parts, queries, d_c, ws
        self.m, self.l, self.acc = state
        self.first = True

    def _scores(self, blk: _BlockRows) -> tuple[Tensor, object]:
        """The base-2 scores [a, H, t] of a gathered block and what its P·V reads: an FP32 [a, t, d_c] block, the
        codes (codes, s, lo'), or None where the C kernels read the c_kv part's codes from the rows themselves."""
        a, t = blk.a, blk.t
        flat = blk.raw.reshape(a * t, blk.raw.shape[2])
        scores, values = None, None
        for k, (p, qp) in enumerate(zip(self.parts, self.q)):
            if p.kern is not None:  # C: every sequence's rows where they are, with the fused FP32 epilogue ...
                if k and self.parts[k - 1].kern is not None:
                    continue  # ... of both parts in one call
                both = [(pk, qk) for pk, qk in zip(self.parts[k:], self.q[k:]) if pk.kern is not None]
                out = self.ws.take(p.name + ".scores", (a, self.acc.shape[1], t), torch.float32) if scores is None \
                    else scores
                for i in range(a):
                    mine = [arg for pk, qk in both for arg in pk.c_args([(q8[i], qs[i]) for q8, qs in qk])]
                    p.kern.scores(blk.rows(i), t, mine, out[i], scores is not None)  # zeroed rows past the end: masked
                scores = out
                continue
            part = p.bytes_of(flat)
            if p.is_int:
                s, lo = (None if x is None else x.view(a, t, -1) for x in p.params(part))
                codes = p.codes(part, self.ws).view(a, t, -1)
                part_scores = _int_scores(p, codes, s, lo, _rows(qp, 0, a), self.ws, into=scores)
                if p is self.parts[0]:
                    values = (codes, s, lo)
            else:
                rows = p.rc.decode(part, out=self.ws.take(p.name + ".rows", (a * t, p.rc.width), torch.float32))
                rows = rows.view(a, t, -1)
                if scores is None:
                    out = self.ws.take(p.name + ".scores", (a, qp.shape[1], t), torch.float32)
                    part_scores = torch.bmm(qp[:a], rows.transpose(1, 2), out=out)
                else:
                    part_scores = scores.baddbmm_(qp[:a], rows.transpose(1, 2))
                if p is self.parts[0]:
                    values = rows[..., : self.d_c]
            scores = part_scores
        if blk.invalid is not None:
            scores.masked_fill_(blk.invalid.unsqueeze(1), float("-inf"))
        return scores, values

    def block(self, blk: _BlockRows) -> None:
        """Fold in one block of rows of the group's first a sequences (`_BlockRows`)."""
        scores, values = self._scores(blk)
        a = blk.a
        m_old, total, acc = self.m[:a], self.l[:a], self.acc[:a]
        if self.first:  # nothing to rescale yet (a 4k sequence is one block)
            torch.amax(scores, -1, out=m_old)  # scores [a, H, t], base 2
            probs = scores.sub_(m_old.unsqueeze(-1)).exp2_()
            torch.sum(probs, -1, out=total)
            self.first = False
        else:
            m = torch.maximum(m_old, scores.amax(-1))
            alpha = torch.exp2(m_old - m)
            probs = scores.sub_(m.unsqueeze(-1)).exp2_()
            total.mul_(alpha).add_(probs.sum(-1))
            acc.mul_(alpha.unsqueeze(-1))
            m_old.copy_(m)
        p = self.parts[0]
        if values is None:  # C: P·V on the codes of the rows where they are (row-wise, grouped or each band)
            for i in range(a):
                for cp, off, ch in p.cparts:
                    p.kern.pv(blk.rows(i, off), blk.n_valid[i], cp, probs[i], acc[i][:, ch:])
        elif isinstance(values, Tensor):
            acc.baddbmm_(probs, values)
        elif p.n_g == 1:
            self._int_pv(acc, probs, *values)
        else:
            self._dequant_pv(acc, probs, *values)

    def _int_pv(self, acc: Tensor, probs: Tensor, codes: Tensor, s: Tensor, lo: Tensor | None) -> None:
        """acc [a, H, W] += probs [a, H, t] @ (codes · s + lo') for a row-wise integer c_kv part (codes int8
        [a, t, W], s, lo' [a, t, 1]), on the codes: the scaled probabilities p·s in two int8 digits
        (`split_probs`), one exact int8 x int8 -> int32 GEMM [2H, t] x [t, W] per sequence (less the
        unsigned int4 bias times each digit row's sum), the digits combined in FP32; lo' as probs @ lo'."""
        ws, heads = self.ws, probs.shape[1]
        digits, m = split_probs(probs, s, ws)
        sums = ws.take("sums", (codes.shape[0], 2 * heads, codes.shape[2]), torch.int32)
        for i in range(codes.shape[0]):
            torch._int_mm(digits[i], codes[i], out=sums[i])
        if self.parts[0].bias:
            sums.sub_(digits.sum(-1, keepdim=True, dtype=torch.int32) * self.parts[0].bias)
        sums = ws.take("sums32", sums.shape, torch.float32).copy_(sums)
        acc.addcmul_(sums[:, :heads].add_(sums[:, heads:], alpha=1.0 / PROB_STEP), m)
        if lo is not None:
            acc.add_(torch.bmm(probs, lo))  # [a, H, 1]: one zero point per row

    def _dequant_pv(self, acc: Tensor, probs: Tensor, codes: Tensor, s: Tensor, lo: Tensor | None) -> None:
        """acc [a, H, W] += probs [a, H, t] @ (codes · s + lo') for a grouped integer c_kv part (s, lo'
        [a, t, n_g]): the block dequantized in FP32, one batched FP32 GEMM (per-group integer GEMMs ran slower:
        docs/cpu.md)."""
        p = self.parts[0]
        a, t = codes.shape[:2]
        v = self.ws.take("values", (a, t, p.n_g, p.g), torch.float32).copy_(codes.view(a, t, p.n_g, p.g))
        if p.bias:
            v.sub_(p.bias)
        v.mul_(s.unsqueeze(-1))
        if lo is not None:
            v.add_(lo.unsqueeze(-1))
        acc.baddbmm_(probs, v.view(a, t, -1))



def _finish(ckv: _CpuPart, m: Tensor, total: Tensor, acc: Tensor) -> tuple[Tensor, Tensor]:
    """(out [n, H, d_c], lse [n, H]) of the sequences' running max m and sum [n, H] (base 2) and acc
    [n, H, d_c] (in the codes' channel order, undone here): out a fresh tensor (acc may be a reused buffer), lse m's
    storage."""
    lse = m.add_(torch.log2(total)).mul_(LN2)
    if ckv.perm is not None:
        return torch.empty_like(acc).index_copy_(2, ckv.perm, acc).div_(total.unsqueeze(-1)), lse
    return torch.div(acc, total.unsqueeze(-1)), lse


def row_parts(codec: LayerCodec, device: torch.device, c_unpack: bool = True,
              c_kernels: bool = True) -> tuple[_CpuPart, ...]:
    """How the blocks read a row: (c_kv part, k_pe part), or one part for the whole row where both parts
    are the same float kind (fp16/fp16: one FP32 conversion and one score GEMM [H, d_c + d_r] x [d_c + d_r,
    t] per block instead of two of each; the values are the first d_c columns of that block). c_unpack:
    int4 codes by the C helper where it builds (`mlaquant.attention.native`), else by torch ops; c_kernels: integer
    parts read by the C kernels where they build."""
    ckv, kpe = codec.ckv.spec, codec.kpe.spec
    if ckv.is_float and ckv == kpe:
        row = RowCodec.build(CodecSpec(ckv.kind), codec.ckv.width + codec.kpe.width)
        return (_CpuPart(row, 0, device, "row"),)
    return (_CpuPart(codec.ckv, 0, device, "ckv", c_unpack, c_kernels),
            _CpuPart(codec.kpe, codec.layout.kpe_offset, device, "kpe", c_unpack, c_kernels))


def _group_blocks(pool: Tensor, pages: list[list[int]], lens: list[int], block_tokens: int, ws: Buffers):
    """The gathered `_BlockRows` (rows uint8 [a, t, row_bytes], invalid bool [a, t] | None) of each block of a
    group of sequences (pages[i] and lens[i] > 0 per sequence, longest first): the a sequences still running,
    t = whole pages up to block_tokens. One sequence: its valid rows only (a view of the pool where the
    block's pages are consecutive, else a copy of those pages). Several: a copy of their pages, a shorter
    sequence's missing pages filled with one of its own and the rows past its end zeroed and marked."""
    block_size, row_bytes = pool.shape[1], pool.shape[2]
    per = max(1, block_tokens // block_size)
    for start in range(0, -(-lens[0] // block_size), per):
        begin = start * block_size
        n_valid = [min(n - begin, per * block_size) for n in lens if n > begin]
        width = -(-n_valid[0] // block_size)
        ids = [row[start : start + width] for row in pages[: len(n_valid)]]
        ids = [row + row[:1] * (width - len(row)) for row in ids]
        raw = gather_pages(pool, ids, out=ws.take("raw", (len(ids), width * block_size, row_bytes), torch.uint8))
        if len(ids) == 1:
            yield _BlockRows(n_valid[0], n_valid, raw[:, : n_valid[0]])
            continue
        t = width * block_size
        if all(n == t for n in n_valid):
            yield _BlockRows(t, n_valid, raw)
            continue
        for row, n in zip(raw, n_valid):
            row[n:] = 0
        invalid = torch.arange(t, device=pool.device) >= torch.tensor(n_valid, device=pool.device).unsqueeze(1)
        yield _BlockRows(t, n_valid, raw, invalid)


def mla_decode_cpu(
    inputs: DecodeInputs,
    scale: float,
    block_tokens: int | None = None,
    group: int = GROUP_SEQUENCES,
    c_unpack: bool = True,
    c_kernels: bool = True,
    threads: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Fast CPU `mla_decode` (module docstring) for checked inputs (`DecodeInputs`: q [B, H, d_c + d_r] float,
    pool uint8 [num_blocks, block_size, row_bytes], block_table int [B, max_blocks], seq_lens int [B], codec)
    → out [B, H, d_c] fp32, lse [B, H] fp32 (seq_lens 0: out 0, lse −inf).
    block_tokens: tokens per sequence and block, rounded to whole pages (default `block_tokens_for(codec)`);
    group: sequences whose blocks run as one batch of torch ops, longest first; c_unpack: int4 codes by the C
    helper where it builds (`mlaquant.attention.native`), else by torch ops (the same outputs bit for bit: the same
    INT32 sums); c_kernels: integer parts by the C kernels where they build (`mlaquant.attention.native.kernels`;
    every part integer: the whole call in one `Kernels.decode`, rows read in place, the online softmax inside the
    kernels); threads: the C decode's threads when the call has fewer live sequences than torch's threads (default
    `split_threads`; with at least as many, torch's threads take whole sequences). The outputs do not depend on it."""
    q, pool, codec, d_c = inputs.q, inputs.pool, inputs.codec, inputs.d_c
    pages, lens = inputs.host_pages()
    block_tokens = block_tokens or block_tokens_for(codec, c_kernels)
    parts = row_parts(codec, q.device, c_unpack, c_kernels)
    in_place = all(p.kern is not None for p in parts) and pool.is_contiguous()
    batch, heads, _ = q.shape
    order = sorted((b for b, n in enumerate(lens) if n), key=lambda b: -lens[b])
    whole = order == list(range(batch))  # every sequence live and already longest first: nothing to reorder
    index = None if whole else torch.tensor(order, dtype=torch.long, device=q.device)
    x = (q.float() if whole else q.float().index_select(0, index)).split([p.rc.width for p in parts], dim=-1)
    queries = [p.query(xp, scale * LOG2E) for p, xp in zip(parts, x)]
    n, team = len(order), torch.get_num_threads()
    if in_place and 0 < n < team:  # before any shared buffer is taken: the first call's probe runs a decode of its own
        team = split_threads(team) if threads is None else threads
    ws = _workspace()
    m, total = torch.empty(n, heads, device=q.device), torch.empty(n, heads, device=q.device)
    acc = ws.take("acc", (n, heads, d_c), torch.float32).zero_()  # a reused buffer: no fresh pages to fault in
    if in_place and n:
        block_tokens = max(pool.shape[1], block_tokens // pool.shape[1] * pool.shape[1])
        c_parts = [arg for p, qp in zip(parts, queries) for arg in p.c_args(qp)]
        ids = torch.tensor([p for b in order for p in pages[b]], dtype=torch.int64)  # one tensor, a view per sequence
        parts[0].kern.decode(pool, list(ids.split([len(pages[b]) for b in order])), [lens[b] for b in order],
                             block_tokens, c_parts, acc, m, total, tuple(ch for _, _, ch in parts[0].cparts), team)
    for g0 in range(0, 0 if in_place else n, group):  # torch-op blocks: gathered rows, in groups of sequences
        seqs = order[g0 : g0 + group]
        state = (m[g0 : g0 + len(seqs)], total[g0 : g0 + len(seqs)], acc[g0 : g0 + len(seqs)])
        runner = _Group([_rows(qp, g0, g0 + len(seqs)) for qp in queries], parts, d_c, ws, state)
        for blk in _group_blocks(pool, [pages[b] for b in seqs], [lens[b] for b in seqs], block_tokens, ws):
            runner.block(blk)
    o, s = _finish(parts[0], m, total, acc)
    if whole:
        return o, s
    out = torch.zeros(batch, heads, d_c, device=q.device)
    lse = torch.full((batch, heads), float("-inf"), device=q.device)
    return out.index_copy_(0, index, o), lse.index_copy_(0, index, s)


@functools.cache
def split_threads(threads: int) -> int:
    """The threads that run a call's sequences when it has fewer live sequences than `threads` (torch's count):
    `threads`, or 1 where splitting one sequence's blocks across them measures slower on this machine. A one-time
    probe per process and thread count: one int8-row sequence of 2048 tokens at 16 heads (DeepSeek widths), best of
    three calls each way. Splitting a sequence costs an OpenMP fork / join per block stage, and on some machines
    the threads waiting between stages slow the working one (docs/cpu.md has the measurements)."""
    if threads <= 1 or native.vector_kernels() is None:
        return max(1, threads)
    inputs = probe_inputs(LayerCodec.from_names("int8-row", "int8-row", 512, 64), 1, 2048)
    best = {threads: math.inf, 1: math.inf}
    for team in (threads, 1) * 3:
        start = time.perf_counter()
        mla_decode_cpu(inputs, 0.04, threads=team)
        best[team] = min(best[team], time.perf_counter() - start)
    return threads if best[threads] <= best[1] else 1


PROBE_HEADS = 16  # the probes' query heads (DeepSeek-V2-Lite's)


def probe_inputs(codec: LayerCodec, sequences: int, tokens: int) -> DecodeInputs:
    """A synthetic call for the one-time timing probes (`split_threads`, `backends.native_faster`): `sequences`
    sequences of `tokens` random rows of `codec` on 64-token pages in order, q [sequences, PROBE_HEADS, width] scaled
    by d_c^-0.5 (the values do not move the times)."""
    g, page = torch.Generator().manual_seed(0), 64
    pages = sequences * -(-tokens // page)
    pool = codec.encode(torch.randn(pages * page, codec.width, generator=g)).view(pages, page, codec.row_bytes)
    table = torch.arange(pages, dtype=torch.int32).view(sequences, -1)
    q = torch.randn(sequences, PROBE_HEADS, codec.width, generator=g) * codec.ckv.width**-0.5
    return DecodeInputs(q, pool, table, torch.full((sequences,), tokens, dtype=torch.int32), codec, codec.ckv.width)


def _rows(query, begin: int, end: int):
    """Sequences [begin, end) of a part's batched `_CpuPart.query` (a tensor, a tuple of tensors / None, or the C
    parts' list of (q8, qs))."""
    if isinstance(query, list):
        return [(q8[begin:end], qs[begin:end]) for q8, qs in query]
    return query[begin:end] if isinstance(query, Tensor) else tuple(x if x is None else x[begin:end] for x in query)


def pv_kind(codec: LayerCodec, c_kernels: bool = True) -> str:
    """How `mla_decode_cpu` runs P·V of `codec`'s c_kv: "int16" (the C kernels, an integer c_kv row-wise or grouped),
    "digits" (torch ops, a row-wise integer c_kv: two int8 digits), or "fp32"."""
    if _c_reads(codec.ckv, c_kernels):
        return "int16"
    return "digits" if codec.ckv.spec.kind in _INT_KINDS and codec.ckv.layout.n_groups == 1 else "fp32"
