"""Dataclass configs loaded from YAML: strict keys, versioned, round-trippable.

Every config in `mlaquant.configs/*.yaml` maps onto one dataclass here or in the module that owns
it. `load_config(cls, source)` accepts a path, a mapping or None (the packaged default) and rejects
unknown keys by name, so a typo never silently falls back to a default, and a `version` other than
the dataclass's own (its `version` field's default) by file and number.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml

from mlaquant.errors import MLAQuantError

T = TypeVar("T")


class ConfigError(MLAQuantError, ValueError):
    """A config file or mapping that does not fit its dataclass (the message names file and key)."""


def _check_value(cls: type, name: str, value: Any, where: str) -> Any:
    hints = typing.get_type_hints(cls)
    hint = hints.get(name)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return from_dict(hint, value, f"{where}.{name}")
    if origin in (typing.Union, types.UnionType) and value is None and type(None) in args:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not isinstance(value, hint):
        raise ConfigError(f"{where}: key '{name}' must be {hint.__name__}, got {value!r}")
    if hint is int and isinstance(value, bool):
        raise ConfigError(f"{where}: key '{name}' must be int, got {value!r}")
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    return value


def from_dict(cls: type[T], data: dict, where: str = "config") -> T:
    """Build dataclass `cls` from `data`, rejecting unknown keys and mistyped scalars."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}' (known: {', '.join(sorted(fields))})")
    values = {k: _check_value(cls, k, v, where) for k, v in data.items()}
    return cls(**values)


def to_dict(obj: Any) -> dict:
    """Dataclass → plain dict (tuples become lists) suitable for `yaml.safe_dump`."""

    def plain(v: Any) -> Any:
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return {k: plain(v) for k, v in dataclasses.asdict(obj).items()}


def packaged_config_path(name: str) -> Path:
    """Path of a YAML file shipped in `mlaquant.configs` (e.g. 'runtime.yaml')."""
    return Path(str(resources.files("mlaquant.configs").joinpath(name)))


def read_yaml(path: str | Path) -> dict:
    """Read one YAML mapping; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e.__class__.__name__})") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at top level")
    return data


def _check_version(cls: type, data: dict, where: str) -> None:
    """Refuse `data` whose `version` is not the one `cls` declares (its `version` field's default)."""
    known = {f.name: f.default for f in dataclasses.fields(cls)}.get("version", dataclasses.MISSING)
    if known is not dataclasses.MISSING and "version" in data and data["version"] != known:
        raise ConfigError(f"{where}: unknown config version {data['version']!r} (this mlaquant reads version {known})")


def load_config(cls: type[T], source: str | Path | dict | T | None, default_file: str) -> T:
    """Load `cls` from a path, a mapping, an instance, or (None) the packaged `default_file`.

    A `version` other than the one `cls` declares is refused; a source without `version` is read as
    the declared one.
    """
    if isinstance(source, cls):
        return source
    if source is None:
        path = packaged_config_path(default_file)
        data, where = read_yaml(path), str(path)
    elif isinstance(source, dict):
        data, where = source, "config"
    else:
        data, where = read_yaml(source), str(source)
    _check_version(cls, data, where)
    return from_dict(cls, data, where)


def chunk_for_context(schedule: tuple, context_len: int) -> int:
    """The chunk length a `[up_to_context, chunk_tokens]` schedule gives a context of `context_len` tokens.

    The first pair whose bound exceeds `context_len` wins; the last pair covers everything longer (its bound
    is ignored). One schedule for prefill chunks (`RuntimeConfig`) and split-KV chunks (`KernelConfig`).
    """
    for bound, chunk in schedule[:-1]:
        if context_len < bound:
            return int(chunk)
    return int(schedule[-1][1])


@dataclasses.dataclass
class RuntimeConfig:
    """Decode-time settings (`configs/runtime.yaml`).

    `prefill_chunks` lists `[up_to_context, chunk_tokens]` pairs, read by `chunk_for_context`.
    """

    version: int = 1
    block_size: int = 64
    prefill_chunks: tuple = ((2048, 512), (8192, 768), (0, 1024))

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"runtime: block_size must be > 0, got {self.block_size}")
        if not self.prefill_chunks or any(len(p) != 2 or p[1] <= 0 for p in self.prefill_chunks):
            raise ConfigError(f"runtime: prefill_chunks must be [bound, chunk>0] pairs, got {self.prefill_chunks}")

    def chunk_for(self, context_len: int) -> int:
        """Prefill chunk length for a total context of `context_len` tokens."""
        return chunk_for_context(self.prefill_chunks, context_len)


def load_runtime_config(source: str | Path | dict | RuntimeConfig | None = None) -> RuntimeConfig:
    """RuntimeConfig from a path/mapping, or the packaged `runtime.yaml`."""
    return load_config(RuntimeConfig, source, "runtime.yaml")
