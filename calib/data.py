"""The bundled held-out text splits: `mlaquant.calib/data/{calibration,validation,test}.jsonl`, and the
off-distribution text the reports add beside them.

The splits are held out from training by file and disjoint (see `manifest.json`); `mlaquant.evaluation.samples` turns
any of them (or any other text source) into deterministic token samples. The bundled model and its splits
come from the Python stdlib; `shift_source` is Python of installed third-party packages (`SHIFT_PACKAGES`),
read where it is installed at run time, never shipped as data.
"""

from __future__ import annotations

import importlib.util
from importlib import metadata, resources
from pathlib import Path

from mlaquant.errors import MLAQuantError

SPLITS = ("calibration", "validation", "test")


def split_path(name: str) -> Path:
    """Path of a bundled split ('calibration', 'validation' or 'test')."""
    if name not in SPLITS:
        raise MLAQuantError(f"unknown split '{name}' (known: {', '.join(SPLITS)})")
    return Path(str(resources.files("mlaquant.calib").joinpath(f"data/{name}.jsonl")))


# packages of torch, which the README's install pins (torch==2.13.0): the same text on every machine that follows it;
# "validation" is the plan search's second domain, "test" the reported off-distribution text (disjoint files)
SHIFT_PACKAGES = {"validation": ("torch.distributed", "torch.utils"), "test": ("torch.nn", "torch.optim", "torch.fx")}


def shift_source(split: str = "test") -> tuple[Path, ...]:
    """The directories of `SHIFT_PACKAGES[split]` as installed (module docstring): a source
    `mlaquant.evaluation.samples` reads."""
    dirs = []
    for name in SHIFT_PACKAGES[split]:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise MLAQuantError(f"off-distribution text: package {name} is not installed")
        dirs.append(Path(next(iter(spec.submodule_search_locations))))
    return tuple(dirs)


def shift_description(split: str = "test") -> str:
    """What `shift_source(split)` reads, with the version: 'torch 2.13.0+cpu: nn, optim, fx (third-party Python)'."""
    parts = ", ".join(name.split(".", 1)[1] for name in SHIFT_PACKAGES[split])
    return f"torch {metadata.version('torch')}: {parts} (third-party Python)"
