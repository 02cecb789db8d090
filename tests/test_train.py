"""`mlaquant train`: a few steps on a tiny MLA config learn, bad input fails clearly, saves are atomic."""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import pytest
import torch

from mlaquant.atomic import recover_directory
from mlaquant.bundled import train as train_mod
from mlaquant.cli import main as cli_main
from mlaquant.errors import MLAQuantError

TINY = {
    "seed": 0,
    "corpus": {"held_out_fraction": 0.1, "max_split_bytes": 100_000},
    "tokenizer": {"vocab_size": 320},
    "model": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 128,
    },
    "train": {
        "seq_len": 64,
        "batch_size": 4,
        "lr": 0.01,
        "warmup_steps": 5,
        "max_steps": 40,
        "time_budget_s": 120.0,
        "checkpoint_every_s": 1e9,
        "log_every": 1,
        "threads": 1,
    },
}


def _tiny_cfg(**model_overrides) -> train_mod.TrainConfig:
    data = json.loads(json.dumps(TINY))
    data["model"].update(model_overrides)
    return train_mod.load_train_config(data)


def _make_corpus(root: Path, n: int = 40) -> Path:
    for i in range(n):
        (root / f"m{i}.py").parent.mkdir(parents=True, exist_ok=True)
        body = "".join(
            f"def add_{i}_{j}(a, b):\n    return a + b + {j}\n\n\nclass Box{j}:\n    def __init__(self):\n"
            f"        self.items = []\n\n"
            for j in range(4)
        )
        (root / f"m{i}.py").write_text(body)
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_train")
    corpus = _make_corpus(root / "corpus")
    logs: list[str] = []
    record = train_mod.train(
        _tiny_cfg(), root / "ckpt", corpus_root=corpus, splits_dir=root / "splits", final_eval=False, log=logs.append
    )
    return record, root, logs


def test_a_few_steps_reduce_the_loss(trained):
    record, _, _ = trained
    losses = [h["loss"] for h in record["history"]]
    assert record["steps"] == 40 and len(losses) == 40
    assert losses[0] > math.log(320) - 1.0  # starts near uniform over the vocabulary
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5


def test_checkpoint_is_hf_deepseek_v3_and_reloads_identically(trained):
    from transformers import AutoModelForCausalLM

    record, root, _ = trained
    ckpt = root / "ckpt"
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"] == 4
    assert cfg["kv_lora_rank"] == 32 and cfg["tie_word_embeddings"] is False
    assert {"model.safetensors", "tokenizer.json", "training.json", "loss_curve.png"} <= {
        p.name for p in ckpt.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([[0, 5, 9, 33, 100, 7]])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    # split_nll must agree with transformers' own loss when one window covers the whole stream.
    nats, count = train_mod.split_nll(model, [[5, 9, 33, 100, 7]], eos_id=0, window=64)
    assert count == 5
    torch.testing.assert_close(torch.tensor(nats / count), loss, rtol=1e-5, atol=1e-5)
    # Overlapping windows still predict each token exactly once.
    _, count_small = train_mod.split_nll(model, [[5, 9, 33, 100, 7]] * 3, eos_id=0, window=4)
    assert count_small == 17
    assert json.loads((ckpt / "training.json").read_text())["parameters"] == record["parameters"]


def test_held_out_files_never_reach_training(trained):
    record, root, _ = trained
    held = set()
    for name in ("calibration", "validation", "test"):
        held |= {json.loads(line)["path"] for line in (root / "splits" / f"{name}.jsonl").read_text().splitlines()}
    manifest = json.loads((root / "splits" / "manifest.json").read_text())
    assert held and record["train_files"] == manifest["splits"]["train"]["files"] == 40 - len(held)


def test_tokenizer_round_trips_code():
    tok = train_mod.train_tokenizer(["def f(x):\n    return x\n"] * 20, 300)
    text = "class Ünïcode:\n\tpass  # ok\r\n"
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.token_to_id(train_mod.EOS) == 0


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"kv_lora_rank": None}, "kv_lora_rank"),
        ({"kv_lora_rank": 16}, "4 x qk_rope_head_dim"),
        ({"num_attention_heads": 2}, "num_attention_heads"),
        ({"first_k_dense_replace": 2}, "no MoE layer"),
        ({"num_experts_per_tok": 8}, "num_experts_per_tok"),
    ],
)
def test_non_mla_config_is_rejected(overrides, match):
    with pytest.raises(MLAQuantError, match=match):
        _tiny_cfg(**overrides)


def test_missing_kv_lora_rank_key_is_rejected():
    data = json.loads(json.dumps(TINY))
    del data["model"]["kv_lora_rank"]
    with pytest.raises(MLAQuantError, match="kv_lora_rank"):
        train_mod.load_train_config(data)


def test_bad_corpus_gives_one_line_cli_error(tmp_path, capsys):
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(json.dumps(TINY))  # JSON is YAML
    empty = tmp_path / "empty"
    empty.mkdir()
    for corpus in (tmp_path / "missing", empty):
        rc = cli_main(["train", "--config", str(cfg_path), "--out", str(tmp_path / "o"), "--corpus", str(corpus)])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "\n" not in err and str(corpus) in err
    assert not (tmp_path / "o").exists()


def test_interrupted_save_keeps_previous_checkpoint(trained, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    _, root, _ = trained
    tok = train_mod.train_tokenizer(["x = 1\n"] * 5, 300)
    model = AutoModelForCausalLM.from_pretrained(root / "ckpt")
    out = tmp_path / "model"
    train_mod.save_checkpoint(model, tok, out, {"run": 1})
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def crash(self, path, **kwargs):
        (Path(path) / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(type(model), "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        train_mod.save_checkpoint(model, tok, out, {"run": 2})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    # Killed between the two renames: the previous checkpoint waits at .model.old and is put back.
    out.rename(tmp_path / ".model.old")
    recover_directory(out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_packaged_config_is_mla_shaped():
    cfg = train_mod.load_train_config(None)
    m = cfg.model
    assert m.kv_lora_rank >= 4 * m.qk_rope_head_dim and m.num_attention_heads >= 4
    assert m.first_k_dense_replace < m.num_hidden_layers


def test_bundled_checkpoint_is_small_and_loads():
    from transformers import AutoConfig

    ckpt = Path(str(resources.files("mlaquant").joinpath("assets", "default_model")))
    assert (ckpt / "model.safetensors").is_file(), f"{ckpt}: the bundled model is shipped with the package"
    assert sum(p.stat().st_size for p in ckpt.iterdir()) <= 30_000_000
    cfg = AutoConfig.from_pretrained(ckpt)
    assert cfg.model_type == "deepseek_v3" and cfg.kv_lora_rank >= 4 * cfg.qk_rope_head_dim
    record = json.loads((ckpt / "training.json").read_text())
    assert record["parameters"] > 0 and record["steps"] > 0


def test_warm_start_continues_from_the_checkpoint(trained, tmp_path):
    record, root, _ = trained
    cfg = _tiny_cfg()
    cfg.train.max_steps = 3
    cfg.seed = 1
    again = train_mod.train(
        cfg,
        tmp_path / "ckpt2",
        corpus_root=root / "corpus",
        final_eval=False,
        init_from=root / "ckpt",
        log=lambda m: None,
    )
    # starts where the first run ended (far below the uniform-vocabulary loss a fresh model starts at)
    assert again["history"][0]["loss"] < record["history"][0]["loss"] - 1.5
    assert again["previous_runs"][-1]["steps"] == record["steps"]
    tok_a = (root / "ckpt" / "tokenizer.json").read_text()
    assert (tmp_path / "ckpt2" / "tokenizer.json").read_text() == tok_a
    with pytest.raises(MLAQuantError, match="not a checkpoint written by"):
        train_mod.train(cfg, tmp_path / "x", corpus_root=root / "corpus", final_eval=False, init_from=tmp_path)


def test_context_extension_switches_to_long_rows_and_scores_by_position(tmp_path):
    """From `extend_from` on the loop trains on rows of `extend_seq_len`; the test split is scored at both
    windows, by position bucket, and the buckets' bytes add up to the split's bytes."""
    data = json.loads(json.dumps(TINY))
    data["train"].update(max_steps=12, extend_seq_len=128, extend_batch_size=2, extend_from=0.5)
    cfg = train_mod.load_train_config(data)
    logs: list[str] = []
    record = train_mod.train(cfg, tmp_path / "ckpt", corpus_root=_make_corpus(tmp_path / "corpus"), log=logs.append)
    assert record["extended_at_step"] == 6
    assert any("context extension to 128 tokens, batch 2" in line for line in logs)
    assert record["tokens_seen"] == 6 * 4 * 64 + 6 * 2 * 128
    short, long = record["test"], record["test_long"]
    assert (short["window"], long["window"]) == (64, 128)
    assert [b["positions"] for b in long["by_position"]] == [[0, 128]]
    assert long["by_position"][0]["tokens"] == long["tokens"]
    assert math.isclose(long["by_position"][0]["bits_per_byte"], long["bits_per_byte"], rel_tol=1e-9)


def test_bucket_metrics_split_positions_and_count_bytes():
    nats = torch.tensor([[1.0] * 300, [2.0] * 300], dtype=torch.float64)
    valid = torch.ones(2, 300, dtype=torch.bool)
    valid[1, 290:] = False
    targets = torch.zeros(2, 300, dtype=torch.long)
    targets[:, 256:] = 1
    nbytes = torch.tensor([2, 4])
    out = train_mod.bucket_metrics(nats * valid, targets, valid, nbytes)
    assert [b["positions"] for b in out] == [[0, 256], [256, 300]]
    assert [b["tokens"] for b in out] == [512, 44 + 34]
    assert math.isclose(out[0]["loss"], 1.5)
    assert math.isclose(out[1]["bits_per_byte"], (44 + 34 * 2) / math.log(2) / (78 * 4))
