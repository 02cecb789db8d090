"""Layer-streamed execution (`calibrate --stream`): bit-identical to the full-load run, one layer resident.

Checkpoints come from mlaquant.modeling.synthetic with tiny dimensions (multi-shard, MoE
layers with per-expert tensors, interleaved RoPE), in BF16 and in FP8 with 128×128 block scales.
"""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mlaquant.calib.calibrate import CalibrateConfig, calibrate
from mlaquant.calib.observers import observe
from mlaquant.cli import main
from mlaquant.config import load_config
from mlaquant.errors import CheckpointError
from mlaquant.evaluation.eval import Evaluator
from mlaquant.modeling.loader import load_model
from mlaquant.modeling.model import hadamard_signs, latent_rotation, with_latent_rotation
from mlaquant.modeling.protocol import LatentModel
from mlaquant.modeling.stream import Store, StreamedModel
from mlaquant.runtime.plan import Plan

LAYERS = 4
CALIBRATE_YAML = (  # every stage runs, on windows small enough for CI (the default long ones: 2,048 tokens)
    "samples: 8\nseq_len: 32\nval_samples: 4\ntest_samples: 4\nbatch_size: 3\n"
    "long_seq_len: 128\nlong_test_samples: 2\nlong_window: 32\nshift_long_samples: 2\nshift_val_samples: 2\n"
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, synthetic) -> Path:
    return synthetic(tmp_path_factory.mktemp("synth") / "bf16", LAYERS, shards=3)


def test_synthetic_checkpoint_is_sharded_deepseek_v3(ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in index
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["num_hidden_layers"] == 4


def test_streamed_calibration_equals_full_load(ckpt, tmp_path, capsys):
    """`mlaquant calibrate --stream` writes byte-for-byte the plan that the full-load pipeline writes."""
    yaml = tmp_path / "calibrate.yaml"
    yaml.write_text(CALIBRATE_YAML)
    cfg = load_config(CalibrateConfig, str(yaml), "calibrate.yaml")
    calibrate(load_model(ckpt), cfg, quiet=True)[0].save(tmp_path / "full")
    out = str(tmp_path / "s")
    assert main(["calibrate", "--model", str(ckpt), "--stream", "--config", str(yaml), "--out", out]) == 0
    assert "plan written to" in capsys.readouterr().out
    assert (tmp_path / "s/plan.yaml").read_text() == (tmp_path / "full/plan.yaml").read_text()
    scales = "scales.safetensors"
    assert (tmp_path / "s" / scales).read_bytes() == (tmp_path / "full" / scales).read_bytes()
    assert Plan.load(tmp_path / "s").tensors  # and it is a real plan


def test_streamed_observe_equals_observe_with_one_layer_resident(ckpt):
    samples = torch.randint(0, 257, (5, 24), generator=torch.Generator().manual_seed(0))
    ref = observe(load_model(ckpt), samples, batch_size=2, max_rows=40)
    model = StreamedModel(ckpt)
    got = observe(model, samples, batch_size=2, max_rows=40)
    for a, b in zip(ref, got):
        assert torch.equal(a.min, b.min) and torch.equal(a.max, b.max) and a.count == b.count
        assert torch.equal(a.sample(), b.sample())
    assert model.max_resident_layers == 1 and model.resident_layers == 0


def _on_disk(store: Store) -> int:
    """How many of a store's tensors were spilled to files (that exist)."""
    return sum(isinstance(item, Path) and item.is_file() for item in store.items)


def test_streamed_evaluator_spilled_to_disk_and_rotated_equals_evaluator(ckpt):
    full = load_model(ckpt)
    samples = torch.randint(0, 257, (4, 20), generator=torch.Generator().manual_seed(1))
    model = StreamedModel(ckpt, spill_bytes=0)  # every kept tensor goes to disk
    assert isinstance(model, LatentModel) and isinstance(full, LatentModel)
    ev_full, ev_stream = Evaluator(full, samples, 3), Evaluator(model, samples, 3)
    assert ev_stream.ref_nll == ev_full.ref_nll
    assert _on_disk(ev_stream.ref_logp) == 2 and all(_on_disk(s) == 2 for s in ev_stream.ref_inputs)
    d_c, d_r = full.cfg.latent_widths
    rot = {2: latent_rotation(hadamard_signs(d_c, 7), hadamard_signs(d_r, 8), d_c, d_r)}
    codecs = [None, None, Plan.uniform("int4", 1).bind(full.cfg).layer_codec(0), None]
    want = ev_full.evaluate(codecs, first_layer=2, model=with_latent_rotation(full, rot))
    got = ev_stream.evaluate(codecs, first_layer=2, model=model.rotated(rot))
    assert got == want and got.loss != 0.0
    assert ev_stream.evaluate(codecs, window=4) == ev_full.evaluate(codecs, window=4)
    assert ev_stream.evaluate(codecs, loss_only=True).loss == ev_full.evaluate(codecs, loss_only=True).loss
    files = model.pool.directory
    del ev_stream
    gc.collect()
    assert list(files.iterdir()) == []


def test_fp8_block_scaled_synthetic_matches_its_bf16_source(tmp_path, synthetic):
    dims = {"hidden": 160, "q_lora_rank": 136}  # blocks of 128 with ragged edges
    bf16 = synthetic(tmp_path / "bf16", LAYERS, shards=2, **dims)
    fp8 = synthetic(tmp_path / "fp8", LAYERS, shards=2, dtype="fp8", **dims)
    a, b = load_model(bf16), load_model(fp8)
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    quantized = 0
    for (name, wa), (_, wb) in zip(a.state_dict().items(), b.state_dict().items()):
        if torch.equal(wa, wb):
            continue
        assert name.startswith("layers.") and wa.dim() >= 2, name
        quantized += 1
        # |w_fp8 - w| ≤ half an e4m3 ulp (2^-4 relative, s·2^-10 below the normal range) + BF16's 2^-9
        scale = max(_max_scale_inv(fp8, index, k) for k in index if k.endswith("weight_scale_inv"))
        assert ((wa - wb).abs() <= wa.abs() * (1 / 16 + 2**-8) + scale * 2**-10).all(), name
        assert (wa - wb).norm() / wa.norm() < 0.04, name
    assert quantized >= 5 * LAYERS
    assert StreamedModel(fp8).fingerprint() == b.fingerprint() != a.fingerprint()


def _max_scale_inv(path: Path, index: dict, name: str) -> float:
    with safe_open(path / index[name], "pt") as f:
        return float(f.get_tensor(name).max())


def test_missing_shard_and_absent_tensor_are_one_line_errors(ckpt, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00003.safetensors is missing"):
        StreamedModel(broken)
    assert main(["calibrate", "--stream", "--model", str(broken), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is missing" in err

    lying = tmp_path / "lying"
    shutil.copytree(ckpt, lying)
    index_file = lying / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"][name] = next(f for f in shards if f != index["weight_map"][name])
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"index names tensor '{name}' but the shard does not hold it"):
        StreamedModel(lying).load_layer(1)
