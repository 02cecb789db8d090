"""Versions of mlaquant and of the libraries around it, as every record a command writes states them (plans,
reports, benchmark JSON)."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version


def package_version(name: str) -> str | None:
    """The installed distribution's version, or None when it is not installed."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def library_versions(*packages: str) -> dict[str, str | None]:
    """{"mlaquant", "torch", "python"} and each of `packages` (None where not installed)."""
    import torch

    import mlaquant

    out = {"mlaquant": mlaquant.__version__, "torch": str(torch.__version__), "python": platform.python_version()}
    return out | {p: package_version(p) for p in packages}
