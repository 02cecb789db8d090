"""The decode kernel on band c_kv parts (`mlaquant.quant.codecs.BandCodec`: channel bands of 8/4/3/2/0 bits, one FP16
scale per coded band), under the Triton interpreter, against the torch reference on the same quantized cache:
bands of every width (8-channel ones, which the kernel pads to 16-wide tiles, 3-bit and 0-bit ones, bands in
any order), codes at both extremes and negative scales (checked on the bytes), NaN in every free slot,
scattered blocks, narrow blocks and wide ones in one or two value programs, k_pe FP16-scored and INT8-scored;
each segment's dequantized tile bit for bit against the codec's decode; the segment plan of the DeepSeek-width
allocations `mlaquant bench kernels --aot` compiles; layouts the kernel refuses and the dispatcher's fallback.

One band part's bytes (kernel docstring): the bands' codes one after another (channel c of a b-bit band at bit
b·c of the band's little-endian byte string, stored u = q + 2^(b−1), an 8-bit code the int8 byte itself), then
one FP16 scale per band of > 0 bits; a 0-bit band stores nothing and decodes to 0."""

from __future__ import annotations

import os

import pytest
import torch

from mlaquant.attention.decode_inputs import DecodeInputs
from mlaquant.attention.ops import mla_decode as ops_mla_decode
from mlaquant.attention.reference import mla_decode_reference
from mlaquant.config import ConfigError
from mlaquant.errors import BackendError
from mlaquant.quant.codecs import LayerCodec
from tests.closeness import assert_close
from tests.reference import kernel_reference

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (see test_kernel_mla_decode.py)
triton = pytest.importorskip("triton", reason="needs triton (not installed)")
import triton.language as tl  # noqa: E402

import mlaquant.kernels.mla_decode as K  # noqa: E402
import mlaquant.kernels.mla_decode_jit as J  # noqa: E402  (the kernels' device functions)

if not K.interpreter_active():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)

from tests.test_kernel_mla_decode import D_C, D_R, PAGE, SCALE, _query, build_cache  # noqa: E402

# d_c 64: the first three run two value programs in the wide blocks below (> 32 coded channels), the fourth one
CODECS = [
    "band-8x8-4x16-3x16-2x8-0x16/int4-row",  # every width, 8-channel bands (padded tiles), 24 bytes of codes
    "band-0x16-4x16-3x32/int8-row",  # a 0-bit band first, a 3-bit band split between the two programs
    "band-2x32-8x16-3x16/int4-g16",  # no 0-bit band, widths out of order
    "band-3x16-2x16-0x32/fp16",  # coded channels fit one program: one value program in wide blocks too
]
_NO_KPE_DEQUANT = {"narrow": {"c_kv": list(K.CKV_FAMILIES), "k_pe": {f: [] for f in K.CKV_FAMILIES}},
                   "wide": {"c_kv": ["band"], "k_pe": {f: [] for f in K.CKV_FAMILIES}}}
CONFIGS = {
    "narrow": (K.KernelConfig(block_n=64), 4, (150, 37)),
    "shipped_ragged": (K.load_kernel_config(), 1, (64, 1, 300)),
    "wide_split": (K.KernelConfig(block_n=64, narrow_heads=2, block_h=8, d_split=2), 12, (150, 33)),
    "wide_unsplit": (K.KernelConfig(block_n=64, narrow_heads=2, block_h=8, d_split=1), 12, (150, 33)),
    "int8_kpe": (K.KernelConfig(block_n=64, narrow_heads=2, block_h=8, d_split=2, dequant_scores=_NO_KPE_DEQUANT),
                 12, (150, 33)),
}


def band_codes(part_bytes: torch.Tensor, bands) -> list[tuple[int, torch.Tensor]]:
    """(bits, q int64 [N, w]) per band of > 0 bits, read from the documented byte layout by bit arithmetic."""
    out, byte = [], 0
    for bits, w in bands:
        if not bits:
            continue
        n = bits * w // 8
        raw = torch.cat([part_bytes[:, byte : byte + n].long(), torch.zeros(len(part_bytes), 1, dtype=torch.long)], 1)
        pos = bits * torch.arange(w)
        u = ((raw[:, pos // 8] | (raw[:, pos // 8 + 1] << 8)) >> (pos % 8)) & ((1 << bits) - 1)
        q = torch.where(u >= 128, u - 256, u) if bits == 8 else u - (1 << (bits - 1))
        out.append((bits, q))
        byte += n
    return out


def _live_rows(pool, table, lens) -> torch.Tensor:
    t = [torch.arange(n) for n in lens.tolist()]
    return torch.cat([pool[table[b, tb // PAGE].long(), tb % PAGE] for b, tb in enumerate(t)])


def _extreme_rows(bands):
    """Random latent rows (`_rows` of test_kernel_mla_decode) where every 4th row gives each coded band a pair
    +a, −a·(2^(b−1) − 1)/2^(b−1) (a above the band's other values, its sign alternating): codes on both
    extremes, scales of both signs."""
    from tests.test_kernel_mla_decode import _rows

    def rows(n: int, gen: torch.Generator) -> torch.Tensor:
        x = _rows(n, gen)
        start = 0
        for bits, w in bands:
            if bits:
                for r in range(0, n, 4):
                    a = 2.0 * x[r, start : start + w].abs().max() * (1 if r % 8 else -1)
                    x[r, start], x[r, start + 1] = a, -a * ((1 << (bits - 1)) - 1) / (1 << (bits - 1))
            start += w
        return x

    return rows


def _assert_extremes(rows: torch.Tensor, codec) -> None:
    """Every coded band has codes on both extremes (−2^(b−1), 2^(b−1) − 1) and some negative scale."""
    lay = codec.ckv.layout
    part = rows[:, : lay.row_bytes]
    scales = part[:, lay.code_bytes :].contiguous().view(torch.float16)
    for k, (bits, q) in enumerate(band_codes(part, lay.spec.bands)):
        assert (q == -(1 << (bits - 1))).any() and (q == (1 << (bits - 1)) - 1).any(), bits
        assert (scales[:, k] < 0).any() and (scales[:, k] > 0).any(), bits


def test_hand_decoder_agrees_with_the_codec():
    codec = LayerCodec.from_names("band-8x8-4x16-3x16-2x8-0x16", "fp16", D_C, D_R)
    rows = codec.encode(torch.randn(40, D_C + D_R, generator=torch.Generator().manual_seed(0)))
    lay = codec.ckv.layout
    scales = rows[:, lay.code_bytes : lay.row_bytes].contiguous().view(torch.float16).float()
    ref = codec.decode(rows)[:, :D_C]
    start = 0
    for k, (bits, q) in enumerate(band_codes(rows, lay.spec.bands)):
        w = q.shape[1]
        assert torch.equal(ref[:, start : start + w], q.float() * scales[:, k : k + 1]), bits
        start += w
    assert not ref[:, start:].any()


# every codec under every config, but for an FP16 k_pe under int8_kpe: an FP16 k_pe has no INT8 score path
BAND_CASES = [(codec, config) for codec in CODECS for config in CONFIGS
              if not (config == "int8_kpe" and codec.endswith("/fp16"))]


@pytest.mark.parametrize("codec_name, config_name", BAND_CASES)
def test_kernel_matches_reference_on_band_caches(codec_name, config_name):
    config, heads, lens = CONFIGS[config_name]
    codec = LayerCodec.from_names(*codec_name.split("/"), D_C, D_R)
    assert K.supports(codec, on_gpu=False) is None
    pool, table, lens = build_cache(codec, lens, seed=len(codec_name) + heads, rows=_extreme_rows(codec.ckv.spec.bands))
    _assert_extremes(_live_rows(pool, table, lens), codec)
    q = _query(len(lens), heads, seed=heads)
    out, lse = K.mla_decode(q, pool, table, lens, codec, D_C, SCALE, 64 if config_name != "shipped_ragged" else 128,
                            config)
    ref_out, ref_lse = kernel_reference(q, pool, table, lens, codec, D_C, SCALE, config)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close(out, ref_out, max_rel=2e-3, min_cosine=0.9999, what="out")
    assert_close(lse, ref_lse, max_abs=2e-5, what="lse")
    # 0-bit channels are exactly 0; against the exact (FP32 query) reference only the FP16 rounding differs
    zero = torch.cat([torch.full((w,), bits == 0) for bits, w in codec.ckv.spec.bands])
    assert not out[..., zero].any()
    ref_out, ref_lse = mla_decode_reference(DecodeInputs(q, pool, table, lens, codec, D_C), SCALE)
    assert_close(out, ref_out, max_rel=3e-2, min_cosine=0.9995, what="out vs exact")


@pytest.mark.parametrize("codec_name", [c.split("/")[0] for c in CODECS])
def test_band_tiles_are_bit_exact(codec_name):
    """Every segment `band_values` makes (both programs' of a split), against the codec's decode rounded to
    FP16, codes at both extremes and negative scales included; padded columns 0."""
    codec = LayerCodec.from_names(codec_name, "fp16", D_C, D_R)
    n = 64
    rows = codec.encode(_extreme_rows(codec.ckv.spec.bands)(n, torch.Generator().manual_seed(2)))
    _assert_extremes(rows, codec)
    c, _ = K.codec_parts(codec, on_gpu=False)
    seg0, seg1, _, _ = K.band_segments(c, 2)
    want = codec.decode(rows)[:, :D_C].half()
    for seg in seg0 + seg1:
        ch, w, v = seg[:3]
        out = torch.full((n, w), float("nan"), dtype=torch.float16)
        _band_probe[(1,)](rows, out, SEG=seg, ROW_BYTES=codec.row_bytes, BLOCK_N=n)
        assert torch.equal(out[:, :v].view(torch.int16), want[:, ch : ch + v].view(torch.int16)), seg
        assert not out[:, v:].any(), seg


@triton.jit
def _band_probe(pool_ptr, out_ptr, SEG: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_t = tl.arange(0, BLOCK_N)
    v = J.band_values(pool_ptr + offs_t * ROW_BYTES, offs_t < BLOCK_N, SEG[4], SEG[1], SEG[2], SEG[3], SEG[5], False)
    tl.store(out_ptr + offs_t[:, None] * SEG[1] + tl.arange(0, SEG[1])[None, :], v)


def _covered(segs) -> list[int]:
    return sorted(c for seg in segs for c in range(seg[0], seg[0] + seg[2 if len(seg) > 2 else 1]))


@pytest.mark.parametrize("name,programs", [("band-8x64-4x64-2x128-0x256", 1), ("band-4x192-3x128-2x64-0x128", 2)])
def test_segments_of_the_deepseek_allocations(name, programs):
    """The two allocations `bench kernels --aot` compiles (d_c 512): tiles of power-of-two widths covering each
    coded channel once, at the byte offsets of the codec's layout; the 0-bit channels stored as zeros; one value
    program when the coded channels fit 256, else two sharing them evenly."""
    codec = LayerCodec.from_names(name, "int4-row", 512, 64)
    config = K.load_kernel_config()
    assert K.supports(codec, on_gpu=True) is None
    c, _ = K.codec_parts(codec, on_gpu=True)
    assert K.value_split(codec, 128, config, on_gpu=True) == programs
    assert K.value_split(codec, 16, config, on_gpu=True) == 1
    seg0, seg1, zero0, zero1 = K.band_segments(c, programs)
    coded = [ch for bits, ch, w, _, _ in c.bands if bits for ch in range(ch, ch + w)]
    assert _covered(seg0 + seg1) == coded and len(_covered(seg0)) == len(coded) // programs
    assert _covered(zero0 + zero1) == sorted(set(range(512)) - set(coded))
    for ch, w, v, bits, off, soff in seg0 + seg1:
        band = next(b for b in c.bands if b[1] <= ch < b[1] + b[2])
        assert w == v and w & (w - 1) == 0 and 16 <= w <= 256 and bits == band[0] and soff == band[4]
        assert off == band[3] + (ch - band[1]) * bits // 8
    assert [b[4] for b in c.bands if b[0]][-1] == codec.ckv.layout.row_bytes - 2  # the last scale ends the part


def test_unaligned_band_layouts_are_refused_and_auto_uses_torch(monkeypatch):
    """An odd number of 3-bit bands of 8 (mod 16) channels gives an odd number of code bytes: the FP16 scales
    and the k_pe part at odd offsets. The kernel refuses them (with the allocation rule), "auto" runs torch."""
    from mlaquant.attention import backends

    codec = LayerCodec.from_names("band-0x16-3x24-4x8-0x16", "int8-row", D_C, D_R)
    assert codec.ckv.layout.code_bytes == 13
    reason = K.supports(codec, on_gpu=False)
    assert reason is not None and "odd byte offsets" in reason and "multiples of 16 channels" in reason
    even = LayerCodec.from_names("band-3x8-3x8-2x16-0x32", "int8-row", D_C, 32)  # two odd bands: 6 bytes
    assert even.ckv.layout.code_bytes == 10 and K.supports(even, on_gpu=True) is None
    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", backends.AUTO_ORDER["cuda"])
    pool, table, lens = build_cache(codec, (40,), seed=11)
    q = _query(1, 4, seed=11)
    out, lse = ops_mla_decode(q, pool, table, lens, codec, D_C, SCALE, backend="auto")
    ref = mla_decode_reference(DecodeInputs(q, pool, table, lens, codec, D_C), SCALE)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    with pytest.raises(BackendError, match="odd byte offsets"):
        K.mla_decode(q, pool, table, lens, codec, D_C, SCALE)


def test_band_k_pe_and_configs_without_band_are_refused():
    assert "c_kv only" in K.supports(LayerCodec.from_names("int4-row", "band-4x16", D_C, D_R), on_gpu=False)
    with pytest.raises(ConfigError, match="band under every c_kv"):
        K.load_kernel_config({"dequant_scores": {
            "narrow": {"c_kv": ["fp16"], "k_pe": {f: [] for f in K.CKV_FAMILIES}},
            "wide": {"c_kv": ["band"], "k_pe": {f: [] for f in K.CKV_FAMILIES}}}})
    with pytest.raises(ConfigError, match="wide_block_n"):
        K.load_kernel_config({"wide_block_n": {"fp16": 32, "row": 32, "grouped": 32}})
