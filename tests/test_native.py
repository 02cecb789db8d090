"""The C int4 unpack (`mlaquant.native`) against the torch ops it replaces, the fast path bit-identical with
and without it, and its fallbacks (disabled, no compiler, a failing build)."""

from __future__ import annotations

import shutil

import pytest
import torch

from mlaquant import native
from mlaquant.codecs import LayerCodec
from mlaquant.cpu_decode import mla_decode_cpu, unpack_nibbles
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
    """Signed codes (no bias term) and unsigned codes less the bias give the same INT32 sums, so the same
    outputs bit for bit; c_unpack=False and an unbuilt helper both run the torch ops."""
    codec = LayerCodec.from_names(*names, D_C, D_R)
    q, pool, table, lens, _, _ = _cache(codec, LENS)
    assert native.unpack_int4() is not None
    args = (q, pool, table, lens, codec, D_C, SCALE)
    out, lse = mla_decode_cpu(*args, block_tokens=16, group=2)
    ref_out, ref_lse = mla_decode_cpu(*args, block_tokens=16, group=2, c_unpack=False)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    monkeypatch.setattr(native, "unpack_int4", lambda: None)
    unbuilt_out, unbuilt_lse = mla_decode_cpu(*args, block_tokens=16, group=2)
    assert torch.equal(unbuilt_out, ref_out) and torch.equal(unbuilt_lse, ref_lse)


def test_native_off_by_environment_without_warning(fresh_native_build, recwarn):
    fresh_native_build.setenv("MLAQUANT_NATIVE", "0")
    assert native.unpack_int4() is None
    assert not recwarn.list


def test_native_missing_compiler_warns_and_falls_back(fresh_native_build):
    fresh_native_build.setenv("CC", "/nonexistent/cc")
    with pytest.warns(UserWarning, match=r"no C compiler \('/nonexistent/cc' not found\)"):
        assert native.unpack_int4() is None


@pytest.mark.skipif(shutil.which("false") is None, reason="no `false` to stand in for a failing compiler")
def test_native_failed_build_warns_and_falls_back(fresh_native_build):
    fresh_native_build.setenv("CC", "false")
    with pytest.warns(UserWarning, match=r"building unpack_int4.c failed \(exit status 1\)"):
        assert native.unpack_int4() is None
