"""Write a random DeepSeek-V3-shaped checkpoint: config.json, sharded safetensors + index, tokenizer.json.

Attention has DeepSeek-V3's shapes by default (H = 128, d_c = 512, d_r = 64, d_n = d_v = 128,
q_lora_rank = 1536); hidden size, layer count, MLP/MoE sizes and vocabulary are small so that
calibration runs on a CPU. Layer 0 is a dense MLP, the others MoE with per-expert tensors (the
official layout), like DeepSeek-V3. Weights are Gaussian with std 1/sqrt(fan_in) (norm weights ≈ 1),
so activations stay O(1) through every layer; the same seed gives the same weights, whatever the
shard count or storage dtype.

    --dtype bf16     all tensors BF16 (the default)
    --dtype fp8      layer matrices as float8_e4m3fn with 128×128 block scales `weight_scale_inv`
                     (official DeepSeek-V3/R1 storage); embeddings, norms, router and lm_head BF16

The tokenizer is byte-level (256 byte tokens + <eos>), so the bundled text splits calibrate it.
Tensors are generated and written one shard at a time: the script's memory stays about one shard.

    python scripts/make_synthetic_checkpoint.py OUT [--layers 8] [--hidden 1024] [--shards 4] [--dtype fp8]

(scripts/make_synthetic_checkpoint.py runs `main` here; `mlaquant bench gpu` and the tests call `write_checkpoint`.)
"""

from __future__ import annotations

import argparse
import json
import math
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from mlaquant.modeling.loader import FP8_BLOCK
from mlaquant.modeling.model import MLAConfig, MLAModel

EOS, EOS_ID = "<eos>", 256


def config_dict(
    layers: int = 8,
    hidden: int = 1024,
    heads: int = 128,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    nope_dim: int = 128,
    v_dim: int = 128,
    q_lora_rank: int | None = 1536,
    intermediate: int = 2048,
    experts: int = 4,
    moe_intermediate: int = 512,
    vocab: int = 320,
    max_positions: int = 4096,
) -> dict:
    """A DeepSeek-V3 `config.json` (sigmoid routing with group top-k, YaRN-free RoPE, interleaved)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "moe_intermediate_size": moe_intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "kv_lora_rank": kv_lora_rank,
        "q_lora_rank": q_lora_rank,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": nope_dim,
        "v_head_dim": v_dim,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_interleave": True,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
    }



def hf_tensors(cfg: MLAConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor, in model order (routed experts one by one)."""
    with torch.device("meta"):
        model = MLAModel(cfg)
    out = []
    for name, t in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("w_gate", "w_up", "w_down"):
            proj = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}[leaf]
            shape = tuple(t.shape[1:])
            out += [(f"model.{prefix}.experts.{e}.{proj}.weight", shape) for e in range(t.shape[0])]
        else:
            out.append((name if name.startswith("lm_head.") else f"model.{name}", tuple(t.shape)))
    return out


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic per-name values (float32): norms ≈ 1, router bias small, matrices N(0, 1/fan_in)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))  # CPU seeds are 32-bit
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(shape, generator=g)
    fan_in = shape[-1] if len(shape) > 1 else 1
    std = 1.0 if name.endswith("embed_tokens.weight") else 1.0 / math.sqrt(fan_in)
    return std * torch.randn(shape, generator=g)


def quantize_fp8_blocks(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] → (float8_e4m3fn q, float32 scale_inv s [⌈out/128⌉, ⌈in/128⌉]) with w ≈ q·s."""
    out_f, in_f = w.shape
    rows, cols = -(-out_f // block), -(-in_f // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:out_f, :in_f] = w.float()
    blocks = padded.view(rows, block, cols, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)  # [rows, cols]
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(rows * block, cols * block)[:out_f, :in_f].contiguous(), scale


def _fp8_stored(name: str, shape: tuple[int, ...]) -> bool:
    """Which tensors official DeepSeek-V3 stores in FP8: the decoder layers' projection matrices."""
    return len(shape) == 2 and ".layers." in name and not name.endswith(("gate.weight", "norm.weight"))


def byte_tokenizer():
    """Byte-level tokenizer: ids 0..255 are the 256 byte symbols, 256 is <eos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {EOS: EOS_ID}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok



def write_checkpoint(out: str | Path, shards: int = 4, dtype: str = "bf16", seed: int = 0, **config) -> Path:
    """Write the checkpoint directory `out`; `config` overrides `config_dict`'s arguments."""
    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"dtype must be bf16 or fp8, got {dtype!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = config_dict(**config)
    if dtype == "fp8":
        raw["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
    cfg = MLAConfig.from_hf(raw)
    names = hf_tensors(cfg)
    total = sum(math.prod(s) for _, s in names)
    per_shard = -(-total // shards)
    weight_map, shard, size, index = {}, {}, 0, 0

    def flush() -> None:
        nonlocal shard, size, index
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard, size, index = {}, 0, index + 1

    for name, shape in names:
        w = random_tensor(name, shape, seed)
        if dtype == "fp8" and _fp8_stored(name, shape):
            shard[name], shard[name.replace("weight", "weight_scale_inv")] = quantize_fp8_blocks(w)
        else:
            shard[name] = w.to(torch.bfloat16)
        size += math.prod(shape)
        if size >= per_shard and index < shards - 1:
            flush()
    flush()
    for stale in out.glob("model-*-of-*.safetensors"):
        if stale.name not in set(weight_map.values()):
            stale.unlink()
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    index_doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n")
    byte_tokenizer().save(str(out / "tokenizer.json"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    dims = {"layers": args.layers, "hidden": args.hidden}
    out = write_checkpoint(args.out, args.shards, args.dtype, args.seed, **dims)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20
    print(f"wrote {out} ({args.layers} layers, hidden {args.hidden}, {args.shards} shards, {size:.0f} MiB)")


if __name__ == "__main__":
    main()
