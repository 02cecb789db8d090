"""The training corpus: Python standard-library source files, split by file into four disjoint sets.

Every machine that runs Python has this corpus offline. `collect_sources(root)` lists the `.py` files
under a directory (by default the running interpreter's stdlib, `sysconfig.get_paths()['stdlib']`,
without `site-packages`). `split_sources` assigns each file to train / calibration / validation / test
from a SHA-256 hash of its relative path, so the split does not depend on file order or on which
other files exist. The held-out splits are capped in bytes (files are taken in hash order until the
cap) so they ship as package data; held-out files over the cap are used by no split at all.

`write_splits` writes `calibration.jsonl`, `validation.jsonl`, `test.jsonl` (one object per file:
`{"path": relative path, "text": source}`) and `manifest.json` (Python version, and for every file its
split, size in bytes and sha256) atomically into a directory such as `calib/data/`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import sysconfig
from pathlib import Path

from mlaquant.atomic import atomic_write
from mlaquant.errors import MLAQuantError

HELD_OUT = ("calibration", "validation", "test")
SPLITS = ("train",) + HELD_OUT


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One corpus file: `path` is relative to the corpus root (POSIX separators)."""

    path: str
    text: str

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def collect_sources(root: str | Path | None = None, max_file_bytes: int = 0) -> list[SourceFile]:
    """All `.py` files under `root` (default: the stdlib), sorted by path, `site-packages` excluded.

    Files that are not valid UTF-8 are skipped (a handful of stdlib test fixtures are deliberately
    broken); `max_file_bytes > 0` also skips larger files (generated tables, not code).
    Raises MLAQuantError if `root` is missing, not a directory, or holds no usable `.py` file.
    """
    root = stdlib_root() if root is None else Path(root)
    if not root.exists():
        raise MLAQuantError(f"corpus directory {root} does not exist")
    if not root.is_dir():
        raise MLAQuantError(f"corpus path {root} is not a directory")
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts or not p.is_file():
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip() or (max_file_bytes > 0 and len(text.encode("utf-8")) > max_file_bytes):
            continue
        files.append(SourceFile(rel.as_posix(), text))
    if not files:
        raise MLAQuantError(f"corpus directory {root} contains no non-empty UTF-8 .py files")
    return files


def path_fraction(path: str) -> float:
    """Deterministic position of `path` in [0, 1) from the first 8 bytes of its SHA-256."""
    digest = hashlib.sha256(path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_sources(
    files: list[SourceFile], held_out_fraction: float = 0.04, max_split_bytes: int = 1_500_000
) -> dict[str, list[SourceFile]]:
    """Split `files` into train and the three held-out sets by path hash.

    A file whose hash falls in [0, f) is calibration, [f, 2f) validation, [2f, 3f) test, the rest is
    train (f = `held_out_fraction`). Each held-out set keeps files in hash order while its total stays
    within `max_split_bytes`; the files it drops are not used for training either, so no held-out file
    ever reaches the model.
    """
    if not 0 < held_out_fraction < 1 / 3:
        raise MLAQuantError(f"held_out_fraction must be in (0, 1/3), got {held_out_fraction}")
    buckets: dict[str, list[tuple[float, SourceFile]]] = {s: [] for s in SPLITS}
    for f in files:
        x = path_fraction(f.path)
        k = int(x / held_out_fraction)
        buckets[HELD_OUT[k] if k < len(HELD_OUT) else "train"].append((x, f))
    out = {"train": [f for _, f in buckets["train"]]}
    for name in HELD_OUT:
        kept, total = [], 0
        for _, f in sorted(buckets[name], key=lambda t: t[0]):
            if total + f.nbytes <= max_split_bytes:
                kept.append(f)
                total += f.nbytes
        out[name] = sorted(kept, key=lambda f: f.path)
    return out


def write_splits(splits: dict[str, list[SourceFile]], out_dir: str | Path, source_root: str | Path) -> dict:
    """Write the held-out splits as JSONL plus `manifest.json` into `out_dir`; returns the manifest."""
    out_dir = Path(out_dir)
    manifest = {
        "version": 1,
        "python_version": platform.python_version(),
        "source_root": str(source_root),
        "split_rule": "sha256(relative path) -> [0,1); calibration/validation/test by bucket, capped",
        "splits": {},
    }
    for name in HELD_OUT:
        lines = [json.dumps({"path": f.path, "text": f.text}, ensure_ascii=False) for f in splits[name]]
        atomic_write(out_dir / f"{name}.jsonl", "".join(line + "\n" for line in lines))
        manifest["splits"][name] = {
            "file": f"{name}.jsonl",
            "bytes": sum(f.nbytes for f in splits[name]),
            "files": [{"path": f.path, "bytes": f.nbytes, "sha256": f.sha256} for f in splits[name]],
        }
    train = splits["train"]
    manifest["splits"]["train"] = {"files": len(train), "bytes": sum(f.nbytes for f in train)}
    atomic_write(out_dir / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return manifest
