"""The bundled held-out text splits: `mlaquant.calib/data/{calibration,validation,test}.jsonl`.

Held out from training by file and disjoint (see `manifest.json`); `mlaquant.samples` turns any of
them (or any other text source) into deterministic token samples.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from mlaquant.errors import MLAQuantError

SPLITS = ("calibration", "validation", "test")


def split_path(name: str) -> Path:
    """Path of a bundled split ('calibration', 'validation' or 'test')."""
    if name not in SPLITS:
        raise MLAQuantError(f"unknown split '{name}' (known: {', '.join(SPLITS)})")
    return Path(str(resources.files("mlaquant.calib").joinpath(f"data/{name}.jsonl")))
