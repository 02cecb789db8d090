"""--device / --dtype: BF16 weights keep the FP32 numerics contract, plans cross dtypes, and nothing in the
runtime allocates on a fixed device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import mlaquant
import mlaquant.calib
from mlaquant import DecodeSession, load_model
from mlaquant.calib.calibrate import CalibrateConfig, calibrate
from mlaquant.calib.data import split_path
from mlaquant.cli import main
from mlaquant.device import resolve_device, resolve_dtype
from mlaquant.errors import DeviceError
from mlaquant.evaluation.eval import Evaluator
from mlaquant.evaluation.samples import token_samples
from mlaquant.modeling.model import hadamard_signs, rope_frequencies
from mlaquant.runtime.guard import Guard
from mlaquant.runtime.plan import LayerPlan, Plan

# BF16 weights against FP32 weights, bundled model, 4 × 128 test-split tokens (measured: max |Δlogit| 0.19 on
# logits up to 15, mean KL 1.1e-4, top-1 98.8 %): the tolerance stated in the README, with margin.
BF16_MAX_LOGIT_DIFF = 1.0
BF16_MAX_KL = 2e-3
BF16_MIN_TOP1 = 0.95


@pytest.fixture(scope="module")
def models():
    return load_model(dtype="float32"), load_model(dtype="bfloat16")


@pytest.fixture(scope="module")
def test_tokens(models):
    m = models[0]
    return token_samples(m.tokenizer, split_path("test"), 4, 128, 2, m.cfg.eos_id)


def test_resolution_and_cuda_refused_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    for bad in ("cuda", "cuda:1"):
        with pytest.raises(DeviceError, match="CUDA is not available"):
            resolve_device(bad)
    with pytest.raises(DeviceError, match="not understood"):
        resolve_device("gpu")
    with pytest.raises(DeviceError, match="--dtype 'int8'"):
        resolve_dtype("int8", "cpu")


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "def f():", "--device", "cuda"],
        ["calibrate", "--device", "cuda", "--out", "never"],
        ["sweep", "--device", "cuda:0", "--out", "never"],
        ["bench", "decode", "--device", "cuda"],
    ],
)
def test_cli_device_cuda_without_cuda_is_one_line_exit_2(argv, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CUDA is not available" in err, err
    assert not (tmp_path / "never").exists()


def test_bf16_weights_fp32_latent_and_logits_within_tolerance(models, test_tokens):
    m32, m16 = models
    assert m16.dtype == torch.bfloat16 and m16.rotary.inv_freq.dtype == torch.float32
    assert m16.fingerprint() == m32.fingerprint()  # the sample is BF16 already: same weights, same print
    rows = []
    m16(test_tokens, latent_rows=lambda i, r: rows.append(r) or r)
    assert all(r.dtype == torch.float32 for r in rows)
    a, b = m32(test_tokens), m16(test_tokens)
    assert b.dtype == torch.float32
    la, lb = a.log_softmax(-1), b.log_softmax(-1)
    diff, kl = (a - b).abs().max().item(), (la.exp() * (la - lb)).sum(-1).mean().item()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"BF16 vs FP32 weights: max |dlogit| {diff:.3f}, mean KL {kl:.2e}, top-1 {top1:.3f}")  # README's numbers
    assert diff <= BF16_MAX_LOGIT_DIFF
    assert kl <= BF16_MAX_KL
    assert top1 >= BF16_MIN_TOP1
    # decode over the INT4 cache with BF16 weights: its logits are FP32 and follow the teacher-forced ones
    session = DecodeSession(m16, plan="int4")
    prefill = session.prefill(test_tokens[:, :64])
    step = session.decode(test_tokens[:, 64])
    assert prefill.dtype == step.dtype == torch.float32
    assert (step.argmax(-1) == b[:, 64].argmax(-1)).float().mean() >= 0.75


def test_moving_a_model_to_bf16_keeps_rope_fp32(tiny_model):
    copy = load_model(tiny_model.source)
    DecodeSession(copy, plan="fp16", dtype="bfloat16")
    assert copy.dtype == torch.bfloat16 and copy.rotary.inv_freq.dtype == torch.float32


SMALL = dict(samples=16, seq_len=128, val_samples=8, test_samples=8, batch_size=8, narrow_trials=2,
             long_test_samples=0, shift_samples=0, shift_long_samples=0, shift_val_samples=0)


def test_bf16_plan_within_budget_and_decodes_in_fp32(models, tmp_path):
    m32, m16 = models
    plan, report = calibrate(m16, CalibrateConfig(**SMALL, budget=0.02), quiet=True)
    assert plan.settings["dtype"] == "bfloat16" and plan.settings["device"] == "cpu"
    assert report["test"]["loss"] <= 0.02 and plan.bits_per_value() < 16
    plan.save(tmp_path / "bf16")
    loaded = Plan.load(tmp_path / "bf16")
    assert loaded.fingerprint == m32.fingerprint()
    fp32 = DecodeSession(m32, plan=tmp_path / "bf16")
    ids = torch.arange(1, 33)[None]
    assert fp32.prefill(ids).dtype == torch.float32 and torch.isfinite(fp32.decode([5])).all()


# Factory functions that allocate; inside the runtime each must name its device.
FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor,
    torch.eye, torch.randn, torch.rand, torch.randint, torch.linspace,
}  # fmt: skip
OUR_DIRS = tuple(str(Path(m.__file__).parent) for m in (mlaquant, mlaquant.calib))
TORCH_DIR = str(Path(torch.__file__).parent)


class FactoryRecorder(TorchFunctionMode):
    """Records every factory call made from mlaquant code without an explicit `device=`."""

    def __init__(self) -> None:
        super().__init__()
        self.implicit: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(OUR_DIRS):
                self.implicit.append(f"{frame.f_code.co_filename}:{frame.f_lineno} torch.{func.__name__}")
        return func(*args, **kwargs)


def _rotated_window_plan(model) -> Plan:
    d_c, d_r, n = model.cfg.kv_lora_rank, model.cfg.qk_rope_head_dim, model.cfg.num_hidden_layers
    layers = [LayerPlan("int4-g32" if i else "int8-row", "int4-row", rotate=True, rotate_rope=True) for i in range(n)]
    tensors = {f"layer{i}.rotation_signs": hadamard_signs(d_c, i) for i in range(n)}
    tensors |= {f"layer{i}.rope_rotation_signs": hadamard_signs(d_r, 9 + i) for i in range(n)}
    return Plan(layers=layers, fingerprint=model.fingerprint(), window=4, tensors=tensors)


def test_runtime_allocates_nothing_on_a_fixed_device(tiny_model):
    with FactoryRecorder() as probe:  # the probe itself sees implicit calls (construction code has some)
        rope_frequencies(tiny_model.cfg)
    assert probe.implicit and "model.py" in probe.implicit[0]
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with FactoryRecorder() as rec:
        for plan in ("int4", _rotated_window_plan(tiny_model)):
            session = DecodeSession(tiny_model, plan=plan, guard=Guard())
            logits = session.prefill([ids[0, :24].tolist(), ids[1, :13].tolist()])
            nxt = logits[:, 12].argmax(-1)
            for _ in range(3):
                nxt = session.decode(nxt).argmax(-1)
        evaluator = Evaluator(tiny_model, ids, batch_size=1)
        int4 = Plan.uniform("int4", tiny_model.cfg.num_hidden_layers).bind(tiny_model.cfg)
        evaluator.evaluate(int4.layer_codecs(), window=4)
    assert rec.implicit == []


def test_batch_size_from_free_memory_on_cuda_else_given_or_default(monkeypatch):
    from mlaquant import device as dev
    from mlaquant.evaluation.eval import sample_bytes

    model = load_model()
    per = sample_bytes(model, 512)
    assert dev.auto_batch_size(torch.device("cpu"), per, None, default=8) == 8
    assert dev.auto_batch_size(torch.device("cpu"), per, 3, default=8) == 3
    monkeypatch.setattr(dev.torch.cuda, "mem_get_info", lambda device: (10 * per, 80 * per))
    assert dev.auto_batch_size(torch.device("cuda"), per, None, default=8) == 5  # half of the free memory
    assert dev.auto_batch_size(torch.device("cuda"), per, 2, default=8) == 2  # given wins
    monkeypatch.setattr(dev.torch.cuda, "mem_get_info", lambda device: (per, 80 * per))
    assert dev.auto_batch_size(torch.device("cuda"), per, None, default=8) == 1  # never 0
