"""Atomic writes: a file or a whole directory appears complete at its path, or not at all.

Both build their output beside the destination (same filesystem), fsync it, rename it into place,
then fsync the parent directory so the rename itself survives a crash. An exception or interrupt
leaves the destination as it was and removes the temporary.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_directory(path: str | Path) -> None:
    """fsync a directory, so that renames and new entries in it are durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and Windows) refuse fsync on a directory: the rename still happened
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        fsync_directory(d)


def atomic_write(path: str | Path, data: bytes | str, mode: int = 0o644) -> None:
    """Write `data` (str is UTF-8 encoded) to `path`: temp file beside it, fsync, chmod `mode`,
    rename, fsync of the directory. The parent directory is created if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp makes 0600
        os.replace(tmp, path)
        fsync_directory(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: str | Path, obj, indent: int = 2) -> None:
    """`atomic_write` of `obj` as JSON (a measurement script's --out)."""
    atomic_write(path, json.dumps(obj, indent=indent) + "\n")


def _aside(out_dir: Path) -> Path:
    return out_dir.with_name(f".{out_dir.name}.old")


def recover_directory(out_dir: str | Path) -> None:
    """Settle a replacement by `atomic_directory` that was killed between its two renames: the previous
    directory, set aside at `.<name>.old`, goes back where `out_dir` is missing, and is deleted where the
    new `out_dir` is already in place. A no-op when there is nothing set aside."""
    out_dir = Path(out_dir)
    old = _aside(out_dir)
    if not old.is_dir():
        return
    if out_dir.exists():
        shutil.rmtree(old)
    else:
        os.replace(old, out_dir)


@contextlib.contextmanager
def atomic_directory(out_dir: str | Path, mode: int = 0o700) -> Iterator[Path]:
    """Yield an empty temp directory beside `out_dir`. When the block ends normally its files are
    fsynced, it gets permission bits `mode` (0700 is mkdtemp's own) and it replaces `out_dir` (an
    existing one is renamed aside to `.<name>.old`, then removed); when it raises, or is interrupted,
    the temp directory is deleted and `out_dir` is left as it was. A replacement killed between its
    renames is settled by `recover_directory`, which runs first."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    recover_directory(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp", dir=out_dir.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        os.chmod(tmp, mode)
        if out_dir.exists():
            os.replace(out_dir, _aside(out_dir))
        os.replace(tmp, out_dir)
        fsync_directory(out_dir.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
        recover_directory(out_dir)
