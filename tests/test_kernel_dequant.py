"""The decode kernel's own pieces under the Triton interpreter: its dequantization of every codec bit-exact
against `codec.decode(...)` rounded to FP16; the value-split programs (D_SPLIT = 2, INT4 rows as two nibble
dots) against the torch reference; the exact INT32 scores of the in-loop path equal to `group_dot`'s; the
SM-filling split-KV schedule."""

from __future__ import annotations

import os

import pytest
import torch

from mlaquant.quant.codecs import LayerCodec
from tests.closeness import assert_close
from tests.reference import kernel_reference

os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="needs triton (not installed)")
import triton.language as tl  # noqa: E402

import mlaquant.kernels.mla_decode as K  # noqa: E402
import mlaquant.kernels.mla_decode_jit as J  # noqa: E402  (the kernels' device functions)

if not K.interpreter_active():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)

from tests.test_kernel_mla_decode import group_dot  # noqa: E402  (a jitted reference: triton must be loaded)

D_C, D_R, N = 64, 16, 32
SCALE = 0.15
C_KV = ["fp16", "int8-row", "int8-row-asym", "int8-g32", "int8-g32-asym", "int4-row", "int4-row-asym",
        "int4-g32", "int4-g32-asym", "int4-g16"]


@triton.jit
def _values_probe(pool_ptr, out_ptr, KIND: tl.constexpr, ASYM: tl.constexpr, W: tl.constexpr,
                  G: tl.constexpr, SOFF: tl.constexpr, LOFF: tl.constexpr, ROW_BYTES: tl.constexpr,
                  BLOCK_N: tl.constexpr, NIBBLES: tl.constexpr):
    offs_t = tl.arange(0, BLOCK_N)
    row = pool_ptr + offs_t * ROW_BYTES
    t_mask = offs_t < BLOCK_N
    for half in tl.static_range(2):
        v = J.half_values(row, t_mask, half, KIND, ASYM, W, G, SOFF, LOFF, False, NIBBLES)
        cols = J.half_channels(half, KIND, W, NIBBLES)
        tl.store(out_ptr + offs_t[:, None] * W + cols[None, :], v)


@triton.jit
def _dots_probe(q_ptr, pool_ptr, a_ptr, b_ptr, H, KIND: tl.constexpr, ASYM: tl.constexpr, W: tl.constexpr,
                G: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_t = tl.arange(0, BLOCK_N)
    h_mask = offs_h < H
    q_row = q_ptr + offs_h * W
    row = pool_ptr + offs_t * ROW_BYTES
    t_mask = offs_t < BLOCK_N
    q8s, qss, qsums = J.query_part(q_row, h_mask, KIND, W, G)
    for g in tl.static_range(W // G):
        ours = J.group_dot_int32(q8s, qsums, row, t_mask, g, KIND, ASYM, G, False)
        ref, _, _ = group_dot(q_row, h_mask, row, t_mask, g, KIND, ASYM, G)
        dst = offs_h[:, None] * (BLOCK_N * (W // G)) + offs_t[None, :] * (W // G) + g
        tl.store(a_ptr + dst, ours)
        tl.store(b_ptr + dst, ref)


def _rows(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    chan = torch.exp(torch.randn(D_C + D_R, generator=gen) * 0.5)
    return torch.randn(n, D_C + D_R, generator=gen) * chan + 0.3 * torch.randn(D_C + D_R, generator=gen)


@pytest.mark.parametrize("nibbles", [True, False], ids=["nibble_halves", "contiguous_halves"])
@pytest.mark.parametrize("ckv", C_KV)
def test_dequantization_is_bit_exact(ckv, nibbles):
    """Both half layouts (int4: low / high nibbles, or contiguous channels for the FP16-scored path), including
    the lowest codes (−128, −8) and negative scales the symmetric codec writes."""
    codec = LayerCodec.from_names(ckv, "fp16", D_C, D_R)
    pool = codec.encode(_rows(N, seed=len(ckv)))
    c, _ = K.codec_parts(codec, on_gpu=False)
    if codec.ckv.spec.symmetric and c.kind != 0:
        codes = pool[:, : codec.ckv.layout.code_bytes]
        low = (codes == 0x80) if c.kind == 1 else ((codes & 15) == 0) | ((codes >> 4) == 0)
        scales = pool[:, c.scale_offset : c.scale_offset + 2 * codec.ckv.layout.n_groups].contiguous()
        assert low.any() and (scales.view(torch.float16) < 0).any()
    out = torch.full((N, D_C), float("nan"), dtype=torch.float16)
    _values_probe[(1,)](pool, out, KIND=c.kind, ASYM=c.asym, W=D_C, G=c.group, SOFF=c.scale_offset,
                        LOFF=c.lo_offset, ROW_BYTES=codec.row_bytes, BLOCK_N=N, NIBBLES=nibbles)
    want = codec.decode(pool)[:, :D_C].half()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (out - want).abs().max()


@pytest.mark.parametrize("ckv", ["int8-row", "int8-g32-asym", "int4-row", "int4-row-asym", "int4-g32"])
def test_in_loop_int32_scores_equal_group_dot(ckv):
    codec = LayerCodec.from_names(ckv, "fp16", D_C, D_R)
    pool = codec.encode(_rows(N, seed=7))
    c, _ = K.codec_parts(codec, on_gpu=False)
    heads, n_g = 4, D_C // c.group
    q = torch.randn(heads, D_C, generator=torch.Generator().manual_seed(8)) * 1.5
    a = torch.zeros(heads, N, n_g, dtype=torch.int32)
    b = torch.ones(heads, N, n_g, dtype=torch.int32)
    _dots_probe[(1,)](q, pool, a, b, heads, KIND=c.kind, ASYM=c.asym, W=D_C, G=c.group,
                      ROW_BYTES=codec.row_bytes, BLOCK_H=heads, BLOCK_N=N)
    assert torch.equal(a, b) and a.abs().sum() > 0


@pytest.mark.parametrize("codec_name", ["fp16/fp16", "int8-g32-asym/int8-g16", "int4-row/int4-row",
                                        "int4-row-asym/fp16"])
def test_value_split_programs_match_reference(codec_name):
    """Four heads as one 4-row block in two programs (D_SPLIT = 2), each accumulating half of the values."""
    from tests.test_kernel_mla_decode import _query, build_cache

    codec = LayerCodec.from_names(*codec_name.split("/"), D_C, D_R)
    config = K.KernelConfig(block_n=64, narrow_heads=1, d_split=2)
    assert config.tile_for(4, on_gpu=False) == (4, 8, 2)
    pool, table, lens = build_cache(codec, (65, 130), seed=3)
    q = _query(2, 4, seed=5)
    out, lse = K.mla_decode(q, pool, table, lens, codec, D_C, SCALE, 64, config)
    ref_out, ref_lse = kernel_reference(q, pool, table, lens, codec, D_C, SCALE, config)
    assert torch.isfinite(out).all()
    assert_close(out, ref_out, max_rel=2e-3, min_cosine=0.9999, what="out")
    assert_close(lse, ref_lse, max_abs=2e-5, what="lse")


@pytest.mark.parametrize("batch,heads,context", [(32, 128, 32768), (32, 16, 32768), (4, 16, 4096), (1, 128, 1000)])
def test_split_schedule_fills_the_sms(batch, heads, context):
    config = K.load_kernel_config()
    n_sm = 132
    chunk = K.schedule_chunk(config, batch, heads, context, n_sm)
    assert chunk % K.PAGE_TOKENS == 0
    block_h, _, d_split = config.tile_for(heads, on_gpu=True)
    per_split = batch * -(-heads // block_h) * d_split
    pages = -(-context // K.PAGE_TOKENS)

    def waves_x_pages(c: int) -> int:  # stage-1 time in page units for chunks of c pages
        return -(-(per_split * -(-pages // c)) // n_sm) * c

    best = min(waves_x_pages(c) for c in range(1, pages + 1))
    assert waves_x_pages(chunk // K.PAGE_TOKENS) <= 1.1 * best
    assert all(waves_x_pages(c) > 1.1 * best for c in range(chunk // K.PAGE_TOKENS + 1, pages + 1))
    assert K.schedule_chunk(config, batch, heads, context, None) == config.chunk_for(context)
