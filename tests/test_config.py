"""`mlaquant.config.load_config`: a config whose `version` this mlaquant does not know is refused."""

from __future__ import annotations

import pytest

from mlaquant.bundled.train import TrainConfig
from mlaquant.calib.calibrate import CalibrateConfig
from mlaquant.calib.sweep import SweepConfig
from mlaquant.config import ConfigError, RuntimeConfig, load_config, load_runtime_config
from mlaquant.runtime.guard import GuardConfig

# (kernels.yaml's KernelConfig is loaded the same way; it lives beside the Triton kernel, which imports triton)
VERSIONED = [(RuntimeConfig, "runtime.yaml"), (GuardConfig, "guard.yaml"), (CalibrateConfig, "calibrate.yaml"),
             (SweepConfig, "sweep.yaml"), (TrainConfig, "train.yaml")]


@pytest.mark.parametrize("cls, default_file", VERSIONED, ids=[f for _, f in VERSIONED])
def test_packaged_configs_carry_the_version_their_dataclass_reads(cls, default_file):
    assert load_config(cls, None, default_file).version == cls().version == 1


def test_unknown_version_in_a_file_is_refused_by_file_and_version(tmp_path):
    path = tmp_path / "runtime.yaml"
    path.write_text("version: 2\nblock_size: 64\n")
    with pytest.raises(ConfigError) as e:
        load_runtime_config(path)
    message = str(e.value)
    assert "\n" not in message
    assert message == f"{path}: unknown config version 2 (this mlaquant reads version 1)"


def test_unknown_version_in_a_mapping_is_refused():
    with pytest.raises(ConfigError, match=r"^config: unknown config version '1.0' \(this mlaquant reads version 1\)$"):
        load_config(GuardConfig, {"version": "1.0"}, "guard.yaml")


def test_known_or_absent_version_loads(tmp_path):
    path = tmp_path / "runtime.yaml"
    path.write_text("block_size: 32\n")
    assert load_runtime_config(path).block_size == 32
    assert load_runtime_config({"version": 1, "block_size": 16}).block_size == 16
