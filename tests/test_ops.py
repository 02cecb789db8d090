"""The decode-attention op: torch reference against dense FP32 attention written here, paged-cache
corner cases (ragged batch, permuted blocks, NaN in every slot that must not be read), dispatch."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mlaquant.attention.backends import Backend, resolve_backend
from mlaquant.attention.buffers import Buffers
from mlaquant.attention.decode_inputs import DecodeInputs
from mlaquant.attention.ops import mla_decode
from mlaquant.attention.reference import mla_decode_reference
from mlaquant.errors import BackendError
from mlaquant.quant.codecs import LayerCodec

D_C, D_R, H, BLOCK = 64, 16, 4, 16
SCALE = 0.17
CODECS = [
    ("fp32", "fp32"),
    ("fp16", "fp16"),
    ("int8-g32", "fp16"),
    ("int4-g32", "int8-row"),
    ("int4-g16-asym", "int4-row-asym"),
]


def _problem(seq_lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(n, D_C + D_R, generator=g) for n in seq_lens]
    q = torch.randn(len(seq_lens), H, D_C + D_R, generator=g)
    return q, rows


def _paged(rows: list[torch.Tensor], codec: LayerCodec, shuffle: bool, max_blocks: int, seed: int = 0):
    """Pool + block table holding `rows`. shuffle=False: blocks in order, free bytes zero.
    shuffle=True: blocks scattered among NaN-filled spare blocks (0xFF bytes decode to NaN in every
    codec), free slots NaN, unused table entries pointing at NaN blocks or out of range."""
    need = [-(-len(r) // BLOCK) for r in rows]
    n_blocks = sum(need) + (5 if shuffle else 0)
    fill = 0xFF if shuffle else 0
    pool = torch.full((n_blocks, BLOCK, codec.row_bytes), fill, dtype=torch.uint8)
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)) if shuffle else None
    ids = order.tolist() if shuffle else list(range(n_blocks))
    spare = ids[sum(need) :]
    table = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
    for b, r in enumerate(rows):
        mine, ids = ids[: need[b]], ids[need[b] :]
        for t in range(len(r)):
            pool[mine[t // BLOCK], t % BLOCK] = codec.encode(r[t : t + 1])[0]
        table[b, : need[b]] = torch.tensor(mine, dtype=torch.int32)
        if shuffle:
            table[b, need[b] :] = spare[0] if b % 2 else -1
    if shuffle:
        assert torch.isnan(codec.decode(pool[spare[0]])).all()
    return pool, table


def _dense_attention(q: torch.Tensor, kv: torch.Tensor):
    """Plain FP32 attention of q [H, D] over rows kv [T, D]; V = kv[:, :D_C]."""
    scores = (q.double() @ kv.double().T) * SCALE  # [H, T], float64 as the independent reference
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ kv.double()[:, :D_C]
    return out.float(), lse.float(), scores


@pytest.mark.parametrize("ckv,kpe", CODECS)
def test_reference_matches_dense_attention_on_ragged_batch(ckv, kpe):
    lens = [1, 37, 70]
    codec = LayerCodec.from_names(ckv, kpe, D_C, D_R)
    q, rows = _problem(lens)
    pool, table = _paged(rows, codec, shuffle=True, max_blocks=6)
    out, lse = mla_decode(q, pool, table, torch.tensor(lens, dtype=torch.int32), codec, D_C, SCALE, "torch")
    assert out.shape == (3, H, D_C) and lse.shape == (3, H)
    assert out.dtype == lse.dtype == torch.float32
    for b, r in enumerate(rows):
        ref_out, ref_lse, scores = _dense_attention(q[b], codec.fake_quant(r))
        torch.testing.assert_close(out[b], ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[b], ref_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[b].double(), torch.logsumexp(scores, dim=-1), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("ckv,kpe", CODECS)
def test_nan_slots_and_permuted_blocks_change_nothing(ckv, kpe):
    lens = [33, 5, 48]
    codec = LayerCodec.from_names(ckv, kpe, D_C, D_R)
    q, rows = _problem(lens, seed=1)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plain = mla_decode_reference(DecodeInputs(q, *_paged(rows, codec, False, 4), seq_lens, codec, D_C), SCALE)
    for seed in (0, 1):
        shuffled_inputs = DecodeInputs(q, *_paged(rows, codec, True, 4, seed), seq_lens, codec, D_C)
        shuffled = mla_decode_reference(shuffled_inputs, SCALE)
        assert torch.isfinite(shuffled[0]).all()
        assert torch.equal(plain[0], shuffled[0]) and torch.equal(plain[1], shuffled[1])


def test_single_token_returns_its_latent():
    codec = LayerCodec.from_names("fp32", "fp32", D_C, D_R)
    q, rows = _problem([1])
    pool, table = _paged(rows, codec, shuffle=True, max_blocks=2)
    out, lse = mla_decode(q, pool, table, torch.tensor([1], dtype=torch.int32), codec, D_C, SCALE, "torch")
    assert torch.equal(out[0], rows[0][0, :D_C].expand(H, D_C))
    torch.testing.assert_close(lse[0], SCALE * (q[0] @ rows[0][0]), rtol=1e-6, atol=1e-6)


def test_empty_sequence_gives_zero_output_and_minus_inf_lse():
    codec = LayerCodec.from_names("int8-g32", "fp16", D_C, D_R)
    q, rows = _problem([5, 1])
    pool, table = _paged(rows, codec, shuffle=True, max_blocks=1)
    full = mla_decode(q, pool, table, torch.tensor([5, 1], dtype=torch.int32), codec, D_C, SCALE, "torch")
    out, lse = mla_decode(q, pool, table, torch.tensor([5, 0], dtype=torch.int32), codec, D_C, SCALE, "torch")
    assert torch.equal(out[0], full[0][0]) and torch.equal(lse[0], full[1][0])
    assert torch.equal(out[1], torch.zeros(H, D_C)) and torch.isneginf(lse[1]).all()


def test_bad_arguments_are_named():
    codec = LayerCodec.from_names("int8-g32", "fp16", D_C, D_R)
    q, rows = _problem([20])
    pool, table = _paged(rows, codec, shuffle=False, max_blocks=2)
    lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(ValueError, match="d_c=32"):
        mla_decode(q, pool, table, lens, codec, 32, SCALE, "torch")
    with pytest.raises(ValueError, match="pool must be uint8"):
        mla_decode(q, pool[..., :-1], table, lens, codec, D_C, SCALE, "torch")
    with pytest.raises(ValueError, match="seq_lens must lie in"):
        mla_decode(q, pool, table, torch.tensor([33], dtype=torch.int32), codec, D_C, SCALE, "torch")
    with pytest.raises(ValueError, match="seq_lens must lie in"):
        mla_decode(q, pool, table, torch.tensor([-1], dtype=torch.int32), codec, D_C, SCALE, "torch")
    with pytest.raises(ValueError, match="outside"):
        mla_decode(q, pool, table + 7, lens, codec, D_C, SCALE, "torch")


# --- dispatch --------------------------------------------------------------------------------------


def test_resolve_backend_choices(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlaquant.kernels.mla_decode", None)  # kernel not importable
    assert resolve_backend("auto", "cpu") == "cpu"
    assert resolve_backend(Backend.AUTO, "cuda") == "torch"
    assert resolve_backend("torch", "cuda") == "torch"
    with pytest.raises(BackendError, match="unknown backend 'cuda'"):
        resolve_backend("cuda", "cpu")


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", "cpu")
    codec = LayerCodec.from_names("fp16", "fp16", D_C, D_R)
    q, rows = _problem([3])
    pool, table = _paged(rows, codec, shuffle=False, max_blocks=1)
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        mla_decode(q, pool, table, torch.tensor([3], dtype=torch.int32), codec, D_C, SCALE, "triton")


def test_triton_without_kernel_module_is_a_backend_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "mlaquant.kernels.mla_decode", None)
    with pytest.raises(BackendError, match="cannot import mlaquant.kernels.mla_decode"):
        resolve_backend("triton", "cpu")
    monkeypatch.setitem(sys.modules, "mlaquant.kernels.mla_decode", types.ModuleType("mla_decode"))
    with pytest.raises(BackendError, match="no function mla_decode"):
        resolve_backend("triton", "cpu")


def test_triton_backend_dispatches_to_the_kernel(monkeypatch):
    calls = []

    def fake_kernel(*args):
        calls.append(args)
        return "out", "lse"

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fake_module = types.SimpleNamespace(mla_decode=fake_kernel, supports=lambda codec, on_gpu: None)
    monkeypatch.setitem(sys.modules, "mlaquant.kernels.mla_decode", fake_module)
    assert resolve_backend("auto", "cpu") == "cpu"  # the interpreter is never chosen automatically
    assert resolve_backend("auto", "cuda") == "triton"
    codec = LayerCodec.from_names("fp16", "fp16", D_C, D_R)
    q, rows = _problem([3])
    pool, table = _paged(rows, codec, shuffle=False, max_blocks=1)
    lens = torch.tensor([3], dtype=torch.int32)
    assert mla_decode(q, pool, table, lens, codec, D_C, SCALE, "triton") == ("out", "lse")
    assert calls[0][4] is codec and calls[0][5:] == (D_C, SCALE)
    assert mla_decode(q, pool, table, lens, codec, D_C, SCALE, "auto")[0].shape == (1, H, D_C)  # CPU → torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)")
def test_reference_on_cuda_equals_cpu():
    codec = LayerCodec.from_names("int4-g32", "int8-row", D_C, D_R)
    q, rows = _problem([1, 37, 70])
    pool, table = _paged(rows, codec, shuffle=True, max_blocks=6)
    lens = torch.tensor([1, 37, 70], dtype=torch.int32)
    cpu = mla_decode(q, pool, table, lens, codec, D_C, SCALE, "torch")
    gpu = mla_decode(q.cuda(), pool.cuda(), table.cuda(), lens.cuda(), codec, D_C, SCALE, "torch")
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gpu[1].cpu(), cpu[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ckv,kpe", [("fp16", "fp16"), ("int4-g32", "int8-row")])
def test_single_sequence_read_in_place_equals_scattered_copy(ckv, kpe):
    """One sequence whose pages are consecutive is read as a view of the pool; the same rows on
    scattered pages go through the copying gather. Both must agree, NaN free slots unread."""
    codec = LayerCodec.from_names(ckv, kpe, D_C, D_R)
    q, rows = _problem([70], seed=2)
    seq_lens = torch.tensor([70], dtype=torch.int32)
    pages = -(-70 // BLOCK)
    pool, table = _paged(rows, codec, shuffle=False, max_blocks=pages)
    pool[pages - 1, 70 - (pages - 1) * BLOCK :] = 0xFF  # the free slots of the last page decode to NaN
    pool, table = torch.cat((torch.full_like(pool[:1], 0xFF), pool)), table + 1  # pages 1..n, not 0..n-1
    in_place = mla_decode_reference(DecodeInputs(q, pool, table, seq_lens, codec, D_C), SCALE)
    scattered_inputs = DecodeInputs(q, *_paged(rows, codec, True, pages, seed=3), seq_lens, codec, D_C)
    scattered = mla_decode_reference(scattered_inputs, SCALE)
    assert torch.isfinite(in_place[0]).all()
    assert torch.equal(in_place[0], scattered[0]) and torch.equal(in_place[1], scattered[1])
    ref_out, ref_lse, _ = _dense_attention(q[0], codec.fake_quant(rows[0]))
    torch.testing.assert_close(in_place[0][0], ref_out, rtol=1e-5, atol=1e-5)


def test_scratch_reused_across_calls_of_other_shapes():
    """A session's Buffers outlive each call: a buffer grown by a long call and then read back in
    part by a shorter or wider one (NaN tails of the last call still in it) must give the results of
    a fresh scratch."""
    codec = LayerCodec.from_names("int4-g32", "int8-row", D_C, D_R)
    scratch = Buffers()
    for lens in ([70], [5, 48], [33], [1, 37, 70]):
        q, rows = _problem(lens, seed=len(lens) + lens[0])
        pool, table = _paged(rows, codec, shuffle=True, max_blocks=5)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        reused = mla_decode_reference(DecodeInputs(q, pool, table, seq_lens, codec, D_C), SCALE, scratch)
        fresh = mla_decode_reference(DecodeInputs(q, pool, table, seq_lens, codec, D_C), SCALE)
        assert torch.equal(reused[0], fresh[0]) and torch.equal(reused[1], fresh[1])


def test_scratch_grows_geometrically_not_a_row_per_step(monkeypatch):
    """Decode asks for one more row every step: the buffer must not be reallocated each time (at 16k
    tokens each reallocation is a fresh 32 MiB mapping, page-faulted in)."""
    allocations = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocations.append(a) or empty(*a, **k))
    scratch = Buffers()
    for rows in range(100, 126):  # 100 rows, then one more per step up to 100 grown by a quarter
        buf = scratch.take("rows", (rows, 8), device=torch.device("cpu"))
        assert buf.shape == (rows, 8) and buf.is_contiguous()
    assert len(allocations) == 2  # the first take, and one growth by a quarter
