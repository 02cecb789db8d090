"""`LayerPages`: the plugin's rows and pages without vLLM — the rows it writes are the rows `DecodeSession` caches,
and decode on vLLM-shaped pages (16-token blocks, permuted block tables, garbage in every unused slot) is the same on
the CPU fast path and on the CUDA path's kernel (Triton, run by its CPU interpreter) as on the torch reference.
"""

from __future__ import annotations

import os

import pytest
import torch

from mlaquant.attention.reference import causal_attention
from mlaquant.integrations.vllm.pages import LayerPages, causal_sdpa, decode_rows, rope_order
from mlaquant.modeling.loader import load_model
from mlaquant.quant.codecs import LayerCodec
from mlaquant.runtime.plan import Plan
from tests.closeness import assert_close

# the Triton kernel runs by its CPU interpreter, which triton picks when it is first imported
os.environ["TRITON_INTERPRET"] = "1"
PLANS = os.path.join(os.path.dirname(__file__), "data", "plans")


def _pages_for(plan: Plan, layer: int, interleaved: bool) -> LayerPages:
    d_c, d_r = plan.latent_widths
    rotation = plan.rotations().get(layer)
    r_c = None if rotation is None else rotation[:d_c, :d_c]
    r_r = None if rotation is None else rotation[d_c:, d_c:]
    return LayerPages(plan.layer_codec(layer), d_c, r_c, r_r, rope_order(d_r, interleaved))


@pytest.mark.parametrize("plan_name", ["default", "3bit", "2bit"])
def test_rows_from_vllms_latent_are_the_rows_decode_session_caches(plan_name):
    """vLLM hands the layer the unrotated c_kv and k_pe in interleaved-RoPE order; the plugin's rows equal the
    rotated model's cache rows (`MLAAttention.latent` of `plan.apply(model)`) to FP32 rounding."""
    model = load_model()
    plan = Plan.load(os.path.join(PLANS, plan_name)).bind(model.cfg)
    rotated = plan.apply(model)
    ids = torch.tensor([[5, 81, 300, 12, 7, 2044, 19, 3]])
    cos, sin = model.rotary(torch.arange(ids.shape[1])[None], torch.float32)
    d_c = model.cfg.kv_lora_rank
    inverse = torch.argsort(rope_order(model.cfg.qk_rope_head_dim, True))
    for i in range(model.cfg.num_hidden_layers):
        x = model.layers[i].input_layernorm(model.embed_tokens(ids))
        plain = model.layers[i].self_attn.latent(x, cos, sin)[0]  # [T, d_c + d_r], mlaquant's order, unrotated
        c_kv, k_pe_vllm = plain[:, :d_c], plain[:, d_c:][:, inverse][:, None]  # as vLLM holds them
        want = rotated.layers[i].self_attn.latent(x, cos, sin)[0]
        got = _pages_for(plan, i, True).rows(c_kv, k_pe_vllm)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def _vllm_pages(pages: LayerPages, lens: list[int], block: int = 16, seed: int = 0):
    """vLLM-shaped pages holding `lens` sequences (rows random), block tables permuted, every other byte random."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per = [-(-n // block) for n in lens]
    total = sum(blocks_per) + 3
    cache = torch.randint(0, 256, (total, block, pages.codec.row_bytes), dtype=torch.uint8, generator=gen)
    order = torch.randperm(total, generator=gen).tolist()
    table = torch.zeros(len(lens), max(blocks_per), dtype=torch.int32)
    d_c, width = pages.d_c, pages.codec.width
    for b, n in enumerate(lens):
        mine = [order.pop() for _ in range(blocks_per[b])]
        table[b, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        slots = torch.tensor([mine[t // block] * block + t % block for t in range(n)])
        rows = torch.randn(n, width, generator=gen)
        slots = torch.cat((slots, torch.tensor([-1, -1])))  # vLLM's padding slots
        rows = torch.cat((rows, torch.full((2, width), float("nan"))))
        pages.write(cache, slots, rows[:, :d_c], rows[:, d_c:][:, None])
    return cache, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("codec_name", ["int4-row/int4-row", "int4-row/int8-row", "band-4x16-3x32-2x16-0x64/int4-row",
                                        "fp16/fp16"])
def test_decode_on_vllm_pages_agrees_across_backends(codec_name):
    """The same pages and query through the torch reference, the CPU fast path and the Triton kernel (interpreter):
    what the plugin runs on a CPU and on a GPU."""
    pytest.importorskip("triton", reason="needs triton (not installed)")
    from mlaquant.kernels import mla_decode as kernel

    if not kernel.interpreter_active():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set")
    codec = LayerCodec.from_names(*codec_name.split("/"), 128, 32)
    gen = torch.Generator().manual_seed(1)
    r_r = torch.linalg.qr(torch.randn(32, 32, generator=gen))[0]
    pages = LayerPages(codec, 128, None, r_r, rope_order(32, True))
    cache, table, lens = _vllm_pages(pages, [37, 5, 64])
    q_lat, q_pe = torch.randn(3, 4, 128, generator=gen), torch.randn(3, 4, 32, generator=gen)
    ref_out, ref_lse = pages.decode(q_lat, q_pe, cache, table, lens, 0.1, "torch")
    assert torch.isfinite(ref_out).all()
    for backend in ("cpu", "triton"):
        out, lse = pages.decode(q_lat, q_pe, cache, table, lens, 0.1, backend)
        # both quantize the query to INT8 for integer parts: the bounds of tests/test_kernel_mla_decode.py against
        # the FP32-query reference
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert_close(out, ref_out, max_rel=3e-2, min_cosine=0.9995, what=f"{backend} out")
        assert_close(lse, ref_lse, max_abs=0.1, what=f"{backend} lse")


def test_read_returns_what_was_written_in_token_order():
    codec = LayerCodec.from_names("fp32", "fp32", 128, 32)
    pages = LayerPages(codec, 128)
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(21, 160, generator=gen)
    cache = torch.zeros(4, 16, codec.row_bytes, dtype=torch.uint8)
    table = torch.tensor([3, 1], dtype=torch.int32)
    slots = torch.tensor([int(table[t // 16]) * 16 + t % 16 for t in range(21)])
    pages.write(cache, slots, rows[:, :128], rows[:, 128:])
    torch.testing.assert_close(pages.read(cache, table, 21), rows)


@pytest.mark.parametrize("new", [40, 13])
def test_prefill_attention_is_causal_softmax_over_the_rows(new):
    """causal_sdpa (the plugin's prefill: the last `new` of 40 positions over all 40 keys, V narrower than K as in
    MLA) against mlaquant's FP32 reference (`causal_attention`, DecodeSession's prefill); it runs only in torch's
    fused kernels (an input they refuse raises instead of falling back to the math path, whose [H, T, L] scores do
    not fit at 16k tokens)."""
    gen = torch.Generator().manual_seed(0)
    L, H, D, E = 40, 3, 24, 16
    q, k, v = (torch.randn(n, H, d, generator=gen) for n, d in ((new, D), (L, D), (L, E)))
    want = causal_attention(q[None], k[None], v[None], 0.2)[0]
    assert_close(causal_sdpa(q, k, v, 0.2), want, max_abs=1e-5, what="prefill attention")
    with pytest.raises(RuntimeError, match="No available kernel"):  # torch's message when only fused ones may run
        causal_sdpa(q, k[:, :2], v[:, :2], 0.2)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_several_query_tokens_per_request_decode_on_the_codes_with_a_causal_limit(backend):
    """Speculative decoding's verify step: requests of 4, 1 and 3 query tokens (vLLM's query_start_loc) become one
    decode row per token (`decode_rows`), token j of a request seeing its rows up to its own position — the same
    out / lse as decoding each token alone over that request's first rows (the block table row repeated)."""
    codec = LayerCodec.from_names("int4-row", "int8-row", 128, 32)
    pages = LayerPages(codec, 128, None, None, rope_order(32, True))
    cache, table, lens = _vllm_pages(pages, [37, 5, 64], seed=3)
    starts = torch.tensor([0, 4, 5, 8], dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)
    q_lat, q_pe = torch.randn(8, 4, 128, generator=gen), torch.randn(8, 4, 32, generator=gen)
    rows_table, rows_lens = decode_rows(table, lens, starts, 8)
    assert rows_lens.tolist() == [34, 35, 36, 37, 5, 62, 63, 64] and rows_table.dtype == table.dtype
    out, lse = pages.decode(q_lat, q_pe, cache, rows_table, rows_lens, 0.1, backend)
    for token, (request, length) in enumerate(zip([0, 0, 0, 0, 1, 2, 2, 2], rows_lens.tolist())):
        alone = pages.decode(q_lat[token : token + 1], q_pe[token : token + 1], cache, table[request : request + 1],
                             torch.tensor([length], dtype=torch.int32), 0.1, backend)
        torch.testing.assert_close(out[token], alone[0][0])
        torch.testing.assert_close(lse[token], alone[1][0])
    assert decode_rows(table, lens, starts[:4], 3) == (table, lens)  # one token each: unchanged
    with pytest.raises(ValueError, match="covers 8 tokens, the query has 7"):
        decode_rows(table, lens, starts, 7)
