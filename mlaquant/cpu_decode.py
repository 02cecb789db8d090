"""Fast CPU decode attention over a paged, quantized latent cache: integer scores, blocked P·V, no FP32
copy of the context. Same op and arguments as `mlaquant.ops.mla_decode` (backend "cpu"):

    score[b, h, t] = scale * (q[b, h, :d_c] · c_kv[b, t] + q[b, h, d_c:] · k_pe[b, t])   t < seq_lens[b]
    out[b, h]      = softmax_t(score[b, h]) @ c_kv[b]            lse[b, h] = logsumexp_t(score[b, h])

Each sequence is read in blocks of `block_tokens_for(codec)` tokens (whole pages: a view of the pool when the pages
are consecutive, else a copy of those pages only), so every decoded value lives in a cache-sized buffer
and is used for the scores and for P·V before the next block is read; the softmax runs online across the
blocks (FP32 running max and sum, flash-style), so a float cache is converted once, not once for the scores
and again for P·V as a two-pass scheme would (the two-pass variant was not timed). Block size (blocks of
512-4096 tokens timed at batch 16 x 4k / 16k): the integer paths are bound by their per-block small ops and
gain up to 4096 tokens (`INT_BLOCK_TOKENS`); blocks decoded to FP32 stop gaining past 2048 (`BLOCK_TOKENS`).

Scores of an integer part (int8/int4, sym/asym, any grouping). The query is quantized per (token, head,
group) exactly as the Triton kernel does (`quantize_query`: qs = absmax / 127, q8 = round_half_even(q /
qs)); per group one int8 x int8 -> int32 `torch._int_mm` (oneDNN, VNNI where the CPU has it) of the
block's codes with q8, exact; then in FP32 `qs * s * dot` (+ `qs * lo' * Σq8` for asymmetric groups).
Codes enter the GEMM as int8: sym int8 as stored (a view, no copy), asym int8 as q − 128 (one XOR of the
byte with 0x80) with lo' = lo + 128 s; int4 nibbles unsigned (0..15, unpacked eight at a time in 64-bit
words: one AND, one shift, one AND) with lo' = lo (asymmetric) or lo' = −8 s (symmetric: x − 8 = q), so
every int4 part takes the zero-point term (+ `qs * lo' * Σq8`), which is exact integer arithmetic too.
A float part (fp16, bf16, fp32, fp8) is decoded by its codec into an FP32 block and multiplied in FP32.

P·V. A row-wise integer c_kv part (one scale s_t per row) is never dequantized: the scaled probabilities
p_t·s_t of a block are written as two int8 digits per head (`split_probs`: m · (hi + lo/128), m = max/127,
|error| ≤ m/256), and one int8 x int8 -> int32 GEMM [2H, t] x [t, d_c] on the dot-form codes gives both
digits' exact sums, combined in FP32 (+ probs @ lo' for asymmetric codes). A grouped integer part is
dequantized block by block in FP32 (`q · s + lo'`) and multiplied in FP32 (per-group integer GEMMs, one
per group and block, measured slower); a float part is its FP32 block from the scores. int4 codes
are unpacked as [low nibbles | high nibbles] (channel order `_Part.perm`, undone once per sequence on the
output): one contiguous pass instead of an interleaving one. BF16 P·V (codes exact in BF16) is not used:
torch on CPU has no BF16 GEMM with an FP32 result, and rounding each block's output to BF16 (2^-9 relative)
loses more than the two digits do (m/256 per probability, m = max/127).

Error against the FP32 reference (`mla_decode_reference`, the same quantized cache):

  scores   the only approximation is the query's quantization: per group |q - q8·qs| ≤ qs/2 per
           channel, so |Δscore| ≤ scale · Σ_groups (qs_g / 2) · Σ_c∈g |k_c|  (the same as the kernel);
           the INT32 dots are exact and the FP32 epilogue adds a few ulps. Float parts: FP32 rounding only.
  P·V      a score error Δs moves each probability by a factor within e^(±2Δs), so |Δout[h, c]| ≤
           (e^(2 Δs) − 1) · max_t |v[t, c]|; FP32 P·V and the online rescaling add ≤ 2^-12 · max_t |v[t, c]|
           (≤ BLOCK_TOKENS · 2^-24 = 2^-13 within a block's FP32 GEMM, a few 2^-24 per block merge, for T < 2^20);
           the two int8 digits of p·s (row-wise integer c_kv) add ≤ e^(4Δs) · max_t(p_t s_t) · Σ_t |q_t,c| /
           (127 · 256 · Σ_t p_t), p_t = e^(score_t − max score), q the codes (`error_bound` computes it).
  lse      |Δlse| ≤ Δs = max_t |Δscore[t]| (+ FP32 rounding).

`error_bound` computes the lse and output bounds of a call; tests/test_cpu_decode.py checks the outputs
against them (ragged batch, NaN-filled free slots and blocks, permuted block tables).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from mlaquant.codecs import LayerCodec, RowCodec
from mlaquant.decode_inputs import DecodeInputs, gather_pages

BLOCK_TOKENS = 2048  # tokens per block when the values are decoded to FP32 (2048 x 512 FP32 values = 4 MiB)
INT_BLOCK_TOKENS = 4096  # row-wise integer c_kv: P·V on the codes, no FP32 values, so fewer and larger blocks
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453  # scores run in base 2 (`_Sequence`)


def block_tokens_for(codec: LayerCodec) -> int:
    """Tokens per block for `codec` (`mlaquant bench decode --batch 16` measured 512 / 1024 / 2048 / 4096)."""
    ckv = codec.ckv
    return INT_BLOCK_TOKENS if ckv.spec.kind in _INT_KINDS and ckv.layout.n_groups == 1 else BLOCK_TOKENS
_INT_KINDS = ("int8", "int4")


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


FAST_MAX_GROUPS = 8  # integer parts with more stored groups run one GEMM per group and block: slower than the reference


def prefers(codec: LayerCodec) -> bool:
    """Whether this path beats the reference on `codec` once a call reads enough tokens: float parts and
    integer parts of at most `FAST_MAX_GROUPS` stored groups (`mlaquant bench decode --batch 1,16`: int4-g32
    c_kv, 16 groups, ran slower than the reference at batch 1)."""
    return all(rc.spec.kind not in _INT_KINDS or rc.layout.n_groups <= FAST_MAX_GROUPS for rc in (codec.ckv, codec.kpe))


PROB_STEP = 128.0  # the low int8 digit of a probability weighs 1/128 of the high one


def split_probs(ps: Tensor) -> tuple[Tensor, Tensor]:
    """Non-negative ps fp32 [H, t] → (digits int8 [2H, t] = [hi; lo], m fp32 [H, 1]) with
    ps ≈ m · (hi + lo / 128): m = max_t ps / 127 (1 for an all-zero row), hi = round(ps / m) ∈ [0, 127],
    lo = round((ps / m − hi) · 128) ∈ [−64, 64], so |ps − m · (hi + lo / 128)| ≤ m / 256 per entry."""
    m = ps.amax(-1, keepdim=True) / 127.0
    m = torch.where(m > 0, m, torch.ones_like(m))
    heads = ps.shape[0]
    digits = torch.empty(2 * heads, ps.shape[1], device=ps.device)  # [hi; lo] in FP32, converted once
    x = torch.div(ps, m, out=digits[heads:])
    torch.round(x, out=digits[:heads])
    x.sub_(digits[:heads]).mul_(PROB_STEP).round_()
    return digits.to(torch.int8), m


class _Part:
    """How one row part (c_kv or k_pe) is read: byte range in the row and, for integer parts, the
    query's quantized form for one sequence (set by `bind`)."""

    def __init__(self, rc: RowCodec, offset: int, device: torch.device) -> None:
        self.rc, self.offset = rc, offset
        self.is_int = rc.spec.kind in _INT_KINDS
        self.asym = self.is_int and not rc.spec.symmetric
        # the part's values are codes · s + lo' (lo' per group) rather than codes · s: asym, and every int4 part
        self.zero = self.asym or rc.spec.kind == "int4"
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
        """The part's bytes of block rows raw uint8 [t, row_bytes] → [t, part bytes] (a view)."""
        return raw[:, self.offset : self.offset + self.rc.row_bytes]

    def _stored(self, part: Tensor, offset: int) -> Tensor:
        """The FP16 array at byte `offset` of the part (one value per stored group) → fp32 [t, n_g]."""
        n = self.rc.layout.n_groups
        vals = part[:, offset : offset + 2 * n].contiguous().view(torch.float16).float()
        return vals if n == self.n_g else torch.cat([vals, vals], dim=1)  # half-groups share their group's

    def params(self, part: Tensor) -> tuple[Tensor, Tensor | None]:
        """FP16 scales and the zero points lo' of the codes as `codes` gives them (None without `zero`) of
        an integer part's bytes → fp32 [t, n_g] each."""
        lay = self.rc.layout
        s = self._stored(part, lay.scale_offset)
        if not self.zero:
            return s, None
        if lay.spec.kind == "int4":
            return s, self._stored(part, lay.zero_offset) if self.asym else s * -8.0
        return s, self._stored(part, lay.zero_offset) + 128.0 * s

    def codes(self, part: Tensor) -> Tensor:
        """int8 codes [t, W] of an integer part (sym int8: a strided view of the block; asym int8: q − 128;
        int4: the unsigned nibbles in the channel order `perm`, [low nibbles | high nibbles])."""
        rc, raw = self.rc, part[:, : self.rc.layout.code_bytes]
        if rc.spec.kind == "int8":
            return raw.view(torch.int8) if rc.spec.symmetric else (raw ^ 0x80).view(torch.int8)
        return unpack_nibbles(raw)

    def quantized_query(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """`quantize_query` of the part's query x [..., H, W] with the stored grouping, in the codes' channel
        order: (q8 int8 [..., H, W], qs fp32 [..., H, n_g])."""
        q8, qs = quantize_query(x, self.rc.layout.group_size)
        if self.perm is None:
            return q8, qs
        return q8.index_select(-1, self.perm), (qs if qs.shape[-1] == self.n_g else torch.cat([qs, qs], dim=-1))

    def query(self, x: Tensor, factor: float) -> Tensor | tuple[Tensor, Tensor, Tensor | None]:
        """The part's query x [B, H, W] as the blocks use it, for all sequences at once, with the score
        factor folded in: FP32 x · factor [B, H, W] for a float part; for an integer part (q8 int8
        [B, n_g, H, G], qs · factor fp32 [B, n_g, H, 1], qlo fp32 [B, H, n_g] or None); q8 is quantized
        from x itself, so it stays the kernel's."""
        if not self.is_int:
            return (x * factor).contiguous()
        batch, heads, _ = x.shape
        q8, qs = self.quantized_query(x)  # [B, H, W], [B, H, n_g]
        qs = qs * factor
        groups = q8.view(batch, heads, self.n_g, self.g)
        qlo = (groups.sum(-1, dtype=torch.int32).float() * qs).contiguous() if self.zero else None
        return groups.transpose(1, 2).contiguous(), qs.transpose(1, 2).unsqueeze(-1).contiguous(), qlo


NIBBLES = {torch.int64: 0x0F0F0F0F0F0F0F0F, torch.int32: 0x0F0F0F0F}  # the low nibble of each byte of a word


def _words(raw: Tensor) -> Tensor:
    """Packed bytes uint8 [t, n] as machine words [t, n / w]: a view as int64, else int32, where the rows'
    stride, offset and width allow (no copy), else an aligned int64 copy."""
    t, n = raw.shape
    for dtype, size in ((torch.int64, 8), (torch.int32, 4)):
        if n % size == 0 and raw.stride(0) % size == 0 and raw.storage_offset() % size == 0:
            return raw.view(dtype)
    return torch.empty(t, n, dtype=torch.uint8, device=raw.device).copy_(raw).view(torch.int64)


def unpack_nibbles(raw: Tensor) -> Tensor:
    """Packed int4 codes uint8 [t, n] (channel 2i in the low nibble of byte i) → unsigned codes int8
    [t, 2n] = [low nibbles | high nibbles], a 32- or 64-bit word per operation where n % 8 == 0 (a right
    shift of a signed word brings in sign bits only where the mask then clears them)."""
    t, n = raw.shape
    if n % 8:
        return torch.cat([raw & 0x0F, raw >> 4], dim=1).view(torch.int8)
    words = _words(raw)
    w = words.shape[1]
    out = torch.empty(t, 2 * w, dtype=words.dtype, device=raw.device)
    torch.bitwise_and(words, NIBBLES[words.dtype], out=out[:, :w])
    torch.bitwise_right_shift(words, 4, out=out[:, w:])
    out[:, w:].bitwise_and_(NIBBLES[words.dtype])
    return out.view(torch.int8)


def _int_scores(part: _Part, codes: Tensor, s: Tensor, lo: Tensor | None, q8t: Tensor, qs: Tensor,
                qlo: Tensor | None) -> Tensor:
    """Unscaled scores [H, t] fp32 of an integer part: codes int8 [t, W], s/lo fp32 [t, n_g],
    q8t int8 [n_g, H, G] (the query's groups), qs fp32 [n_g, H, 1], qlo fp32 [H, n_g]."""
    t, heads = codes.shape[0], q8t.shape[1]
    dots = torch.empty(part.n_g, heads, t, dtype=torch.int32, device=codes.device)
    for g in range(part.n_g):
        torch._int_mm(q8t[g], codes[:, g * part.g : (g + 1) * part.g].t(), out=dots[g])
    scores = torch.mul(dots, qs).mul_(s.t().unsqueeze(1))  # int32 x fp32 → fp32 in one pass
    scores = scores[0] if part.n_g == 1 else scores.sum(0)
    return scores if lo is None else scores.addmm_(qlo, lo.t())


class _Sequence:
    """Online-softmax state of one sequence over its blocks: running max m [H], sum l [H], acc [H, d_c]."""

    def __init__(self, queries: list, parts: tuple[_Part, _Part]) -> None:
        """`queries`: this sequence's entry of each part's `_Part.query` with factor scale · log2(e)
        (FP32 [H, W], or (q8 [n_g, H, G], qs [n_g, H, 1], qlo [H, n_g] | None)): the blocks' scores come
        out in base 2 (`exp2` is ~3x faster than `exp` in torch on CPU), so m is the running max of
        score · log2(e)."""
        self.parts, self.q = parts, queries
        first = queries[0] if isinstance(queries[0], Tensor) else queries[0][0]  # [H, W] or [n_g, H, G]
        heads, device = first.shape[-2], first.device
        self.m = torch.full((heads,), float("-inf"), device=device)
        self.l = torch.zeros(heads, device=device)
        self.acc = torch.zeros(heads, parts[0].rc.width, device=device)

    def block(self, raw: Tensor) -> None:
        """Fold in the rows raw uint8 [t, row_bytes] (all valid)."""
        scores, values = None, None
        for p, qp in zip(self.parts, self.q):
            part = p.bytes_of(raw)
            if p.is_int:
                s, lo = p.params(part)
                codes = p.codes(part)
                part_scores = _int_scores(p, codes, s, lo, *qp)
                if p is self.parts[0]:
                    values = (codes, s, lo)
            else:
                rows = p.rc.decode(part, out=torch.empty(raw.shape[0], p.rc.width, device=raw.device))
                part_scores = qp @ rows.t()
                if p is self.parts[0]:
                    values = rows
            scores = part_scores if scores is None else scores.add_(part_scores)
        m = torch.maximum(self.m, scores.amax(-1))  # scores [H, t], base 2
        alpha = torch.exp2(self.m - m)
        probs = scores.sub_(m.unsqueeze(-1)).exp2_()
        self.l.mul_(alpha).add_(probs.sum(-1))
        self.acc.mul_(alpha.unsqueeze(-1))
        self.m = m
        if isinstance(values, Tensor):
            self.acc.addmm_(probs, values)
        elif self.parts[0].n_g == 1:
            self._int_pv(probs, *values)
        else:
            self._dequant_pv(probs, *values)

    def _int_pv(self, probs: Tensor, codes: Tensor, s: Tensor, lo: Tensor | None) -> None:
        """acc += probs [H, t] @ (codes · s + lo') for a row-wise integer c_kv part (s, lo' [t, 1]), on the
        codes: the scaled probabilities p·s in two int8 digits (`split_probs`), one exact int8 x int8 ->
        int32 GEMM [2H, t] x [t, W], the digits combined in FP32; the zero points as probs @ lo'."""
        digits, m = split_probs(probs * s.t())
        hi, low = torch._int_mm(digits, codes).float().chunk(2)  # [H, W] each
        self.acc.addcmul_(hi.add_(low, alpha=1.0 / PROB_STEP), m)
        if lo is not None:
            self.acc.add_(probs @ lo)

    def _dequant_pv(self, probs: Tensor, codes: Tensor, s: Tensor, lo: Tensor | None) -> None:
        """acc += probs [H, t] @ (codes · s + lo') for a grouped integer c_kv part (s, lo' [t, n_g]): the
        block dequantized in FP32, one FP32 GEMM (per-group integer GEMMs measured ~2x slower than this)."""
        p = self.parts[0]
        v = codes.float().view(codes.shape[0], p.n_g, p.g).mul_(s.unsqueeze(-1))
        if lo is not None:
            v.add_(lo.unsqueeze(-1))
        self.acc.addmm_(probs, v.view(codes.shape[0], -1))

    def result(self) -> tuple[Tensor, Tensor]:
        """(out [H, d_c], lse [H]) of the blocks folded in so far (out 0, lse −inf before any)."""
        perm = self.parts[0].perm
        acc = self.acc if perm is None else torch.empty_like(self.acc).index_copy_(1, perm, self.acc)
        if torch.isinf(self.m).all():
            return acc, self.m.clone()
        return acc / self.l.unsqueeze(-1), (self.m + torch.log2(self.l)) * LN2


def _blocks(pool: Tensor, pages: list[int], n_tokens: int, block_tokens: int):
    """Rows uint8 [t, row_bytes] of the first n_tokens tokens on `pages`, block by block (whole pages:
    a view of the pool where the block's pages are consecutive, else a copy of just those pages)."""
    block_size = pool.shape[1]
    per = max(1, block_tokens // block_size)
    for i in range(0, len(pages), per):
        yield gather_pages(pool, [pages[i : i + per]])[0, : n_tokens - i * block_size]


def mla_decode_cpu(
    q: Tensor,
    pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    codec: LayerCodec,
    d_c: int,
    scale: float,
    block_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Fast CPU `mla_decode` (module docstring): q [B, H, d_c + d_r] float, pool uint8 [num_blocks,
    block_size, row_bytes], block_table int [B, max_blocks], seq_lens int [B] → out [B, H, d_c] fp32,
    lse [B, H] fp32 (seq_lens 0: out 0, lse −inf). block_tokens: tokens per block, rounded to whole pages
    (default `block_tokens_for(codec)`)."""
    pages, lens = DecodeInputs(q, pool, block_table, seq_lens, codec, d_c).host_pages()
    block_tokens = block_tokens or block_tokens_for(codec)
    parts = (_Part(codec.ckv, 0, q.device), _Part(codec.kpe, codec.layout.kpe_offset, q.device))
    batch, heads, _ = q.shape
    out = torch.zeros(batch, heads, d_c, device=q.device)
    lse = torch.full((batch, heads), float("-inf"), device=q.device)

    x = q.float().split([parts[0].rc.width, parts[1].rc.width], dim=-1)
    queries = [p.query(xp, scale * LOG2E) for p, xp in zip(parts, x)]

    def run(b: int) -> None:
        seq = _Sequence([_entry(qp, b) for qp in queries], parts)
        for raw in _blocks(pool, pages[b], lens[b], block_tokens):
            seq.block(raw)
        out[b], lse[b] = seq.result()

    order = sorted((b for b, n in enumerate(lens) if n), key=lambda b: -lens[b])
    threads = torch.get_num_threads()
    if threads <= 1 or len(order) <= 1:
        for b in order:
            run(b)
        return out, lse
    torch.set_num_threads(1)  # one sequence per core: the per-block ops are too small to split
    try:
        run_shared(order, min(threads, len(order)), run)
    finally:
        torch.set_num_threads(threads)
    return out, lse


def _entry(query, b: int):
    """Sequence b's entry of a part's batched `_Part.query`."""
    return query[b] if isinstance(query, Tensor) else tuple(t if t is None else t[b] for t in query)


_POOL: dict[int, ThreadPoolExecutor] = {}  # worker count → pool, kept between calls (starting threads costs)


def _workers(n: int) -> ThreadPoolExecutor:
    """A thread pool of `n` workers, created on first use and kept."""
    if n not in _POOL:
        _POOL[n] = ThreadPoolExecutor(n, thread_name_prefix="mlaquant-cpu-decode")
    return _POOL[n]


def run_shared(order: list[int], workers: int, fn) -> None:
    """fn(b) for every b of `order` on `workers` threads, the caller one of them: each takes the next b
    when its last is done, so a thread that starts late (measured here: the pool's thread 4-5 ms after the
    call, every call) or runs slower simply takes fewer (fixed equal groups left the other core idle that
    long). Returns when every fn(b) has returned; an exception in any is raised after all have stopped."""
    queue = iter(order)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                b = next(queue, None)
            if b is None:
                return
            fn(b)

    helpers = [_workers(workers - 1).submit(worker) for _ in range(workers - 1)]
    try:
        worker()
    finally:
        for h in helpers:
            h.result()


def error_bound(
    q: Tensor, rows: list[Tensor], codec: LayerCodec, d_c: int, scale: float,
    row_scales: list[Tensor] | None = None, quantized_query: bool = True,
) -> tuple[Tensor, Tensor]:
    """Worst-case |lse error| [B, H] and |out error| [B, H, d_c] of `mla_decode_cpu` against the FP32
    reference, for q [B, H, d_c + d_r] and each sequence's decoded rows [T_b, d_c + d_r] (module
    docstring): Δs = scale · (Σ_g qs_g/2 · Σ_c∈g |k_c| + 2^-20 · Σ_c |q_c k_c| [+ 2^-18 · Σ_g Σ_c∈g |q_c| ·
    max_c∈g |k_c| for symmetric int4: its unsigned codes' FP32 epilogue cancels]) · (1 + 2^-10) over the
    tokens (the qs term only when `quantized_query`: off for a query already equal to its quantized
    value), Δout = (e^(2 Δs) − 1 + 2^-12) · max_t |v[t, c]| + the P·V digit term of a row-wise integer
    c_kv part, e^(4 Δs) · max_t(p_t s_t) · Σ_t |q_t,c| / (127 · 256 · Σ_t p_t) with p_t = e^(score_t − max)
    and s_t = `row_scales[b]` fp32 [T_b] (the stored c_kv row scales; required for such a part); |q_t,c| =
    |v_t,c| / s_t for symmetric int8 codes, the codes' bound otherwise (128 asym int8, 15 unsigned int4)."""
    int_pv = codec.ckv.spec.kind in _INT_KINDS and codec.ckv.layout.n_groups == 1
    if int_pv and row_scales is None:
        raise ValueError(f"error_bound: codec {codec.name} decodes P·V on the codes; pass row_scales")
    d_score, d_out = [], []
    for b, (qb, kv) in enumerate(zip(q.float(), rows)):
        heads = qb.shape[0]
        if not kv.shape[0]:
            d_score.append(torch.zeros(heads, device=q.device))
            d_out.append(torch.zeros(heads, d_c, device=q.device))
            continue
        k_abs = kv.abs()
        bound = (qb.abs() @ k_abs.t()) * 2.0**-20  # [H, T]: FP32 products and sums
        for rc, sl in ((codec.ckv, slice(0, d_c)), (codec.kpe, slice(d_c, None))):
            g = rc.layout.group_size
            if rc.spec.kind in _INT_KINDS and quantized_query:
                _, qs = quantize_query(qb[:, sl], g)  # [H, n_g]
                bound += (qs / 2) @ _grouped(k_abs[:, sl], g).sum(-1).t()
            if rc.spec.kind == "int4" and rc.spec.symmetric:  # unsigned codes: |x·s| ≤ |k| + 8/7 absmax(group)
                bound += 2.0**-18 * _grouped(qb[:, sl].abs(), g).sum(-1) @ _grouped(k_abs[:, sl], g).amax(-1).t()
        ds = scale * (1 + 2.0**-10) * bound.amax(-1)
        out = (torch.expm1(2 * ds) + 2.0**-12).unsqueeze(-1) * kv[:, :d_c].abs().amax(0)
        if int_pv:
            out += _digit_bound(qb, kv, codec, d_c, scale, row_scales[b], ds)
        d_score.append(ds)
        d_out.append(out)
    return torch.stack(d_score), torch.stack(d_out)


def _grouped(x: Tensor, group_size: int) -> Tensor:
    """[..., W] → [..., W / group_size, group_size]."""
    return x.unflatten(-1, (-1, group_size))


def _digit_bound(q: Tensor, kv: Tensor, codec: LayerCodec, d_c: int, scale: float, s: Tensor, ds: Tensor) -> Tensor:
    """The P·V digit term of `error_bound` for one sequence: [H, d_c]."""
    scores = (q @ kv.t()) * scale  # [H, T]
    p = (scores - scores.amax(-1, keepdim=True)).exp()
    if codec.ckv.spec.kind == "int8" and codec.ckv.spec.symmetric:
        safe = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)
        sum_q = (kv[:, :d_c].abs() / safe).sum(0)  # [d_c]
    else:
        sum_q = torch.full((d_c,), (128.0 if codec.ckv.spec.kind == "int8" else 15.0) * kv.shape[0], device=kv.device)
    top = (p * s).amax(-1) / (127.0 * 256.0 * p.sum(-1))  # [H]
    return (torch.exp(4 * ds) * top).unsqueeze(-1) * sum_q
