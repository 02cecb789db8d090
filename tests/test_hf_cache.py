"""`mlaquant.integrations.hf.PlanCache`: transformers' own DeepSeek model over a plan's quantized latent cache.

Reference: `DecodeSession` with the same plan — greedy tokens equal for 64 steps; per-step logits within
LOGIT_ATOL while both caches hold the same codes, within DIVERGED_ATOL after a row was encoded differently
— and, for the lossless `fp32` plan, transformers' default cache (≤ 1e-5).

Why two tolerances: the two implementations' unquantized rows differ by FP32 rounding (~1e-7), so a value
on a rounding boundary (of a code, or of a row's FP16 scale) can land one step apart; measured on the
bundled model with int4-g32/int8-g32, one row in each of layers 1–3 from step 28 on, after which the
logits differ by up to 6.6e-2. Until then (and in every other plan measured: int8, int4, rotated int4 /
int8 on both models) they agree to ≤ 1.1e-5.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mlaquant.errors import PlanError
from mlaquant.integrations.hf import PlanCache
from mlaquant.modeling.loader import default_model_path, load_model
from mlaquant.modeling.model import hadamard_signs
from mlaquant.runtime.plan import LayerPlan, Plan
from mlaquant.runtime.session import DecodeSession

STEPS = 64
LOGIT_ATOL = 1e-4  # same codes in both caches; measured ≤ 1.1e-5
DIVERGED_ATOL = 0.2  # after a boundary row was encoded differently; measured ≤ 6.6e-2


def rotated_plan(model, ckv: str = "int4-row", kpe: str = "int4-row") -> Plan:
    """Every layer rotated (c_kv and k_pe), fingerprinted for `model` — the shape of a calibrated plan."""
    d_c, d_r, n = model.cfg.kv_lora_rank, model.cfg.qk_rope_head_dim, model.cfg.num_hidden_layers
    layers = [LayerPlan(ckv, kpe, rotate=True, rotate_rope=True) for _ in range(n)]
    tensors = {}
    for i in range(n):
        tensors[f"layer{i}.rotation_signs"] = hadamard_signs(d_c, 10 + i)
        tensors[f"layer{i}.rope_rotation_signs"] = hadamard_signs(d_r, 20 + i)
    return Plan(layers=layers, fingerprint=model.fingerprint(), tensors=tensors)


def hf_greedy(hf, ids: torch.Tensor, cache=None) -> tuple[list[int], torch.Tensor]:
    """transformers greedy search: STEPS new tokens and the logits [STEPS, V] that chose them."""
    kwargs = {} if cache is None else {"cache": cache}
    out = hf.generate(
        ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0, **kwargs,
    )  # fmt: skip
    return out.sequences[0, ids.shape[1] :].tolist(), torch.stack(out.logits)[:, 0].float()


def session_greedy(session: DecodeSession, ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    logits = [session.prefill(ids)[0, -1]]
    for _ in range(STEPS - 1):
        logits.append(session.decode([int(logits[-1].argmax())])[0])
    logits = torch.stack(logits)
    return logits.argmax(-1).tolist(), logits


@pytest.fixture(scope="module")
def bundled():
    hf = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    ours = load_model()
    ids = torch.tensor([ours.tokenizer.encode("def fib(n):\n    if n < 2:").ids])
    return hf, ours, ids


@pytest.fixture
def tiny_v2(make_checkpoint):
    """A random DeepseekV2 checkpoint (interleaved complex RoPE) loaded by transformers and by mlaquant."""
    _, path = make_checkpoint(2, q_lora_rank=None)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, load_model(path), torch.tensor([[3, 17, 42, 8, 91, 5, 60]])


def first_differing_row(cache: PlanCache, session: DecodeSession, n_rows: int) -> int:
    """The first token whose stored row differs between the two caches in any layer (n_rows if none)."""
    first = n_rows
    for i, layer in enumerate(cache.layers):
        differs = (layer.cache.read(0, 0) != session.cache.read(i, 0)).any(-1)  # [n_rows]
        if differs.any():
            first = min(first, int(differs.nonzero()[0]))
    return first


def check_against_session(hf, ours, ids, plan) -> None:
    cache = PlanCache(plan, hf)
    hf_tokens, hf_logits = hf_greedy(hf, ids, cache)
    session = DecodeSession(ours, plan=plan)
    tokens, logits = session_greedy(session, ids)
    assert hf_tokens == tokens
    n_rows = ids.shape[1] + STEPS - 1
    same = max(0, first_differing_row(cache, session, n_rows) - ids.shape[1] + 1)  # steps reading equal rows only
    err = (hf_logits - logits).abs().amax(-1)  # [STEPS]
    assert all(e <= LOGIT_ATOL for e in err[:same].tolist())
    assert err.max().item() <= DIVERGED_ATOL
    # what the cache stores: the plan's bytes for every cached token (the last token is never written)
    assert cache.nbytes() == session.cache_nbytes() > 0
    assert cache.nbytes() == n_rows * session.plan.bytes_per_token()


@pytest.mark.parametrize("plan", ["int8", "int4-g32/int8-g32", "rotated"])
def test_bundled_greedy_equals_decode_session(bundled, plan):
    hf, ours, ids = bundled
    check_against_session(hf, ours, ids, rotated_plan(ours) if plan == "rotated" else plan)


@pytest.mark.parametrize("plan", ["int8", "rotated"])
def test_tiny_deepseek_v2_greedy_equals_decode_session(tiny_v2, plan):
    hf, ours, ids = tiny_v2
    # rotated int8 plan: the Hadamard mixes k_pe channels, so a wrong RoPE channel order would show
    check_against_session(hf, ours, ids, rotated_plan(ours, "int8-row", "int8-row") if plan == "rotated" else plan)


@pytest.mark.parametrize("model", ["bundled", "tiny_v2"])
def test_fp32_plan_equals_default_cache(model, request):
    hf, _, ids = request.getfixturevalue(model)
    tokens, logits = hf_greedy(hf, ids, PlanCache("fp32", hf))
    ref_tokens, ref_logits = hf_greedy(hf, ids)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() <= 1e-5


def test_quantized_plan_changes_the_logits(bundled):
    """The cache really quantizes: int4 logits differ from the default cache's."""
    hf, _, ids = bundled
    _, logits = hf_greedy(hf, ids, PlanCache("int4", hf))
    _, ref = hf_greedy(hf, ids)
    assert (logits - ref).abs().max().item() > 1e-2


def test_plan_from_another_model_is_refused(make_checkpoint, tmp_path):
    _, path_a = make_checkpoint(2, q_lora_rank=None, seed=0)
    _, path_b = make_checkpoint(2, q_lora_rank=None, seed=1)
    rotated_plan(load_model(path_a)).save(tmp_path / "plan_a")
    hf_b = AutoModelForCausalLM.from_pretrained(path_b, dtype=torch.float32)
    with pytest.raises(PlanError, match="fingerprint .* this plan was calibrated for another model"):
        PlanCache(tmp_path / "plan_a", hf_b)
    hf_a = AutoModelForCausalLM.from_pretrained(path_a, dtype=torch.float32)
    assert len(PlanCache(tmp_path / "plan_a", hf_a).layers) == 3  # its own model accepts it
    with pytest.raises(PlanError, match="pass the model, not only its config"):
        PlanCache(tmp_path / "plan_a", hf_a.config)


def test_plans_that_need_mlaquants_decoder_are_refused(bundled):
    hf, _, _ = bundled
    assert len(PlanCache("int8", hf.config).layers) == 4  # a uniform plan needs only the config
    with pytest.raises(PlanError, match="residual FP16 window of 64 tokens"):
        PlanCache("int4+w64", hf)
    with pytest.raises(PlanError, match=r"int8_matmul\) in layers \[0, 1, 2, 3\]"):
        PlanCache("int8+i8mm", hf)
