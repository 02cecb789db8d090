"""The C integer kernels (`mlaquant.attention.native`, mlaquant/attention/csrc/decode_kernels.c), every ISA variant
forced in turn, against torch references computed independently: exact integer sums (float64 matmuls of the decoded
codes, exact below 2^53) and, for the fused FP32 epilogues, torch performing the same FP32 operations in the same order
(so the same bits). Rows strided and paged, widths with tails, codes -128 / -8 present, negative scales.

The tests are generated for the variants this CPU runs (`RUNS`, from `native.runnable`); each variant it cannot run
is one skip of `test_each_variant_builds_or_is_refused`, naming the CPU features it lacks: avxvnni needs AVX-VNNI
(Intel Alder Lake and later, AMD Zen 5; AMD Zen 4, for one, has AVX-512 VNNI but not AVX-VNNI), avx512vnni needs
AVX-512 VNNI."""

from __future__ import annotations

import shutil

import pytest
import torch

from mlaquant.attention import native
from mlaquant.attention.cpu_decode import native_parts, quantize_query
from mlaquant.errors import BackendError
from mlaquant.quant import band_codecs
from mlaquant.quant.codecs import CodecSpec, RowCodec, packed_as

if shutil.which("cc") is None:
    pytest.skip("needs a C compiler (no `cc` here): the torch ops run instead", allow_module_level=True)

RUNS = [isa for isa in native.ISAS if native.runnable(isa)]  # probed at collection (the scalar build's probe)
ISAS = pytest.mark.parametrize("isa", RUNS)


def _variant(isa: str) -> native.Kernels:
    k = native.kernels(isa)
    assert k is not None and k.isa == isa and k.lib.mlaq_isa() == native.ISAS.index(isa)
    return k


@pytest.mark.parametrize("isa", native.ISAS)
def test_each_variant_builds_or_is_refused(isa):
    """A variant this CPU runs builds as itself (its tests below are generated); one it cannot run is refused with
    the features it lacks named, and is this CPU's one skip for that variant (its tests are not generated)."""
    if isa in RUNS:
        _variant(isa)
        return
    lacks = ", ".join(f for f in native.ISA_NEEDS[isa] if f not in native.cpu_features())
    with pytest.raises(BackendError, match=rf"native ISA '{isa}' cannot run on this CPU \(it lacks {lacks}\)"):
        native.kernels(isa)
    pytest.skip(f"needs {lacks} for the {isa} variant: this CPU lacks {'them' if ',' in lacks else 'it'} (the "
                "variant's tests are not generated here)")


# (codec, width): int8/int4 sym/asym, row-wise and grouped, widths with tails past whole 32- and 16-channel chunks
PARTS = [("int8-row", 48), ("int8-row-asym", 12), ("int4-row", 160), ("int4-row-asym", 48), ("int8-g16", 48),
         ("int8-g32-asym", 160), ("int4-g16", 48), ("int4-g32-asym", 160), ("int4-g64", 512), ("int8-row", 512)]
# one band of a band codec: a row-wise part of 3- or 2-bit codes (a bit stream); whole chunks, 8/16/24-channel tails
BAND_PARTS = [("band-3x48", 48), ("band-3x40", 40), ("band-3x160", 160), ("band-2x24", 24), ("band-2x160", 160),
              ("band-2x48", 48)]


def codes_of(rc: RowCodec, raw: torch.Tensor) -> torch.Tensor:
    """The codes c' as they enter the dots (int8 sym q, asym q - 128; int4 sym nibble - 8, asym nibble), int64."""
    width, kind, sym = rc.width, rc.spec.kind, rc.spec.symmetric
    if kind == "band":  # one band: u - 2^(bits - 1)
        (bits, _), = rc.spec.bands
        return band_codecs.unpack(raw[:, : rc.layout.code_bytes], bits, width).long() - (1 << (bits - 1))
    if kind == "int8":
        return raw[:, :width].contiguous().view(torch.int8).long() if sym else raw[:, :width].long() - 128
    b = raw[:, : width // 2].long()
    return torch.stack([b & 15, b >> 4], -1).flatten(1) - (8 if sym else 0)


def params_of(rc: RowCodec, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(s fp32 [n, G], zp fp32 [n, G] | None): lo + 128 s for int8 asym, lo for int4 asym."""
    lay = rc.layout
    s = packed_as(raw[:, lay.scale_offset : lay.scale_offset + 2 * lay.n_groups], torch.float16).float()
    if rc.spec.symmetric:
        return s, None
    lo = raw[:, lay.zero_offset : lay.zero_offset + 2 * lay.n_groups].contiguous().view(torch.float16).float()
    return s, (lo + 128.0 * s if rc.spec.kind == "int8" else lo)


def part_of(rc: RowCodec) -> native.Part:
    (part, offset, channel), = native_parts(rc)  # one integer part, or the one band of a band part
    assert offset == channel == 0
    return part


def _block(name: str, width: int, n: int, seed: int, paged: bool):
    """(rc, raw [n, row_bytes] the rows in order, native.Rows reading them strided at an odd offset, or from
    permuted 16-row pages of a pool among 0xFF-filled pages)."""
    g = torch.Generator().manual_seed(seed)
    rc = RowCodec.build(CodecSpec.parse(name), width)
    x = torch.randn(n, width, generator=g) * (1 + 3 * torch.rand(width, generator=g))
    raw = rc.encode(x)
    assert raw.shape == (n, rc.row_bytes)
    return rc, raw, _placed(rc, raw, paged, g)


def _placed(rc: RowCodec, raw: torch.Tensor, paged: bool, g: torch.Generator) -> native.Rows:
    """native.Rows reading raw [n, row_bytes] strided at an odd offset, or from permuted 16-row pages of a pool among
    0xFF-filled pages."""
    n = raw.shape[0]
    if not paged:
        buf = torch.full((n, rc.row_bytes + 13), 0xFF, dtype=torch.uint8)
        buf[:, 5 : 5 + rc.row_bytes] = raw
        return native.Rows(buf, 5, buf.stride(0))
    page = 16
    need = -(-n // page)
    pool = torch.full((need + 3, page, rc.row_bytes), 0xFF, dtype=torch.uint8)
    ids = torch.randperm(need + 3, generator=g)[:need]
    flat = torch.full((need * page, rc.row_bytes), 0xFF, dtype=torch.uint8)
    flat[:n] = raw
    pool[ids] = flat.view(need, page, rc.row_bytes)
    return native.Rows(pool, 0, rc.row_bytes, ids.long().contiguous(), page)


def test_codes_cover_the_extreme_levels_and_negative_scales():
    """The test data holds what must be exact: sym codes -128 / -8 and negative scales (`symmetric_codes`)."""
    for name, low in (("int8-row", -128), ("int4-g16", -8), ("band-3x48", -4), ("band-2x48", -2)):
        rc, raw, _ = _block(name, 48, 40, 0, False)
        assert codes_of(rc, raw).min() == low
        assert (params_of(rc, raw)[0] < 0).any()


@ISAS
@pytest.mark.parametrize("kind", ["int8", "int8-asym", "int4", "int4-asym"])
@pytest.mark.parametrize("k", [12, 48, 160, 2048])
def test_dots_exact_int32(isa, kind, k):
    """dots of int8 a (strided rows, -128 included) with code rows (strided, every code value) = float64 matmul."""
    kern = _variant(isa)
    g = torch.Generator().manual_seed(k)
    code = native.KINDS[(kind[:4], not kind.endswith("asym"))]
    nbytes = k if code < 2 else k // 2
    a = torch.randint(-128, 128, (3, 6, k + 9), dtype=torch.int8, generator=g)[:, :, 4 : 4 + k]
    w = torch.randint(0, 256, (3, 21, nbytes + 7), dtype=torch.uint8, generator=g)[:, :, 2 : 2 + nbytes]
    rc = RowCodec.build(CodecSpec.parse(kind.replace("-", "-row-") if "asym" in kind else kind + "-row"), k)
    got = kern.dots(a, w, code, k)
    want = torch.stack([a[b].double() @ codes_of(rc, w[b]).double().t() for b in range(3)])
    assert got.dtype == torch.int32 and torch.equal(got.double(), want)


@ISAS
@pytest.mark.parametrize("bits", [3, 2])
@pytest.mark.parametrize("k", [8, 24, 40, 160, 2048])
def test_dots_exact_int32_on_bit_stream_codes(isa, bits, k):
    """dots of int8 a with 3- and 2-bit codes (every code value, byte-misaligned fields, short tails) = float64
    matmul of a with the unpacked codes u - 2^(bits - 1)."""
    kern = _variant(isa)
    g = torch.Generator().manual_seed(k + bits)
    nbytes = k * bits // 8
    a = torch.randint(-128, 128, (2, 5, k + 3), dtype=torch.int8, generator=g)[:, :, 1 : 1 + k]
    w = torch.randint(0, 256, (2, 19, nbytes + 5), dtype=torch.uint8, generator=g)[:, :, 3 : 3 + nbytes]
    got = kern.dots(a, w, native.BAND_KINDS[bits], k)
    codes = [band_codecs.unpack(w[b], bits, k).double() - (1 << (bits - 1)) for b in range(2)]
    want = torch.stack([a[b].double() @ codes[b].t() for b in range(2)])
    assert torch.equal(got.double(), want)


@ISAS
@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("k", [2048, 528])  # whole runs of 32-channel chunks; a short run and a 16-channel tail
@pytest.mark.parametrize("m", [6, 3])  # 3- and 2-bit codes: unpacked to bytes once (6 rows), or read in place (3)
@pytest.mark.parametrize("a_value", [-128, 127])
def test_dots_exact_at_the_largest_sub_byte_codes(isa, bits, k, m, a_value):
    """Every sub-byte code at its largest unsigned value and every a at -128 or +127, over parts wide enough for
    the dots of `dots_rows` (not token-lane): the avx2 variant adds maddubs pairs in int16 over runs of chunks
    (8 / 16 / 32 chunks for 4 / 3 / 2 bits), whose sums then reach their bound and must not wrap."""
    kern = _variant(isa)
    code = native.KINDS[("int4", True)] if bits == 4 else native.BAND_KINDS[bits]
    a = torch.full((1, m, k), a_value, dtype=torch.int8)
    w = torch.full((1, 5, k * bits // 8), 0xFF, dtype=torch.uint8)
    got = kern.dots(a, w, code, k)
    want = a_value * ((1 << bits) - 1 - (1 << (bits - 1))) * k  # every code c' = 2^bits - 1 - bias
    assert torch.equal(got, torch.full((1, m, 5), want, dtype=torch.int32))


def scores_reference(rc, raw, q8, qs, init=None):
    """The scores' formula in torch, FP32 operation by operation: v = init or 0; per group g in order
    v += (qs_g · s_g) · float(dot_g) (+ (Σq8_g · qs_g) · zp_g for asymmetric codes); dot_g exact via float64."""
    gs = rc.layout.group_size
    c, (s, zp) = codes_of(rc, raw).double(), params_of(rc, raw)
    v = torch.zeros(q8.shape[0], raw.shape[0]) if init is None else init.clone()
    for g in range(rc.layout.n_groups):
        sl = slice(g * gs, (g + 1) * gs)
        dot = (q8[:, sl].double() @ c[:, sl].t()).float()
        v = v + (qs[:, g : g + 1] * s[:, g]) * dot
        if zp is not None:
            qlo = q8[:, sl].sum(-1, dtype=torch.int32).float() * qs[:, g]
            v = v + qlo[:, None] * zp[:, g]
    return v


@ISAS
@pytest.mark.parametrize("name, width", PARTS + BAND_PARTS)
@pytest.mark.parametrize("paged", [False, True])
def test_scores_bit_identical_to_torch_formula(isa, name, width, paged):
    kern = _variant(isa)
    n, heads = 150, 5  # tiles of 64 tokens and a tail; heads past a 4-head tile
    rc, raw, rows = _block(name, width, n, width + paged, paged)
    g = torch.Generator().manual_seed(1)
    q8 = torch.randint(-127, 128, (heads, width), dtype=torch.int8, generator=g)
    qs = torch.rand(heads, rc.layout.n_groups, generator=g) * 0.01
    out = torch.full((heads, n + 3), float("nan"))
    kern.scores(rows, n, [(part_of(rc), 0, q8, qs)], out, accumulate=False)
    want = scores_reference(rc, raw, q8, qs)
    assert torch.equal(out[:, :n], want)
    assert torch.isnan(out[:, n:]).all()  # nothing past n written
    init = torch.randn(heads, n, generator=g)
    out[:, :n] = init
    kern.scores(rows, n, [(part_of(rc), 0, q8, qs)], out, accumulate=True)
    assert torch.equal(out[:, :n], scores_reference(rc, raw, q8, qs, init))


@ISAS
@pytest.mark.parametrize("name", ["int4-row", "int4-g64", "band-3x128", "band-2x128", "int8-row"])
@pytest.mark.parametrize("sign", [1, -1])
def test_scores_exact_at_the_largest_codes_and_query(isa, name, sign):
    """Every code at its largest stored value and every query code at ±127 over a 128-channel part: the sums the
    avx2 token-lane dots keep in int16 (runs of 8 / 16 / 32 words for 4 / 3 / 2 bits) reach their bound and must not
    wrap; the scores equal the torch formula's bits."""
    kern = _variant(isa)
    n, heads, width = 70, 5, 128
    rc, raw, _ = _block(name, width, n, 3, False)
    raw[:, : rc.layout.code_bytes] = 0x7F if name == "int8-row" else 0xFF  # int8 sym: +127; sub-byte: all ones
    rows = _placed(rc, raw, False, torch.Generator().manual_seed(0))
    q8 = torch.full((heads, width), 127 * sign, dtype=torch.int8)
    qs = torch.rand(heads, rc.layout.n_groups, generator=torch.Generator().manual_seed(2)) * 0.01
    out = torch.empty(heads, n)
    kern.scores(rows, n, [(part_of(rc), 0, q8, qs)], out, accumulate=False)
    assert torch.equal(out, scores_reference(rc, raw, q8, qs))


@ISAS
@pytest.mark.parametrize("first, second", [("int8-row", "int4-g16-asym"), ("int4-g32-asym", "int8-row")])
def test_two_parts_in_one_scores_call_are_the_bits_of_two_calls(isa, first, second):
    """c_kv and k_pe of one row in one call: the second part's groups follow the first's, as if accumulated."""
    kern = _variant(isa)
    n, heads = 100, 6
    (rc1, raw1, _), (rc2, raw2, _) = _block(first, 160, n, 4, False), _block(second, 48, n, 5, False)
    raw = torch.cat([raw1, raw2], dim=1)
    rows = native.Rows(raw, 0, raw.stride(0))
    g = torch.Generator().manual_seed(6)
    queries = [(torch.randint(-127, 128, (heads, rc.width), dtype=torch.int8, generator=g),
                torch.rand(heads, rc.layout.n_groups, generator=g)) for rc in (rc1, rc2)]
    out = torch.empty(heads, n)
    kern.scores(rows, n, [(part_of(rc1), 0, *queries[0]), (part_of(rc2), rc1.row_bytes, *queries[1])], out, False)
    want = scores_reference(rc2, raw2, *queries[1], scores_reference(rc1, raw1, *queries[0]))
    assert torch.equal(out, want)


def _lane_dot(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Σ_t p[h, t] · z[t] in the kernels' fixed order: 8 lanes (t % 8, in t order), then
    ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) → [H]."""
    lanes = torch.zeros(p.shape[0], 8)
    for t in range(p.shape[1]):
        lanes[:, t % 8] = lanes[:, t % 8] + p[:, t] * z[t]
    l0, l1, l2, l3, l4, l5, l6, l7 = lanes.unbind(-1)
    return ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))


def pv_reference(rc, raw, probs, acc):
    """P·V in torch, FP32 operation by operation: per group M = max_t |s|, w = s · (32767 / M), P = clamp(round(p
    · w), ±32767), S = Σ_t P · c' exact (float64), acc + (float(M / 32767 · S) + Σ_t p · zp in lane order)."""
    gs = rc.layout.group_size
    c, (s, zp) = codes_of(rc, raw).double(), params_of(rc, raw)
    out = acc.clone()
    for g in range(rc.layout.n_groups):
        sl = slice(g * gs, (g + 1) * gs)
        m = s[:, g].abs().amax()
        r = torch.full_like(m, 32767.0) / m if m > 0 else torch.zeros_like(m)  # `32767.0 / m` is reciprocal · 32767
        w = s[:, g] * r
        p16 = torch.round(probs * w).clamp(-32767, 32767)
        v = ((m.double() / 32767.0) * (p16.double() @ c[:, sl])).float()
        z = _lane_dot(probs, zp[:, g]) if zp is not None else torch.zeros(probs.shape[0])
        out[:, sl] = out[:, sl] + (v + z[:, None])
    return out


@ISAS
@pytest.mark.parametrize("name, width", PARTS + BAND_PARTS)
@pytest.mark.parametrize("n", [1, 77, 600])  # one token; odd tails; chunks of 256 tokens summed
def test_pv_bit_identical_to_torch_formula(isa, name, width, n):
    kern = _variant(isa)
    heads = 9 if n > 1 else 3  # past 4- and 8-head tiles
    rc, raw, rows = _block(name, width, n, n + width, paged=n > 1)
    g = torch.Generator().manual_seed(n)
    probs = torch.rand(heads, n + 5, generator=g) ** 4
    probs[:, 0] = 1.0  # the running max's own token
    acc = torch.randn(heads, width + 2, generator=g)
    want = pv_reference(rc, raw, probs[:, :n], acc[:, :width])
    kern.pv(rows, n, part_of(rc), probs, acc)
    assert torch.equal(acc[:, :width], want)


def _extreme_rows(rc: RowCodec, n: int, g: torch.Generator) -> torch.Tensor:
    """raw [n, row_bytes]: each row's codes all at its lowest or all at its highest level (random per row) and its
    FP16 scales ±1 with the sign of its codes, so M = 1 in every group, P = ±32767 wherever p = 1 and every product
    P · c' is ≥ 0: the sums grow as fast as the codes allow (zero points as encoded)."""
    lay = rc.layout
    raw = rc.encode(torch.randn(n, rc.width, generator=g))
    low = 0x80 if (rc.spec.kind, rc.spec.symmetric) == ("int8", True) else 0x00  # int8 sym: -128; else 0 / -2^(b-1)
    high = torch.rand(n, generator=g) < 0.5
    raw[:, : lay.code_bytes] = torch.where(high, 0x7F if low else 0xFF, low).to(torch.uint8)[:, None]
    sign = torch.where(codes_of(rc, raw)[:, :1] < 0, -1.0, 1.0).half().expand(n, lay.n_groups).contiguous()
    raw[:, lay.scale_offset : lay.scale_offset + 2 * lay.n_groups] = sign.view(torch.uint8)
    return raw


@ISAS
@pytest.mark.parametrize("name, width", [("int8-row", 160), ("int8-g16-asym", 48), ("int4-g32", 160),
                                         ("int4-row-asym", 12), ("band-3x40", 40), ("band-2x48", 48)])
def test_pv_exact_at_the_int16_extremes(isa, name, width):
    """P = ±32767 everywhere over 600 tokens (chunks of 256 at the INT32 limit, then FP64) with the codes at their
    extremes: bit-identical to the torch formula, whose sums are exact in float64."""
    kern = _variant(isa)
    n, heads = 600, 5
    g = torch.Generator().manual_seed(3)
    rc = RowCodec.build(CodecSpec.parse(name), width)
    raw = _extreme_rows(rc, n, g)
    probs, acc = torch.ones(heads, n), torch.zeros(heads, width)
    want = pv_reference(rc, raw, probs, acc)
    if rc.spec.kind == "int8":  # 600 tokens of |P · c'| ≈ 32767 · 127.5: past 2^31, so the FP64 sum across chunks runs
        assert want.abs().min() > 2**31 / 32767
    kern.pv(_placed(rc, raw, True, g), n, part_of(rc), probs, acc)
    assert torch.equal(acc, want)


@pytest.mark.parametrize("name, width", PARTS[:6] + BAND_PARTS[:2])
def test_every_variant_gives_the_same_bits(name, width):
    """Across the variants this CPU runs: scores and P·V outputs bit for bit (the FP32 operations are the same)."""
    rc, raw, rows = _block(name, width, 130, 9, paged=True)
    g = torch.Generator().manual_seed(3)
    q8 = torch.randint(-127, 128, (16, width), dtype=torch.int8, generator=g)
    qs = torch.rand(16, rc.layout.n_groups, generator=g)
    probs = torch.rand(16, 130, generator=g)
    outs = []
    for isa in RUNS:
        scores, acc = torch.zeros(16, 130), torch.zeros(16, width)
        native.kernels(isa).scores(rows, 130, [(part_of(rc), 0, q8, qs)], scores, False)
        native.kernels(isa).pv(rows, 130, part_of(rc), probs, acc)
        outs.append((scores, acc))
    assert len(RUNS) >= 2
    for scores, acc in outs[1:]:
        assert torch.equal(scores, outs[0][0]) and torch.equal(acc, outs[0][1])


@ISAS
def test_exp2_close_to_torch_and_the_same_bits_in_every_variant(isa):
    """The in-kernel softmax's exp2: relative error ≤ 2^-21 against torch's on [-126, 0] (the bound the P·V and
    lse terms allow), 0 below; its sum in the fixed lane order; identical bits to the scalar variant."""
    kern = _variant(isa)
    g = torch.Generator().manual_seed(7)
    x = torch.cat([-torch.rand(5000, generator=g) * 126, -torch.rand(1000, generator=g) * 2, torch.zeros(3),
                   torch.tensor([-126.0, -126.5, -300.0, float("-inf")])])
    got, total = kern.exp2(x + 1.5, 1.5)
    want = torch.exp2(x.double())
    inside = x >= -126
    assert ((got.double() - want).abs() <= 2.0**-21 * want)[inside].all()
    assert (got[~inside] == 0).all()
    lanes = torch.zeros(8, dtype=torch.float32)
    for t in range(got.numel()):
        lanes[t % 8] += got[t]
    l0, l1, l2, l3, l4, l5, l6, l7 = lanes.unbind()  # FP32 scalars: the combination in FP32, in the kernels' order
    assert total == (((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))).item()
    scalar, scalar_total = native.kernels("scalar").exp2(x + 1.5, 1.5)
    assert torch.equal(got, scalar) and total == scalar_total


@ISAS
@pytest.mark.parametrize("width, group_size", [(512, 512), (64, 64), (160, 32), (48, 12), (24, 4)])
def test_query_quantization_bit_identical_to_quantize_query(isa, width, group_size):
    """`Kernels.quantize` against `cpu_decode.quantize_query` then `qs * factor` (the route it replaced): a channel
    slice of a wider query (rows strided), groups with vector tails and none, an all-zero group (scale 1), and exact
    halves q / qs = k + 1/2 that round half to even (a group whose absmax is 127, so qs = 1)."""
    kern = _variant(isa)
    g = torch.Generator().manual_seed(width + group_size)
    whole = torch.randn(3, 5, width + 40, generator=g) * 4
    x = whole[..., 24 : 24 + width]
    x[0, 1, :group_size] = 0.0
    halves = torch.arange(group_size, dtype=torch.float32) % 9 - 4.5  # -4.5 .. 3.5, each k + 1/2
    x[1, 2, :group_size] = halves
    x[1, 2, 0] = 127.0
    factor = 0.125 * 1.4426950408889634
    q8, qs = kern.quantize(x, group_size, factor)
    want_q8, want_qs = quantize_query(x, group_size)
    assert q8.dtype == torch.int8 and q8.is_contiguous() and qs.is_contiguous()
    assert torch.equal(q8, want_q8) and torch.equal(qs, want_qs * factor)
    assert (qs[0, 1, 0] == factor).item() and (q8[0, 1, :group_size] == 0).all()
    assert torch.equal(q8[1, 2, 1:group_size].float(), torch.round(halves[1:]))  # half to even: -4.5 → -4, 3.5 → 4
