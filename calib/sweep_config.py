"""What `mlaquant sweep` measures: `SweepConfig` (configs/sweep.yaml, checked up front: codecs, engines, peers
and the `calibrate:` overrides, by name), loaded with the CLI's overrides (`load_sweep_config`), and the
calibration config of each calibrated row (`calibrate_config`)."""

from __future__ import annotations

import dataclasses

from mlaquant.calib.calibrate_config import CalibrateConfig
from mlaquant.calib.peers import PeerSpec
from mlaquant.config import ConfigError, load_config, to_dict
from mlaquant.integrations.engines import FORMATS
from mlaquant.runtime.plan import Plan


@dataclasses.dataclass
class SweepConfig:
    """`configs/sweep.yaml` (see the comments there; these defaults are the same)."""

    version: int = 1
    codecs: tuple = (
        "fp16",
        "int8-row",
        "int8-g64",
        "int8-g32",
        "int4-row",
        "int4-g64",
        "int4-g32",
        "int4-g32-asym",
        "int4-g32/int8-g32",
        "int4-g32/fp16",
        "int8-row+i8mm",
        "int4-row+i8mm",
    )
    window: int = 128
    window_codecs: tuple = ("int4-g32", "int4-g32/int8-g32")
    budgets: tuple = (0.005, 0.01, 0.02)
    target_budget: float = 0.01
    # other calibration configs (packaged configs/ names), each calibrated at target_budget: their own rows
    tiers: tuple = ("calibrate-3bit.yaml",)
    calibrate: dict = dataclasses.field(
        default_factory=lambda: {"samples": 64, "seq_len": 512, "val_samples": 32}
    )
    calibration_data: str | None = None
    validation_data: str | None = None
    contexts: tuple = (512, 2048, 8192)
    samples: int = 8
    seq_len: int = 2048
    seed: int = 0
    batch_size: int | None = None  # samples per evaluation batch; None: from free GPU memory, 8 off CUDA
    engines: tuple = ("vllm fp8", "vllm fp8_ds_mla", "vllm nvfp4_ds_mla", "sglang nvfp4", "llama.cpp q8_0",
                      "llama.cpp q4_0")
    peers: tuple = ("transformers", "quanto-int4", "quanto-int2", "hqq-int4", "hqq-int2", "bnb-nf4", "llama.cpp-f16",
                    "llama.cpp-q8_0", "llama.cpp-q4_0")
    peer_group_size: int = 64
    peer_residual_length: int = 128
    peer_batch_size: int = 16
    nf4_blocksize: int = 64
    decode_context: int = 256
    decode_steps: int = 16
    decode_backend: str = "auto"
    decode_threads: int | None = 1
    recall_prompts: int = 0
    recall_seq_len: int = 2048
    recall_cue: int = 16
    recall_span: int = 64

    def __post_init__(self) -> None:
        if not self.codecs and not self.peers and not self.budgets:
            raise ConfigError("sweep: nothing to measure (codecs, budgets and peers are all empty)")
        if self.samples <= 0 or self.seq_len < 2 or (self.batch_size or 1) <= 0 or self.peer_batch_size <= 0:
            raise ConfigError("sweep: need samples > 0, seq_len ≥ 2, batch_size > 0, peer_batch_size > 0")
        if not self.contexts or any(not isinstance(c, int) or c <= 0 for c in self.contexts):
            raise ConfigError(f"sweep: contexts must be positive integers, got {list(self.contexts)}")
        if any(not 0 < b < 1 for b in (*self.budgets, self.target_budget)):
            raise ConfigError("sweep: budgets and target_budget must lie in (0, 1)")
        if (
            self.window < 0
            or self.decode_context < 1
            or self.decode_steps < 1
            or (self.decode_threads is not None and self.decode_threads < 1)
        ):
            raise ConfigError(
                "sweep: need window ≥ 0, decode_context ≥ 1, decode_steps ≥ 1, decode_threads ≥ 1"
            )
        if self.recall_prompts < 0 or min(self.recall_cue, self.recall_span) < 1 or (
            self.recall_prompts and self.recall_seq_len < 2 * (self.recall_cue + self.recall_span) + self.recall_cue
        ):
            raise ConfigError(
                "sweep: need recall_prompts ≥ 0, recall_cue and recall_span ≥ 1, and recall_seq_len ≥ "
                f"2 × (cue + span) + cue = {2 * (self.recall_cue + self.recall_span) + self.recall_cue}"
            )
        for name in self.peers:
            PeerSpec.parse(name)
        unknown = sorted(set(self.engines) - {f.name for f in FORMATS})
        if unknown:
            raise ConfigError(f"sweep: engines {unknown} unknown (known: {', '.join(f.name for f in FORMATS)})")
        for name in (*self.codecs, *self.window_codecs):
            Plan.uniform(name, 1)
        calibrate_config(self, self.target_budget)  # unknown or bad `calibrate:` keys fail here, by name
        for tier in self.tiers:
            calibrate_config(self, self.target_budget, tier)


def load_sweep_config(source=None, overrides: dict | None = None) -> SweepConfig:
    """SweepConfig from a path / mapping / None (packaged sweep.yaml), with CLI overrides applied."""
    base = load_config(SweepConfig, source, "sweep.yaml")
    if not overrides:
        return base
    return load_config(SweepConfig, {**to_dict(base), **overrides}, "sweep.yaml")


def calibrate_config(cfg: SweepConfig, budget: float, base_file: str = "calibrate.yaml") -> CalibrateConfig:
    """configs/`base_file` + the sweep's `calibrate:` overrides + `budget`; no test split or off-distribution
    report (the sweep measures its own text)."""
    base = to_dict(load_config(CalibrateConfig, None, base_file))
    merged = {**base, **cfg.calibrate, "budget": budget, "test_samples": 0, "shift_samples": 0,
              "shift_long_samples": 0}
    return load_config(CalibrateConfig, merged, "calibrate.yaml")
