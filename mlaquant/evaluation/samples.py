"""Text sources → deterministic token samples for calibration, plan search, evaluation and export.

Sources: a text file, a directory of text files (recursively, sorted by path), JSONL with a `text`
field per line (the bundled splits, `mlaquant.calib.data`, are JSONL), or a list of those, read in order.

Sampling: documents are tokenized, joined with the EOS token, cut into non-overlapping windows of
`seq_len` tokens, and `n` windows are drawn without replacement with a seeded generator. When the
source has fewer windows than asked, all of them are used and a warning says so (documented
down-sampling); a source with no full window is an error.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from mlaquant.errors import MLAQuantError

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".yaml", ".yml", ".toml", ".js", ".ts")


def load_texts(source: str | Path | Sequence[str | Path]) -> list[str]:
    """Documents from a text file, a directory of text files, a JSONL file with a `text` field, or a list of
    those (in order)."""
    if isinstance(source, (list, tuple)):
        return [text for one in source for text in load_texts(one)]
    path = Path(source)
    if not path.exists():
        raise MLAQuantError(f"{path}: data not found")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    elif path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise MLAQuantError(f"{path}:{n}: invalid JSON ({e.msg})") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise MLAQuantError(f"{path}:{n}: expected an object with a string 'text' field")
            texts.append(obj["text"])
    else:
        texts = [path.read_text(encoding="utf-8", errors="replace")]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise MLAQuantError(f"{path}: no text in data")
    return texts


def token_stream(tokenizer, texts: list[str], eos_id: int | None) -> torch.Tensor:
    """All documents tokenized and joined by EOS: int64 [N]."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        if eos_id is not None:
            ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


_STREAMS: dict = {}  # (tokenizer, source, eos_id) → token stream: a process tokenizes each source once


def _stream(tokenizer, source, eos_id: int | None) -> torch.Tensor:
    """`token_stream` of `source`, kept for the process under the tokenizer's serialized form (sources are read
    once: files changed while a command runs are not re-read); at most 4 sources are kept."""
    if not hasattr(tokenizer, "to_str"):
        return token_stream(tokenizer, load_texts(source), eos_id)
    paths = tuple(str(Path(p).resolve()) for p in (source if isinstance(source, (list, tuple)) else [source]))
    key = (hashlib.sha256(tokenizer.to_str().encode()).hexdigest(), paths, eos_id)
    if key not in _STREAMS:
        if len(_STREAMS) >= 4:
            _STREAMS.pop(next(iter(_STREAMS)))
        _STREAMS[key] = token_stream(tokenizer, load_texts(source), eos_id)
    return _STREAMS[key]


def token_samples(
    tokenizer, source: str | Path | Sequence[str | Path], n: int, seq_len: int, seed: int = 0, eos_id: int | None = None
) -> torch.Tensor:
    """`n` deterministic windows of `seq_len` tokens from `source`: int64 [n', seq_len], n' ≤ n."""
    if n <= 0 or seq_len <= 1:
        raise MLAQuantError(f"need samples > 0 and seq_len > 1, got samples={n}, seq_len={seq_len}")
    stream = _stream(tokenizer, source, eos_id)
    windows = stream.numel() // seq_len
    if windows == 0:
        raise MLAQuantError(f"{source}: {stream.numel()} tokens, fewer than one sample of {seq_len}")
    if windows < n:
        warnings.warn(
            f"{source}: {stream.numel()} tokens hold only {windows} samples of {seq_len}; using {windows} "
            f"instead of {n}",
            stacklevel=2,
        )
        n = windows
    order = torch.randperm(windows, generator=torch.Generator().manual_seed(seed))[:n].sort().values
    return stream[: windows * seq_len].view(windows, seq_len)[order]
