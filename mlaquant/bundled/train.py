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
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from mlaquant.atomic import atomic_directory
from mlaquant.bundled import corpus as corpus_mod
from mlaquant.config import load_config, to_dict
from mlaquant.errors import MLAQuantError
from mlaquant.evaluation.eval import position_spans
from mlaquant.versions import library_versions

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
    # Context extension: from progress `extend_from` ∈ (0, 1) on, train on rows of `extend_seq_len`
    # tokens, `extend_batch_size` per step (0 = no extension). Validation and test use the longer window.
    extend_seq_len: int = 0
    extend_batch_size: int = 2
    extend_from: float = 1.0

    @property
    def context(self) -> int:
        """The longest window the run trains on: `extend_seq_len` when extending, else `seq_len`."""
        return max(self.seq_len, self.extend_seq_len)


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
        # V3 routing, spelled out: transformers assumes it, vLLM and llama.cpp read these keys (softmax without)
        scoring_func="sigmoid",
        topk_method="noaux_tc",
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


POSITION_BUCKETS = (0, 256, 512, 1024, 2048, 4096)


def split_nll(model, token_lists: list[list[int]], eos_id: int, window: int, batch_size: int = 8) -> tuple[float, int]:
    """Total NLL (nats) of every token of the split, each predicted once with ≤ `window` tokens of context.

    The stream is `[eos] f1 [eos] f2 ...`; windows of `window + 1` tokens overlap by one so each token
    after the leading eos is a target exactly once (the eos between files counts as a target too).
    Returns (total nats, number of targets).
    """
    nats, _, valid = position_nll(model, token_lists, eos_id, window, batch_size)
    return float(nats.sum()), int(valid.sum())


@torch.no_grad()
def position_nll(
    model, token_lists: list[list[int]], eos_id: int, window: int, batch_size: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-target NLL of the split cut as in `split_nll`: (nats [W, window] float64, target ids
    [W, window] int64, valid [W, window] bool), row w = window w, column p = the target at position p
    (predicted from p + 1 tokens of context)."""
    stream = torch.tensor([t for ids in token_lists for t in [eos_id, *ids]], dtype=torch.long)
    starts = list(range(0, len(stream) - 1, window))
    model.eval()
    nats_rows, target_rows, valid_rows = [], [], []
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
        pad = window - valid.shape[1]
        nats_rows.append(torch.nn.functional.pad(nll.double() * valid, (0, pad)))
        target_rows.append(torch.nn.functional.pad(ids[:, 1:], (0, pad), value=eos_id))
        valid_rows.append(torch.nn.functional.pad(valid, (0, pad)))
    return torch.cat(nats_rows), torch.cat(target_rows), torch.cat(valid_rows)


def token_bytes(tokenizer) -> torch.Tensor:
    """UTF-8 bytes each token id stands for, [V] int64 (byte-level BPE: one symbol per byte; the
    special tokens stand for none)."""
    vocab = tokenizer.get_vocab()
    out = torch.zeros(max(vocab.values()) + 1, dtype=torch.long)
    for piece, i in vocab.items():
        out[i] = 0 if piece == EOS else len(piece)
    return out


def bucket_metrics(nats: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, nbytes: torch.Tensor) -> list[dict]:
    """Loss and bits per byte by target position ([lo, hi) of `POSITION_BUCKETS` within its window),
    from `position_nll`'s tensors and `token_bytes`; buckets the window does not reach are left out."""
    out = []
    for lo, hi in position_spans(nats.shape[1], edges=POSITION_BUCKETS):
        sel = valid[:, lo:hi]
        n = int(sel.sum())
        if n == 0:
            continue
        total = float(nats[:, lo:hi].sum())
        b = int((nbytes[targets[:, lo:hi]] * sel).sum())
        out.append(
            {
                "positions": [lo, hi],
                "tokens": n,
                "loss": total / n,
                "bits_per_byte": total / math.log(2) / b,
            }
        )
    return out


def evaluate_split(model, tokenizer, files: list[corpus_mod.SourceFile], window: int) -> dict:
    """Perplexity and bits per byte (total NLL in bits / UTF-8 bytes of the texts) of a split, with
    each token seen from ≤ `window` tokens of context, and the same by position bucket (`bucket_metrics`)."""
    eos_id = tokenizer.token_to_id(EOS)
    token_lists = [e.ids for e in tokenizer.encode_batch([f.text for f in files])]
    nats_t, targets, valid = position_nll(model, token_lists, eos_id, window)
    nats, count = float(nats_t.sum()), int(valid.sum())
    nbytes = sum(f.nbytes for f in files)
    return {
        "files": len(files),
        "bytes": nbytes,
        "window": window,
        "tokens": count,
        "loss": nats / count,
        "perplexity": math.exp(nats / count),
        "bits_per_byte": nats / math.log(2) / nbytes,
        "by_position": bucket_metrics(nats_t, targets, valid, token_bytes(tokenizer)),
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


@dataclasses.dataclass
class Corpus:
    """The corpus at `root` split by file (`corpus.split_sources`: 'train', 'validation', 'test', ...)."""

    root: Path
    splits: dict[str, list[corpus_mod.SourceFile]]


@dataclasses.dataclass
class TrainData:
    """The tokenizer and what it made of the corpus.

    `rows`: the train split packed, files in a seeded order, [N, seq_len] int64; `long_rows`: the same
    stream packed for context extension, [N', extend_seq_len] int64 (None without extension);
    `val_tokens`: the validation split's token ids (at most 32 windows of the run's context);
    `previous`: the records of the runs a warm start continues (oldest first, empty otherwise).
    """

    tokenizer: object
    eos_id: int
    rows: torch.Tensor
    long_rows: torch.Tensor | None
    train_bytes: int
    val_tokens: list[list[int]]
    previous: list[dict]


@dataclasses.dataclass
class LoopState:
    """Where the training loop stands: optimizer steps and tokens trained on since `t_loop` (time.time()),
    the per-log mean training losses and the validation losses measured at checkpoints."""

    t_loop: float
    step: int = 0
    extended_at: int | None = None
    tokens_seen: int = 0
    history: list[dict] = dataclasses.field(default_factory=list)
    val_history: list[dict] = dataclasses.field(default_factory=list)


def load_corpus(cfg: TrainConfig, corpus_root: str | Path | None, splits_dir: str | Path | None, log) -> Corpus:
    """Stage data (1/2): collect and split the corpus (`corpus_root`, else `cfg.corpus.root`, else the
    stdlib); the held-out JSONL splits go to `splits_dir` when given."""
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
    return Corpus(root, splits)


def load_warm_start(init_from: Path) -> tuple[object, list[dict]]:
    """The tokenizer of a checkpoint written by `train`, and its record with the runs before it."""
    from tokenizers import Tokenizer

    if not (init_from / "tokenizer.json").is_file() or not (init_from / "model.safetensors").is_file():
        raise MLAQuantError(f"{init_from}: not a checkpoint written by `mlaquant train`")
    tokenizer = Tokenizer.from_file(str(init_from / "tokenizer.json"))
    old_record = json.loads((init_from / "training.json").read_text())
    return tokenizer, [*old_record.pop("previous_runs", []), old_record]


def tokenize(cfg: TrainConfig, corpus: Corpus, init_from: Path | None, log, t_start: float) -> TrainData:
    """Stage data (2/2): the tokenizer (trained on the train split, or the warm start's), the packed train
    rows and the validation tokens."""
    train_texts = [f.text for f in corpus.splits["train"]]
    if init_from is not None:
        tokenizer, previous = load_warm_start(init_from)
    else:
        tokenizer, previous = train_tokenizer(train_texts, cfg.tokenizer.vocab_size), []
    eos_id = tokenizer.token_to_id(EOS)
    order = np.random.default_rng(cfg.seed).permutation(len(train_texts))
    encoded = tokenizer.encode_batch([train_texts[i] for i in order])
    rows = pack([e.ids for e in encoded], eos_id, cfg.train.seq_len)  # [N, seq_len]
    ext = cfg.train.extend_seq_len
    long_rows = pack([e.ids for e in encoded], eos_id, ext) if ext else None  # [N', extend_seq_len]
    train_bytes = sum(f.nbytes for f in corpus.splits["train"])
    log(
        f"tokenizer: vocab {tokenizer.get_vocab_size()}, {rows.numel()} train tokens in {len(rows)} rows "
        f"({train_bytes / rows.numel():.2f} bytes/token), {time.time() - t_start:.0f}s"
    )
    val_tokens = [e.ids for e in tokenizer.encode_batch([f.text for f in corpus.splits["validation"]])]
    val_tokens = _first_tokens(val_tokens, 32 * cfg.train.context)
    return TrainData(tokenizer, eos_id, rows, long_rows, train_bytes, val_tokens, previous)


def build_model(cfg: TrainConfig, data: TrainData, init_from: Path | None, log):
    """Stage model: a fresh fp32 `DeepseekV3ForCausalLM` for `cfg.model` (initialised from the torch RNG),
    or the warm start's weights."""
    from transformers import DeepseekV3ForCausalLM

    if init_from is not None:
        model = DeepseekV3ForCausalLM.from_pretrained(init_from).float()
    else:
        model = DeepseekV3ForCausalLM(hf_config(cfg.model, data.tokenizer.get_vocab_size(), data.eos_id)).float()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params} parameters ({n_params * 4 / 2**20:.1f} MiB fp32)")
    return model


def build_optimizer(model, loop: LoopConfig) -> torch.optim.AdamW:
    """Stage optimizer: AdamW, weight decay on the ≥ 2-D weights except embeddings."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": loop.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=loop.lr,
        betas=(0.9, 0.95),
    )


def new_record(
    cfg: TrainConfig, command: str | None, model, corpus: Corpus, data: TrainData, init_from: Path | None
) -> dict:
    """The training record (training.json) as known before the first step."""
    versions = library_versions()
    return {
        "config": to_dict(cfg),
        "command": command,
        "python_version": versions["python"],
        "torch_version": versions["torch"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": data.tokenizer.get_vocab_size(),
        "train_files": len(corpus.splits["train"]),
        "train_bytes": data.train_bytes,
        "train_tokens_available": int(data.rows.numel()),
        "init_from": None if init_from is None else str(init_from),
        "previous_runs": data.previous,
    }


def train_step(model, opt: torch.optim.Optimizer, batch: torch.Tensor, lr: float, grad_clip: float) -> float:
    """One optimizer step at learning rate `lr` on `batch` [B, seq_len] int64; returns its loss."""
    for g in opt.param_groups:
        g["lr"] = lr
    model.train()
    loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return loss.item()


def train_loop(
    model, opt: torch.optim.Optimizer, data: TrainData, cfg: TrainConfig, out_dir: str | Path, record: dict, log
) -> LoopState:
    """Stage loop: steps over seeded permutations of `data.rows` (from progress `extend_from` on, of
    `data.long_rows`) until `max_steps` or `time_budget_s`, logging every `log_every` steps; every
    `checkpoint_every_s` the record is updated, validation measured and a checkpoint saved to `out_dir`."""
    loop = cfg.train
    gen = torch.Generator().manual_seed(cfg.seed)
    rows, batch_size = data.rows, loop.batch_size
    perm, cursor = torch.randperm(len(rows), generator=gen), 0
    state = LoopState(t_loop=time.time())
    last_ckpt = state.t_loop
    window_loss, window_n = 0.0, 0
    while True:
        progress = max(state.step / loop.max_steps, (time.time() - state.t_loop) / loop.time_budget_s)
        if progress >= 1.0:
            break
        if data.long_rows is not None and rows is data.rows and progress >= loop.extend_from:
            rows, batch_size = data.long_rows, loop.extend_batch_size
            perm, cursor = torch.randperm(len(rows), generator=gen), 0
            state.extended_at = state.step
            log(f"step {state.step}: context extension to {rows.shape[1]} tokens, batch {batch_size}")
        if cursor + batch_size > len(perm):
            perm, cursor = torch.randperm(len(rows), generator=gen), 0
        batch = rows[perm[cursor : cursor + batch_size]]  # [B, seq_len or extend_seq_len]
        cursor += batch_size
        lr = lr_at(loop, state.step, progress)
        window_loss += train_step(model, opt, batch, lr, loop.grad_clip)
        window_n += 1
        state.step += 1
        state.tokens_seen += batch.numel()
        if state.step % loop.log_every == 0 or state.step == 1:
            el = time.time() - state.t_loop
            state.history.append(
                {"step": state.step, "loss": window_loss / window_n, "lr": lr, "elapsed_s": round(el, 1)}
            )
            log(
                f"step {state.step} loss {window_loss / window_n:.4f} lr {lr:.2e} "
                f"{state.tokens_seen / el:.0f} tok/s elapsed {el:.0f}s"
            )
            window_loss, window_n = 0.0, 0
        if time.time() - last_ckpt >= loop.checkpoint_every_s:
            _record_progress(record, state)
            _validate(model, data.val_tokens, data.eos_id, loop.context, state.step, state.val_history, log)
            save_checkpoint(model, data.tokenizer, out_dir, record, state.history, state.val_history)
            log(f"checkpoint at step {state.step} -> {out_dir}")
            last_ckpt = time.time()
    return state


def evaluate_and_save(
    model,
    data: TrainData,
    corpus: Corpus,
    cfg: TrainConfig,
    record: dict,
    state: LoopState,
    out_dir: str | Path,
    final_eval: bool,
    t_start: float,
    log,
) -> dict:
    """Stage eval: final validation, with `final_eval` test-split metrics and greedy completions from the
    saved checkpoint; the record is completed and saved with the model to `out_dir`, and returned.
    The test split is scored with windows of `seq_len` (`test`) and, when the run extends its context,
    of `extend_seq_len` too (`test_long`)."""
    _record_progress(record, state)
    _validate(model, data.val_tokens, data.eos_id, cfg.train.context, state.step, state.val_history, log)
    record["validation_history"] = state.val_history
    windows = {"test": cfg.train.seq_len, "test_long": cfg.train.extend_seq_len}
    for key, window in windows.items():
        if not (final_eval and corpus.splits["test"] and window):
            continue
        t_eval = time.time()
        record[key] = evaluate_split(model, data.tokenizer, corpus.splits["test"], window)
        record[key]["eval_s"] = round(time.time() - t_eval, 1)
        buckets = ", ".join(
            f"{b['positions'][0]}-{b['positions'][1]}: {b['bits_per_byte']:.4f}" for b in record[key]["by_position"]
        )
        log(
            f"test split, window {window}: {record[key]['files']} files, ppl {record[key]['perplexity']:.3f}, "
            f"{record[key]['bits_per_byte']:.4f} bits/byte ({buckets})"
        )
    record["total_wall_s"] = round(time.time() - t_start, 1)
    save_checkpoint(model, data.tokenizer, out_dir, record, state.history, state.val_history)
    if final_eval:
        record["completions"] = greedy_completions(out_dir)
        for c in record["completions"]:
            log(f"--- {c['prompt']!r} -> {c['completion']!r}")
        record["total_wall_s"] = round(time.time() - t_start, 1)
        save_checkpoint(model, data.tokenizer, out_dir, record, state.history, state.val_history)
    log(f"done in {record['total_wall_s']:.0f}s -> {out_dir}")
    return record


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

    Stages: data (`load_corpus`, `tokenize`) → model (`build_model`) → optimizer (`build_optimizer`) →
    loop (`train_loop`) → eval (`evaluate_and_save`).
    `corpus_root` (else `cfg.corpus.root`, else the stdlib) is split by file; only the train split is
    trained on. `splits_dir` receives the held-out JSONL splits and manifest. With `final_eval`, the
    record gains test-split perplexity / bits per byte and greedy completions from the saved model.
    `init_from` warm-starts from a checkpoint written by this function (its weights and tokenizer; the
    optimizer restarts with a fresh warmup) and carries its record forward as `previous_runs`.
    """
    check_mla_shape(cfg.model)
    init_from = None if init_from is None else Path(init_from)
    torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    t_start = time.time()
    corpus = load_corpus(cfg, corpus_root, splits_dir, log)
    data = tokenize(cfg, corpus, init_from, log, t_start)
    model = build_model(cfg, data, init_from, log)
    opt = build_optimizer(model, cfg.train)
    record = new_record(cfg, command, model, corpus, data, init_from)
    state = train_loop(model, opt, data, cfg, out_dir, record, log)
    return evaluate_and_save(model, data, corpus, cfg, record, state, out_dir, final_eval, t_start, log)


def _first_tokens(token_lists: list[list[int]], limit: int) -> list[list[int]]:
    out, n = [], 0
    for ids in token_lists:
        if n >= limit:
            break
        out.append(ids[: limit - n])
        n += len(out[-1])
    return out


def _record_progress(record: dict, state: LoopState) -> None:
    el = time.time() - state.t_loop
    record.update(
        steps=state.step,
        tokens_seen=state.tokens_seen,
        train_wall_s=round(el, 1),
        tokens_per_s=round(state.tokens_seen / max(el, 1e-9), 1),
        final_train_loss=state.history[-1]["loss"] if state.history else None,
        extended_at_step=state.extended_at,
        history=state.history,
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
