"""lm-evaluation-harness model `mlaquant` (mlaquant.integrations.harness): local tasks end to end, offline, checked
against `DecodeSession` on the same strings."""

from __future__ import annotations

import sys
from pathlib import Path

import lm_eval
import pytest
import torch

from mlaquant.errors import MLAQuantError
from mlaquant.integrations.harness import MLAQuantLM, main
from mlaquant.modeling.loader import load_model
from mlaquant.runtime.session import DecodeSession, generate

TASKS = Path(__file__).parent / "lm_eval_tasks"  # three YAML tasks over mlaquant_code.jsonl (4 docs)
PLAN = "int8"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No network, a private datasets cache, and the tasks' directory as cwd (their data_files are relative)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(TASKS)


def session_loglikelihood(session: DecodeSession, context: list[int], continuation: list[int]) -> float:
    """Σ log p(continuation | context) from one DecodeSession prefill of context + continuation[:-1]."""
    logits = session.prefill([context + continuation[:-1]])[0]
    logp = torch.log_softmax(logits[len(context) - 1 :], dim=-1)
    return logp.gather(-1, torch.tensor(continuation)[:, None]).sum().item()


def test_local_tasks_run_offline_and_match_decode_session(offline):
    from lm_eval.tasks import TaskManager

    tasks = ["mlaquant_code_choice", "mlaquant_code_rolling", "mlaquant_code_generate"]
    out = lm_eval.simple_evaluate(
        model="mlaquant", model_args=f"plan={PLAN}", tasks=tasks, task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
    )  # fmt: skip
    assert all(out["results"][t]["sample_len"] == 4 for t in tasks)
    model = load_model()
    tok = model.tokenizer
    session = DecodeSession(model, plan=PLAN)
    choice_samples = out["samples"]["mlaquant_code_choice"]
    assert sum(len(s["arguments"]) for s in choice_samples) == 12
    for sample in choice_samples:
        for (context, continuation), [(ll, _)] in zip(sample["arguments"], sample["resps"]):
            ctx = tok.encode(context).ids
            cont = tok.encode(context + continuation).ids[len(ctx) :]
            assert ll == pytest.approx(session_loglikelihood(session, ctx, cont), abs=1e-5)
    for sample in out["samples"]["mlaquant_code_rolling"]:
        text = sample["arguments"][0][0]
        [ll] = sample["resps"][0]
        # short strings: one window, conditioned on the BOS token
        assert ll == pytest.approx(
            session_loglikelihood(session, [model.cfg.bos_token_id], tok.encode(text).ids), abs=1e-4
        )
    for sample in out["samples"]["mlaquant_code_generate"]:
        context = sample["arguments"][0][0]
        [text] = sample["resps"][0]
        [new] = generate(model, tok.encode(context).ids, max_new_tokens=8, plan=PLAN, stop_at_eos=True)
        expected = tok.decode([t for t in new if t not in model.cfg.eos_ids]).split("\n")[0]
        assert text == expected


def test_command_line_runs_a_local_task(offline, monkeypatch, capsys):
    argv = ["mlaquant-lm-eval", "--model", "mlaquant", "--model_args", f"plan={PLAN},device=cpu",
            "--tasks", "mlaquant_code_choice", "--include_path", str(TASKS)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert main() == 0
    assert "mlaquant_code_choice" in capsys.readouterr().out


def test_unknown_model_arg_is_one_line_naming_it(offline, monkeypatch, capsys):
    with pytest.raises(MLAQuantError, match="unknown model_args key 'plna'"):
        MLAQuantLM.create_from_arg_string("plna=int8")
    argv = ["mlaquant-lm-eval", "--model", "mlaquant", "--model_args", "plna=int8", "--tasks", "mlaquant_code_choice",
            "--include_path", str(TASKS)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: mlaquant lm-eval model: unknown model_args key 'plna'")
