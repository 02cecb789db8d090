"""Checkpoint loading: sharded files, FP8 block scales, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlaquant import load_model
from mlaquant.errors import CheckpointError
from mlaquant.modeling.loader import dequantize_fp8_blocks


def test_sharded_checkpoint_loads_identically(make_checkpoint, tmp_path):
    hf, path = make_checkpoint(3)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 96, (1, 7))
    assert torch.equal(load_model(sharded)(ids), load_model(path)(ids))


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)


def test_non_mla_config_names_missing_fields(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(CheckpointError, match="missing MLA fields: kv_lora_rank, qk_rope_head_dim"):
        load_model(tmp_path)


def test_missing_and_misshaped_tensor(make_checkpoint):
    _, path = make_checkpoint(3)
    file = path / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    good_shape = tuple(tensors[name].shape)
    tensors[name] = torch.zeros(5, 7)
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \(5, 7\), expected \({good_shape[0]}, "):
        load_model(path)
    del tensors[name]
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_model(path)


@pytest.mark.parametrize(
    "name", ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.2.self_attn.q_proj.weight"]
)
@pytest.mark.parametrize("shape", [(5, 7), (3,)])
def test_misshaped_rope_permuted_tensor_is_one_line(make_checkpoint, name, shape):
    """With rope_interleave on, RoPE rows are permuted at load: a mis-shaped tensor must fail on its shape
    (naming it and both shapes), not inside the permutation with an IndexError / RuntimeError."""
    _, path = make_checkpoint(3, q_lora_rank=None)
    assert json.loads((path / "config.json").read_text()).get("rope_interleave", True)
    file = path / "model.safetensors"
    tensors = load_file(file)
    good_shape = tuple(tensors[name].shape)
    tensors[name] = torch.zeros(shape)
    save_file(tensors, file)
    expected = rf"'{name}' has shape \({', '.join(map(str, shape))},?\), expected \({good_shape[0]}, {good_shape[1]}\)"
    with pytest.raises(CheckpointError, match=expected):
        load_model(path)
    from mlaquant.modeling.stream import StreamedModel

    with pytest.raises(CheckpointError, match=expected):
        StreamedModel(path).load_layer(int(name.split(".")[2]))


def test_truncated_safetensors(make_checkpoint):
    _, path = make_checkpoint(3)
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(path)


def test_pickle_checkpoint_refused_without_unpickling(make_checkpoint):
    _, path = make_checkpoint(3)
    (path / "model.safetensors").unlink()
    # a file that would execute code if unpickled: loading must not touch it
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04cos\nsystem\n(S'touch pwned'\ntR.")
    with pytest.raises(CheckpointError, match="never unpickles.*safetensors"):
        load_model(path)
    assert not (path / "pwned").exists()


def test_missing_shard_and_index_naming_absent_tensor(make_checkpoint, tmp_path):
    hf, _ = make_checkpoint(3)
    sharded = tmp_path / "s"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (sharded / shard).rename(sharded / "moved")
    with pytest.raises(CheckpointError, match=f"shard {shard} is missing"):
        load_model(sharded)
    (sharded / "moved").rename(sharded / shard)
    index["weight_map"]["model.norm.weight"] = sorted(set(index["weight_map"].values()))[0]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    if index["weight_map"]["model.norm.weight"] != shard:
        with pytest.raises(CheckpointError, match="does not hold it"):
            load_model(sharded)


def test_fp8_block_scaled_weights_dequantize(make_checkpoint):
    hf, path = make_checkpoint(3, hidden_size=160, intermediate_size=200)
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name in [n for n, t in tensors.items() if n.endswith("proj.weight") and t.dim() == 2]:
        w = tensors[name]
        blocks = (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        amax = torch.zeros(blocks)
        for i in range(blocks[0]):
            for j in range(blocks[1]):
                amax[i, j] = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max()
        scale_inv = amax / 448.0
        s = scale_inv.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        tensors[name] = (w / s).to(torch.float8_e4m3fn)
        tensors[name.replace("weight", "weight_scale_inv")] = scale_inv
    save_file(tensors, file)
    fp8 = load_model(path)
    ref = hf.model.layers[0].self_attn.kv_b_proj.weight
    got = fp8.layers[0].self_attn.kv_b_proj.weight
    # e4m3 keeps 3 mantissa bits: relative rounding ≤ 2^-4 of each value (plus subnormal floor)
    assert ((got - ref).abs() <= ref.abs() * 2**-4 + 1e-3 * ref.abs().max()).all()
    assert not torch.equal(got, ref)
    assert (
        dequantize_fp8_blocks(
            tensors["model.layers.0.self_attn.kv_b_proj.weight"],
            tensors["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"],
        ).shape
        == ref.shape
    )


def test_cli_error_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mlaquant.cli", "generate", "--model", str(tmp_path / "nope"), "--prompt", "x"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "model directory not found" in proc.stderr


def test_bundled_config_spells_out_v3_routing_for_other_engines():
    """vLLM and llama.cpp default to softmax routing without `scoring_func` / `topk_method` (llama.cpp read
    +1.6 % ppl on the bundled model without them); the shipped config.json carries both, and they are what
    mlaquant and transformers compute with."""
    from transformers import AutoConfig

    from mlaquant.modeling.loader import default_model_path

    raw = json.loads((default_model_path() / "config.json").read_text())
    assert raw["scoring_func"] == "sigmoid" and raw["topk_method"] == "noaux_tc"
    cfg = load_model().cfg
    assert (cfg.scoring_func, cfg.topk_method) == (raw["scoring_func"], raw["topk_method"])
    hf = AutoConfig.from_pretrained(default_model_path())
    assert (hf.scoring_func, hf.topk_method) == ("sigmoid", "noaux_tc")
