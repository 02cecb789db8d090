"""CLI conventions: --version, python -m mlaquant, EOS stop, --json summaries, Hugging Face model ids."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mlaquant
from mlaquant.cli import main
from mlaquant.modeling.loader import default_model_path, resolve_model_path
from mlaquant.runtime.plan import Plan
from mlaquant.runtime.session import generate

PROMPT = "def add(a, b):"


def _run_module(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlaquant", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def test_version_matches_the_installed_package(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mlaquant {mlaquant.__version__}"
    assert mlaquant.__version__ == importlib.metadata.version("mlaquant")


def test_python_dash_m_runs_the_command(tmp_path):
    proc = _run_module("--version", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"mlaquant {mlaquant.__version__}"
    proc = _run_module(cwd=tmp_path)
    assert proc.returncode == 2 and "calibrate" in proc.stdout and "export" in proc.stdout


def _model_with_eos(tmp_path: Path, eos: int) -> Path:
    """The bundled model (weights and tokenizer linked) with `eos` as its end-of-sequence id."""
    src = default_model_path()
    out = tmp_path / f"eos{eos}"
    out.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    return out


def _generate_json(capsys, *args: str) -> tuple[dict, str]:
    assert main(["generate", "--prompt", PROMPT, "--no-guard", "--json", *args]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_generate_stops_at_eos_unless_ignore_eos(tmp_path, capsys):
    bundled = mlaquant.load_model()
    prompt = bundled.tokenizer.encode(PROMPT).ids
    reference = generate(bundled, prompt, 8)[0]  # greedy, never stopping
    # the first token whose first occurrence is not at position 0: as EOS it must end generation there
    k = next(i for i, t in enumerate(reference) if i > 0 and t not in reference[:i])
    model = _model_with_eos(tmp_path, reference[k])

    summary, err = _generate_json(capsys, "--model", str(model), "--max-new-tokens", "8")
    assert summary["tokens"] == reference[: k + 1] and summary["new_tokens"] == k + 1
    assert summary["stopped_at_eos"] is True
    assert summary["completion"] == bundled.tokenizer.decode(reference[: k + 1])
    assert summary["prompt_tokens"] == len(prompt) and summary["model"] == str(model)
    assert PROMPT in err and f"-- {k + 1} tokens" in err  # human text on stderr with --json

    summary, _ = _generate_json(capsys, "--model", str(model), "--max-new-tokens", "8", "--ignore-eos")
    assert summary["tokens"] == reference and summary["stopped_at_eos"] is False

    # --quiet with --json: nothing but the JSON object
    assert main(["--quiet", "generate", "--prompt", PROMPT, "--no-guard", "--json", "--max-new-tokens", "2"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["tokens"] == reference[:2] and captured.err == ""


def test_calibrate_json_summary_matches_the_written_plan(tmp_path, synthetic, capsys):
    ckpt = synthetic(tmp_path / "m", 2)
    config = tmp_path / "small.yaml"
    config.write_text(
        "samples: 4\nseq_len: 32\nval_samples: 2\ntest_samples: 2\nbatch_size: 2\nbudget: 0.5\n"
        "try_rotation: false\ntry_clip: false\nnarrow_trials: 0\ncandidates: [int8-row/int8-row, fp16/fp16]\n"
    )
    out = tmp_path / "plan"
    argv = ["calibrate", "--model", str(ckpt), "--config", str(config), "--out", str(out), "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)  # exactly one JSON object on stdout
    plan = Plan.load(out)
    assert summary["plan"] == str(out) and summary["model"] == str(ckpt)
    assert [(lx["layer"], lx["ckv"], lx["kpe"]) for lx in summary["layers"]] == [
        (i, lp.ckv, lp.kpe) for i, lp in enumerate(plan.layers)
    ]
    assert summary["bits_per_value"] == plan.metrics["bits_per_value"]
    assert summary["validation"] == plan.metrics["validation"] and summary["test"] == plan.metrics["test"]
    assert "| layer |" in captured.err and "plan written to" in captured.err


def _hub_cache(root: Path, repo: str, revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """A pre-filled Hugging Face hub cache holding the bundled model as `repo`: the snapshot directory."""
    org, name = repo.split("/")
    entry = root / "hub" / f"models--{org}--{name}"
    snapshot = entry / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (snapshot / f).symlink_to(default_model_path() / f)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(revision)
    return snapshot


def test_hub_id_loads_from_the_local_cache_offline(tmp_path):
    snapshot = _hub_cache(tmp_path, "mlaquant-test/bundled")
    env = {"HF_HOME": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    proc = _run_module(
        "generate", "--model", "mlaquant-test/bundled", "--prompt", PROMPT, "--max-new-tokens", "3",
        "--no-guard", "--json", "--ignore-eos", env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert Path(summary["model"]) == snapshot and summary["new_tokens"] == 3
    bundled = mlaquant.load_model()
    assert summary["tokens"] == generate(bundled, bundled.tokenizer.encode(PROMPT).ids, 3)[0]

    proc = _run_module("bench", "memory", "--model", "mlaquant-test/bundled", env=env, cwd=tmp_path)
    assert proc.returncode == 0 and f"{snapshot.name} (this checkpoint)" in proc.stdout

    proc = _run_module("generate", "--model", "mlaquant-test/absent", "--prompt", PROMPT, env=env, cwd=tmp_path)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert "\n" not in err and "'mlaquant-test/absent'" in err and "HF_HUB_OFFLINE" in err


def test_only_org_name_strings_that_are_not_paths_are_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert resolve_model_path("org/name") == Path("org/name")  # an existing path wins over an id
    for not_an_id in ("a/b/c", "./x/y", "/abs/dir", "plain"):
        assert resolve_model_path(not_an_id) == Path(not_an_id)
    assert resolve_model_path(None) == default_model_path()


@pytest.mark.parametrize("given, kept", [(None, "1"), ("0", "0")])
def test_the_command_puts_large_tensors_on_huge_pages_unless_told_otherwise(tmp_path, monkeypatch, given, kept):
    """`main` sets THP_MEM_ALLOC_ENABLE=1 before torch allocates (docs/commands.md, "Calibration time"), and leaves
    a value the user set."""
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", given or "")  # recorded, so undone after the test either way
    if given is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == kept


def test_top_level_kernels_from_a_checkout_root_is_the_installed_one():
    """`python -c` / `python -m` from the checkout's root put it first on sys.path, where kernels/ (installed as
    `mlaquant.kernels`) takes the name of Hugging Face's `kernels` that transformers imports: transformers' model
    code still loads and `kernels` is the installed package; with none installed it stays this checkout's."""
    root = Path(__file__).resolve().parents[1]
    ours = str(root / "kernels" / "__init__.py")
    here = "import kernels; print(kernels.__file__)"
    bare = "import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]; " + here
    proc = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0 and proc.stdout.strip() == ours, proc.stderr
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed (transformers before 5.25 does not need it)")
    proc = subprocess.run([sys.executable, "-c", "import transformers.modeling_utils; " + here],
                          capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:]
    assert proc.stdout.strip() != ours and Path(proc.stdout.strip()).is_file()
