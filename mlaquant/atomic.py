"""Write a directory all at once: build it beside its destination, then swap it in by rename."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(out_dir: str | Path) -> Iterator[Path]:
    """Yield an empty temp directory beside `out_dir`. When the block ends normally the temp directory
    replaces `out_dir` (an existing one is renamed aside, then removed); when it raises, or is
    interrupted, the temp directory is deleted and `out_dir` is left as it was."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
