"""`mlaquant train`: the bundled default model, a small DeepSeek-V3 code LM trained on the Python stdlib.

Owns the training config (`TrainConfig`, `configs/train.yaml`), the MLA-shape check, the byte-level
BPE tokenizer, packing of the train split into fixed-length sequences, the training loop on CPU
(transformers' `DeepseekV3ForCausalLM`, the independent oracle, which also writes Hugging Face format),
test-split perplexity / bits per byte, and the atomic checkpoint write.

Checkpoint directory (package data `mlaquant/assets/default_model/`): config.json,
generation_config.json, model.safetensors (fp32), tokenizer.json, tokenizer_config.json,
training.json (config, metrics, loss history, completions) and loss_curve.png. It is written to a temp
directory beside the target and swapped in by rename, so an interrupted run leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from mlaquant import corpus as corpus_mod
from mlaquant.atomic import atomic_directory
from mlaquant.config import load_config, to_dict
from mlaquant.errors import MLAQuantError

EOS = "<|endoftext|>"
COMPLETION_PROMPTS = ("def fibonacci(n):", "import os\n\ndef ", "class Stack:\n    def __init__(self):")


@dataclasses.dataclass
class CorpusConfig:
    root: str | None = None
    max_file_bytes: int = 400_000
    held_out_fraction: float = 0.04
    max_split_bytes: int = 1_500_000


@dataclasses.dataclass
class TokenizerConfig:
    vocab_size: int = 4096


@dataclasses.dataclass
class ModelConfig:
    """DeepseekV3Config fields; kv_lora_rank has no default so a config without a latent is rejected."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 32
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    intermediate_size: int = 768
    moe_intermediate_size: int = 256
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0


@dataclasses.dataclass
class LoopConfig:
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int = 3000
    time_budget_s: float = 3000.0
    checkpoint_every_s: float = 600.0
    log_every: int = 25
    threads: int = 2


@dataclasses.dataclass
class TrainConfig:
    """Everything `train` needs (`configs/train.yaml`); the resolved copy goes into training.json."""

    version: int = 1
    seed: int = 0
    corpus: CorpusConfig = dataclasses.field(default_factory=CorpusConfig)
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: LoopConfig = dataclasses.field(default_factory=LoopConfig)


def load_train_config(source: str | Path | dict | TrainConfig | None = None) -> TrainConfig:
    """TrainConfig from a path/mapping, or the packaged `train.yaml`; the MLA shape is checked."""
    cfg = load_config(TrainConfig, source, "train.yaml")
    check_mla_shape(cfg.model)
    return cfg


def check_mla_shape(m: ModelConfig) -> None:
    """Reject shapes that are not DeepSeek-like MLA (one latent shared by ≥ 4 heads, d_c ≥ 4·d_r, MoE)."""
    if m.kv_lora_rank is None or m.kv_lora_rank <= 0:
        raise MLAQuantError("train config: model.kv_lora_rank (d_c) is missing; MLA needs a latent width > 0")
    if m.qk_rope_head_dim <= 0 or m.qk_nope_head_dim <= 0 or m.v_head_dim <= 0:
        raise MLAQuantError(
            f"train config: head dims must be > 0 (d_r={m.qk_rope_head_dim}, d_n={m.qk_nope_head_dim}, "
            f"d_v={m.v_head_dim})"
        )
    if m.kv_lora_rank < 4 * m.qk_rope_head_dim:
        raise MLAQuantError(
            f"train config: model.kv_lora_rank={m.kv_lora_rank} < 4 x qk_rope_head_dim={m.qk_rope_head_dim}; "
            "DeepSeek MLA has d_c >= 4 d_r"
        )
    if m.num_attention_heads < 4:
        raise MLAQuantError(
            f"train config: model.num_attention_heads={m.num_attention_heads}; the latent must be shared by >= 4 heads"
        )
    if not 0 <= m.first_k_dense_replace < m.num_hidden_layers or m.n_routed_experts < 2:
        raise MLAQuantError(
            f"train config: no MoE layer (first_k_dense_replace={m.first_k_dense_replace}, "
            f"num_hidden_layers={m.num_hidden_layers}, n_routed_experts={m.n_routed_experts})"
        )
    if not 1 <= m.num_experts_per_tok <= m.n_routed_experts or m.n_routed_experts % m.n_group:
        raise MLAQuantError(
            f"train config: num_experts_per_tok={m.num_experts_per_tok} / n_group={m.n_group} do not fit "
            f"n_routed_experts={m.n_routed_experts}"
        )


def hf_config(m: ModelConfig, vocab_size: int, eos_id: int):
    """The transformers `DeepseekV3Config` for `m` (K/V heads = query heads, untied embeddings)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        moe_intermediate_size=m.moe_intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_attention_heads,
        n_shared_experts=m.n_shared_experts,
        n_routed_experts=m.n_routed_experts,
        routed_scaling_factor=m.routed_scaling_factor,
        kv_lora_rank=m.kv_lora_rank,
        q_lora_rank=m.q_lora_rank,
        qk_rope_head_dim=m.qk_rope_head_dim,
        qk_nope_head_dim=m.qk_nope_head_dim,
        v_head_dim=m.v_head_dim,
        n_group=m.n_group,
        topk_group=m.topk_group,
        num_experts_per_tok=m.num_experts_per_tok,
        first_k_dense_replace=m.first_k_dense_replace,
        norm_topk_prob=True,
        max_position_embeddings=m.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        rope_interleave=True,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (`tokenizers`) over `texts`, with `<|endoftext|>` as id 0; round-trips any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise MLAQuantError(f"tokenizer.vocab_size={vocab_size}: byte-level BPE needs at least 258")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def pack(token_lists: list[list[int]], eos_id: int, seq_len: int) -> torch.Tensor:
    """Concatenate `[eos] + ids` per file and cut into rows: [N, seq_len] int64, the tail dropped."""
    stream = np.fromiter(
        (t for ids in token_lists for t in [eos_id, *ids]), dtype=np.int32, count=sum(len(x) + 1 for x in token_lists)
    )
    n = len(stream) // seq_len
    if n == 0:
        raise MLAQuantError(f"corpus has {len(stream)} tokens, fewer than one sequence of {seq_len}")
    return torch.from_numpy(stream[: n * seq_len].astype(np.int64)).view(n, seq_len)


@torch.no_grad()
def split_nll(model, token_lists: list[list[int]], eos_id: int, window: int, batch_size: int = 8) -> tuple[float, int]:
    """Total NLL (nats) of every token of the split, each predicted once with ≤ `window` tokens of context.

    The stream is `[eos] f1 [eos] f2 ...`; windows of `window + 1` tokens overlap by one so each token
    after the leading eos is a target exactly once (the eos between files counts as a target too).
    Returns (total nats, number of targets).
    """
    stream = torch.tensor([t for ids in token_lists for t in [eos_id, *ids]], dtype=torch.long)
    starts = list(range(0, len(stream) - 1, window))
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        chunk = [stream[s : s + window + 1] for s in starts[i : i + batch_size]]
        width = max(len(c) for c in chunk)
        ids = torch.full((len(chunk), width), eos_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, c in enumerate(chunk):
            ids[j, : len(c)] = c
            mask[j, : len(c)] = 1
        out = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=False)
        logits = out.logits.float()  # [B, T, V]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T]
        valid = mask[:, 1:].bool()
        total += float(nll[valid].sum())
        count += int(valid.sum())
    return total, count


def evaluate_split(model, tokenizer, files: list[corpus_mod.SourceFile], window: int) -> dict:
    """Perplexity and bits per byte (total NLL in bits / UTF-8 bytes of the texts) of a split."""
    eos_id = tokenizer.token_to_id(EOS)
    token_lists = [e.ids for e in tokenizer.encode_batch([f.text for f in files])]
    nats, count = split_nll(model, token_lists, eos_id, window)
    nbytes = sum(f.nbytes for f in files)
    return {
        "files": len(files),
        "bytes": nbytes,
        "tokens": count,
        "loss": nats / count,
        "perplexity": math.exp(nats / count),
        "bits_per_byte": nats / math.log(2) / nbytes,
    }


def lr_at(cfg: LoopConfig, step: int, progress: float) -> float:
    """Linear warmup over `warmup_steps`, then cosine to `min_lr_ratio·lr` over `progress` ∈ [0, 1]."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def plot_loss(history: list[dict], val_history: list[dict], path: Path) -> None:
    """Training loss (and validation loss where measured) against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train (per-log mean)")
    if val_history:
        ax.plot([h["step"] for h in val_history], [h["loss"] for h in val_history], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("mlaquant default model: stdlib code LM")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def save_checkpoint(model, tokenizer, out_dir: str | Path, training: dict, history=(), val_history=()) -> Path:
    """Write the HF checkpoint into `out_dir` through `atomic_directory`: the previous checkpoint stays
    in place until the new one is complete (a save killed between the two renames is settled by the
    next one). Files are 0644 and the directory 0755: it ships as package data."""
    out_dir = Path(out_dir)
    with atomic_directory(out_dir, mode=0o755) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save(str(tmp / "tokenizer.json"))
        eos_id = tokenizer.token_to_id(EOS)
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": EOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "model_max_length": int(model.config.max_position_embeddings),
            "add_prefix_space": False,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1) + "\n")
        (tmp / "training.json").write_text(json.dumps({**training, "eos_token_id": eos_id}, indent=1) + "\n")
        if history:
            plot_loss(list(history), list(val_history), tmp / "loss_curve.png")
        for p in tmp.iterdir():
            p.chmod(0o644)  # safetensors writes 0600
    return out_dir


def greedy_completions(checkpoint: str | Path, prompts=COMPLETION_PROMPTS, max_new_tokens: int = 40) -> list[dict]:
    """Greedy continuations of `prompts` from the saved checkpoint, loaded by transformers' Auto classes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([[tok.eos_token_id, *tok.encode(p, add_special_tokens=False)]])
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
        out.append({"prompt": p, "completion": tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=False)})
    return out


def train(
    cfg: TrainConfig,
    out_dir: str | Path,
    corpus_root: str | Path | None = None,
    splits_dir: str | Path | None = None,
    final_eval: bool = True,
    command: str | None = None,
    log=print,
    init_from: str | Path | None = None,
) -> dict:
    """Train the model described by `cfg` and write it to `out_dir`; returns the training record.

    `corpus_root` (else `cfg.corpus.root`, else the stdlib) is split by file; only the train split is
    trained on. `splits_dir` receives the held-out JSONL splits and manifest. With `final_eval`, the
    record gains test-split perplexity / bits per byte and greedy completions from the saved model.
    `init_from` warm-starts from a checkpoint written by this function (its weights and tokenizer; the
    optimizer restarts with a fresh warmup) and carries its record forward as `previous_runs`.
    """
    from transformers import DeepseekV3ForCausalLM

    check_mla_shape(cfg.model)
    loop = cfg.train
    torch.set_num_threads(loop.threads)
    torch.manual_seed(cfg.seed)
    t_start = time.time()
    root = corpus_root if corpus_root is not None else cfg.corpus.root
    root = corpus_mod.stdlib_root() if root is None else Path(root)
    files = corpus_mod.collect_sources(root, cfg.corpus.max_file_bytes)
    splits = corpus_mod.split_sources(files, cfg.corpus.held_out_fraction, cfg.corpus.max_split_bytes)
    if not splits["train"]:
        raise MLAQuantError(f"corpus {root}: no file falls in the train split ({len(files)} files)")
    if splits_dir is not None:
        corpus_mod.write_splits(splits, splits_dir, root)
    log(
        f"corpus {root}: "
        + ", ".join(f"{k} {len(v)} files / {sum(f.nbytes for f in v) / 1e6:.2f} MB" for k, v in splits.items())
    )

    train_texts = [f.text for f in splits["train"]]
    previous = []
    if init_from is not None:
        from tokenizers import Tokenizer

        init_from = Path(init_from)
        if not (init_from / "tokenizer.json").is_file() or not (init_from / "model.safetensors").is_file():
            raise MLAQuantError(f"{init_from}: not a checkpoint written by `mlaquant train`")
        tokenizer = Tokenizer.from_file(str(init_from / "tokenizer.json"))
        old_record = json.loads((init_from / "training.json").read_text())
        previous = [*old_record.pop("previous_runs", []), old_record]
    else:
        tokenizer = train_tokenizer(train_texts, cfg.tokenizer.vocab_size)
    eos_id = tokenizer.token_to_id(EOS)
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(train_texts))
    encoded = tokenizer.encode_batch([train_texts[i] for i in order])
    data = pack([e.ids for e in encoded], eos_id, loop.seq_len)  # [N, seq_len]
    train_bytes = sum(f.nbytes for f in splits["train"])
    log(
        f"tokenizer: vocab {tokenizer.get_vocab_size()}, {data.numel()} train tokens in {len(data)} rows "
        f"({train_bytes / data.numel():.2f} bytes/token), {time.time() - t_start:.0f}s"
    )

    if init_from is not None:
        model = DeepseekV3ForCausalLM.from_pretrained(init_from).float()
    else:
        model = DeepseekV3ForCausalLM(hf_config(cfg.model, tokenizer.get_vocab_size(), eos_id)).float()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params} parameters ({n_params * 4 / 2**20:.1f} MiB fp32)")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": loop.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=loop.lr,
        betas=(0.9, 0.95),
    )
    val_files = splits["validation"]
    val_tokens = [e.ids for e in tokenizer.encode_batch([f.text for f in val_files])]
    val_tokens = _first_tokens(val_tokens, 32 * loop.seq_len)

    record = {
        "config": to_dict(cfg),
        "command": command,
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "parameters": n_params,
        "vocab_size": tokenizer.get_vocab_size(),
        "train_files": len(splits["train"]),
        "train_bytes": train_bytes,
        "train_tokens_available": int(data.numel()),
        "init_from": None if init_from is None else str(init_from),
        "previous_runs": previous,
    }
    history: list[dict] = []
    val_history: list[dict] = []
    gen = torch.Generator().manual_seed(cfg.seed)
    perm, cursor = torch.randperm(len(data), generator=gen), 0
    t_loop = time.time()
    last_ckpt = t_loop
    step, tokens_seen, window_loss, window_n = 0, 0, 0.0, 0
    while True:
        elapsed = time.time() - t_loop
        progress = max(step / loop.max_steps, elapsed / loop.time_budget_s)
        if progress >= 1.0:
            break
        if cursor + loop.batch_size > len(perm):
            perm, cursor = torch.randperm(len(data), generator=gen), 0
        batch = data[perm[cursor : cursor + loop.batch_size]]  # [B, seq_len]
        cursor += loop.batch_size
        lr = lr_at(loop, step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        model.train()
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), loop.grad_clip)
        opt.step()
        step += 1
        tokens_seen += batch.numel()
        window_loss += loss.item()
        window_n += 1
        if step % loop.log_every == 0 or step == 1:
            el = time.time() - t_loop
            history.append({"step": step, "loss": window_loss / window_n, "lr": lr, "elapsed_s": round(el, 1)})
            log(
                f"step {step} loss {window_loss / window_n:.4f} lr {lr:.2e} "
                f"{tokens_seen / el:.0f} tok/s elapsed {el:.0f}s"
            )
            window_loss, window_n = 0.0, 0
        if time.time() - last_ckpt >= loop.checkpoint_every_s:
            _record_progress(record, step, tokens_seen, t_loop, history)
            _validate(model, val_tokens, eos_id, loop.seq_len, step, val_history, log)
            save_checkpoint(model, tokenizer, out_dir, record, history, val_history)
            log(f"checkpoint at step {step} -> {out_dir}")
            last_ckpt = time.time()

    _record_progress(record, step, tokens_seen, t_loop, history)
    _validate(model, val_tokens, eos_id, loop.seq_len, step, val_history, log)
    record["validation_history"] = val_history
    if final_eval and splits["test"]:
        t_eval = time.time()
        record["test"] = evaluate_split(model, tokenizer, splits["test"], loop.seq_len)
        record["test"]["eval_s"] = round(time.time() - t_eval, 1)
        log(
            f"test split: {record['test']['files']} files, ppl {record['test']['perplexity']:.3f}, "
            f"{record['test']['bits_per_byte']:.4f} bits/byte"
        )
    record["total_wall_s"] = round(time.time() - t_start, 1)
    save_checkpoint(model, tokenizer, out_dir, record, history, val_history)
    if final_eval:
        record["completions"] = greedy_completions(out_dir)
        for c in record["completions"]:
            log(f"--- {c['prompt']!r} -> {c['completion']!r}")
        record["total_wall_s"] = round(time.time() - t_start, 1)
        save_checkpoint(model, tokenizer, out_dir, record, history, val_history)
    log(f"done in {record['total_wall_s']:.0f}s -> {out_dir}")
    return record


def _first_tokens(token_lists: list[list[int]], limit: int) -> list[list[int]]:
    out, n = [], 0
    for ids in token_lists:
        if n >= limit:
            break
        out.append(ids[: limit - n])
        n += len(out[-1])
    return out


def _record_progress(record: dict, step: int, tokens: int, t_loop: float, history: list[dict]) -> None:
    el = time.time() - t_loop
    record.update(
        steps=step,
        tokens_seen=tokens,
        train_wall_s=round(el, 1),
        tokens_per_s=round(tokens / max(el, 1e-9), 1),
        final_train_loss=history[-1]["loss"] if history else None,
        history=history,
    )


def _validate(model, val_tokens, eos_id: int, seq_len: int, step: int, val_history: list, log) -> None:
    if not val_tokens:
        return
    nats, count = split_nll(model, val_tokens, eos_id, seq_len)
    val_history.append({"step": step, "loss": nats / count})
    log(f"step {step} validation loss {nats / count:.4f} ({count} tokens)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="training YAML (default: the packaged configs/train.yaml)")
    parser.add_argument("--out", required=True, help="checkpoint directory (replaced atomically)")
    parser.add_argument("--corpus", help="directory of .py files (default: this Python's stdlib)")
    parser.add_argument("--splits-dir", help="write calibration/validation/test JSONL + manifest here")
    parser.add_argument("--max-steps", type=int, help="override train.max_steps")
    parser.add_argument("--time-budget", type=float, help="override train.time_budget_s (seconds)")
    parser.add_argument("--no-eval", action="store_true", help="skip test-split metrics and completions")
    parser.add_argument("--init-from", help="warm-start from this checkpoint (weights + tokenizer)")
    parser.add_argument("--seed", type=int, help="override seed (a warm start should take a new data order)")


def run(args: argparse.Namespace) -> int:
    cfg = load_train_config(args.config)
    if args.max_steps is not None:
        cfg.train.max_steps = args.max_steps
    if args.time_budget is not None:
        cfg.train.time_budget_s = args.time_budget
    if args.seed is not None:
        cfg.seed = args.seed
    if args.corpus is not None and not Path(args.corpus).is_dir():
        raise MLAQuantError(f"corpus directory {args.corpus} does not exist")
    command = "mlaquant " + shlex.join(sys.argv[1:])
    train(
        cfg,
        args.out,
        corpus_root=args.corpus,
        splits_dir=args.splits_dir,
        final_eval=not args.no_eval,
        command=command,
        log=lambda msg: print(msg, flush=True),
        init_from=args.init_from,
    )
    return 0
