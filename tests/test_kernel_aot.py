"""The decode kernels compiled for sm_90a and sm_80 on the CPU (`mlaquant bench kernels --aot`, kernels/aot.py):
resources, MMA instructions and the cost model's predicted times, asserted for every decode, query and merge
variant against issue 27's targets (B = 32, 32k context; predictions from static code, not measurements):

- no stack frame and no local loads / stores in any variant, on both targets, at H = 128 and 16;
- shared memory within the SM's limit (227 KiB on sm_90a, 163 KiB on sm_80);
- wgmma in the sm_90a main loop from 64 heads;
- sm_90a, H = 128, H100: every grouped c_kv codec no slower than FP16, every row-wise one at most 0.8x FP16;
- sm_90a, H = 16, H100: INT4-row and INT8-row at least 70 % of their HBM roofline (cache bytes / 3.35 TB/s);
- band c_kv (issue 28's sub-4-bit tier, the allocations of `aot.DECODE_CODECS`): at most 0.8x FP16 at H = 128
  (sm_90a, H100), and at H = 16 no slower than INT4-row/INT4-row, on both targets (H100 / A100).

The report (every decode variant of both targets, the merge and the query kernels; not the W8A8 GEMM, whose
variants `bench kernels --aot` also lists) runs once per session in a subprocess without TRITON_INTERPRET (the
test session runs triton's interpreter, which replaces the compiler); Triton's on-disk cache makes reruns fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

TARGETS = ("sm_90a", "sm_80")
SMEM_PER_BLOCK = {"sm_90a": 227 * 1024, "sm_80": 163 * 1024}
H100_PEAK_TB_S = 3.35  # the roofline of the target (datasheet peak, not the model's achieved 3.0)
_SCRIPT = (
    "import json, sys\n"
    "from mlaquant.kernels import aot\n"
    "rows = aot.report(sys.argv[2].split(','), lambda config: aot.decode_variants(config=config))\n"
    "json.dump(rows, open(sys.argv[1], 'w'), default=str)\n"
)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("aot") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", _SCRIPT, str(out), ",".join(TARGETS)], env=env, check=True, timeout=1800)
    return {(r["target"], r["kernel"], r["variant"], r["heads"]): r for r in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def rows(report) -> dict:
    return {(t, v, h): r for (t, k, v, h), r in report.items() if k == "mla_decode"}


def _us(row: dict, key: str = "H100 32k") -> float:
    return row["predicted"][key]["us"]


def _ckv_family(codec: str) -> str:
    ckv = codec.split("/")[0]
    return "fp16" if ckv == "fp16" else "band" if ckv.startswith("band") else "row" if "-row" in ckv else "grouped"


def test_every_decode_variant_compiled(report, rows):
    from mlaquant.kernels.aot import DECODE_CODECS, HEADS

    assert set(rows) == {(t, c, h) for t in TARGETS for c in DECODE_CODECS for h in HEADS}
    assert {(t, h) for (t, k, _, h) in report if k == "merge"} == {(t, h) for t in TARGETS for h in HEADS}


def test_no_variant_spills(report):
    """Every stage-1 variant, its query kernel and the merge, on both targets: no stack frame, no local loads
    or stores."""
    for key, r in report.items():
        assert key[1] in ("mla_decode", "query", "merge"), key
        assert r["stack_bytes"] == 0 and r["spill_instructions"] == 0, (key, r["stack_bytes"])


def test_shared_memory_within_the_sm_limit(rows):
    for key, r in rows.items():
        assert 0 < r["shared_bytes"] <= SMEM_PER_BLOCK[key[0]], (key, r["shared_bytes"])


def test_wgmma_in_the_main_loop_from_64_heads(rows):
    for (target, codec, heads), r in rows.items():
        if target == "sm_90a" and heads >= 64:
            assert set(r["loop_mma"]) & {"HGMMA", "IGMMA"}, (codec, r["loop_mma"])
            assert not set(r["loop_mma"]) & {"HMMA", "IMMA"}, (codec, r["loop_mma"])


def test_every_variant_has_a_prediction(rows):
    for (target, _, _), r in rows.items():
        assert set(r["predicted"]) == ({"A100 4k", "A100 32k"} if target == "sm_80" else
                                       {"H100 4k", "H100 32k", "H200 4k", "H200 32k"}), target


def test_at_128_heads_grouped_no_slower_than_fp16_row_wise_within_80_percent(rows):
    fp16 = _us(rows[("sm_90a", "fp16/fp16", 128)])
    checked = set()
    for (target, codec, heads), r in rows.items():
        family = _ckv_family(codec)
        if target != "sm_90a" or heads != 128 or family == "fp16":
            continue
        limit = fp16 if family == "grouped" else 0.8 * fp16
        assert _us(r) <= limit, (codec, _us(r), limit)
        checked.add(family)
    assert checked == {"row", "grouped", "band"}


@pytest.mark.parametrize("target,device", [("sm_90a", "H100 32k"), ("sm_80", "A100 32k")])
def test_band_at_16_heads_no_slower_than_int4_row(rows, target, device):
    int4 = _us(rows[(target, "int4-row/int4-row", 16)], device)
    bands = [r for (t, codec, heads), r in rows.items() if t == target and heads == 16 and codec.startswith("band")]
    assert len(bands) >= 2 and all(_us(r, device) <= int4 for r in bands), [(_us(r, device), int4) for r in bands]


@pytest.mark.parametrize("codec", ["int4-row/int4-row", "int8-row/int8-row"])
def test_at_16_heads_within_70_percent_of_the_hbm_roofline(rows, codec):
    from mlaquant.kernels.aot import BATCH, D_C, D_R
    from mlaquant.quant.codecs import LayerCodec

    roofline = BATCH * 32768 * LayerCodec.from_names(*codec.split("/"), D_C, D_R).row_bytes / (H100_PEAK_TB_S * 1e6)
    assert roofline / _us(rows[("sm_90a", codec, 16)]) >= 0.7, (roofline, _us(rows[("sm_90a", codec, 16)]))
    assert rows[("sm_90a", "fp16/fp16", 16)]["predicted"]["H100 32k"]["bound"] == "hbm"


_MEASURED_SCRIPT = (
    "import json, sys\n"
    "from mlaquant.kernels import aot\n"
    "shapes = [('int4-row/int4-row', 128, 32, 32768, 'NVIDIA H100 80GB HBM3'),\n"
    "          ('int4-row/int4-row', 128, 1, 4096, 'NVIDIA H100 80GB HBM3'),\n"
    "          ('int8-row/int8-row', 16, 32, 32768, 'NVIDIA A100-SXM4-80GB'),\n"
    "          ('fp16/fp16', 16, 32, 32768, 'Tesla T4')]\n"
    "json.dump([aot.predict_measured(*s) for s in shapes], open(sys.argv[1], 'w'))\n"
)


def test_prediction_beside_a_measurement_is_the_reports_at_its_shape(rows, tmp_path):
    """`bench kernels` on a GPU puts `aot.predict_measured` beside each measured row: the report's own prediction
    at B = 32, 32k on that device; a smaller shape predicts less; a GPU the cost model lacks gets none."""
    out = tmp_path / "predicted.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", _MEASURED_SCRIPT, str(out)], env=env, check=True, timeout=1800)
    h100, small, a100, t4 = json.loads(out.read_text())
    assert h100["us"] == pytest.approx(_us(rows[("sm_90a", "int4-row/int4-row", 128)]))
    assert a100["us"] == pytest.approx(_us(rows[("sm_80", "int8-row/int8-row", 16)], "A100 32k"))
    assert small["us"] < h100["us"] / 10
    assert t4 is None


def test_kernel_bench_table_puts_measured_and_predicted_side_by_side():
    from mlaquant.bench.kernels import render_markdown

    meta = {"device": "NVIDIA H100", "torch": "t", "triton": "t", "copy_gb_per_s": 3000.0, "spec_peaks": None,
            "args": {}}
    row = {"kind": "mla_decode", "heads": 128, "batch": 32, "context": 32768, "codec": "int4-row/int4-row",
           "bytes_per_token": 292, "chunk_tokens": 1024, "time_us": 500.0, "gb_per_s": 1.0, "tflops": 1.0}
    table = render_markdown(meta, [{**row, "predicted_us": 400.0, "predicted_bound": "mma"},
                                   {**row, "predicted": "n/a: no cost-model device for X"}])
    assert "| predicted µs (bound) | measured / predicted |" in table
    assert "| 400.0 (mma) | 1.25 |" in table and "| n/a: no cost-model device for X | — |" in table
