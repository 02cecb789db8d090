"""W8A8 absorbed projections (`int8_matmul`): exact INT8 arithmetic, decode = teacher forcing, plan plumbing."""

from __future__ import annotations

import pytest
import torch

from mlaquant import DecodeSession
from mlaquant.evaluation.eval import Evaluator, fake_quant_hook
from mlaquant.modeling.int8_proj import Int8Projections, grouped_int8_matmul, quantize_grouped, with_int8_projections
from mlaquant.runtime.plan import Plan
from tests.reference import int8_gemm_error_bound, int8_gemm_reference


def _weights(g: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(g, n, k, generator=torch.Generator().manual_seed(seed))


def test_grouped_matmul_is_int8_gemm_per_group():
    w = _weights(3, 24, 40)
    x = torch.randn(2, 5, 3, 40, generator=torch.Generator().manual_seed(1)) * 3
    w8, ws = quantize_grouped(w)
    y = grouped_int8_matmul(x, w8, ws, backend="torch")
    assert y.shape == (2, 5, 3, 24) and y.dtype == torch.float32
    for g in range(3):
        ref = int8_gemm_reference(x[:, :, g], w8[g], ws[g], out_dtype=torch.float32)
        torch.testing.assert_close(y[:, :, g], ref, rtol=1e-6, atol=1e-6)
        # the FP32 product of the unquantized operands lies within int8_gemm's stated bound
        bound = int8_gemm_error_bound(x[:, :, g].reshape(-1, 40), w[g], w8[g], ws[g], ref.reshape(-1, 24))
        exact = x[:, :, g].reshape(-1, 40) @ w[g].T
        assert ((ref.reshape(-1, 24) - exact).abs() <= bound).all()
        assert (ref.reshape(-1, 24) - exact).abs().max() > 1e-4  # it really is quantized


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_triton_grouped_matmul_is_one_int8_gemm_per_group(out_dtype):
    from mlaquant.kernels.int8_gemm import int8_gemm

    w8, ws = quantize_grouped(_weights(3, 40, 48, seed=2))
    x = (torch.randn(2, 5, 3, 48, generator=torch.Generator().manual_seed(3)) * 2).to(out_dtype)
    y = grouped_int8_matmul(x, w8, ws, backend="triton")  # one launch, heads on the grid's third axis
    assert y.shape == (2, 5, 3, 40) and y.dtype == out_dtype
    for g in range(3):
        assert torch.equal(y[:, :, g], int8_gemm(x[:, :, g], w8[g], ws[g], out_dtype))
    torch.testing.assert_close(y, grouped_int8_matmul(x, w8, ws, backend="torch"), rtol=1e-6, atol=1e-6)


def test_projections_track_the_fp32_ones(tiny_model):
    attn = tiny_model.layers[1].self_attn
    cfg = tiny_model.cfg
    int8 = Int8Projections.of(attn, backend="torch")
    x = torch.randn(2, 6, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(6)[None]
    cos, sin = tiny_model.rotary(pos, torch.float32)
    q_fp = attn.absorbed_query(x, cos, sin)
    attn.int8 = int8
    try:
        q8 = attn.absorbed_query(x, cos, sin)
        o_lat = torch.randn(2, 6, cfg.num_attention_heads, cfg.kv_lora_rank, generator=torch.Generator().manual_seed(5))
        out8 = attn.output_from_latent(o_lat)
    finally:
        attn.int8 = None
    out_fp = attn.output_from_latent(o_lat)
    for a, b in ((q8, q_fp), (out8, out_fp)):
        rel = (a - b).norm() / b.norm()
        assert 1e-4 < rel < 0.02


@pytest.mark.parametrize("plan", ["fp32+i8mm", "int4+i8mm", "int8-row/int4+w5+i8mm"])
def test_teacher_forced_equals_step_decode_with_int8_matmul(tiny_model, plan):
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(6))
    session = DecodeSession(tiny_model, plan=plan, backend="torch")
    assert all(lp.int8_matmul for lp in session.plan.layers) and session.plan.name.endswith("+i8mm")
    codecs, window = session.codecs, session.plan.window
    teacher = session.model(ids, fake_quant_hook(codecs, window), window=window)[0]
    without = DecodeSession(tiny_model, plan=plan.replace("+i8mm", ""), backend="torch")
    assert (teacher - without.model(ids, fake_quant_hook(codecs, window), window=window)[0]).abs().max() > 1e-4
    steps = [session.prefill(ids[:, :1])[0, 0]]
    steps += [session.decode(ids[:, t])[0] for t in range(1, ids.shape[1])]
    tol = 1e-3 if window else 1e-5
    assert (torch.stack(steps) - teacher).abs().max() < tol
    chunked = DecodeSession(tiny_model, plan=plan, backend="torch", runtime={"prefill_chunks": [[0, 7]]})
    assert (chunked.prefill(ids)[0] - teacher).abs().max() < tol


def test_plan_round_trip_and_evaluator_sees_int8(tiny_model, tmp_path):
    n = tiny_model.cfg.num_hidden_layers
    plan = Plan.uniform("int8", n)
    plan.layers[1].int8_matmul = True
    assert plan.name == "calibrated"
    plan.save(tmp_path / "p")
    loaded = Plan.load(tmp_path / "p").bind(tiny_model.cfg)
    assert [lp.int8_matmul for lp in loaded.layers] == [False, True, False]
    samples = torch.randint(0, tiny_model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    ev = Evaluator(tiny_model, samples)
    codecs = loaded.layer_codecs()
    assert ev.evaluate(codecs, model=loaded.apply(tiny_model)).loss != ev.evaluate(codecs).loss
    # resuming at layer 1 from the reference inputs gives the whole-model result
    only1 = with_int8_projections(tiny_model, [1])
    full = ev.evaluate([None] * n, model=only1, loss_only=True).loss
    assert ev.evaluate([None] * n, first_layer=1, model=only1, loss_only=True).loss == pytest.approx(full, rel=1e-9)


def test_unknown_plan_suffix_is_an_error(tiny_model):
    with pytest.raises(Exception, match=r"unknown plan suffix '\+i4mm'"):
        DecodeSession(tiny_model, plan="int4+i4mm")


@pytest.mark.parametrize("route", ["c-kernels", "int_mm", "fp64"])
@pytest.mark.parametrize("shape", [(1, 16, 128, 512), (16, 1, 2048, 2048), (3, 4, 48, 12), (5, 2, 160, 7)])
def test_cpu_int8_matmul_every_route_bit_identical_to_fp64_sums(route, shape, monkeypatch):
    """backend "cpu" takes the C kernels where a vector ISA builds, torch._int_mm only where it has VNNI, the FP64
    sums otherwise (issue 29: _int_mm ~10x slower than FP32 on AVX2-only CPUs): every route gives the same bits."""
    from mlaquant.attention import backends, native

    m, g, k, n = shape
    gen = torch.Generator().manual_seed(k + n)
    x = torch.randn(m, g, k, generator=gen) * torch.logspace(-2, 1, k)
    w8, ws = quantize_grouped(torch.randn(g, n, k, generator=gen))
    want = grouped_int8_matmul(x, w8, ws, backend="torch")
    calls = []
    if route == "c-kernels":
        if native.chosen_isa() not in native.VECTOR_ISAS:
            pytest.skip(f"needs a vector ISA variant of the C kernels (an x86 CPU with AVX2); "
                        f"here: {native.describe()}")
        monkeypatch.setattr(torch, "_int_mm", lambda *a, **kw: calls.append("int_mm"))
    else:
        monkeypatch.setattr(native, "vector_kernels", lambda: None)
        monkeypatch.setattr(backends, "torch_int8_vnni", lambda: route == "int_mm")
    if route == "fp64":
        monkeypatch.setattr(torch, "_int_mm", lambda *a, **kw: calls.append("int_mm"))
    assert torch.equal(grouped_int8_matmul(x, w8, ws, backend="cpu"), want)
    assert not calls  # the route asked for ran, not torch._int_mm
