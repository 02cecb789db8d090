"""Released distributions of other projects, fetched once into a local cache and unpacked: the engines'
wheels whose loader code the tests execute (vLLM, SGLang), llama.cpp's converter from the llama-cpp-python
sdist.

    cache       $MLAQUANT_CACHE, else $XDG_CACHE_HOME/mlaquant, else ~/.cache/mlaquant
    fetch       `pip download --no-deps` of exactly `name==version` (a wheel, or the sdist with
                `sdist=True`) into cache/downloads, then unpacked into cache/<name>-<version>[-sdist]/;
                both steps atomic (a temp directory renamed into place), so an interrupted fetch leaves
                nothing half-written and the next call starts over
    offline     a distribution already unpacked is used without touching the network; one that is not, with
                no registry reachable, is a `DistributionError` naming it and the command that failed
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from mlaquant.atomic import atomic_directory
from mlaquant.errors import MLAQuantError


class DistributionError(MLAQuantError):
    """A distribution that cannot be fetched or unpacked here (the message names it and why)."""


def cache_dir() -> Path:
    """The cache root (module docstring)."""
    if os.environ.get("MLAQUANT_CACHE"):
        return Path(os.environ["MLAQUANT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlaquant"


def fetch(name: str, version: str, sdist: bool = False, suffixes: tuple[str, ...] = (), timeout: float = 600.0) -> Path:
    """The unpacked directory of `name==version` (a wheel's files, or the sdist's top directory), fetched on
    first use (module docstring); only members ending in `suffixes` when given (e.g. (".py",): an engine's
    Python without its compiled kernels). DistributionError when it is not cached and cannot be downloaded."""
    tag = ("-sdist" if sdist else "") + ("-" + "".join(s.strip(".") for s in suffixes) if suffixes else "")
    target = cache_dir() / f"{name}-{version}{tag}"
    if not target.is_dir():
        archive = _download(name, version, sdist, timeout)
        with atomic_directory(target, mode=0o755) as tmp:
            _unpack(archive, tmp, suffixes)
    return _sdist_root(target) if sdist else target


def _download(name: str, version: str, sdist: bool, timeout: float) -> Path:
    """The downloaded archive of name==version in cache/downloads (downloaded when missing)."""
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    found = _archive_in(downloads, name, version, sdist)
    if found is not None:
        return found
    kind = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".partial-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *kind, "--quiet", "-d", tmp, f"{name}=={version}"]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DistributionError(f"{name}=={version}: download timed out after {timeout:.0f} s") from None
        if run.returncode != 0:
            last = next((ln for ln in reversed(run.stderr.splitlines()) if ln.strip()), f"exit {run.returncode}")
            raise DistributionError(f"{name}=={version}: not in the cache and `pip download` failed ({last.strip()})")
        got = _archive_in(Path(tmp), name, version, sdist)
        if got is None:
            raise DistributionError(f"{name}=={version}: pip download gave no {'sdist' if sdist else 'wheel'}")
        final = downloads / got.name
        os.replace(got, final)
    return final


def _archive_in(folder: Path, name: str, version: str, sdist: bool) -> Path | None:
    stem = f"{name.replace('-', '_').lower()}-{version}"
    suffixes = (".tar.gz", ".zip") if sdist else (".whl",)
    for p in sorted(folder.iterdir()):
        if p.name.lower().replace("-", "_").startswith(stem.replace("-", "_")) and p.name.endswith(suffixes):
            return p
    return None


def _unpack(archive: Path, into: Path, suffixes: tuple[str, ...]) -> None:
    """Extract a wheel/zip or a .tar.gz into `into` (only members ending in `suffixes` when given), refusing
    members that would land outside it."""
    keep = (lambda n: n.endswith(suffixes)) if suffixes else (lambda n: True)
    if archive.name.endswith(".tar.gz"):
        with tarfile.open(archive) as tar:
            tar.extractall(into, members=[m for m in tar.getmembers() if m.isdir() or keep(m.name)], filter="data")
        return
    root = into.resolve()
    with zipfile.ZipFile(archive) as zf:
        members = [m for m in zf.namelist() if keep(m)]
        for member in members:
            if not (root / member).resolve().is_relative_to(root):
                raise DistributionError(f"{archive.name}: member {member!r} lies outside the archive")
        zf.extractall(into, members)


def _sdist_root(target: Path) -> Path:
    """An sdist's single top-level directory."""
    entries = [p for p in target.iterdir() if p.is_dir()]
    if len(entries) != 1:
        raise DistributionError(f"{target}: expected one top-level directory in the sdist, found {len(entries)}")
    return entries[0]
