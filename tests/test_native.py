"""The C helper (`mlaquant.attention.native`): the int4 unpack against the torch ops it replaces, the fast path
bit-identical with and without it; the choice of ISA variant (CPU features capped by torch's capability,
MLAQUANT_NATIVE_ISA, a clear error for a variant the CPU cannot run); the fast path bit-identical under every variant
the CPU runs; the fallbacks (disabled, no compiler, a failing build). tests/test_native_kernels.py checks each
kernel."""

from __future__ import annotations

import shutil

import pytest
import torch

from mlaquant.attention import native
from mlaquant.attention.cpu_decode import mla_decode_cpu, unpack_nibbles
from mlaquant.attention.decode_inputs import DecodeInputs
from mlaquant.errors import BackendError
from mlaquant.quant.codecs import LayerCodec
from tests.test_cpu_decode import D_C, D_R, LENS, SCALE, _cache

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the torch ops run instead")


@needs_compiler
@pytest.mark.parametrize("width", [1, 3, 8, 13, 32, 256])
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("signed", [False, True])
def test_native_unpack_equals_torch_ops(width, rows, signed):
    """Strided rows at an odd byte offset, widths with and without a tail past whole 8-byte words."""
    unpack = native.unpack_int4()
    assert unpack is not None, "cc is present, so the helper must build"
    g = torch.Generator().manual_seed(width * 10 + rows)
    block = torch.randint(0, 256, (rows, width + 11), dtype=torch.uint8, generator=g)
    raw = block[:, 3 : 3 + width]
    out = torch.full((rows, 2 * width), 0xAA, dtype=torch.uint8)
    got = unpack(raw, out, signed)
    want = unpack_nibbles(raw).to(torch.int16) - (8 if signed else 0)
    assert got.dtype == torch.int8 and got.data_ptr() == out.data_ptr()
    assert torch.equal(got.to(torch.int16), want)


@needs_compiler
def test_native_unpack_rejects_bad_buffers():
    unpack = native.unpack_int4()
    raw = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"out must be contiguous uint8 \(4, 16\)"):
        unpack(raw, torch.zeros(4, 15, dtype=torch.uint8), True)
    with pytest.raises(ValueError, match="raw must be CPU uint8 rows"):
        unpack(raw.t(), torch.zeros(8, 8, dtype=torch.uint8), True)


@needs_compiler
@pytest.mark.parametrize("names", [("int4-row", "int4-row"), ("int4-g16-asym", "int4-row-asym"),
                                   ("int4-g32", "int8-row"), ("int8-row-asym", "int4-g16")], ids="/".join)
def test_fast_path_bit_identical_with_and_without_native_unpack(names, monkeypatch):
    """The torch-ops path (c_kernels=False): signed codes (no bias term) and unsigned codes less the bias give the
    same INT32 sums, so the same outputs bit for bit; c_unpack=False and an unbuilt helper both run torch ops."""
    codec = LayerCodec.from_names(*names, D_C, D_R)
    q, pool, table, lens, _, _ = _cache(codec, LENS)
    assert native.unpack_int4() is not None
    args = (DecodeInputs(q, pool, table, lens, codec, D_C), SCALE)
    out, lse = mla_decode_cpu(*args, block_tokens=16, group=2, c_kernels=False)
    ref_out, ref_lse = mla_decode_cpu(*args, block_tokens=16, group=2, c_unpack=False, c_kernels=False)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    monkeypatch.setattr(native, "unpack_int4", lambda: None)
    unbuilt_out, unbuilt_lse = mla_decode_cpu(*args, block_tokens=16, group=2, c_kernels=False)
    assert torch.equal(unbuilt_out, ref_out) and torch.equal(unbuilt_lse, ref_lse)


def test_native_off_by_environment_without_warning(fresh_native_build, recwarn):
    fresh_native_build.setenv("MLAQUANT_NATIVE", "0")
    assert native.unpack_int4() is None and native.kernels() is None
    assert native.describe() == "none (MLAQUANT_NATIVE=0): torch ops"
    assert not recwarn.list


AVX512_CPU = frozenset(native.FEATURES) - {"avxvnni"}  # e.g. AMD Zen 4
AVX2_CPU = frozenset({"avx2", "fma", "f16c"})  # e.g. AMD Zen 2/3


@pytest.mark.parametrize("features, capability, want", [
    (AVX512_CPU, "AVX512", "avx512vnni"),
    (AVX512_CPU, "AVX2", "avx2"),  # ATEN_CPU_CAPABILITY=avx2: behaves as an AVX2-only CPU
    (AVX512_CPU, "DEFAULT", "scalar"),
    (AVX2_CPU, "AVX2", "avx2"),
    (AVX2_CPU | {"avxvnni"}, "AVX2", "avxvnni"),  # Alder Lake and later
    (AVX2_CPU, "AVX512", "avx2"),  # a capability never adds what the CPU lacks
    (frozenset(), "DEFAULT", "scalar"),  # not x86
    (frozenset({"avx2", "f16c"}), "AVX2", "scalar"),  # no FMA: the avx2 variant's flags cannot run
])
def test_auto_isa_is_the_cpu_capped_by_torch_capability(features, capability, want):
    assert native.auto_isa(features, capability) == want


@needs_compiler
def test_forced_isa_runs_that_variant_and_says_so(fresh_native_build):
    fresh_native_build.setenv("MLAQUANT_NATIVE_ISA", "scalar")
    assert native.kernels().isa == "scalar" and native.kernels().lib.mlaq_isa() == 0
    assert native.describe() == "scalar (forced by MLAQUANT_NATIVE_ISA)"
    fresh_native_build.setenv("MLAQUANT_NATIVE_ISA", "auto")
    assert native.chosen_isa() == native.auto_isa()


@needs_compiler
def test_forced_isa_the_cpu_cannot_run_is_one_clear_error(fresh_native_build):
    fresh_native_build.setattr(native, "cpu_features", lambda: AVX2_CPU)
    fresh_native_build.setenv("MLAQUANT_NATIVE_ISA", "avx512vnni")
    with pytest.raises(BackendError, match=r"native ISA 'avx512vnni' cannot run on this CPU \(it lacks avx512f, "
                                           r"avx512bw, avx512vl, avx512vnni\); MLAQUANT_NATIVE_ISA=auto picks"):
        native.kernels()
    fresh_native_build.setenv("MLAQUANT_NATIVE_ISA", "sse9")
    with pytest.raises(BackendError, match="MLAQUANT_NATIVE_ISA='sse9': choose auto or one of scalar, avx2"):
        native.kernels()


@needs_compiler
@pytest.mark.parametrize("names", [("int8-row", "int8-row"), ("int4-g16-asym", "int4-row-asym"),
                                   ("int4-g32", "int8-row"), ("int8-g16-asym", "fp16"),
                                   ("band-8x16-4x16-3x16-2x8-0x8", "int8-row"), ("band-0x16-3x32-2x16", "fp16")],
                         ids="/".join)
def test_fast_path_bit_identical_under_every_isa_variant(names, fresh_native_build):
    """The whole call, each variant this CPU runs forced in turn: the same bits (same integer sums, same FP32
    operations in the same order); and not the torch-ops path's (int16 P instead of two int8 digits)."""
    codec = LayerCodec.from_names(*names, D_C, D_R)
    q, pool, table, lens, _, _ = _cache(codec, LENS)
    inputs = DecodeInputs(q, pool, table, lens, codec, D_C)
    results = {}
    for isa in native.ISAS:
        if native.runnable(isa):
            fresh_native_build.setenv("MLAQUANT_NATIVE_ISA", isa)
            results[isa] = mla_decode_cpu(inputs, SCALE, block_tokens=32, group=2)
    assert "scalar" in results and len(results) >= 2
    first = results["scalar"]
    for isa, (out, lse) in results.items():
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), isa
    torch_ops = mla_decode_cpu(inputs, SCALE, block_tokens=32, group=2, c_kernels=False)
    assert not torch.equal(torch_ops[0], first[0])


@needs_compiler
@pytest.mark.parametrize("shape", [(1, 16, 128, 512), (16, 1, 2048, 96), (3, 4, 48, 12), (5, 2, 160, 7)])
def test_w8a8_bit_identical_to_the_fp64_route_under_every_isa_variant(shape, fresh_native_build):
    """`Kernels.w8a8` (activation codes, INT32 sums, epilogue in C) against grouped_int8_matmul's torch route, each
    variant this CPU runs forced in turn, with rows that need a rounding tie and an all-zero row."""
    from mlaquant.modeling.int8_proj import grouped_int8_matmul, quantize_grouped

    m, g, k, n = shape
    gen = torch.Generator().manual_seed(k * n)
    x = torch.randn(m, g, k, generator=gen) * torch.logspace(-2, 1, k)
    x[0, 0, :2] = torch.tensor([2.5, -127.0]) / 50.0 * x[0, 0].abs().max()  # codes at exact .5 steps and ±127
    x[-1, -1] = 0.0
    w8, ws = quantize_grouped(torch.randn(g, n, k, generator=gen))
    want = grouped_int8_matmul(x, w8, ws, backend="torch")
    ran = []
    for isa in native.ISAS:
        if native.runnable(isa):
            fresh_native_build.setenv("MLAQUANT_NATIVE_ISA", isa)
            assert torch.equal(native.kernels().w8a8(x, native.pack_w8(w8, ws)), want), isa
            ran.append(isa)
    assert "scalar" in ran and len(ran) >= 2, ran


@needs_compiler
def test_w8a8_exact_at_the_largest_codes_under_every_isa_variant(fresh_native_build):
    """Every product at ±127 · ±127, with signs mixed so that the int16 pairs of the sign trick reach ±32258 and the
    INT32 sums their largest magnitude at this K: the C route still equals the FP64 sums."""
    from mlaquant.modeling.int8_proj import grouped_int8_matmul

    m, g, k, n = 5, 2, 1028, 19
    gen = torch.Generator().manual_seed(7)
    x = torch.where(torch.rand(m, g, k, generator=gen) < 0.5, -1.0, 1.0)
    x[0] = 1.0  # a row of equal signs: every pair at +-32258 against a constant-sign weight row
    w8 = torch.where(torch.rand(g, n, k, generator=gen) < 0.5, -127, 127).to(torch.int8)
    w8[:, 0] = 127
    w8[:, 1] = -127
    ws = torch.rand(g, n, generator=gen) + 0.5
    want = grouped_int8_matmul(x, w8, ws, backend="torch")
    torch.testing.assert_close(want[0, :, 0], k * 127 * ws[:, 0], rtol=1e-6, atol=0)  # the largest sum
    for isa in [isa for isa in native.ISAS if native.runnable(isa)]:
        fresh_native_build.setenv("MLAQUANT_NATIVE_ISA", isa)
        assert torch.equal(native.kernels().w8a8(x, native.pack_w8(w8, ws)), want), isa


def test_pack_w8_rejects_code_minus_128():
    w8 = torch.zeros(1, 3, 8, dtype=torch.int8)
    w8[0, 2, 5] = -128
    with pytest.raises(ValueError, match="holds -128"):
        native.pack_w8(w8, torch.ones(1, 3))


def test_native_missing_compiler_warns_and_falls_back(fresh_native_build):
    fresh_native_build.setenv("CC", "/nonexistent/cc")
    with pytest.warns(UserWarning, match=r"no C compiler \('/nonexistent/cc' not found\)"):
        assert native.unpack_int4() is None


@pytest.mark.skipif(shutil.which("false") is None, reason="no `false` to stand in for a failing compiler")
def test_native_failed_build_warns_and_falls_back(fresh_native_build):
    fresh_native_build.setenv("CC", "false")
    with pytest.warns(UserWarning, match=r"building unpack_int4.c \+ decode_kernels.c failed \(exit status 1\)"):
        assert native.unpack_int4() is None
        assert native.kernels() is None
