"""Hugging Face DeepSeek-V2/V3 checkpoint directory → `MLAModel`.

Reads `config.json`, `model.safetensors` or shards listed in `model.safetensors.index.json`
(memory-mapped, one tensor at a time), and `tokenizer.json` when present. Routed experts are
accepted per expert (`mlp.experts.{e}.gate_proj.weight`, the official layout) or fused
(`mlp.experts.gate_up_proj`, transformers ≥ 5 in memory). FP8 (e4m3) weights with 128×128 block
scales (`weight_scale_inv`, official DeepSeek-V3/R1) are dequantized on the fly. Pickle checkpoints
(`.bin`, `.pt`) are refused, never unpickled. Every problem raises `CheckpointError` naming the file,
tensor and shapes.

`resolve_model_path` is the one place a model argument becomes a directory: None (the bundled
model), an existing path, or a Hugging Face model id (`org/name`, not an existing path) resolved by
`huggingface_hub.snapshot_download`, which honours `HF_HUB_OFFLINE`, `HF_HOME` / `HF_HUB_CACHE`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from mlaquant.errors import CheckpointError
from mlaquant.modeling.model import MLAConfig, MLAModel, RotaryEmbedding

FP8_BLOCK = 128
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
HUB_FILES = ["*.json", "*.safetensors"]  # config, index, tokenizer, weights: never pickles


def default_model_path() -> Path:
    """Directory of the bundled model shipped as package data."""
    return Path(str(resources.files("mlaquant").joinpath("assets/default_model")))


def resolve_model_path(model: str | Path | None) -> Path:
    """A model argument → its checkpoint directory: None → the bundled model; an existing path → itself;
    `org/name` that is not an existing path → its Hugging Face Hub snapshot (downloaded, or from the local
    cache; offline and not cached is a CheckpointError naming the id). Anything else is returned as a
    Path, for the caller's "model directory not found"."""
    if model is None:
        return default_model_path()
    path = Path(model)
    if path.exists() or not HUB_ID.fullmatch(str(model)):
        return path
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(str(model), allow_patterns=HUB_FILES))
    except (OSError, ValueError) as e:
        if constants.HF_HUB_OFFLINE:
            raise CheckpointError(
                f"model '{model}': not a local directory and not in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set"
            ) from e
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"model '{model}': not a local directory; Hugging Face Hub download failed ({first})"
        ) from e


def read_config(path: Path) -> MLAConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object")
    return MLAConfig.from_hf(raw, str(cfg_file))


def weight_files(path: Path) -> dict[str, Path]:
    """tensor name → safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{index}: shard {shard.name} is missing")
        return files
    if single.is_file():
        try:
            with safe_open(single, "pt") as f:
                return dict.fromkeys(f.keys(), single)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{single}: unreadable safetensors file ({e})") from e
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{path}: only pickle checkpoints ({', '.join(pickles)}); mlaquant never unpickles weights — "
            "convert to safetensors (e.g. save_pretrained(..., safe_serialization=True))"
        )
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


class TensorReader:
    """Reads named tensors from memory-mapped safetensors files, keeping each file open once.

    FP8 block-scaled weights are moved to `device` (default CPU) and dequantized there; other tensors
    come back as stored, on the CPU (memory-mapped), for the caller to cast and move.
    """

    def __init__(self, files: dict[str, Path], device: torch.device | str = "cpu") -> None:
        self.files = files
        self.device = torch.device(device)
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> Iterator[str]:
        return iter(self.files)

    def get(self, name: str) -> torch.Tensor:
        file = self.files.get(name)
        if file is None:
            raise CheckpointError(f"missing tensor '{name}'")
        try:
            if file not in self._open:
                self._open[file] = safe_open(file, "pt")
            handle = self._open[file]
            if name not in handle.keys():
                raise CheckpointError(f"{file.name}: index names tensor '{name}' but the shard does not hold it")
            t = handle.get_tensor(name)
            scale_name = name[: -len("weight")] + "weight_scale_inv"
            if t.dtype == torch.float8_e4m3fn and scale_name in self.files:
                t = dequantize_fp8_blocks(t.to(self.device), self.get(scale_name).to(self.device))
            return t
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{file}: cannot read tensor '{name}' ({e}); file truncated or corrupt?") from e


def dequantize_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 weight [out, in] with per-(128×128)-block scales [ceil(out/128), ceil(in/128)] → float32."""
    out_f, in_f = w.shape
    expected = (-(-out_f // block), -(-in_f // block))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not fit weight {tuple(w.shape)}")
    s = scale_inv.float().repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return w.float() * s


def _rope_permutation(d_r: int, device: torch.device) -> torch.Tensor:
    """Interleaved pairs (x0,x1),(x2,x3).. → [x0,x2,..,x1,x3,..] so rotate-half RoPE applies."""
    return torch.cat((torch.arange(0, d_r, 2, device=device), torch.arange(1, d_r, 2, device=device)))


def _deinterleave_rope(cfg: MLAConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """Permute the rope output rows of query and kv_a projections (weights and biases)."""
    perm = _rope_permutation(cfg.qk_rope_head_dim, t.device)
    if name.endswith(("q_proj.weight", "q_b_proj.weight")):
        rows = t.view(cfg.num_attention_heads, cfg.qk_head_dim, -1)
        rope = rows[:, cfg.qk_nope_head_dim :][:, perm]
        return torch.cat((rows[:, : cfg.qk_nope_head_dim], rope), dim=1).reshape(t.shape)
    if name.endswith(("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias")):
        d_c = cfg.kv_lora_rank
        return torch.cat((t[:d_c], t[d_c:][perm]), dim=0)
    return t


def _hf_name(ours: str) -> str:
    if ours.startswith("lm_head."):
        return ours
    return "model." + ours


def _expert_tensor(reader: TensorReader, prefix: str, ours: str, e_count: int, inter: int) -> torch.Tensor:
    """Stacked routed-expert weight [E, ...] from per-expert or fused checkpoint tensors."""
    proj = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}[ours]
    per_expert = f"{prefix}.experts.0.{proj}.weight"
    if per_expert in reader:
        return torch.stack([reader.get(f"{prefix}.experts.{e}.{proj}.weight") for e in range(e_count)])
    if ours == "w_down":
        return reader.get(f"{prefix}.experts.down_proj")
    gate_up = reader.get(f"{prefix}.experts.gate_up_proj")  # [E, 2*inter, hidden]
    return gate_up[:, :inter] if ours == "w_gate" else gate_up[:, inter:]


def read_parameter(reader: TensorReader, cfg: MLAConfig, name: str, shape: tuple, where: Path) -> torch.Tensor:
    """Our parameter `name` [shape] from the checkpoint in its stored dtype (FP8 blocks dequantized): experts
    gathered, RoPE rows de-interleaved; a shape that disagrees with config.json is a CheckpointError."""
    prefix, _, leaf = name.rpartition(".")
    if leaf in ("w_gate", "w_up", "w_down"):
        t = _expert_tensor(reader, _hf_name(prefix), leaf, cfg.n_routed_experts, cfg.moe_intermediate_size)
        hf = f"{_hf_name(prefix)}.experts.*.{leaf[2:]}_proj.weight"
    else:
        hf = _hf_name(name)
        t = reader.get(hf)
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(
            f"{where}: tensor '{hf}' has shape {tuple(t.shape)}, expected {tuple(shape)} from config.json"
        )
    # after the shape check: the permutation indexes rows that a mis-shaped tensor does not have
    return _deinterleave_rope(cfg, name, t) if cfg.rope_interleave else t


def load_model(
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = "auto",
) -> MLAModel:
    """Load a DeepSeek-V2/V3 checkpoint (a directory, a Hugging Face model id, None: the bundled model) as an
    `MLAModel`.

    device: "auto" | "cpu" | "cuda" | "cuda:N" (`mlaquant.device.resolve_device`); dtype of the weights:
    "auto" (bfloat16 on CUDA, float32 on CPU) | "float32" | "bfloat16" | "float16" or a torch.dtype. Each
    tensor is read from the memory-mapped checkpoint, dequantized (FP8 blocks) on `device` and cast there,
    so host memory holds one tensor at a time. The latent, scores and logits stay FP32 (`mlaquant.modeling.model`).
    """
    from mlaquant.device import resolve_device, resolve_dtype

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    bundled = path is None
    path = resolve_model_path(path)
    if bundled and not (path / "config.json").is_file():
        raise CheckpointError(f"bundled model not found at {path}; train it with `mlaquant train` or pass a path")
    if not path.is_dir():
        raise CheckpointError(f"{path}: model directory not found")
    cfg = read_config(path)
    reader = TensorReader(weight_files(path), device)
    with torch.device("meta"):
        model = MLAModel(cfg)
    state = {}
    for name, param in model.state_dict(keep_vars=True).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("rotary."):
            continue
        t = read_parameter(reader, cfg, name, tuple(param.shape), path)
        state[name] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = RotaryEmbedding(cfg).to(device)
    model.eval()
    model.source = str(path)
    tok = path / "tokenizer.json"
    if tok.is_file():
        from tokenizers import Tokenizer

        model.tokenizer = Tokenizer.from_file(str(tok))
    return model
