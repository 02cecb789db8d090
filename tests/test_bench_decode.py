"""`mlaquant bench decode` on one short context: every side runs and the table
reports what it computed (speed itself is never asserted)."""

from __future__ import annotations

import pytest

from mlaquant.bench import decode as bench


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


def test_attention_bench_batch_axis_rows_per_codec_and_path(capsys):
    from mlaquant.attention import native
    from mlaquant.bench import attention as bench_attention

    rows = bench_attention.bench_attention([1, 2], [64], ["fp16", "int8"], steps=1, min_call_s=0)
    paths = {"fp16": ("reference", "fast", "auto"),
             "int8": ("reference", "fast", "auto", *(("fast torch-ops",) if native.kernels() else ()))}
    assert [(r["batch"], r["codec"], r["path"]) for r in rows] == [
        (b, c, p) for b in (1, 2) for c in ("fp16", "int8") for p in paths[c]
    ]
    assert capsys.readouterr().out.startswith("-- cpu: torch capability ")
    for r in rows:
        assert r["s"] > 0 and r["bound_s"] > 0 and r["vs_bound"] == pytest.approx(r["s"] / r["bound_s"])
        assert 0 < r["min_s"] <= r["s"]
    assert rows[0]["vs_reference"] == 1.0 and rows[1]["vs_base_fast"] == 1.0
    for r in rows:  # the auto rows name what auto ran, by the routing of this machine
        assert ("runs" in r) == ("decide_s" in r) == (r["path"] == "auto")
        if r["path"] == "auto":
            assert r["runs"] in ("torch", "cpu") and f"| auto ({r['runs']}) |" in bench_attention.format_row(r)
            assert isinstance(r["decide_s"], float)
    header = bench_attention.format_header().splitlines()[0]
    assert header.count("|") == bench_attention.format_row(rows[0]).count("|")


def test_timed_rounds_go_past_steps_until_each_call_has_run_min_call_s(monkeypatch):
    """On a fake clock where every timed call takes 5 ms: 3 rounds when that is enough, else rounds until the
    calls' timed runs add up to min_call_s (20 rounds for 0.1 s), each timed call after an untimed one."""
    from mlaquant.bench import attention as bench_attention

    clock = iter(range(10**6))
    monkeypatch.setattr(bench_attention.time, "perf_counter", lambda: next(clock) * 0.005)
    made = {"a": 0, "b": 0}

    def call(name):
        def fn():
            made[name] += 1
        return fn

    calls = {name: call(name) for name in made}
    for min_call_s, rounds in ((0.0, 3), (0.014, 3), (0.016, 4), (0.099, 20)):
        made.update(a=0, b=0)
        out = bench_attention._timed_rounds(calls, 3, min_call_s)
        assert made == {"a": 2 * rounds, "b": 2 * rounds}
        assert out["a"] == pytest.approx((0.005, 0.005)) and out["b"] == pytest.approx((0.005, 0.005))


def test_timed_rounds_start_each_round_one_call_further_along():
    """Round r calls the functions from the (r mod n)-th on, so no call always follows the same other one; each
    timed call still follows an untimed one of its own."""
    from mlaquant.bench import attention as bench_attention

    made = []
    calls = {name: (lambda name=name: made.append(name)) for name in "abc"}
    out = bench_attention._timed_rounds(calls, 4)
    assert made == [x for r in ("abc", "bca", "cab", "abc") for name in r for x in (name, name)]
    assert list(out) == ["a", "b", "c"]


def test_attention_bench_fast_block_rows_and_bad_option_exits_nonzero(capsys):
    from mlaquant.bench import attention as bench_attention
    from mlaquant.cli import main

    rows = bench_attention.bench_attention([2], [128], ["int8-row"], steps=1, fast_blocks=[(64, 1), (128, 2)],
                                          min_call_s=0)
    assert [r["path"] for r in rows][:5] == ["reference", "fast", "auto", "fast 64x1", "fast 128x2"]
    assert all(r["s"] > 0 for r in rows)
    assert main(["bench", "decode", "--batch", "1", "--contexts", "64", "--fast-blocks", "1024"]) != 0
    assert "--fast-blocks: '1024' is not BLOCKxGROUP" in capsys.readouterr().err


def test_attention_bench_times_integer_codecs_with_and_without_the_c_kernels():
    from mlaquant.attention import native
    from mlaquant.bench import attention as bench_attention

    rows = bench_attention.bench_attention([1], [64], ["fp16", "int4-row"], steps=1, min_call_s=0)
    paths = [(r["codec"], r["path"]) for r in rows]
    torch_rows = [("int4-row", "fast torch-ops")] if native.kernels() else []
    assert paths == [("fp16", "reference"), ("fp16", "fast"), ("fp16", "auto"), ("int4-row", "reference"),
                     ("int4-row", "fast"), ("int4-row", "auto"), *torch_rows]


def test_attention_bench_header_names_the_capability_isa_and_routing(capsys, fresh_native_build):
    """The header says which int4 unpack and C kernels the fast rows ran with, and the rule auto followed."""
    from mlaquant.cli import main

    fresh_native_build.setenv("MLAQUANT_NATIVE", "0")
    args = ["bench", "decode", "--batch", "1", "--contexts", "64", "--codecs", "int4-row", "--steps", "1"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "int4 unpack: torch ops (MLAQUANT_NATIVE=0 or no cc)" in lines[0]
    cpu = next(line for line in lines if line.startswith("-- cpu:"))
    assert "C kernels none (MLAQUANT_NATIVE=0): torch ops" in cpu and "auto: CPU capability" in cpu


def test_decision_cost_is_what_auto_spends_beyond_an_explicit_backend(monkeypatch):
    """`decision_s` is the difference of the two medians: 3 ms where only auto's choice sleeps 3 ms (a fake clock
    that advances by what each call sleeps), 0 where both take the same time."""
    from mlaquant.attention import backends
    from mlaquant.bench import attention as bench_attention

    now = [0.0]
    monkeypatch.setattr(bench_attention.time, "perf_counter", lambda: now[0])
    for extra in (0.003, 0.0):
        def choose(backend, *args, extra=extra):
            now[0] += 0.001 + (extra if backend == "auto" else 0.0)
            return backends.TorchBackend()

        monkeypatch.setattr(bench_attention.backends, "choose_backend", choose)
        assert bench_attention.decision_s(None, "cpu", None, reps=5) == pytest.approx(extra)
