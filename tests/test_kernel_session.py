"""The Triton decode kernel inside a real session: same greedy tokens as the torch reference (and the CPU fast path
for the 3-bit tier)."""

from __future__ import annotations

import os

import pytest
import torch

from mlaquant import DecodeSession, load_model
from mlaquant.attention import native
from mlaquant.attention.cpu_decode import pv_kind
from mlaquant.runtime.plan import LayerPlan, Plan
from mlaquant.runtime.session import generate

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 on CPU", allow_module_level=True)


@pytest.mark.parametrize("plan", ["fp16", "int8", "int4"])
def test_triton_backend_matches_torch_greedy_tokens(plan):
    model = load_model()
    prompt = model.tokenizer.encode("def fibonacci(n):\n    ").ids
    torch_tokens = generate(model, prompt, 8, plan=plan, backend="torch")[0]
    triton_tokens = generate(model, prompt, 8, plan=plan, backend="triton")[0]
    assert triton_tokens == torch_tokens


# the layouts configs/calibrate-3bit.yaml calibrates on the bundled model (README, "Below 4 bits"): c_kv bands, k_pe
THREE_BIT_LAYERS = [("band-4x16-3x32-2x16-0x64", "int4-row"), ("band-4x32-2x32-0x64", "int4-row"),
                    ("band-8x16-4x16-2x32-0x64", "int8-row"), ("band-8x16-4x16-2x32-0x64", "int4-row")]


def test_the_3bit_tier_gives_the_same_greedy_tokens_on_every_backend(tmp_path):
    """The 3-bit tier's band layouts on rotated c_kv, bundled model: the torch reference, the CPU fast path (band
    codes read by the C kernels where they build) and the Triton kernel pick the same greedy tokens."""
    model = load_model()
    d_c = model.cfg.kv_lora_rank
    g = torch.Generator().manual_seed(0)
    rotations = {f"layer{i}.ckv_rotation": torch.linalg.qr(torch.randn(d_c, d_c, generator=g))[0]
                 for i in range(len(THREE_BIT_LAYERS))}
    layers = [LayerPlan(ckv, kpe, rotate=True) for ckv, kpe in THREE_BIT_LAYERS]
    Plan(layers=layers, fingerprint=model.fingerprint(), budget=0.01, tensors=rotations).bind(model.cfg).save(
        tmp_path / "plan")
    plan = str(tmp_path / "plan")
    fast = DecodeSession(model, plan=plan, backend="cpu")
    assert all(pv_kind(c) == ("int16" if native.kernels() is not None else "fp32") for c in fast.codecs)
    prompt = model.tokenizer.encode("def fibonacci(n):\n    ").ids
    tokens = {b: generate(model, prompt, 16, plan=plan, backend=b)[0] for b in ("torch", "cpu", "triton")}
    assert tokens["cpu"] == tokens["torch"] and tokens["triton"] == tokens["torch"], tokens
