"""Triton MLA decode (run by the Triton CPU interpreter) against the torch reference on the same quantized
paged cache: every codec x {batch 1, ragged batch, lengths off the page/chunk grid, a context across a
chunk-size boundary} x heads {1, 4, 16}; the exact INT32 score path; the FP16-gated split-KV merge
against one exact softmax; NaN-filled free slots and permuted block tables."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from mlaquant.attention.decode_inputs import DecodeInputs
from mlaquant.attention.ops import mla_decode as ops_mla_decode
from mlaquant.attention.reference import mla_decode_reference
from mlaquant.config import ConfigError
from mlaquant.errors import BackendError
from mlaquant.quant.codecs import LayerCodec
from tests.closeness import assert_close
from tests.reference import kernel_reference, merge_error_bound, merge_gated_fp16_reference, quantize_query

# triton.jit picks the CPU interpreter at decoration time, also for triton's own library functions, so the
# variable must be set before triton is first imported; it stays set (tests that need it unset monkeypatch).
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="needs triton (not installed)")
import triton.language as tl  # noqa: E402

import mlaquant.kernels.mla_decode as K  # noqa: E402
import mlaquant.kernels.mla_decode_jit as J  # noqa: E402  (the kernels' device functions)

if not K.interpreter_active():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)

D_C, D_R, PAGE = 64, 16, 64
SCALE = 0.15
CODECS = [
    "fp16/fp16",
    "int8-g32/fp16",
    "int8-g32-asym/int8-g16",
    "int4-g32/int8-g16",
    "int4-g32-asym/int4-g16",
]
# The interpreter's cost grows with the number of tiles: most cases use 64-token tiles, the ragged case runs
# the shipped configs/kernels.yaml (32-token tiles, not aligned with chunk tails), and the chunk-boundary case
# a config with the shipped thresholds scaled down 8x, so the context that crosses one stays short (the
# shipped 2048-token boundary runs once, in test_shipped_chunk_boundary_end_to_end).
CONFIGS = {
    "big_tiles": K.KernelConfig(block_n=64),
    "shipped": K.load_kernel_config(),
    "small_chunks": K.KernelConfig(split_kv_chunks=((256, 64), (1024, 128), (0, 192)), block_n=64),
}


@dataclass(frozen=True)
class Case:
    name: str
    seq_lens: tuple[int, ...]
    chunk_tokens: int | None  # None: from the config by the longest context
    config: str = "big_tiles"


CASES = [
    Case("batch1", (256,), 128),  # exactly two chunks, four pages
    Case("ragged3", (64, 1, 300), 128, "shipped"),  # one page, one token, three chunks with a partial tail
    Case("off_grid", (65, 191, 127), 128),  # neither page nor chunk multiples
    Case("chunk_boundary", (300, 70), None, "small_chunks"),  # 300 ≥ 256 -> 128-token chunks (3 chunks)
]
HEADS = [1, 4, 16]


def _rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """Latent rows [n, D_C + D_R] with per-channel scales and an offset, as real latents have."""
    chan = torch.exp(torch.randn(D_C + D_R, generator=gen) * 0.5)
    return torch.randn(n, D_C + D_R, generator=gen) * chan + 0.3 * torch.randn(D_C + D_R, generator=gen)


def build_cache(codec: LayerCodec, seq_lens, seed: int = 0, shuffle: bool = True, page: int = PAGE, rows=None):
    """(pool, block_table, seq_lens) holding random rows (or `rows(n, gen)`) on pages of `page` tokens.
    shuffle: blocks scattered among spare blocks, free bytes 0xFF (NaN in every codec), unused table entries -1
    or a spare block; else in order, zero-filled."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in seq_lens]
    n_blocks = sum(need) + (3 if shuffle else 0)
    pool = torch.full((n_blocks, page, codec.row_bytes), 0xFF if shuffle else 0, dtype=torch.uint8)
    perm_gen = torch.Generator().manual_seed(seed + 1)  # the rows do not depend on the placement
    ids = torch.randperm(n_blocks, generator=perm_gen).tolist() if shuffle else list(range(n_blocks))
    spare = ids[sum(need) :]
    table = torch.full((len(seq_lens), max(need) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        mine, ids = ids[: need[b]], ids[need[b] :]
        enc = codec.encode((rows or _rows)(n, gen))
        for j, blk in enumerate(mine):
            seg = enc[j * page : (j + 1) * page]
            pool[blk, : len(seg)] = seg
        table[b, : need[b]] = torch.tensor(mine, dtype=torch.int32)
        if shuffle and b % 2:
            table[b, need[b] :] = spare[0]
    if shuffle:  # every value of a free slot decodes to NaN (a 0-bit band's to 0), so reading one poisons the output
        free = codec.decode(pool[spare[0]])
        assert (torch.isnan(free) | (free == 0)).all() and torch.isnan(free).any(-1).all()
    return pool, table, torch.tensor(seq_lens, dtype=torch.int32)


def _query(batch: int, heads: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(batch, heads, D_C + D_R, generator=gen) * 1.5


def _compare(out, lse, ref_out, ref_lse, max_rel: float, min_cosine: float, lse_atol: float):
    """Finite outputs; out within `max_rel` (max abs error / output scale) and `min_cosine` of ref_out; lse
    within `lse_atol` of ref_lse."""
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close(out, ref_out, max_rel=max_rel, min_cosine=min_cosine, what="out")
    assert_close(lse, ref_lse, max_abs=lse_atol, what="lse")


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("codec_name", CODECS)
def test_kernel_matches_reference(codec_name, case, heads):
    codec = LayerCodec.from_names(*codec_name.split("/"), D_C, D_R)
    pool, table, lens = build_cache(codec, case.seq_lens, seed=len(case.seq_lens) + heads)
    q = _query(len(case.seq_lens), heads, seed=heads)
    config = CONFIGS[case.config]
    if case.chunk_tokens is None:
        assert config.chunk_for(max(case.seq_lens)) != config.chunk_for(min(case.seq_lens))
    out, lse = K.mla_decode(q, pool, table, lens, codec, D_C, SCALE, case.chunk_tokens, config)
    assert out.shape == (len(case.seq_lens), heads, D_C) and out.dtype == torch.float32
    assert lse.shape == (len(case.seq_lens), heads) and lse.dtype == torch.float32
    # Same quantized cache, same (kernel-quantized) query: only the kernel's own arithmetic differs.
    ref_out, ref_lse = kernel_reference(q, pool, table, lens, codec, D_C, SCALE, config)
    _compare(out, lse, ref_out, ref_lse, max_rel=2e-3, min_cosine=0.9999, lse_atol=2e-5)
    # Against the unquantized FP32 query: the INT8 query quantization is the only addition.
    ref_out, ref_lse = mla_decode_reference(DecodeInputs(q, pool, table, lens, codec, D_C), SCALE)
    _compare(out, lse, ref_out, ref_lse, max_rel=3e-2, min_cosine=0.9995, lse_atol=0.1)


@pytest.mark.parametrize("d_split", [1, 2])
@pytest.mark.parametrize("codec_name", ["fp16/fp16", "int8-row-asym/int8-row", "int4-row/int4-row", "int4-g32/fp16"])
def test_wide_head_blocks(codec_name, d_split):
    """The wide path (more heads than `narrow_heads`): several head blocks, the last one partial, and with
    d_split 2 the value halves in separate programs (each compiled for its half), against the reference."""
    codec = LayerCodec.from_names(*codec_name.split("/"), D_C, D_R)
    pool, table, lens = build_cache(codec, (150, 33), seed=9)
    q = _query(2, 12, seed=9)
    config = K.KernelConfig(block_n=64, narrow_heads=2, block_h=8, d_split=d_split)
    assert config.tile_for(12, on_gpu=False) == (8, 8, d_split)
    out, lse = K.mla_decode(q, pool, table, lens, codec, D_C, SCALE, 64, config)
    ref_out, ref_lse = kernel_reference(q, pool, table, lens, codec, D_C, SCALE, config)
    _compare(out, lse, ref_out, ref_lse, max_rel=2e-3, min_cosine=0.9999, lse_atol=2e-5)


@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("codec_name", ["fp16/fp16", "int4-row/int8-row"])
def test_pages_other_than_64_tokens(codec_name, page):
    """A 16-token page is smaller than a tile (each token's page looked up, `tile_rows`); in a 128-token page
    a tile starts mid-page (`page_rows` with a row offset). Both against the reference."""
    codec = LayerCodec.from_names(*codec_name.split("/"), D_C, D_R)
    pool, table, lens = build_cache(codec, (300, 70), seed=5, page=page)
    q = _query(2, 4, seed=5)
    out, lse = K.mla_decode(q, pool, table, lens, codec, D_C, SCALE, 128)
    ref_out, ref_lse = kernel_reference(q, pool, table, lens, codec, D_C, SCALE, None)
    _compare(out, lse, ref_out, ref_lse, max_rel=2e-3, min_cosine=0.9999, lse_atol=2e-5)


@pytest.mark.parametrize(
    "codec_name",
    ["int8-g32/int8-g16", "int8-g16-asym/int8-row-asym", "int4-g32/int4-g16-asym", "int4-g16-asym/int4-row"],
)
def test_int32_score_path_is_exact(codec_name):
    codec = LayerCodec.from_names(*codec_name.split("/"), D_C, D_R)
    pool, table, lens = build_cache(codec, (70, 5), seed=3)
    q = _query(2, 4, seed=3)
    # amax 127 -> qs = 1, so q/qs hits exact .5 ties: round half to even (2.5 -> 2, -3.5 -> -4, 0.5 -> 0)
    q[0, 0, :16] = torch.tensor([127, 2.5, -3.5, 0.5, -0.5, 1.5, 3.5, -2.5] * 2)
    q[0, 1, :16] = 0.0  # an all-zero group
    for part, rc, sl in (("c_kv", codec.ckv, slice(0, D_C)), ("k_pe", codec.kpe, slice(D_C, D_C + D_R))):
        dots, qs = score_group_dots(q, pool, table, lens, codec, D_C, part=part)
        q8, qs_ref = quantize_query(q[..., sl], rc.layout.group_size)
        if part == "c_kv":
            assert q8[0, 0, 1:8].tolist() == [2, -4, 0, 0, 2, 4, -2]
        assert torch.equal(qs, qs_ref)
        for b, n in enumerate(lens.tolist()):
            t = torch.arange(n)
            raw = pool[table[b, t // PAGE].long(), t % PAGE]
            raw = raw[:, 0 : rc.row_bytes] if part == "c_kv" else raw[:, codec.layout.kpe_offset :]
            codes = _dot_codes(raw[:, : rc.layout.code_bytes], rc)  # [n, W], decoded here from the documented layout
            ref = torch.einsum(
                "hgc,tgc->htg",
                q8[b].long().unflatten(-1, (-1, rc.layout.group_size)),
                codes.unflatten(-1, (-1, rc.layout.group_size)),
            )
            assert torch.equal(dots[b, :, :n].long(), ref), part
            assert not dots[b, :, n:].any()


@triton.jit
def group_dot(q_row, h_mask, row, t_mask, g, KIND: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr):
    """The reference INT8 score path of group g of one integer part, from the kernel's own pieces: (INT32 dot
    [BH, BN], qs [BH] fp32, Σq8 [BH] int32).

    `q_row` [BH] points at the part's first query channel, `row` [BN] at the part's first byte. The codes
    enter the dot as int8: sym int8 q, asym int8 q − 128, int4 nibbles interleaved (q − 8 when sym)."""
    q8, qs, qsum = J.quantize_query_group(q_row, h_mask, g, G)
    k = J.dot_codes(row, t_mask, g, KIND, ASYM, G)
    return tl.dot(q8, tl.trans(k), out_dtype=tl.int32), qs, qsum


@triton.jit
def _scores_kernel(
    q_ptr, pool_ptr, bt_ptr, lens_ptr, dot_ptr, qs_ptr,
    stride_qb, stride_qh, stride_pool, stride_bt, stride_db, stride_dh, stride_dt, stride_sb, stride_sh,
    H,
    PAGE: tl.constexpr, ROW_BYTES: tl.constexpr, PART_OFF: tl.constexpr, Q_OFF: tl.constexpr,
    KIND: tl.constexpr, ASYM: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The kernel's INT32 score path of one integer part on its own: dots [B, H, T, n_g] and query scales."""
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_t = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = offs_t < tl.load(lens_ptr + b)
    row = J.tile_rows(pool_ptr, bt_ptr, b, stride_pool, stride_bt, offs_t, t_mask, PAGE, ROW_BYTES) + PART_OFF
    q_row = q_ptr + b * stride_qb + offs_h * stride_qh + Q_OFF
    for g in tl.static_range(W // G):
        dot, qs, qsum = group_dot(q_row, h_mask, row, t_mask, g, KIND, ASYM, G)
        dst = dot_ptr + b * stride_db + offs_h[:, None] * stride_dh + offs_t[None, :] * stride_dt + g
        tl.store(dst, dot, mask=h_mask[:, None] & t_mask[None, :])
        tl.store(qs_ptr + b * stride_sb + offs_h * stride_sh + g, qs, mask=h_mask)


def score_group_dots(
    q: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, codec, d_c: int,
    part: str = "c_kv", block_n: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's INT32 score path for one integer part ('c_kv' or 'k_pe') under the interpreter:
    (dots int32 [B, H, T, n_g] with T = max(seq_lens), zero past each sequence's end; q scales fp32
    [B, H, n_g]). dots[b, h, t, g] = Σ_{c in group g} q8[b, h, c] · code[t, c] with the dot-form codes of
    the kernel docstring (asymmetric INT8 codes shifted by −128). int32 index tensors, fp32 q."""
    longest = DecodeInputs(q, pool, block_table, seq_lens, codec, d_c).longest()
    c_part, r_part = K.codec_parts(codec, on_gpu=False)
    p, rc, q_off = (c_part, codec.ckv, 0) if part == "c_kv" else (r_part, codec.kpe, d_c)
    assert rc.spec.kind in ("int8", "int4"), f"the {part} part ({rc.spec.name}) has no integer score path"
    q = q.contiguous()
    bsz, heads = q.shape[:2]
    n_g = p.width // p.group
    dots = torch.zeros(bsz, heads, longest, n_g, dtype=torch.int32)
    qs = torch.zeros(bsz, heads, n_g, dtype=torch.float32)
    block_h = max(1, triton.next_power_of_2(min(heads, 16)))
    _scores_kernel[(bsz, triton.cdiv(heads, block_h), triton.cdiv(longest, block_n))](
        q, pool, block_table, seq_lens, dots, qs,
        q.stride(0), q.stride(1), pool.stride(0), block_table.stride(0),
        dots.stride(0), dots.stride(1), dots.stride(2), qs.stride(0), qs.stride(1),
        heads,
        PAGE=pool.shape[1], ROW_BYTES=codec.row_bytes, PART_OFF=p.offset, Q_OFF=q_off,
        KIND=p.kind, ASYM=p.asym, W=p.width, G=p.group, BLOCK_H=block_h, BLOCK_N=block_n,
    )
    return dots, qs


def _dot_codes(code_bytes: torch.Tensor, rc) -> torch.Tensor:
    """Codes as they enter the INT8 dot, from the byte layout in the kernel docstring: sym int8 as int8,
    asym int8 minus 128, int4 nibbles (low = even channel) minus 8 when symmetric."""
    if rc.spec.kind == "int8":
        return code_bytes.view(torch.int8).long() if rc.spec.symmetric else code_bytes.long() - 128
    nib = torch.stack([code_bytes & 15, code_bytes >> 4], dim=-1).flatten(-2).long()
    return nib - 8 if rc.spec.symmetric else nib


# Scoring paths under the interpreter: the shipped narrow blocks (every integer part FP16-scored), wide blocks
# (grouped parts FP16-scored, row-wise c_kv through INT8 dots, values in one or two programs), and every part
# through INT8 dots (no `dequant_scores`), each against the kernel reference.
_NO_DEQUANT = {"narrow": {"c_kv": ["fp16", "band"], "k_pe": {f: [] for f in K.CKV_FAMILIES}},
               "wide": {"c_kv": ["band"], "k_pe": {f: [] for f in K.CKV_FAMILIES}}}
SCORING = {
    "narrow": K.KernelConfig(block_n=64),
    "wide_split": K.KernelConfig(block_n=64, narrow_heads=2, block_h=8, d_split=2),
    "wide_unsplit": K.KernelConfig(block_n=64, narrow_heads=2, block_h=8, d_split=1),
    "int8_dots": K.KernelConfig(block_n=64, dequant_scores=_NO_DEQUANT),
}


def _sym_extremes(pool: torch.Tensor, rc, offset: int) -> tuple[bool, bool]:
    """(some code is the lowest level, −128 / −8; some FP16 scale is negative) in part `rc` of the pool's rows,
    read from the byte layout of the kernel docstring."""
    raw = pool.reshape(-1, pool.shape[-1])[:, offset : offset + rc.layout.row_bytes]
    codes = raw[:, : rc.layout.code_bytes]
    low = (codes == 0x80) if rc.spec.kind == "int8" else ((codes & 15) == 0) | ((codes >> 4) == 0)
    off = rc.layout.scale_offset
    scales = raw[:, off : off + 2 * rc.layout.n_groups].contiguous().view(torch.float16)
    return bool(low.any()), bool((scales < 0).any())


@pytest.mark.parametrize("config_name", list(SCORING))
@pytest.mark.parametrize("codec_name", ["int8-g32/int8-g16", "int4-g32/int4-g16", "int4-row/int8-row",
                                        "int8-g16-asym/int4-g16"])
def test_scoring_paths_with_extreme_codes(codec_name, config_name):
    """Codes on the lowest level (−128, −8) and negative scales (the symmetric codec puts a positive extreme
    on −(qmax+1)), NaN in every free slot, scattered blocks, tiles past the sequence end."""
    codec = LayerCodec.from_names(*codec_name.split("/"), D_C, D_R)
    pool, table, lens = build_cache(codec, (150, 37), seed=12)
    for rc, off in ((codec.ckv, 0), (codec.kpe, codec.layout.kpe_offset)):
        if rc.spec.symmetric:
            live = torch.cat([pool[table[b, : -(-n // PAGE)].long()] for b, n in enumerate(lens.tolist())])
            assert _sym_extremes(live, rc, off) == (True, True), rc.spec.name
    config = SCORING[config_name]
    heads = 12 if config_name.startswith("wide") else 4
    q = _query(2, heads, seed=12)
    out, lse = K.mla_decode(q, pool, table, lens, codec, D_C, SCALE, 64, config)
    ref_out, ref_lse = kernel_reference(q, pool, table, lens, codec, D_C, SCALE, config)
    _compare(out, lse, ref_out, ref_lse, max_rel=2e-3, min_cosine=0.9999, lse_atol=2e-5)


def _rising_rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """Rows whose scores against an all-ones query rise along the sequence (the running max grows on most
    tiles) with a random ripple, so the lazy rescale runs often, also across chunk boundaries."""
    x = _rows(n, gen) * 0.2
    return x + torch.linspace(0, 6, n)[:, None] * torch.sign(torch.randn(1, D_C + D_R, generator=gen)).clamp(min=0)


@pytest.mark.parametrize("codec_name", ["fp16/fp16", "int4-row/int8-row", "int8-g32/int4-g16"])
def test_lazy_rescale_when_the_max_keeps_rising(codec_name):
    codec = LayerCodec.from_names(*codec_name.split("/"), D_C, D_R)
    pool, table, lens = build_cache(codec, (300, 129), seed=13, rows=_rising_rows)
    q = torch.ones(2, 4, D_C + D_R) * 1.5
    q[:, 1] *= -1.0  # a head whose max is set on the first tile and never moves
    config = K.KernelConfig(block_n=16)
    out, lse = K.mla_decode(q, pool, table, lens, codec, D_C, 1.0, 192, config)
    ref_out, ref_lse = kernel_reference(q, pool, table, lens, codec, D_C, 1.0, config)
    assert (ref_lse.max() - ref_lse.min()) > 8  # scores spread over far more than 2^RESCALE_LOG2
    _compare(out, lse, ref_out, ref_lse, max_rel=2e-3, min_cosine=0.9999, lse_atol=1e-4)


def test_merge_in_channel_blocks_matches_one_block():
    gen = torch.Generator().manual_seed(14)
    parts = torch.randn(3, 5, 4, 256, generator=gen)
    lses = torch.randn(3, 5, 4, generator=gen) * 4
    lens = torch.tensor([700, 64, 0], dtype=torch.int32)
    whole = K.merge_launch(parts, lses, lens, 192, block_d=256)
    blocks = K.merge_launch(parts, lses, lens, 192, block_d=64)
    assert whole[0].grid == (3, 1, 1) and blocks[0].grid == (3, 1, 4)
    whole[0].run()
    blocks[0].run()
    assert torch.equal(whole[1], blocks[1]) and torch.equal(whole[2], blocks[2])
    ref_h, ref_lse = merge_gated_fp16_reference(parts[0, :, :4], lses[0, :, :4])  # 700 tokens: 4 chunks
    assert torch.allclose(blocks[1][0], ref_h, rtol=1e-6, atol=1e-6) and torch.allclose(blocks[2][0], ref_lse)


def test_per_target_settings():
    cfg = K.load_kernel_config()
    ampere = cfg.for_target("sm_80")
    assert (ampere.block_h, ampere.num_warps, ampere.d_split) != (cfg.block_h, cfg.num_warps, cfg.d_split)
    assert ampere.targets == {} and cfg.for_target("sm_90a") is cfg and cfg.for_target(None) is cfg
    assert K.TARGETS == {8: "sm_80", 9: "sm_90a"}
    with pytest.raises(ConfigError, match="targets"):
        K.load_kernel_config({"targets": {"sm_70": {}}})
    with pytest.raises(ConfigError, match="targets.sm_80 may override"):
        K.load_kernel_config({"targets": {"sm_80": {"version": 2}}})
    with pytest.raises(ConfigError, match="d_split"):
        K.load_kernel_config({"targets": {"sm_80": {"d_split": 4}}})
    with pytest.raises(ConfigError, match="dequant_scores"):
        K.load_kernel_config({"dequant_scores": {"narrow": ["row"], "wide": []}})
    codec = LayerCodec.from_names("int4-g64", "int8-row", 512, 64)
    assert K.scored_parts(codec, 128, cfg, on_gpu=True)[2:] == (True, False)  # grouped c_kv; its row k_pe: INT8
    assert K.scored_parts(codec, 16, cfg, on_gpu=True)[2:] == (True, True)
    assert K.scored_parts(codec, 128, ampere, on_gpu=True)[2:] == (True, True)


def test_shipped_chunk_boundary_end_to_end():
    codec = LayerCodec.from_names("int4-g32", "int8-g16", D_C, D_R)
    pool, table, lens = build_cache(codec, (2100, 70), seed=4)
    q = _query(2, 4, seed=4)
    parts, _, chunk = K.mla_decode_partials(q, pool, table, lens, codec, D_C, SCALE)
    assert chunk == 768 and parts.shape[2] == 3  # 2100 tokens cross the shipped 2048-token boundary
    out, lse = K.mla_decode(q, pool, table, lens, codec, D_C, SCALE)
    ref_out, ref_lse = kernel_reference(q, pool, table, lens, codec, D_C, SCALE, None)
    _compare(out, lse, ref_out, ref_lse, max_rel=2e-3, min_cosine=0.9999, lse_atol=2e-5)


def test_nan_slots_and_permuted_blocks_change_nothing():
    codec = LayerCodec.from_names("int4-g32", "int8-g16", D_C, D_R)
    lens = (150, 64, 33)
    dense = build_cache(codec, lens, seed=5, shuffle=False)
    scattered = build_cache(codec, lens, seed=5, shuffle=True)
    for i in range(len(lens)):  # same rows, different placement
        n = lens[i]
        t = torch.arange(n)
        rows = [c[0][c[1][i, t // PAGE].long(), t % PAGE] for c in (dense, scattered)]
        assert torch.equal(*rows)
    q = _query(len(lens), 4, seed=5)
    a = K.mla_decode(q, *dense, codec, D_C, SCALE, chunk_tokens=64)
    b = K.mla_decode(q, *scattered, codec, D_C, SCALE, chunk_tokens=64)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_empty_sequence_bf16_query_int64_indices():
    codec = LayerCodec.from_names("int8-g32", "fp16", D_C, D_R)
    pool, table, lens = build_cache(codec, (0, 90), seed=6)
    q = _query(2, 4, seed=6).bfloat16()
    out, lse = K.mla_decode(q, pool, table.long(), lens.long(), codec, D_C, SCALE, chunk_tokens=64)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
    ref_out, ref_lse = kernel_reference(q[1:].float(), pool, table[1:], lens[1:], codec, D_C, SCALE)
    _compare(out[1:], lse[1:], ref_out, ref_lse, max_rel=2e-3, min_cosine=0.9999, lse_atol=1e-4)


def _exact_partials(scores: torch.Tensor, values: torch.Tensor, chunk: int):
    """FP64 per-chunk normalized outputs [H, S, D] and LSEs [H, S] of scores [H, T] over values [T, D]."""
    outs, lses = [], []
    for s in range(0, scores.shape[1], chunk):
        sc = scores[:, s : s + chunk].double()
        lses.append(torch.logsumexp(sc, -1))
        outs.append(torch.softmax(sc, -1) @ values[s : s + chunk].double())
    return torch.stack(outs, 1), torch.stack(lses, 1)


def test_gated_merge_within_stated_bound():
    gen = torch.Generator().manual_seed(7)
    heads, t, chunk, dim = 8, 16 * 64, 64, 32
    values = torch.randn(t, dim, generator=gen) * torch.linspace(0.1, 10, dim)
    # Chunk-level offsets of ±12 make some gates tiny (FP16 subnormal) and some near 1.
    scores = torch.randn(heads, t // chunk, chunk, generator=gen) * 2
    scores = (scores + torch.randn(heads, t // chunk, 1, generator=gen) * 12).flatten(1)  # [H, T]
    parts, lses = _exact_partials(scores, values, chunk)
    exact = torch.softmax(scores.double(), -1) @ values.double()
    exact_lse = torch.logsumexp(scores.double(), -1)
    bound = merge_error_bound(t // chunk, values).double()

    h_torch, lse_torch = merge_gated_fp16_reference(parts.float(), lses.float())
    lens = torch.full((heads,), t, dtype=torch.int32)  # one "sequence" per head: [B=heads, H=1, S, D]
    h_tri, lse_tri = K.merge_gated_fp16(
        parts.float().unsqueeze(1), lses.float().unsqueeze(1), lens, chunk
    )
    for h, lse in ((h_torch, lse_torch), (h_tri[:, 0], lse_tri[:, 0])):
        err = (h.double() - exact).abs()
        assert (err <= bound).all(), (err / bound).max().item()
        assert torch.allclose(lse.double(), exact_lse, rtol=0, atol=1e-5)
    assert torch.allclose(h_tri[:, 0], h_torch, rtol=1e-6, atol=1e-6)
    # The bound is not vacuous: the FP16 gate's error is visible and within a factor ~100 of the bound.
    err = (h_torch.double() - exact).abs()
    assert err.max() > 1e-3 * bound.max()


def test_chunk_config_and_overrides():
    cfg = K.load_kernel_config()
    assert [cfg.chunk_for(n) for n in (1, 2047, 2048, 8191, 8192, 65536)] == [512, 512, 768, 768, 1024, 1024]
    with pytest.raises(ConfigError, match="typo"):
        K.load_kernel_config({"typo": 1})
    with pytest.raises(ConfigError, match="split_kv_chunks"):
        K.load_kernel_config({"split_kv_chunks": [[0, 100]]})
    codec = LayerCodec.from_names("fp16", "fp16", D_C, D_R)
    pool, table, lens = build_cache(codec, (10,), seed=8)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        K.mla_decode(_query(1, 1, 8), pool, table, lens, codec, D_C, SCALE, chunk_tokens=100)
    _, _, chunk = K.mla_decode_partials(_query(1, 1, 8), pool, table, lens, codec, D_C, SCALE)
    assert chunk == 512


def test_unsupported_codec_raises_backend_error():
    codec = LayerCodec.from_names("fp32", "fp16", D_C, D_R)
    pool, table, lens = build_cache(codec, (10,), seed=9)
    with pytest.raises(BackendError, match="fp32"):
        K.mla_decode(_query(1, 1, 9), pool, table, lens, codec, D_C, SCALE)


def test_ops_dispatcher_runs_this_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    codec = LayerCodec.from_names("int8-g32", "fp16", D_C, D_R)
    pool, table, lens = build_cache(codec, (100, 30), seed=10)
    q = _query(2, 4, seed=10)
    out, lse = ops_mla_decode(q, pool, table, lens, codec, D_C, SCALE, backend="triton")
    ref = K.mla_decode(q, pool, table, lens, codec, D_C, SCALE)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


def test_auto_sends_codecs_the_kernel_cannot_read_to_torch(monkeypatch):
    from mlaquant.attention import backends

    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", backends.AUTO_ORDER["cuda"])  # as on CUDA
    q = _query(1, 4, seed=11)
    for name, reads in (("fp32", False), ("int4-g32", True)):
        codec = LayerCodec.from_names(name, "fp16", D_C, D_R)
        assert (K.supports(codec, on_gpu=False) is None) == reads
        pool, table, lens = build_cache(codec, (40,), seed=11)
        out, lse = ops_mla_decode(q, pool, table, lens, codec, D_C, SCALE, backend="auto")
        inputs = DecodeInputs(q, pool, table, lens, codec, D_C)
        expect = K.mla_decode(q, pool, table, lens, codec, D_C, SCALE) if reads else mla_decode_reference(inputs, SCALE)
        assert torch.equal(out, expect[0]) and torch.equal(lse, expect[1])
    codec = LayerCodec.from_names("fp32", "fp16", D_C, D_R)
    pool, table, lens = build_cache(codec, (40,), seed=11)
    with pytest.raises(BackendError, match="fp32"):  # an explicit "triton" still refuses
        ops_mla_decode(q, pool, table, lens, codec, D_C, SCALE, backend="triton")


def test_bench_refuses_without_cuda(monkeypatch):
    import argparse

    from mlaquant.bench import kernels as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([])
    with pytest.raises(BackendError, match="TRITON_INTERPRET"):
        bench.run(args)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendError, match="CUDA"):
        bench.run(args)


def test_bench_pipeline_runs_every_path_on_cpu():
    """The benchmark's setup, accounting and report on tiny shapes, timed by a stand-in clock (1 ms per call,
    after really running the call once) — the real command refuses on CPU."""
    from mlaquant.bench import kernels as bench

    calls = []
    clock = bench._Clock(lambda fn: (calls.append(fn()), 1.0)[1], budget_s=600)
    dims = {"d_c": D_C, "d_r": D_R, "d_n": 16, "d_v": 16}
    peaks = (1.0, 100.0, 200.0)
    rows = bench.decode_rows(
        [2],
        [1, 2],
        [128],
        ["fp16/fp16", "int4-g32/fp16"],
        dims,
        torch.device("cpu"),
        clock,
        sdpa_max_gb=1.0,
        peaks=peaks,
    )
    rows += bench.gemm_rows([3], [(64, 32)], torch.device("cpu"), clock, peaks)
    assert [r["kind"] for r in rows].count("mla_decode") == 4 and not any("skipped" in r for r in rows)
    r = next(
        r for r in rows if r["kind"] == "mla_decode" and r["batch"] == 2 and r["codec"] == "int4-g32/fp16"
    )
    cache = 2 * 128 * LayerCodec.from_names("int4-g32", "fp16", D_C, D_R).row_bytes
    assert cache < r["gb_per_s"] * 1e6 < 1.2 * cache  # 1 ms per call: GB/s = bytes / 1e6
    assert r["tflops"] == pytest.approx(2 * 2 * 2 * 128 * (2 * D_C + D_R) / 1e9)
    assert r["speedup_vs_base"] == 1.0 and r["chunk_tokens"] == 512
    assert {r["kind"] for r in rows} >= {"sdpa_expanded", "int8_gemm", "bnb_int8", "fp16_matmul"}
    meta = {
        "device": "cpu",
        "spec_peaks": peaks,
        "torch": "t",
        "triton": "t",
        "copy_gb_per_s": None,
        "args": {},
    }
    text = bench.render_markdown(meta, rows)
    assert text.count("| int4-g32/fp16 |") == 2 and "| int8_gemm | 3 | 64 | 32 |" in text
    expired = bench._Clock(lambda fn: 1.0, budget_s=-1)
    rows = bench.decode_rows([2], [1], [64], ["fp16/fp16"], dims, torch.device("cpu"), expired, 1.0, None)
    assert all(r["skipped"] == "time budget" for r in rows)
