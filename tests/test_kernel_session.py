"""The Triton decode kernel inside a real session: same greedy tokens as the torch reference."""

from __future__ import annotations

import os

import pytest

from mlaquant import load_model
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
