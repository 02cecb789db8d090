"""What a calibration is given: `CalibrateConfig` (configs/calibrate.yaml, its keys and their checks) and
`Sources`, where the text of each split comes from (the given files, else the bundled splits and the third-party
text of `mlaquant.calib.data`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mlaquant.calib.data import shift_description, shift_source, split_path
from mlaquant.calib.transform import is_transform_candidate
from mlaquant.config import ConfigError
from mlaquant.quant.codecs import split_pair


@dataclasses.dataclass
class CalibrateConfig:
    version: int = 1
    samples: int = 512
    seq_len: int = 512
    val_samples: int = 32
    test_samples: int = 128
    # Long-context check on the test split (with test_samples > 0): `long_test_samples` windows of
    # `long_seq_len` tokens (0 = off);
    # over budget there, a residual FP16 window of `long_window` rows is one of the fixes measured.
    long_seq_len: int = 2048
    long_test_samples: int = 16
    long_window: int = 128
    # Off-distribution check: the plan on text unlike the bundled splits (`mlaquant.calib.data.shift_source`, or
    # --shift-data), `shift_samples` windows of seq_len and `shift_long_samples` of long_seq_len tokens (0 = off).
    shift_samples: int = 32
    shift_long_samples: int = 8
    # A second validation domain: the plan must also stay under headroom x budget on `shift_val_samples` windows
    # of long_seq_len tokens of third-party text disjoint from the reported one (`shift_validation_source`;
    # 0 = off), where long contexts and unfamiliar code cost the most.
    shift_val_samples: int = 8
    # Exact recall (`mlaquant.evaluation.recall`): `recall_prompts` test windows of long_seq_len tokens ending in
    # the first `recall_cue` tokens of an earlier span; the share of the next `recall_span` greedy tokens that
    # reproduce it, FP16 and the plan (0 = off). Reported, never used to choose.
    recall_prompts: int = 0
    recall_cue: int = 16
    recall_span: int = 64
    budget: float = 0.01
    # A cap on the plan's size: at most `max_bits` bits per cached value (every byte of codes and scales, all
    # layers; null = no cap). The search and the fallbacks stay within it; a cap under the cheapest candidates,
    # or one that leaves no plan within the budget, is an error naming the layer (`mlaquant.calib.search`).
    max_bits: float | None = None
    headroom: float = 0.6
    seed: int = 0
    # samples per forward batch; None: from free GPU memory on CUDA (`calibration_batch_size`), 8 elsewhere
    batch_size: int | None = None
    percentile: float = 0.999
    try_clip: bool = True
    try_rotation: bool = True
    int8_matmul: bool = False
    narrow_trials: int = 8
    # 'pca-<rate>' c_kv candidates (`mlaquant.calib.transform`): bits allocated in blocks of band_block
    # channels among band_bits
    band_block: int = 16
    band_bits: tuple = (0, 2, 3, 4, 8)
    # what those bits follow: 'variance' (reverse water-filling on the rotated channels' variances, least row error)
    # or 'fisher' (on the variances weighted by each channel's loss sensitivity, `mlaquant.calib.sensitivity`;
    # needs the model loaded whole)
    allocation: str = "variance"
    candidates: tuple = (
        "int4-row/int4-row",
        "int4-row/int4-row-asym",
        "int4-g64/int4-g32",
        "int4-g32/int4-g32",
        "int4-g32/int4-row-asym",
        "int4-row/int8-row",
        "int4-g32/int8-g32",
        "int8-g64/int8-g32",
        "fp16/fp16",
    )

    def __post_init__(self) -> None:
        if not 0 < self.budget < 1:
            raise ConfigError(f"calibrate: budget must be in (0, 1), got {self.budget}")
        if self.samples <= 0 or self.val_samples <= 0 or self.test_samples < 0:
            raise ConfigError(
                f"calibrate: samples must be > 0 (got samples={self.samples}, val_samples={self.val_samples}, "
                f"test_samples={self.test_samples})"
            )
        if self.seq_len < 2 or not 0 < self.headroom <= 1 or not 0.5 < self.percentile <= 1:
            raise ConfigError("calibrate: need seq_len ≥ 2, 0 < headroom ≤ 1, 0.5 < percentile ≤ 1")
        if min(self.long_seq_len, self.long_test_samples, self.long_window) < 0 or self.long_seq_len == 1:
            raise ConfigError("calibrate: long_seq_len (0 or ≥ 2), long_test_samples and long_window must be ≥ 0")
        if min(self.shift_samples, self.shift_long_samples, self.shift_val_samples) < 0:
            raise ConfigError("calibrate: shift_samples, shift_long_samples and shift_val_samples must be ≥ 0")
        if self.recall_prompts < 0 or self.recall_cue < 1 or self.recall_span < 1:
            raise ConfigError("calibrate: recall_prompts must be ≥ 0, recall_cue and recall_span ≥ 1")
        need = 2 * (self.recall_cue + self.recall_span) + self.recall_cue
        if self.recall_prompts and self.long_seq_len < need:
            raise ConfigError(
                f"calibrate: recall needs long_seq_len ≥ {need} for a cue of {self.recall_cue} and a span of "
                f"{self.recall_span}, got {self.long_seq_len}"
            )
        if self.max_bits is not None and not 0 < self.max_bits <= 16:
            raise ConfigError(f"calibrate: max_bits must be in (0, 16] (bits per cached value) or null, got "
                              f"{self.max_bits}")
        if self.batch_size is not None and self.batch_size <= 0:
            raise ConfigError(f"calibrate: batch_size must be > 0 or null (auto), got {self.batch_size}")
        if self.allocation not in ("variance", "fisher"):
            raise ConfigError(f"calibrate: allocation must be 'variance' or 'fisher', got {self.allocation!r}")
        if self.allocation == "fisher" and not any(is_transform_candidate(split_pair(c)[0]) for c in self.candidates):
            raise ConfigError("calibrate: allocation 'fisher' allocates the bits of 'pca-<rate>' candidates; "
                              "the candidates have none")
        if "fp16/fp16" not in self.candidates:
            raise ConfigError("calibrate: candidates must include 'fp16/fp16' (the fallback of last resort)")


@dataclasses.dataclass(frozen=True)
class Sources:
    """Where each split's text comes from: the given file, directory or JSONL, else the bundled split; `shift`
    the off-distribution text (default: `shift_source`, described by `shift_name`)."""

    calibration: str | Path
    validation: str | Path
    test: str | Path
    shift: str | Path | tuple[Path, ...]
    shift_name: str
    shift_validation: tuple[Path, ...]

    @classmethod
    def resolve(
        cls,
        data: str | Path | None,
        val_data: str | Path | None,
        test_data: str | Path | None,
        shift_data: str | Path | None = None,
    ) -> Sources:
        shift, name = (shift_data, str(shift_data)) if shift_data else (shift_source(), shift_description())
        return cls(
            data or split_path("calibration"),
            val_data or split_path("validation"),
            test_data or split_path("test"),
            shift,
            name,
            shift_source("validation"),
        )
