"""Row codecs: byte layouts, exactness of the float kinds, error bounds derived from the stored scales,
SQNR floors on Gaussian data, clipping, names.

The references here re-derive scales and codes from the documented layout (byte offsets computed
from width and group size, FP16 rounding via torch.nextafter) instead of reusing codec internals.
"""

from __future__ import annotations

import pytest
import torch

from mlaquant.quant.codecs import (
    CodecError,
    CodecSpec,
    FloatCodec,
    Fp8Codec,
    IntCodec,
    LayerCodec,
    PartLayout,
    RowCodec,
    RowLayout,
    bits_per_value,
)

QUANT_NAMES = [
    "int8-row", "int8-g16", "int8-g32", "int8-g64", "int8-row-asym", "int8-g32-asym",
    "int4-row", "int4-g16", "int4-g32", "int4-g64", "int4-row-asym", "int4-g32-asym", "int4-g64-asym",
]  # fmt: skip


def _codec(name: str, width: int, **kw) -> RowCodec:
    return RowCodec.build(CodecSpec.parse(name), width, **kw)


def _rows(n: int = 64, width: int = 128, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with per-row magnitudes over 6 decades, offsets, a tiny and an offset row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g) * torch.logspace(-3, 3, n).unsqueeze(1)
    x[1::3] += 5 * torch.randn(len(range(1, n, 3)), 1, generator=g)
    x[0] = 1e-6 * torch.randn(width, generator=g)  # FP16-subnormal scales
    x[2] = 100 + 0.01 * torch.randn(width, generator=g)  # narrow range far from zero
    return x


def _fp16_toward(x: torch.Tensor, up: bool) -> torch.Tensor:
    h = x.half()
    miss = h.float() < x if up else h.float() > x
    step = torch.nextafter(h, torch.full_like(h, float("inf") if up else float("-inf")))
    return torch.where(miss, step, h).float()


def _reference_symmetric(xg: torch.Tensor, bits: int, factors: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric x̂ and signed scales of groups xg [N, G, g], group by group in Python: every candidate of
    the docstring (the extreme on the negative code, |s| = fp16_up(|e| · f / 2^(b-1))) enumerated, the least
    squared error kept, the first on ties."""
    lo_code, hi_code = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    xq, scales = torch.empty_like(xg), torch.empty(xg.shape[:2])
    for n in range(xg.shape[0]):
        for j in range(xg.shape[1]):
            grp = xg[n, j]
            e = grp[grp.abs().argmax()]
            best = None
            for f in factors:
                mag = _fp16_toward((e.abs() * f / -lo_code).reshape(1), up=True)[0]
                s = 0.0 if mag == 0 else float(mag) * (-1.0 if e > 0 else 1.0)
                q = torch.clamp(torch.round(grp / (s if s else 1.0)), lo_code, hi_code)
                err = float(((q * s - grp) ** 2).sum())
                if best is None or err < best[0]:
                    best = (err, q * s, s)
            xq[n, j], scales[n, j] = best[1], best[2]
    return xq, scales


INT4_FACTORS = [1.0 - k / 40 for k in range(11)]


def _reference_fake_quant(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent quantize→dequantize of x [N, W] per the docstring formulas; returns (x̂, scale [N, W])."""
    spec = CodecSpec.parse(name)
    w = x.shape[1]
    g = spec.group_size or w
    qmax = 127 if spec.kind == "int8" else 7
    xg = x.reshape(x.shape[0], w // g, g)
    if spec.symmetric:
        xq, s = _reference_symmetric(xg, spec.bits, INT4_FACTORS if spec.kind == "int4" else [1.0])
        s = s.unsqueeze(-1)
    else:
        lo = _fp16_toward(xg.amin(-1, keepdim=True), up=False)
        s = _fp16_toward((xg.amax(-1, keepdim=True) - lo) / (2 * qmax + 1), up=True)
        q = torch.clamp(torch.round((xg - lo) / torch.where(s > 0, s, 1)), 0, 2 * qmax + 1)
        xq = q * s + lo
    return xq.reshape_as(x), s.expand_as(xg).reshape_as(x)


def _sqnr_db(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-row signal-to-quantization-noise ratio in dB."""
    return 10 * torch.log10(x.pow(2).sum(-1) / (x - y).pow(2).sum(-1))


# --- exact float kinds ------------------------------------------------------------------------------


def test_fp32_round_trip_is_bit_exact():
    x = _rows()
    x[3, :4] = torch.tensor([-0.0, 3.4e38, -1e-45, 1e-30])
    codec = _codec("fp32", 128)
    codes = codec.encode(x)
    assert codes.dtype == torch.uint8 and codes.shape == (64, 512)
    assert torch.equal(codec.decode(codes).view(torch.int32), x.view(torch.int32))


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_kinds_equal_a_plain_cast(name, dtype):
    x = _rows()[3:]  # skip the subnormal row only for readability of failures
    codec = _codec(name, 128)
    assert torch.equal(codec.fake_quant(x), x.to(dtype).float())
    assert torch.equal(codec.decode(codec.encode(x), dtype=dtype), x.to(dtype))
    # little-endian values, nothing else in the row
    assert torch.equal(codec.encode(x), x.to(dtype).view(torch.uint8))


# --- integer kinds against an independent reference ----------------------------------------------


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_integer_codecs_match_reference_and_half_step_bound(name):
    x = _rows()
    codec = _codec(name, 128)
    xq = codec.fake_quant(x)
    ref, s = _reference_fake_quant(x, name)
    assert torch.equal(xq, ref)
    eps = 4 * torch.finfo(torch.float32).eps * (x.abs() + xq.abs())
    spec = CodecSpec.parse(name)
    xg = x.reshape(64, -1, spec.group_size or 128)
    s_group = s.reshape_as(xg)[..., 0]
    if not spec.symmetric:
        # the bound comes from the stored scale: |x - x̂| ≤ s/2 (+ FP32 rounding of q*s + lo); the scale is the
        # FP16 value just at or above range / levels (one FP16 ulp, relative 2^-10 for normal numbers, 2^-24
        # absolute for subnormal ones), not something coarser
        assert ((x - xq).abs() <= s / 2 + eps).all()
        levels = 255 if spec.kind == "int8" else 15
        span = xg.amax(-1) - _fp16_toward(xg.amin(-1), up=False)
        assert (s_group * levels >= span * (1 - 1e-6)).all()
        assert (s_group <= span / levels * (1 + 2**-10) + 2**-24).all()
        return
    # symmetric: half a step inside the code range [-(qmax+1.5)|s|, (qmax+0.5)|s|] (oriented by s's sign),
    # |s| at most one FP16 ulp above |extreme| / (qmax + 1) and at least its smallest shrink factor of that
    n_neg = 128 if spec.kind == "int8" else 8
    inside = (x / torch.where(s != 0, s, 1)).clamp(-n_neg - 0.5, n_neg - 0.5) == x / torch.where(s != 0, s, 1)
    assert ((x - xq).abs() <= s.abs() / 2 + eps)[inside].all()
    assert inside.float().mean() > 0.97  # saturation is the exception, not the rule
    absmax = xg.abs().amax(-1)
    assert (s_group.abs() <= absmax / n_neg * (1 + 2**-10) + 2**-24).all()
    smallest = min(INT4_FACTORS) if spec.kind == "int4" else 1.0
    assert (s_group.abs() >= absmax * smallest / n_neg * (1 - 1e-6)).all()
    # every level is used: each group's extreme sits on -(qmax+1) unless a shrunk scale clipped it
    assert (xq / torch.where(s != 0, s, 1)).round().min() == -n_neg


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_stored_scales_sit_where_the_layout_says(name):
    spec = CodecSpec.parse(name)
    width = 128
    g = spec.group_size or width
    n_groups = width // g
    code_bytes = width if spec.kind == "int8" else width // 2
    x = _rows(n=8, width=width)
    codes = _codec(name, width).encode(x)
    assert codes.shape[1] == code_bytes + 2 * n_groups * (1 if spec.symmetric else 2)
    _, s = _reference_fake_quant(x, name)
    stored = codes[:, code_bytes : code_bytes + 2 * n_groups].contiguous().view(torch.float16).float()
    assert torch.equal(stored, s[:, ::g])
    if not spec.symmetric:
        lo = _fp16_toward(x.reshape(8, n_groups, g).amin(-1), up=False)
        stored_lo = codes[:, code_bytes + 2 * n_groups :].contiguous().view(torch.float16).float()
        assert torch.equal(stored_lo, lo)


def test_int4_nibble_order_and_bias_by_hand():
    # symmetric: the extreme -1 lands on code -8 with s = 1/8 (exact in FP16), 0.5 on +4, 0.25 on +2, 0 on 0;
    # stored as q + 8 = 0, 12, 10, 8
    codec = _codec("int4-row", 4)
    codes = codec.encode(torch.tensor([[-1.0, 0.5, 0.25, 0.0]]))
    assert codes.shape == (1, 4)
    assert codes[0, :2].tolist() == [0xC0, 0x8A]  # low nibble = even channel
    assert codes[0, 2:].contiguous().view(torch.float16).item() == 0.125
    # a positive extreme gets a negative scale (q4_0's rule): 1.0 → code -8 with s = -1/8
    codes = codec.encode(torch.tensor([[1.0, -0.5, 0.25, 0.0]]))
    assert codes[0, :2].tolist() == [0xC0, 0x86]
    assert codes[0, 2:].contiguous().view(torch.float16).item() == -0.125
    # asymmetric: lo = 0, s = 1 exactly; codes 0, 15, 1, 14
    codec = _codec("int4-row-asym", 4)
    codes = codec.encode(torch.tensor([[0.0, 15.0, 1.0, 14.0]]))
    assert codes[0].tolist() == [0xF0, 0xE1, 0x00, 0x3C, 0x00, 0x00]  # codes | fp16 1.0 | fp16 +0.0
    # int8 symmetric codes are two's complement, then the fp16 scale: -128 → code -128 with s = 1.0
    codes = _codec("int8-row", 2).encode(torch.tensor([[127.0, -128.0]]))
    assert codes[0].tolist() == [0x7F, 0x80, 0x00, 0x3C]


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", *QUANT_NAMES])
def test_all_zero_row_decodes_to_exact_zero(name):
    x = torch.zeros(3, 64)
    x[1] = torch.linspace(-1, 1, 64)
    out = _codec(name, 64).fake_quant(x)
    assert torch.equal(out[0], torch.zeros(64)) and torch.equal(out[2], torch.zeros(64))
    assert torch.isfinite(out).all()


def test_constant_row_is_exact_for_asymmetric():
    x = torch.full((2, 64), -3.25)
    assert torch.equal(_codec("int4-g32-asym", 64).fake_quant(x), x)
    assert torch.equal(_codec("int8-row-asym", 64).fake_quant(x), x)


# --- measured quality -------------------------------------------------------------------------------

# Measured mean SQNR on N(0, 1) rows [512, 512], seed 0 (dB): int8-g64 44.5, int8-row 42.6,
# int8-g32-asym 46.7, int4-g16 21.4, int4-g32 20.3, int4-g64 19.4, int4-row 17.5,
# int4-g32-asym 22.1, bf16 55.6, fp16 73.7. Floors below keep ~1 dB of margin.
SQNR_FLOORS = {
    "int8-g64": 43.5, "int8-row": 41.5, "int8-g32-asym": 45.5,
    "int4-g16": 20.4, "int4-g32": 19.3, "int4-g64": 18.4, "int4-row": 16.5, "int4-g32-asym": 21.1,
    "bf16": 54.5, "fp16": 72.5,
}  # fmt: skip


@pytest.fixture(scope="module")
def gaussian():
    return torch.randn(512, 512, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(SQNR_FLOORS))
def test_sqnr_floor_on_gaussian_rows(name, gaussian):
    sqnr = _sqnr_db(gaussian, _codec(name, 512).fake_quant(gaussian))
    assert sqnr.mean() >= SQNR_FLOORS[name], f"{name}: {sqnr.mean():.2f} dB"
    # rows are independent draws: no single row may fall far below the mean (6 sigma-ish)
    assert sqnr.min() >= SQNR_FLOORS[name] - 4.5, f"{name}: worst row {sqnr.min():.2f} dB"


def test_finer_groups_quantize_better(gaussian):
    means = [_sqnr_db(gaussian, _codec(n, 512).fake_quant(gaussian)).mean() for n in
             ("int4-row", "int4-g64", "int4-g32", "int4-g16")]  # fmt: skip
    assert means == sorted(means)


def test_relative_error_matches_its_definition(gaussian):
    codec = _codec("int4-g32", 512)
    per_row = codec.relative_error(gaussian, reduction="none")
    ref = (codec.fake_quant(gaussian) - gaussian).norm(dim=-1) / gaussian.norm(dim=-1)
    assert torch.allclose(per_row, ref, rtol=1e-6)
    assert codec.relative_error(gaussian) == pytest.approx(ref.mean().item(), rel=1e-6)
    assert codec.relative_error(torch.zeros(2, 512), reduction="none").tolist() == [0.0, 0.0]


# --- sizes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ckv,kpe,row_bytes",
    [
        ("fp16", "fp16", 1152),  # 576 values x 2 B
        ("fp32", "fp32", 2304),
        ("bf16", "bf16", 1152),
        ("int8-g64", "fp16", 512 + 8 * 2 + 128),
        ("int8-g64", "int8-g64", 512 + 8 * 2 + 64 + 2),
        ("int8-row-asym", "int8-row-asym", 512 + 4 + 64 + 4),
        ("int4-g32", "fp16", 256 + 16 * 2 + 128),  # c_kv part 288 B
        ("int4-g32", "bf16", 256 + 16 * 2 + 128),
        ("int4-g32", "int8-g32", 288 + 64 + 2 * 2),
        ("int4-g64-asym", "int4-g64-asym", 256 + 8 * 4 + 32 + 4),
    ],
)
def test_row_bytes_for_deepseek_shapes(ckv, kpe, row_bytes):
    codec = LayerCodec.from_names(ckv, kpe, d_c=512, d_r=64)
    assert codec.row_bytes == row_bytes
    assert codec.encode(torch.randn(3, 576)).shape == (3, row_bytes)
    assert bits_per_value(codec) == pytest.approx(8 * row_bytes / 576)


def test_int4_g32_ckv_part_is_288_bytes():
    assert _codec("int4", 512).row_bytes == 288
    assert _codec("int8", 512).row_bytes == 528


@pytest.mark.parametrize(
    ("name", "fields"),  # (group_size, n_groups, code_bytes, scale_offset, zero_offset, row_bytes), width 64
    [
        ("fp16", (64, 0, 128, None, None, 128)),
        ("int8-g32-asym", (32, 2, 64, 64, 68, 72)),
        ("int4-g32", (32, 2, 32, 32, None, 36)),
        ("int4-row-asym", (64, 1, 32, 32, 34, 36)),
        ("fp8", (64, 0, 64, None, None, 64)),
        ("fp8-g16", (16, 4, 64, 64, None, 72)),
    ],
)
def test_part_layout_follows_the_documented_table(name, fields):
    layout = PartLayout.of(CodecSpec.parse(name), 64)
    got = (layout.group_size, layout.n_groups, layout.code_bytes, layout.scale_offset, layout.zero_offset)
    assert (*got, layout.row_bytes) == fields
    codec = _codec(name, 64)
    assert codec.layout == layout and codec.row_bytes == layout.row_bytes
    assert codec.encode(torch.randn(2, 64)).shape == (2, layout.row_bytes)


def test_one_codec_class_per_kind_and_the_row_layout_places_the_parts():
    kinds = {"bf16": FloatCodec, "int8-g32": IntCodec, "int4-row-asym": IntCodec, "fp8": Fp8Codec, "fp8-g32": Fp8Codec}
    for name, cls in kinds.items():
        assert type(_codec(name, 64)) is cls
    with pytest.raises(TypeError):
        RowCodec(PartLayout.of(CodecSpec.parse("fp16"), 8), None, None)  # abstract: build() picks the class
    codec = LayerCodec.from_names("int4-g32", "int8-g32", 512, 64)
    assert codec.layout == RowLayout(codec.ckv.layout, codec.kpe.layout)
    assert (codec.layout.kpe_offset, codec.layout.row_bytes, codec.layout.width) == (288, 356, 576)


# --- clipping -------------------------------------------------------------------------------------


def test_clipping_changes_scale_and_clip_rate_counts():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)).clamp(-1.9, 1.9)
    x[0, 5], x[7, 40], x[9, 63] = 50.0, -80.0, 3.0  # three outliers out of 1024 values
    bound = torch.full((64,), 2.0)
    plain, clipped = _codec("int8-g64", 64), _codec("int8-g64", 64, clip_hi=bound)  # clip_lo mirrored
    s_plain = plain.encode(x)[:, 64:].contiguous().view(torch.float16).float().squeeze(1)
    s_clip = clipped.encode(x)[:, 64:].contiguous().view(torch.float16).float().squeeze(1)
    # the extreme (50, clipped to 2) lands on code -128: a negative scale
    assert s_plain[0] == -_fp16_toward(torch.tensor(50.0 / 128), up=True)
    assert s_clip[0] == -_fp16_toward(torch.tensor(2.0 / 128), up=True)
    assert torch.equal(s_plain[1:7], s_clip[1:7])  # rows without outliers keep their own range
    assert plain.clip_rate(x) == 0.0
    assert clipped.clip_rate(x) == pytest.approx(3 / 1024)
    out = clipped.fake_quant(x)
    assert out[0, 5] == pytest.approx(2.0, abs=1e-2) and out[7, 40] == pytest.approx(-2.0, abs=1e-2)
    # the unclipped values of the outlier row are now resolved much more finely
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, 5] = False
    assert (out[0][mask[0]] - x[0][mask[0]]).abs().max() < (plain.fake_quant(x)[0] - x[0]).abs().max() / 10


def test_asymmetric_clip_side_left_open_is_unbounded():
    x = torch.tensor([[-10.0, 0.0, 1.0, 10.0]])
    codec = _codec("int8-row-asym", 4, clip_hi=torch.full((4,), 5.0))
    assert codec.clip_rate(x) == pytest.approx(0.25)
    out = codec.fake_quant(x)
    assert out[0, 0] == pytest.approx(-10.0, abs=0.06) and out[0, 3] == pytest.approx(5.0, abs=0.06)


def test_layer_codec_splits_clip_bounds_and_parts():
    d_c, d_r = 64, 16
    hi = torch.full((d_c + d_r,), float("inf"))
    hi[d_c:] = 1.0  # clip only k_pe
    codec = LayerCodec.from_names("int8-g32", "int8-row", d_c, d_r, clip_lo=-hi, clip_hi=hi)
    assert codec.ckv.clip_hi is not None and torch.isinf(codec.ckv.clip_hi).all()
    rows = 3 * torch.randn(2, 5, d_c + d_r, generator=torch.Generator().manual_seed(1))
    codes = codec.encode(rows)
    assert codes.shape == (2, 5, codec.row_bytes)
    assert torch.equal(codes[..., : codec.ckv.row_bytes], codec.ckv.encode(rows[..., :d_c]))
    assert torch.equal(codes[..., codec.ckv.row_bytes :], codec.kpe.encode(rows[..., d_c:]))
    n_clipped = (rows[..., d_c:].abs() > 1).sum().item()
    assert codec.clip_rate(rows) == pytest.approx(n_clipped / rows.numel())
    assert codec.name == "int8-g32/int8-row"


# --- names and API contracts -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", *QUANT_NAMES])
def test_canonical_names_round_trip(name):
    assert CodecSpec.parse(name).name == name


def test_parse_defaults_and_fields():
    assert CodecSpec.parse("int8") == CodecSpec("int8", 64, True)
    assert CodecSpec.parse("int4") == CodecSpec("int4", 32, True)
    assert CodecSpec.parse("int4-g64-asym") == CodecSpec("int4", 64, False)
    assert CodecSpec.parse("int8-row") == CodecSpec("int8", None, True)
    assert [CodecSpec.parse(n).bits for n in ("fp32", "bf16", "fp16", "int8", "int4")] == [32, 16, 16, 8, 4]


@pytest.mark.parametrize("bad", ["int3", "int8-g0", "fp16-g32", "int8-gx", "int4-g32-foo", "", "fp8-asym"])
def test_parse_rejects_bad_names(bad):
    with pytest.raises(CodecError, match="codec"):
        CodecSpec.parse(bad)


def test_width_errors_name_width_and_group():
    with pytest.raises(CodecError, match=r"group size 64 does not divide width 48"):
        _codec("int8-g64", 48)
    with pytest.raises(CodecError, match="even width"):
        _codec("int4-row", 7)
    with pytest.raises(CodecError, match=r"clip_hi must be \[8\]"):
        _codec("int8-row", 8, clip_hi=torch.ones(9))


def test_wider_chain():
    chain, spec = [], CodecSpec.parse("int4-g32-asym")
    while spec is not None:
        chain.append(spec.name)
        spec = spec.wider()
    assert chain == ["int4-g32-asym", "int8-g32-asym", "fp16"]
    assert CodecSpec.parse("int4-row").wider().name == "int8-row"
    assert CodecSpec.parse("fp32").wider() is None and CodecSpec.parse("bf16").wider() is None


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "int8-g32", "int4-g32-asym"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fake_quant_is_bit_identical_to_decode_encode(name, dtype):
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    codec = _codec(name, 64)
    fq = codec.fake_quant(x)
    assert fq.dtype == dtype and fq.shape == x.shape
    bits = lambda t: t.view(torch.int32 if t.element_size() == 4 else torch.int16)
    assert torch.equal(bits(fq), bits(codec.decode(codec.encode(x), dtype=dtype)))


@pytest.mark.parametrize("name", ["fp32", "fp16"])
def test_float_codes_do_not_alias_their_source(name):
    codec = _codec(name, 8)
    x = torch.ones(2, 8, dtype=torch.float32 if name == "fp32" else torch.float16)
    codes = codec.encode(x)
    x.zero_()
    out = codec.decode(codes, dtype=x.dtype)
    codes.zero_()
    assert torch.equal(out, torch.ones_like(out))


@pytest.mark.parametrize("name", ["fp16", "int8-g32", "int4-g32-asym"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_rejected(name, bad):
    x = torch.randn(4, 64)
    x[2, 7] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        _codec(name, 64).encode(x)


def test_values_beyond_fp16_are_rejected():
    with pytest.raises(ValueError, match="range"):
        _codec("fp16", 4).encode(torch.tensor([[1e5, 0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="range"):
        _codec("int8-row-asym", 4).encode(torch.tensor([[-1e5, 0.0, 0.0, 0.0]]))


def test_decode_rejects_wrong_bytes():
    with pytest.raises(ValueError, match="uint8"):
        _codec("int8-g32", 64).decode(torch.zeros(2, 65, dtype=torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)")
@pytest.mark.parametrize("name", ["fp16", "int8-g64", "int4-g32", "int4-g32-asym"])
def test_cuda_bytes_equal_cpu_bytes(name):
    x = _rows()
    codec = _codec(name, 128)
    codes = codec.encode(x)
    assert torch.equal(codec.encode(x.cuda()).cpu(), codes)
    assert torch.equal(codec.decode(codes.cuda()).cpu(), codec.decode(codes))


@pytest.mark.parametrize("name", ["int4-row", "int4-g32-asym", "int8-row", "fp16"])
def test_decode_stays_on_the_codes_device(name):
    """Every tensor decode makes follows the codes' device (meta stands in for CUDA here): a buffer
    allocated on the default device would fail, or silently move a GPU cache's rows to the CPU."""
    codec = LayerCodec.from_names(name, name, 64, 32)
    codes = codec.encode(torch.randn(3, 96)).to("meta")
    out = codec.decode(codes)
    assert out.device.type == "meta" and out.shape == (3, 96)
    assert [p.device.type for p in codec.decode_parts(codes)] == ["meta", "meta"]


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "fp8", "fp8-g32", *QUANT_NAMES])
def test_decode_into_a_buffer_equals_decode(name):
    """decode(out=) (the decode path's reused scratch) writes exactly what decode returns, also from
    strided rows (one part of a wider row) and over stale buffer contents."""
    codec = _codec(name, 128)
    wide = torch.cat([codec.encode(_rows()), torch.zeros(64, 5, dtype=torch.uint8)], dim=1)
    codes = wide[:, : codec.row_bytes]  # strided rows, as one part of a cached row is
    out = torch.full((64, 128), float("nan"))
    assert codec.decode(codes, out=out) is out
    assert torch.equal(out, codec.decode(codes))
    with pytest.raises(ValueError, match="out must be contiguous float32"):
        codec.decode(codes, out=torch.empty(64, 127))
    with pytest.raises(ValueError, match="out must be contiguous float32"):
        codec.decode(codes, out=torch.empty(64, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="strided"):
        codec.decode(codes, out=torch.empty(128, 64).T)
