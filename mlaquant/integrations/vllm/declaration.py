"""What a model directory says about its plan, the vLLM way: `config.json`'s `quantization_config` (no vLLM import).

`mlaquant export --engine vllm --codecs plan` writes the plan into the model directory and declares it there, as
every quantized checkpoint declares its method to vLLM (vllm/config/model.py `ModelConfig._verify_quantization`
reads `quantization_config.quant_method`; vllm/model_executor/model_loader/weight_utils.py `get_quant_config`
builds the method's config from the rest):

    "quantization_config": {
        "quant_method": "mlaquant",        the method mlaquant's plugin registers with vLLM
                                           (`register_quantization_config`); a vLLM without the plugin stops
                                           at start-up: "Unknown quantization method: mlaquant"
        "format_version": 1,
        "plan": "mlaquant_plan",           the plan directory, relative to the model directory
        "checkpoint_sample": "<sha256>",   `checkpoint_sample` of the weights the plan was checked against at export
        "base": {...}                      the checkpoint's own quantization_config, if it had one (e.g. DeepSeek-V3's
                                           fp8 weights): vLLM's method for every layer but the MLA cache
    }

`checkpoint_sample` is what start-up reads instead of the checkpoint: the safetensors headers (every tensor's
name, dtype, shape and offsets) and `SAMPLE_READS` reads of `SAMPLE_BYTES` bytes spread over each tensor's data,
with the model's config. A changed weight file, another model with the same shapes, a shape or dtype change: another
digest. The full weights fingerprint (`MLAModel.fingerprint`, which reads every tensor) is checked once, at export.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path

from mlaquant.integrations.vllm.settings import VLLMPluginError

QUANT_METHOD = "mlaquant"
FORMAT_VERSION = 1
KEYS = ("quant_method", "format_version", "plan", "checkpoint_sample", "base")
SAMPLE_READS = 8  # reads per tensor, evenly spread from its first byte to its last
SAMPLE_BYTES = 64


@dataclasses.dataclass(frozen=True)
class Declaration:
    """A parsed `quantization_config` of quant_method "mlaquant" (module docstring)."""

    plan: str
    checkpoint_sample: str
    base: dict | None = None

    def as_config(self) -> dict:
        out = {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "plan": self.plan,
               "checkpoint_sample": self.checkpoint_sample}
        return out if self.base is None else {**out, "base": self.base}

    @classmethod
    def parse(cls, config: dict, where: str) -> Declaration:
        """`config` (a quantization_config dict) → Declaration; VLLMPluginError (one line, naming `where` and the
        key) on an unknown key, a missing one, another format version or a base that is not a quantization_config."""
        unknown = sorted(set(config) - set(KEYS))
        if unknown:
            raise VLLMPluginError(f"{where}: quantization_config has unknown key {unknown[0]!r} (known: "
                                   f"{', '.join(KEYS)})")
        if config.get("quant_method") != QUANT_METHOD:
            raise VLLMPluginError(f"{where}: quantization_config.quant_method is {config.get('quant_method')!r}, "
                                   f"not {QUANT_METHOD!r}")
        if config.get("format_version") != FORMAT_VERSION:
            raise VLLMPluginError(f"{where}: quantization_config.format_version {config.get('format_version')!r}: "
                                   f"this mlaquant reads version {FORMAT_VERSION}")
        for key in ("plan", "checkpoint_sample"):
            if not isinstance(config.get(key), str) or not config[key]:
                raise VLLMPluginError(f"{where}: quantization_config.{key} is missing or not a string")
        base = config.get("base")
        if base is not None and not (isinstance(base, dict) and isinstance(base.get("quant_method"), str)):
            raise VLLMPluginError(f"{where}: quantization_config.base must be a quantization_config with a "
                                   "quant_method")
        return cls(config["plan"], config["checkpoint_sample"], base)


def read_declaration(model_dir: Path) -> Declaration | None:
    """The mlaquant declaration in `model_dir`/config.json, or None where its quantization_config is another
    method's or absent. VLLMPluginError when config.json is unreadable or the declaration malformed."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise VLLMPluginError(f"{path}: cannot read the model config ({e})") from e
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(quant, dict) or quant.get("quant_method") != QUANT_METHOD:
        return None
    return Declaration.parse(quant, str(path))


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name → dtype, shape, data_offsets) and where its data begins."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise VLLMPluginError(f"{path}: not a safetensors file (shorter than its header length)")
        (size,) = struct.unpack("<Q", raw)
        text = f.read(size)
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VLLMPluginError(f"{path}: not a safetensors file (its header is not JSON)") from e
    if not isinstance(header, dict):
        raise VLLMPluginError(f"{path}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    return header, 8 + size


def checkpoint_sample(files: list[Path], config: dict) -> str:
    """sha256 (hex) over `config` (the model's MLA config as a dict) and, per safetensors file of `files` in the
    order given, its header and SAMPLE_READS × SAMPLE_BYTES bytes of each tensor's data (tensors by name): reads
    of about 1 KB per tensor and its header, never the weights."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for path in files:
        header, start = _header(path)
        h.update(path.name.encode())
        h.update(json.dumps(header, sort_keys=True).encode())
        with open(path, "rb") as f:
            for name in sorted(header):
                begin, end = header[name]["data_offsets"]
                span = max(end - begin - SAMPLE_BYTES, 0)
                for k in range(SAMPLE_READS):
                    f.seek(start + begin + span * k // (SAMPLE_READS - 1))
                    h.update(f.read(min(SAMPLE_BYTES, end - begin)))
    return h.hexdigest()


def model_checkpoint_sample(model_dir: Path) -> str:
    """`checkpoint_sample` of the checkpoint in `model_dir`: its weight files as the loader finds them
    (`model.safetensors` or the shards of its index) and its MLA config."""
    from mlaquant.modeling.loader import read_config, weight_files

    files = sorted(set(weight_files(Path(model_dir)).values()))
    return checkpoint_sample(files, dataclasses.asdict(read_config(Path(model_dir))))
