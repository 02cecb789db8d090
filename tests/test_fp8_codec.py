"""FP8 (e4m3) row codecs: static per-layer scale (`fp8`, vLLM's cache) and dynamic per-group (`fp8-g<N>`).

The reference for e4m3 rounding is independent of torch's cast: the nearest of all 254 finite e4m3fn
values, ties to the even code, computed by brute force.
"""

from __future__ import annotations

import pytest
import torch

from mlaquant.modeling.model import MLAConfig
from mlaquant.modeling.synthetic import config_dict
from mlaquant.quant.codecs import (
    FP8_MAX,
    CodecError,
    CodecSpec,
    LayerCodec,
    RowCodec,
    bits_per_value,
    fp8_static_scale,
)
from mlaquant.runtime.plan import LayerPlan, Plan


def e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """All finite e4m3fn values (float64, ascending) and their codes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).double()
    keep = torch.isfinite(vals) & ~(codes == 0x80)  # drop NaNs and -0
    order = vals[keep].argsort()
    return vals[keep][order], codes[keep][order].to(torch.int32)


def nearest_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round float64 values already within [-448, 448] to e4m3 by brute force (ties → even code)."""
    grid, codes = e4m3_grid()
    d = (v.reshape(-1, 1) - grid).abs()
    best = d.min(dim=1, keepdim=True).values
    ties = d == best
    # among equally near values prefer the even code (mantissa LSB 0), as IEEE round-to-nearest-even
    score = ties.double() * 2 + ((codes % 2) == 0).double()
    return grid[score.argmax(dim=1)].reshape(v.shape)


def _rows(n: int, w: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, w, generator=g) * scale
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-6, -3e-3])  # zeros and subnormal-range values
    return x


# --- names -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8", "fp8-g64", "fp8-g128"])
def test_fp8_names_round_trip(name):
    spec = CodecSpec.parse(name)
    assert spec.name == name and spec.bits == 8 and spec.kind == "fp8"
    assert spec.is_static_fp8 == (name == "fp8")
    assert spec.wider() == CodecSpec("fp16")


@pytest.mark.parametrize("bad", ["fp8-row", "fp8-asym", "fp8-g0", "fp8-g64-asym", "fp8-gx", "fp4"])
def test_fp8_bad_names_rejected(bad):
    with pytest.raises(CodecError, match="codec"):
        CodecSpec.parse(bad)


def test_fp8_asymmetric_spec_rejected():
    with pytest.raises(CodecError, match="symmetric"):
        CodecSpec("fp8", 64, symmetric=False)


# --- static (per-layer) scale ------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 0.0123, 3.5])
def test_static_fp8_matches_brute_force_rounding(scale):
    x = _rows(64, 40, scale=scale * 50)
    codec = RowCodec.build(CodecSpec.parse("fp8"), 40, fp8_scale=scale)
    assert codec.row_bytes == 40 and codec.layout.scale_offset is None and codec.layout.n_groups == 0
    codes = codec.encode(x)
    assert codes.dtype == torch.uint8 and codes.shape == (64, 40)
    s = torch.tensor(scale, dtype=torch.float32).double()
    ref = nearest_e4m3((x.double() / s).clamp(-FP8_MAX, FP8_MAX)) * s
    assert torch.equal(codec.decode(codes).double(), ref.float().double())
    # the stored bytes are exactly the e4m3 codes of x / s
    assert torch.equal(codes.view(torch.float8_e4m3fn).double(), (ref / s).float().double())


def test_static_fp8_saturates_and_reports_the_saturation_rate():
    codec = RowCodec.build(CodecSpec.parse("fp8"), 8, fp8_scale=0.5)
    x = torch.tensor([[300.0, -300.0, 223.0, 1.0, 0.0, -224.0, 225.0, 5.0]])
    out = codec.fake_quant(x)
    assert out[0, 0] == 224.0 and out[0, 1] == -224.0  # ±448·s
    assert torch.isfinite(out).all()
    assert codec.clip_rate(x) == pytest.approx(3 / 8)  # 300, -300, 225 lie beyond ±224
    assert torch.equal(codec.clip_hi, torch.full((8,), 224.0))


def test_static_fp8_scale_from_bounds_is_absmax_over_448_in_fp32():
    lo, hi = torch.tensor([-1.0, -7.5, 0.0]), torch.tensor([2.0, 0.5, 6.0])
    s = fp8_static_scale(lo, hi)
    assert s == float(torch.tensor(7.5, dtype=torch.float32) / 448.0)
    assert fp8_static_scale(torch.zeros(3), torch.zeros(3)) == 1.0
    assert fp8_static_scale(None, None) == 1.0
    with pytest.raises(CodecError, match="not finite"):
        fp8_static_scale(torch.tensor([float("inf")]), None)


def test_layer_codec_shares_one_scale_over_ckv_and_kpe():
    d_c, d_r = 32, 8
    lo = -torch.linspace(0.1, 1.0, d_c + d_r)
    hi = torch.linspace(0.1, 2.0, d_c + d_r)
    hi[d_c + 3] = 9.0  # the row's absmax lives in k_pe
    codec = LayerCodec.from_names("fp8", "fp8", d_c, d_r, lo, hi)
    expected = float(torch.tensor(9.0) / 448.0)
    assert codec.ckv.fp8_scale == codec.kpe.fp8_scale == expected
    assert codec.row_bytes == d_c + d_r and bits_per_value(codec) == 8.0
    # without bounds: the engines' default scale 1.0; an explicit scale wins over bounds
    assert LayerCodec.from_names("fp8", "fp8", d_c, d_r).ckv.fp8_scale == 1.0
    assert LayerCodec.from_names("fp8", "fp8", d_c, d_r, lo, hi, fp8_scale=0.25).kpe.fp8_scale == 0.25


def test_static_fp8_rejects_bad_scale_and_nan_input():
    with pytest.raises(CodecError, match="scale"):
        RowCodec.build(CodecSpec.parse("fp8"), 8, fp8_scale=0.0)
    codec = RowCodec.build(CodecSpec.parse("fp8"), 4)
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(torch.tensor([[1.0, float("nan"), 0.0, 0.0]]))


def test_deepseek_row_sizes():
    assert LayerCodec.from_names("fp8", "fp8", 512, 64).row_bytes == 576  # vLLM fp8
    assert LayerCodec.from_names("fp8-g128", "bf16", 512, 64).row_bytes == 512 + 4 * 2 + 128


# --- dynamic per-group scales ------------------------------------------------------------------------


def test_dynamic_fp8_layout_and_rounding():
    w, g = 64, 16
    x = _rows(32, w, seed=3, scale=4.0)
    codec = RowCodec.build(CodecSpec.parse(f"fp8-g{g}"), w)
    assert codec.row_bytes == w + 2 * (w // g) and codec.layout.scale_offset == w
    codes = codec.encode(x)
    scales = codes[:, w:].contiguous().view(torch.float16).float()  # [N, G]
    absmax = x.view(32, w // g, g).abs().amax(-1)
    # the smallest FP16 value ≥ absmax / 448
    assert (scales >= absmax / FP8_MAX).all()
    below = (scales.half().view(torch.int16) - 1).view(torch.float16).float()
    assert (below < absmax / FP8_MAX).all()
    s = scales.double().repeat_interleave(g, dim=1)
    ref = nearest_e4m3((x.double() / s).clamp(-FP8_MAX, FP8_MAX)) * s
    assert torch.allclose(codec.decode(codes).double(), ref, rtol=0, atol=1e-12)


def test_dynamic_fp8_error_bound_and_zero_group():
    x = _rows(200, 64, seed=5, scale=2.0)
    x[1, :16] = 0.0
    codec = RowCodec.build(CodecSpec.parse("fp8-g16"), 64)
    out = codec.fake_quant(x)
    assert torch.equal(out[1, :16], torch.zeros(16))
    s = codec.encode(x)[:, 64:].contiguous().view(torch.float16).float().repeat_interleave(16, dim=1)
    # half an e4m3 ulp: 2^-4 relative in the normal range, s·2^-10 absolute below it
    assert ((out - x).abs() <= x.abs() / 16 + s * 2**-10 + 1e-12).all()


def test_fp8_group_as_wide_as_the_part_stays_dynamic():
    codec = LayerCodec.from_names("fp8-g64", "fp8-g64", 128, 32)
    assert codec.kpe.spec == CodecSpec("fp8", 32) and not codec.kpe.spec.is_static_fp8
    assert codec.kpe.row_bytes == 32 + 2 and codec.name == "fp8-g64/fp8-g32"


def test_fake_quant_keeps_dtype_and_equals_decode_encode():
    x = _rows(8, 32, seed=9).to(torch.bfloat16)
    for name in ("fp8", "fp8-g16"):
        codec = RowCodec.build(CodecSpec.parse(name), 32, fp8_scale=0.01 if name == "fp8" else None)
        out = codec.fake_quant(x)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, codec.decode(codec.encode(x), dtype=torch.bfloat16))


# --- plans -------------------------------------------------------------------------------------------


def test_plan_fp8_layer_uses_its_calibrated_clip_range():
    d_c, d_r = 16, 4
    cfg = MLAConfig.from_hf(config_dict(layers=3, kv_lora_rank=d_c, rope_dim=d_r))
    lo, hi = -torch.rand(d_c + d_r), torch.rand(d_c + d_r) * 3
    plan = Plan(
        layers=[LayerPlan("fp8", "fp8", clip=True), LayerPlan("fp8", "fp8", clip=False)],
        tensors={f"layer{i}.clip_{k}": t for i in range(2) for k, t in (("lo", lo), ("hi", hi))},
    ).bind(cfg)
    assert plan.layer_codec(0).ckv.fp8_scale == fp8_static_scale(lo, hi)
    assert plan.layer_codec(1).ckv.fp8_scale == 1.0  # unclipped = uncalibrated default
    assert Plan.uniform("fp8", 3).bind(cfg).bytes_per_token() == 3 * (d_c + d_r)
