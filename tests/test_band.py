"""The sub-4-bit tier: the band codec's packing and error bounds, the principal rotation and the bit allocation
(`mlaquant.calib.transform`), and a PCA-band plan decoding exactly as teacher-forced evaluation measures it."""

from __future__ import annotations

import pytest
import torch

from mlaquant import DecodeSession
from mlaquant.attention import native
from mlaquant.attention.cpu_decode import pv_kind
from mlaquant.calib.transform import allocate_bands, band_spec, principal_rotation
from mlaquant.evaluation.eval import fake_quant_hook
from mlaquant.quant.band_codecs import pack, unpack
from mlaquant.quant.codecs import CodecError, CodecSpec, LayerCodec, RowCodec, symmetric_codes
from mlaquant.runtime.plan import LayerPlan, Plan


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packing_round_trips_and_matches_the_documented_bit_positions(bits):
    g = torch.Generator().manual_seed(bits)
    u = torch.randint(0, 1 << bits, (5, 48), generator=g, dtype=torch.uint8)
    packed = pack(u, bits)
    assert packed.shape == (5, 48 * bits // 8)
    assert torch.equal(unpack(packed, bits, 48), u)
    # the layout by hand: channel c of the band at bit offset c·bits of the little-endian byte string
    stream = [int(b) for b in packed[0].tolist()]
    word = sum(b << (8 * k) for k, b in enumerate(stream))
    assert [(word >> (c * bits)) & ((1 << bits) - 1) for c in range(48)] == u[0].tolist()


def test_band_codec_bands_their_bits_and_bounds():
    name = "band-8x16-4x32-3x24-2x40-0x16"
    spec = CodecSpec.parse(name)
    assert spec.name == name and spec.bands == ((8, 16), (4, 32), (3, 24), (2, 40), (0, 16))
    codec = RowCodec.build(spec, 128)
    assert codec.row_bytes == 16 + 16 + 9 + 10 + 2 * 4  # codes of each band, then 4 FP16 scales
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g) * torch.linspace(4, 0.05, 128)
    y = codec.fake_quant(x)
    assert torch.equal(y[:, 112:], torch.zeros(256, 16))  # the 0-bit band stores nothing
    start = 0
    for bits, w in spec.bands[:-1]:
        band = x[:, start : start + w]
        # each band encoded as one symmetric every-level group: the same values as `symmetric_codes`
        q, s = symmetric_codes(band.unsqueeze(1), (1 << (bits - 1)) - 1,
                               tuple(1.0 - k / 40 for k in range(11)) if bits <= 4 else (1.0,))
        assert torch.equal(y[:, start : start + w], (q * s.unsqueeze(-1)).squeeze(1)), bits
        start += w
    nothing = RowCodec.build(CodecSpec.parse("band-0x32"), 32)  # every band 0 bits: no bytes, zeros back
    assert nothing.row_bytes == 0 and torch.equal(nothing.fake_quant(x[:, :32]), torch.zeros(256, 32))
    with pytest.raises(CodecError, match="bands cover 120 channels, width 128"):
        RowCodec.build(CodecSpec.parse("band-4x64-2x56"), 128)
    with pytest.raises(CodecError, match="a band of 12 channels at 4 bits"):
        CodecSpec.parse("band-4x12")
    with pytest.raises(CodecError, match="a band of 16 channels at 5 bits"):
        CodecSpec.parse("band-5x16")


def test_principal_rotation_decorrelates_and_the_allocation_follows_the_variances():
    g = torch.Generator().manual_seed(1)
    mix = torch.linalg.qr(torch.randn(64, 64, generator=g))[0]
    rows = (torch.randn(8192, 64, generator=g) * torch.logspace(1, -2, 64)) @ mix.T
    r, moments = principal_rotation(rows)
    assert torch.allclose(r.T @ r, torch.eye(64), atol=1e-5)
    cov = (rows @ r).T @ (rows @ r) / rows.shape[0]
    assert (cov - torch.diag(torch.diag(cov))).abs().max() < 1e-3 * cov.diag().max()
    assert torch.all(moments[:-1] >= moments[1:])
    bands = allocate_bands(moments, 2.0, block=16)
    assert sum(w for _, w in bands) == 64 and sum(b * w for b, w in bands) <= 2.0 * 64
    bits = [b for b, w in bands for _ in range(w)]
    assert bits == sorted(bits, reverse=True)  # more bits where the variance is
    assert bits[0] > bits[-1] == 0  # the tail of a steep spectrum gets nothing
    assert band_spec("pca-2.0", moments, 16, (0, 2, 3, 4, 8)) == "band" + "".join(f"-{b}x{w}" for b, w in bands)
    flat = allocate_bands(torch.ones(64), 3.0, block=16)
    assert flat == ((3, 64),)  # equal variances: the same bits everywhere


def _pca_plan(model, rows_seed: int = 0) -> Plan:
    d_c = model.cfg.kv_lora_rank
    layers, tensors = [], {}
    g = torch.Generator().manual_seed(rows_seed)
    for i in range(model.cfg.num_hidden_layers):
        r = torch.linalg.qr(torch.randn(d_c, d_c, generator=g))[0]
        tensors[f"layer{i}.ckv_rotation"] = r
        layers.append(LayerPlan("band-4x8-3x8-2x16", "int4-row", rotate=True))
    return Plan(layers=layers, fingerprint=model.fingerprint(), budget=0.01, tensors=tensors)


def test_pca_band_plan_round_trips_and_decodes_as_teacher_forced(tiny_model, tmp_path):
    d_c, d_r = tiny_model.cfg.latent_widths
    plan = _pca_plan(tiny_model).bind(tiny_model.cfg)
    plan.save(tmp_path / "p")
    loaded = Plan.load(tmp_path / "p").bind(tiny_model.cfg)
    for i, r in plan.rotations().items():
        assert torch.equal(loaded.rotations()[i][:d_c, :d_c], plan.tensors[f"layer{i}.ckv_rotation"])
        assert torch.equal(r[d_c:, d_c:], torch.eye(d_r))
    session = DecodeSession(tiny_model, plan=tmp_path / "p", backend="torch")
    assert session.codecs[0].row_bytes == (4 + 3 + 2 * 2) + 3 * 2 + d_r // 2 + 2
    model = loaded.apply(tiny_model)
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    teacher = model(ids, fake_quant_hook(session.codecs))[0]
    assert (teacher - tiny_model(ids, fake_quant_hook(session.codecs))[0]).abs().max() > 1e-4  # rotation matters
    steps = [session.prefill(ids[:, :1])[0, 0]]
    steps += [session.decode(ids[:, t])[0] for t in range(1, ids.shape[1])]
    assert (torch.stack(steps) - teacher).abs().max() < 1e-5
    # the fast path decodes bands too, on their codes where the C kernels build (one integer part per band): its
    # approximations are the INT8 query per band and of k_pe and the int16 P (their bound: tests/test_cpu_decode.py),
    # so the next-token choices are the same
    fast = DecodeSession(tiny_model, plan=tmp_path / "p", backend="cpu")
    assert pv_kind(fast.codecs[0]) == ("int16" if native.kernels() is not None else "fp32")
    fast_steps = [fast.prefill(ids[:, :1])[0, 0]] + [fast.decode(ids[:, t])[0] for t in range(1, ids.shape[1])]
    assert torch.equal(torch.stack(fast_steps).argmax(-1), teacher.argmax(-1))
    assert (torch.stack(fast_steps) - teacher).abs().max() < 5e-2


def test_a_missing_rotation_tensor_is_refused(tiny_model, tmp_path):
    from mlaquant.errors import PlanError

    plan = _pca_plan(tiny_model)
    del plan.tensors["layer1.ckv_rotation"]
    plan.save(tmp_path / "p")
    with pytest.raises(PlanError, match="layer1.rotation_signs"):
        Plan.load(tmp_path / "p")


def test_band_layer_codec_names_split_and_fit():
    codec = LayerCodec.from_names("band-4x16-2x16", "int8-row", 32, 8)
    assert codec.name == "band-4x16-2x16/int8-row"
    assert Plan.uniform("band-4x16-2x16/int8-row", 2).layers[0].ckv == "band-4x16-2x16"
