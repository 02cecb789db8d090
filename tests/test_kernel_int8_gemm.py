"""Triton W8A8 GEMM (run by the Triton CPU interpreter) against its torch reference, against bitsandbytes'
LLM.int8() ops on the same inputs (with and without outlier columns), and against an FP32 matmul within the
bound its docstring states."""

from __future__ import annotations

import os

import pytest
import torch

from tests.closeness import closeness
from tests.reference import int8_gemm_error_bound, int8_gemm_reference

# triton.jit picks the CPU interpreter at decoration time, also for triton's own library functions, so the
# variable must be set before triton is first imported; it stays set (tests that need it unset monkeypatch).
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="needs triton (not installed)")
import mlaquant.kernels.int8_gemm as G  # noqa: E402

if not G.interpreter_active():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)

SHAPES = [(1, 96, 64), (5, 200, 80), (33, 64, 130)]  # (M, K, N): K and N off the tile grid


def _data(m: int, k: int, n: int, seed: int, outliers: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp(torch.randn(k, generator=gen) * 0.3)
    if outliers:  # a few feature columns with LLM.int8()-style magnitudes, only in some rows
        cols = torch.randperm(k, generator=gen)[:3]
        x[::2, cols] = 8.0 + 4.0 * torch.rand(x[::2, cols].shape, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    return x.half(), w.half()


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_torch_reference(shape, out_dtype):
    x, w = _data(*shape, seed=shape[0])
    w8, ws = G.quantize_weight_per_channel(w)
    for xin in (x, x.float(), x.bfloat16()):
        y = G.int8_gemm(xin, w8, ws, out_dtype=out_dtype)
        ref = int8_gemm_reference(xin, w8, ws, out_dtype=out_dtype)
        assert y.dtype == out_dtype and y.shape == (shape[0], shape[2])
        # Same INT32 sums, same FP32 epilogue: equal up to FP32 rounding before the final cast.
        tol = (
            2.0**-22 * ref.float().abs()
            + (2.0**-11 if out_dtype != torch.float32 else 0.0) * ref.float().abs()
        )
        assert ((y.float() - ref.float()).abs() <= tol + 1e-30).all()
    x8, sx, _ = G.quantize_rows(x.float())
    x8_ref, sx_ref, _ = G.quantize_activation(x.float())
    assert torch.equal(x8, x8_ref) and torch.equal(sx, sx_ref)


def test_leading_dims_and_zero_row():
    x, w = _data(6, 64, 48, seed=1)
    x[2] = 0.0
    w8, ws = G.quantize_weight_per_channel(w)
    y = G.int8_gemm(x.view(2, 3, 64), w8, ws, out_dtype=torch.float32)
    assert y.shape == (2, 3, 48)
    assert (y.view(6, 48)[2] == 0).all()
    assert torch.equal(y.view(6, 48), int8_gemm_reference(x, w8, ws, out_dtype=torch.float32))


def _bnb():
    return pytest.importorskip("bitsandbytes.functional")


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_bitsandbytes(shape):
    F = _bnb()
    x, w = _data(*shape, seed=10 + shape[0])
    ca, sca, _ = F.int8_vectorwise_quant(x.clone())
    cb, scb, _ = F.int8_vectorwise_quant(w.clone())
    ref = F.int8_mm_dequant(F.int8_linear_matmul(ca, cb), sca, scb)  # fp16
    w8, ws = G.quantize_weight_per_channel(w)
    assert torch.equal(w8, cb) and torch.allclose(ws * 127.0, scb, rtol=2**-23, atol=0)
    x8, sx, _ = G.quantize_rows(x)
    assert torch.equal(x8, ca)
    y = G.int8_gemm(x, w8, ws, out_dtype=torch.float16)
    # Same codes and INT32 sums; the FP32 scale products round differently: at most one FP16 ulp apart.
    ulp = torch.finfo(torch.float16).eps * ref.float().abs().clamp_min(2.0**-14)
    assert ((y.float() - ref.float()).abs() <= ulp).all()


def test_outlier_columns_match_bitsandbytes():
    F = _bnb()
    x, w = _data(9, 128, 96, seed=20, outliers=True)
    ca, sca, cols = F.int8_vectorwise_quant(x.clone(), threshold=6.0)
    assert cols.numel() == 3
    cb, scb, _ = F.int8_vectorwise_quant(w.clone())
    out = F.int8_mm_dequant(F.int8_linear_matmul(ca, cb), sca, scb)
    sub_w = F.int8_vectorwise_dequant(cb[:, cols].contiguous(), scb).half().t()
    ref = out.addmm(x[:, cols], sub_w)  # what bitsandbytes' int8_mixed_scaled_mm does

    w8, ws = G.quantize_weight_per_channel(w)
    x8, _, mask = G.quantize_rows(x, outlier_threshold=6.0)
    assert torch.equal(x8, ca) and torch.equal(mask.nonzero().flatten(), cols)
    y = G.int8_gemm(x, w8, ws, out_dtype=torch.float16, outlier_threshold=6.0)
    # bitsandbytes rounds the INT8 part to FP16, then adds the FP16 outlier product; we add in FP32 and round
    # once. Each rounding is at most one FP16 ulp of the value rounded (outlier terms are large and cancel).
    terms = out.float().abs() + x[:, cols].float().abs() @ sub_w.float().abs() + ref.float().abs()
    assert ((y.float() - ref.float()).abs() <= torch.finfo(torch.float16).eps * terms).all()
    # Without the outlier path the outliers inflate their rows' scales (measured: 1.4% relative error, 0.88%
    # with the outlier columns, 0.71% when they use the original weights).
    exact = x.float() @ w.float().T
    errors = [
        (G.int8_gemm(x, w8, ws, torch.float32, **kw) - exact).norm() / exact.norm()
        for kw in ({}, {"outlier_threshold": 6.0}, {"outlier_threshold": 6.0, "w_fp": w})
    ]
    assert errors[1] < 0.75 * errors[0] and errors[2] < 0.9 * errors[1], errors
    y_fp = G.int8_gemm(x, w8, ws, out_dtype=torch.float32, outlier_threshold=6.0, w_fp=w)
    assert torch.allclose(y_fp, int8_gemm_reference(x, w8, ws, torch.float32, 6.0, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_against_fp32_matmul_within_stated_bound(out_dtype):
    x, w = _data(17, 256, 72, seed=30)
    x, w = x.float(), w.float()
    w8, ws = G.quantize_weight_per_channel(w)
    y = G.int8_gemm(x, w8, ws, out_dtype=out_dtype)
    exact = x.double() @ w.double().T
    err = (y.double() - exact).abs()
    bound = int8_gemm_error_bound(x, w, w8, ws, y).double()
    assert (err <= bound).all(), (err / bound).max().item()
    # The worst case is loose (measured max error ≈ 0.12 of it); typical quality as SQNR.
    sqnr = closeness(y, exact).sqnr_db
    assert sqnr > 36.0, sqnr  # measured 39.2 dB for all three output types


def test_bad_arguments():
    x, w = _data(2, 64, 32, seed=40)
    w8, ws = G.quantize_weight_per_channel(w)
    with pytest.raises(ValueError, match="w_scale"):
        G.int8_gemm(x, w8, ws.half())
    with pytest.raises(ValueError, match="out_dtype"):
        G.int8_gemm(x, w8, ws, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="w_int8"):
        G.int8_gemm(x[:, :32], w8, ws)
