"""llama.cpp as a peer engine on the bundled model (`mlaquant.integrations.llamacpp`).

Tier 1: the padded checkpoint is the same function as the original (exact, mlaquant only); llama.cpp with an
f16 latent cache reproduces mlaquant's FP16-cache mean NLL. Tier 3: llama.cpp's q8_0 / q4_0 caches cost a
little / more than f16. The speed bench's batched decode (`decode_steps`) generates what llama.cpp's own prefill
predicts. The llama.cpp tests skip where llama-cpp-python is not installed, or where llama.cpp's converter
source is not found (`unavailable()`'s reason), naming which.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from mlaquant.calib.data import split_path
from mlaquant.errors import MLAQuantError
from mlaquant.evaluation.eval import Evaluator
from mlaquant.evaluation.samples import token_samples
from mlaquant.integrations import llamacpp
from mlaquant.modeling.loader import default_model_path, load_model

# Measured on 2 × 256 test tokens (seed 0), x86 AVX2, llama-cpp-python 0.3.36: f16 − mlaquant FP16 = −6.4e-6,
# q8_0 − f16 = +3.1e-5, q4_0 − f16 = +8.1e-3 (8 × 512: +1.2e-6, +1.0e-4, +1.2e-2). Limits with margin.
PARITY_NLL = 1e-4
Q8_MAX = 1e-3
Q4_RANGE = (2e-3, 5e-2)


@pytest.fixture
def one_thread():
    """torch on one thread for the test: its many small ops stall for seconds each when 2 threads share a
    machine with another process, and results do not depend on the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return load_model()


@pytest.fixture(scope="module")
def tokens(model):
    return token_samples(model.tokenizer, split_path("test"), 2, 256, 0, model.cfg.eos_id)  # [2, 256]


@pytest.fixture(scope="module")
def llama_cpp():
    """The llama_cpp module; without it every llama.cpp test skips here, with one reason naming the package."""
    return pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (not installed)")


@pytest.fixture(scope="module")
def gguf(llama_cpp, tmp_path_factory):
    reason = llamacpp.unavailable()  # llama_cpp imports: what is missing is llama.cpp's converter source
    if reason is not None:
        pytest.skip(f"needs llama.cpp's converter source ({reason})")
    return llamacpp.gguf_for(default_model_path(), tmp_path_factory.mktemp("llamacpp"))


@pytest.fixture(scope="module")
def nll(gguf, tokens):
    """llama.cpp's per-token NLL [2, 255] float64 per cache type. One thread: the NLLs do not depend on it, and
    ggml's spinning worker threads stall when another process holds a core."""
    return {t: llamacpp.token_nll(gguf, tokens, t, n_threads=1) for t in llamacpp.CACHE_TYPES}


def test_padded_checkpoint_is_the_same_function(model, tmp_path, one_thread):
    padded_dir = llamacpp.padded_checkpoint(default_model_path(), tmp_path / "padded")
    raw = json.loads((padded_dir / "config.json").read_text())
    assert (raw["num_hidden_layers"], raw["scoring_func"], raw["topk_method"]) == (26, "sigmoid", "noaux_tc")
    padded = load_model(padded_dir)
    assert len(padded.layers) == 26
    for layer in padded.layers[4:]:
        zero = [p for n, p in layer.named_parameters() if n.endswith("o_proj.weight") or re.search("down", n)]
        assert len(zero) == 3 and all(not p.any() for p in zero)  # o_proj, routed and shared experts' down
    ids = token_samples(model.tokenizer, split_path("test"), 1, 64, 0, model.cfg.eos_id)
    assert torch.equal(padded(ids), model(ids))


def test_cache_types_are_llama_cpp_constants(llama_cpp):
    assert llamacpp.CACHE_TYPES == {
        "f16": llama_cpp.GGML_TYPE_F16,
        "q8_0": llama_cpp.GGML_TYPE_Q8_0,
        "q4_0": llama_cpp.GGML_TYPE_Q4_0,
    }


def test_gguf_is_cached(gguf):
    start = time.perf_counter()
    assert llamacpp.gguf_for(default_model_path(), gguf.parent) == gguf
    assert time.perf_counter() - start < 5.0


def test_f16_cache_reproduces_mlaquant_fp16(model, tokens, nll, one_thread):
    assert nll["f16"].shape == (2, 255) and nll["f16"].dtype == torch.float64
    ref = Evaluator(model, tokens, 8).ref_nll
    assert abs(nll["f16"].mean().item() - ref) <= PARITY_NLL


def test_quantized_caches_cost_little_then_more(nll):
    f16, q8, q4 = (nll[t].mean().item() for t in ("f16", "q8_0", "q4_0"))
    assert abs(q8 - f16) < Q8_MAX
    assert Q4_RANGE[0] < q4 - f16 < Q4_RANGE[1]


def test_conversion_failure_is_one_line(gguf, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(MLAQuantError, match=r"llama.cpp conversion failed \(.+\)") as e:
        llamacpp.convert(tmp_path, tmp_path / "out.gguf")
    assert "\n" not in str(e.value) and not (tmp_path / "out.gguf").exists()


def test_unknown_cache_type_is_refused(gguf, tokens):
    with pytest.raises(MLAQuantError, match="q5_1"):
        llamacpp.token_nll(gguf, tokens, "q5_1")
    with pytest.raises(MLAQuantError, match="q5_1"):
        llamacpp.decode_steps(gguf, tokens.tolist(), 4, "q5_1", 1)


def test_batched_decode_follows_llama_cpps_own_prefill(gguf, tokens):
    """`decode_steps` (the speed bench's llama.cpp peer: every sequence one token a `llama_decode`, each its own
    sequence id and positions) generates, per prompt, the argmax of llama.cpp's one-sequence prefill over that prompt
    and the tokens before: a mixed-up sequence id, position or logits row gives other tokens."""
    prompts = [tokens[0, :40].tolist(), tokens[1, :23].tolist(), tokens[0, 100:131].tolist()]
    out, steps = llamacpp.decode_steps(gguf, prompts, 6, "f16", 1, chunk=16)  # chunk < prompts: chunked prefill
    assert len(steps) == 4 and all(s > 0 for s in steps)
    for prompt, got in zip(prompts, out):
        logits = llamacpp.token_logits(gguf, torch.tensor([prompt + got[:-1]]), "f16", n_threads=1)
        assert logits[0, len(prompt) - 1 :].argmax(-1).tolist() == got


def test_a_merge_free_tokenizer_gets_one_merge_and_keeps_its_ids(tmp_path):
    """llama.cpp refuses a BPE vocabulary without merges: `add_a_merge` adds "a"+"b" under a fresh id inside
    vocab_size; every byte and <eos> keep their ids; a tokenizer with merges is left alone; no free id → one line."""
    from tokenizers import Tokenizer

    from mlaquant.modeling.synthetic import EOS_ID, byte_tokenizer

    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": EOS_ID + 2}))
    before = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    llamacpp.add_a_merge(tmp_path)
    after = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert after.encode("ab").ids == [EOS_ID + 1]
    assert before.encode("ab").ids == after.encode("a").ids + after.encode("b").ids
    assert after.encode("xyz<eos>").ids == before.encode("xyz<eos>").ids
    written = (tmp_path / "tokenizer.json").read_text()
    llamacpp.add_a_merge(tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == written
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": EOS_ID + 1}))
    with pytest.raises(MLAQuantError, match="no id left in vocab_size") as e:
        llamacpp.add_a_merge(tmp_path)
    assert "\n" not in str(e.value)
