"""The decode kernel compiled for sm_90a on the CPU (`mlaquant bench kernels --aot`, kernels/aot.py): resources,
MMA instructions and the cost model's predicted times, asserted for every decode variant against issue 15's
targets: no spills, wgmma in the main loop from 64 heads, shared memory within the SM, INT4-row predicted no
slower than FP16 at H = 128 and at most 0.6x FP16 at H = 16 (B = 32, 32k, H100; FP16 HBM-bound there).

The report runs once per session in a subprocess without TRITON_INTERPRET (the test session runs triton's
interpreter, which replaces the compiler); Triton's on-disk cache makes reruns fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SMEM_PER_BLOCK = 227 * 1024
_SCRIPT = (
    "import json, sys\n"
    "from mlaquant.kernels import aot\n"
    "json.dump(aot.report(['sm_90a'], aot.decode_variants()), open(sys.argv[1], 'w'), default=str)\n"
)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("aot") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", _SCRIPT, str(out)], env=env, check=True, timeout=1200)
    return {(r["kernel"], r["variant"], r["heads"]): r for r in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def rows(report) -> dict:
    return {(v, h): r for (k, v, h), r in report.items() if k == "mla_decode"}


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


def test_no_variant_spills(report):
    """Every stage-1 variant and its query kernel: no stack frame, no local loads or stores."""
    for key, r in report.items():
        if key[0] in ("mla_decode", "query"):
            assert r["stack_bytes"] == 0 and r["spill_instructions"] == 0, (key, r["stack_bytes"])


def test_int4_row_at_128_heads_no_slower_than_fp16(rows):
    int4, fp16 = rows[("int4-row/int4-row", 128)], rows[("fp16/fp16", 128)]
    assert _us(int4) <= _us(fp16), (_us(int4), _us(fp16))


def test_int4_row_at_16_heads_within_60_percent_of_fp16(rows):
    int4, fp16 = rows[("int4-row/int4-row", 16)], rows[("fp16/fp16", 16)]
    assert fp16["predicted"]["H100 32k"]["bound"] == "hbm"
    assert _us(int4) <= 0.6 * _us(fp16), (_us(int4), _us(fp16))
