"""`mlaquant bench decode` on one short context: every side runs and the table
reports what it computed (speed itself is never asserted)."""

from __future__ import annotations

import pytest

from mlaquant import bench


@pytest.fixture(scope="module")
def results():
    return bench.bench_decode([96], layers=1, steps=1, codecs=["fp16", "int4"], intermediate_size=64)


def test_every_side_is_timed_and_the_ratios_follow(results):
    (row,) = results
    for key in ("transformers_s", "fp16_s", "int4_s", "transformers_mlp_s", "ours_mlp_s", "ours_weights_s"):
        assert row[key] > 0, key
    assert row["speedup_vs_transformers"] == pytest.approx(row["transformers_s"] / row["fp16_s"])
    assert row["speedup_ceiling"] == pytest.approx(row["transformers_s"] / row["ours_weights_s"])
    without = (row["transformers_s"] - row["transformers_mlp_s"]) / (row["fp16_s"] - row["ours_mlp_s"])
    assert row["speedup_without_mlp"] == pytest.approx(without)


def test_table_has_one_cell_per_column(results):
    header = bench.format_header(["fp16", "int4"]).splitlines()[0]
    line = bench.format_row(results[0], ["fp16", "int4"])
    assert line.startswith("| 96 |")
    assert header.count("|") == line.count("|")
    assert "ceiling (weights only)" in header
