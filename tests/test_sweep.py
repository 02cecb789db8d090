"""`mlaquant sweep`: the reported numbers are measurements (JSON rows equal a direct recomputation with
independent code paths), the outputs are valid, reruns resume, bad input gives one-line errors."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from mlaquant import cli
from mlaquant.calib.calibrate import CalibrateConfig, calibrate
from mlaquant.calib.sweep import SweepRun, load_sweep_config, sweep
from mlaquant.config import ConfigError
from mlaquant.evaluation.eval import Evaluator
from mlaquant.evaluation.report import dominates, pareto_front, target_verdict, write_report
from mlaquant.evaluation.samples import token_samples
from mlaquant.modeling.loader import load_model
from mlaquant.runtime.plan import Plan

WORDS = [
    "def",
    "return",
    "x",
    "y",
    "self",
    "for",
    "in",
    "if",
    "else",
    "print",
    "(",
    ")",
    ":",
    "=",
    "+",
    "1",
    "0",
]
CFG = {
    "codecs": ["fp16", "int8", "int4", "int4-g16/fp16"],
    "window": 8,
    "window_codecs": ["int4"],
    "contexts": [64, 1024],
    "samples": 4,
    "seq_len": 32,
    "batch_size": 2,
    "peers": ["transformers", "quanto-int4", "bnb-nf4", "hqq-int2"],
    "decode_context": 16,
    "decode_steps": 2,
    "decode_backend": "torch",
}


def text(seed: int, lines: int = 300) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(lines))


def char_tokenizer(corpus: str, vocab_size: int):
    """A tiny BPE over the corpus' characters (ids < vocab_size, so the 96-token test model can read them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "isolated")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator([corpus], trainer)
    assert tok.get_vocab_size() <= vocab_size
    return tok


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    ckpt = root / "ckpt"
    shutil.copytree(tiny_model.source, ckpt)
    for i, name in enumerate(("cal", "val", "test")):
        (root / f"{name}.txt").write_text(text(i))
    char_tokenizer(text(0) + text(1), tiny_model.cfg.vocab_size).save(str(ckpt / "tokenizer.json"))
    model = load_model(ckpt)
    ccfg = CalibrateConfig(samples=4, seq_len=32, val_samples=4, test_samples=0, budget=0.01, batch_size=4,
                           shift_samples=0, shift_long_samples=0, shift_val_samples=0)
    plan, _ = calibrate(model, ccfg, root / "cal.txt", root / "val.txt", quiet=True)
    plan.save(root / "plan-1pct")
    cfg = load_sweep_config(None, CFG)
    with pytest.MonkeyPatch.context() as mp:
        # an uninstallable backend: its row must say why instead of disappearing
        mp.setitem(__import__("mlaquant.calib.peers").calib.peers.BACKEND_PACKAGE, "hqq",
                   ("no_such_hqq", "no-such-hqq"))
        report = sweep(model, cfg, root / "out", root / "test.txt", [str(root / "plan-1pct")], quiet=True)
    samples = token_samples(model.tokenizer, root / "test.txt", 4, 32, 0, model.cfg.eos_token_id)
    return {"root": root, "model": model, "cfg": cfg, "report": report, "samples": samples}


def rows_by_id(report: dict) -> dict:
    return {r["id"]: r for r in report["rows"]}


def assert_metrics(row: dict, result, rel: float = 0.0) -> None:
    got = row["metrics"]
    for k in ("loss", "kl", "top1", "ppl"):
        assert got[k] == pytest.approx(getattr(result, k), rel=rel, abs=1e-7 if rel == 0 else 1e-6), k
    assert got["tokens"] == result.tokens == 4 * 31


def test_json_rows_equal_direct_recomputation(setup):
    report, model, samples = setup["report"], setup["model"], setup["samples"]
    rows = rows_by_id(json.loads((setup["root"] / "out" / "report.json").read_text()))
    assert rows == rows_by_id(report)
    ev = Evaluator(model, samples, batch_size=4)  # other batching than the sweep's
    d_c, d_r, n = 32, 8, 3
    # bytes by hand from the layouts in mlaquant.quant.codecs: d_c = 32, d_r = 8
    expected_bytes = {
        "fp16": 80,
        "int8": 32 + 2 + 8 + 2,
        "int4": 16 + 2 + 4 + 2,
        "int4-g16/fp16": 16 + 4 + 16,
    }
    for name, nbytes in expected_bytes.items():
        row = rows[f"ours:{name}"]
        plan = Plan.uniform(name, n).bind(model.cfg)
        assert_metrics(row, ev.evaluate(plan.layer_codecs()), rel=1e-6)
        assert row["bytes_per_token_per_layer"] == nbytes
        assert row["bits_per_value"] == pytest.approx(8 * nbytes / 40)
        assert row["cache_mib"]["1024"] == pytest.approx(n * nbytes * 1024 / 2**20, abs=1e-4)
        assert row["vs_fp16_latent"] == pytest.approx(80 / nbytes, abs=1e-4)
        assert row["vs_mha_kv"] == pytest.approx(4 * (12 + 8 + 12) * 2 / nbytes, abs=1e-4)
        assert row["decode_tokens_per_s"] > 0
    assert rows["ours:fp16"]["metrics"]["loss"] == 0.0 and rows["ours:fp16"]["metrics"]["top1"] == 1.0
    assert rows["ours:int4"]["metrics"]["loss"] != rows["ours:int8"]["metrics"]["loss"]

    win = rows["window:int4+w8"]
    assert_metrics(win, ev.evaluate(Plan.uniform("int4", n).bind(model.cfg).layer_codecs(), window=8), rel=1e-6)
    # 1024 tokens: 1016 quantized rows of 24 B + 8 FP16 rows of 80 B, per layer
    assert win["cache_mib"]["1024"] == pytest.approx(n * (1016 * 24 + 8 * 80) / 2**20, abs=1e-4)

    # other engines' cache settings: measured as uniform plans of their codecs, or said not to fit the widths
    fp8 = rows["engine:vllm fp8"]
    assert_metrics(fp8, ev.evaluate(Plan.uniform("e4m3/e4m3", n).bind(model.cfg).layer_codecs()), rel=1e-6)
    assert fp8["bytes_per_token_per_layer"] == d_c + d_r and fp8["kind"] == "engine"
    ds = rows["engine:vllm fp8_ds_mla"]
    assert ds["status"].startswith("not run: does not fit this model") and "128" in ds["status"]

    plan = Plan.load(setup["root"] / "plan-1pct").bind(model.cfg)
    cal = rows["plan:plan-1pct"]
    assert_metrics(cal, ev.evaluate(plan.layer_codecs(), model=plan.apply(model)), rel=1e-6)
    assert cal["bytes_per_token_per_layer"] == pytest.approx(plan.bytes_per_token() / n)
    assert report["target"]["row"] == "plan:plan-1pct"


def test_peer_rows_equal_independent_recomputation(setup):
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit
    from transformers import AutoModelForCausalLM, QuantizedCache

    rows, samples = rows_by_id(setup["report"]), setup["samples"]
    ev = Evaluator(setup["model"], samples, batch_size=4)
    hf = AutoModelForCausalLM.from_pretrained(str(setup["root"] / "ckpt"), dtype=torch.float32).eval()

    def metrics(logits: torch.Tensor) -> dict:
        logp = F.log_softmax(logits[:, :-1], -1)
        ref = torch.cat(ev.ref_logp).float()
        nll = -logp.gather(-1, samples[:, 1:, None]).mean().item()
        kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
        return {"loss": math.exp(nll - ev.ref_nll) - 1, "kl": kl, "ppl": math.exp(nll)}

    with torch.no_grad():
        # the default cache is exact: its step decoding equals one full-sequence forward without cache
        checks = [("peer:transformers", hf(samples).logits.float())]
        if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.quanto") is None:
            want = "not run: optimum-quanto not installed (pip install optimum-quanto)"
            assert rows["peer:quanto-int4"]["status"] == want
        else:
            cache = QuantizedCache("quanto", hf.config, nbits=4, q_group_size=8, residual_length=128)
            pos = lambda t: torch.full((4, 1), t)
            steps = [hf(samples[:, t : t + 1], cache=cache, position_ids=pos(t)).logits for t in range(32)]
            checks.append(("peer:quanto-int4", torch.cat(steps, 1).float()))
            # quanto int4, groups of 8 on a 40-wide row: 4 code bytes + FP32 scale + FP32 shift per group
            assert rows["peer:quanto-int4"]["bytes_per_token_per_layer"] == pytest.approx(5 * (4 + 8))
            assert rows["peer:quanto-int4"]["bits_per_value_16bit_meta"] == pytest.approx(
                8 * 5 * (4 + 4) / 40
            )
    for row_id, logits in checks:
        want = metrics(logits)
        for k, v in want.items():
            assert rows[row_id]["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), (row_id, k)
    assert rows["peer:transformers"]["bits_per_value"] == 32.0
    assert abs(rows["peer:transformers"]["metrics"]["loss"]) < 1e-4  # fp32 latent vs our FP16 latent

    def nf4(layer: int, rows_: torch.Tensor) -> torch.Tensor:
        c_kv, k_pe = rows_.split([32, 8], dim=-1)
        q, state = quantize_4bit(c_kv.contiguous(), blocksize=32, quant_type="nf4")
        return torch.cat([dequantize_4bit(q, state), k_pe.half().float()], -1)

    with torch.no_grad():
        logits = torch.cat([setup["model"](ids, nf4) for ids in samples.split(4)])
    for k, v in metrics(logits).items():
        assert rows["peer:bnb-nf4"]["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    assert rows["peer:bnb-nf4"]["bytes_per_token_per_layer"] == 16 + 4 + 16  # codes + FP32 absmax + FP16 k_pe
    assert rows["peer:hqq-int2"]["status"].startswith("not run: no-such-hqq not installed")


def test_outputs_are_valid(setup):
    import matplotlib.image

    out, report = setup["root"] / "out", setup["report"]
    for name in ("sweep.png", "memory.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        img = matplotlib.image.imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 300 and img.std() > 0
    md = (out / "report.md").read_text()
    for row in report["rows"]:
        assert f"| {row['label']} |" in md
    assert "not run: no-such-hqq not installed" in md and "## Findings" in md
    assert report["findings"] in md
    assert report["model"]["fingerprint"] == setup["model"].fingerprint()
    assert report["versions"]["transformers"] and report["settings"]["samples"] == 4
    assert set(report["pareto"]) <= {r["id"] for r in report["rows"] if r["status"] == "ok"}
    assert "ours:fp16" in report["pareto"] or any(
        dominates(r, rows_by_id(report)["ours:fp16"]) for r in report["rows"] if r["status"] == "ok"
    )
    assert not list(out.glob(".*.tmp"))


def test_rerun_reuses_finished_rows(setup, monkeypatch, tmp_path):
    root, first = setup["root"], setup["report"]
    shutil.copytree(root / "out", tmp_path / "out")
    measured = []
    original = SweepRun.measure

    def recording(self, row):
        measured.append(row.id)
        return original(self, row)

    monkeypatch.setattr(SweepRun, "measure", recording)
    again = sweep(
        setup["model"],
        setup["cfg"],
        tmp_path / "out",
        root / "test.txt",
        [str(root / "plan-1pct")],
        quiet=True,
    )
    ok = [r for r in first["rows"] if r["status"] == "ok"]
    not_run = [r["id"] for r in first["rows"] if r["status"] != "ok"]  # hqq, and quanto where not installed
    assert "peer:hqq-int2" in not_run
    assert measured == not_run  # only the rows that did not run are tried again
    assert again["resumed_rows"] == len(ok)
    assert [r for r in again["rows"] if r["id"] not in not_run] == ok
    hqq = rows_by_id(again)["peer:hqq-int2"]["status"]
    assert hqq == "ok" or hqq.startswith("not run: hqq not installed")
    assert again["reference"] == first["reference"]
    # other settings (here: the test tokens) are a different sweep: nothing is reused
    measured.clear()
    cfg = load_sweep_config(None, {**CFG, "seed": 1, "peers": [], "engines": [], "codecs": ["int4"], "window": 0})
    other = sweep(
        setup["model"], cfg, tmp_path / "out", root / "test.txt", [str(root / "plan-1pct")], quiet=True
    )
    assert other["resumed_rows"] == 0 and measured == ["ours:int4", "plan:plan-1pct"]


def test_pareto_front_and_target_verdict():
    def row(i, kind, bits, loss):
        return {"id": i, "kind": kind, "status": "ok", "eff_bits_per_value": bits, "metrics": {"loss": loss}}

    rows = [
        row("a", "ours", 16, 0.0),
        row("b", "ours", 4.5, 0.02),
        row("plan", "calibrated", 5.0, 0.008),
        row("p1", "peer", 5.0, 0.009),
        row("p2", "peer", 2.5, 0.3),
        row("c", "ours", 6.0, 0.008),
        {"id": "x", "kind": "peer", "status": "not run: missing"},
    ]
    assert pareto_front(rows) == ["p2", "b", "plan", "a"]
    v = target_verdict(rows, "plan")
    assert v["on_front"] and v["dominated_by"] == [] and v["peers_compared"] == ["p1", "p2"]
    rows.append({**row("p3", "peer", 4.9, 0.008), "eff_bits_per_value_16bit_meta": 4.0})
    assert target_verdict(rows, "plan")["dominated_by"] == ["p3"]
    # as stored (FP32 scales) no longer fewer bits; with 16-bit scales it would be
    rows[-1]["eff_bits_per_value"] = 5.5
    v = target_verdict(rows, "plan")
    assert v["on_front"] and not v["on_front_16bit_peer_scales"]
    assert v["dominated_by_16bit_peer_scales"] == ["p3"] and v["dominated_by_nominal"] == []
    # a peer whose rate without its residual window beats the plan, but not with it counted
    rows.append({**row("p4", "peer", 6.0, 0.001), "bits_per_value": 3.0})
    v = target_verdict(rows, "plan")
    assert v["on_front"] and v["dominated_by_nominal"] == ["p4"]
    assert target_verdict(rows, None)["on_front"] is None


def test_packaged_config_is_the_dataclass_default():
    from mlaquant.calib.sweep import SweepConfig
    from mlaquant.config import ConfigError, to_dict

    assert to_dict(load_sweep_config()) == to_dict(SweepConfig())
    with pytest.raises(ConfigError, match="unknown key 'samplez'"):
        load_sweep_config(None, {"calibrate": {"samplez": 3}})


@pytest.mark.parametrize(
    "args, message",
    [
        (["--codecs", "fp16,int5"], "codec name 'int5' not understood"),
        (["--codecs", " , "], "--codecs: empty list"),
        (["--plan"], "--plan: empty plan list"),
        (["--contexts", "512,abc"], "--contexts: cannot parse"),
        (["--peers", "vllm"], "peer 'vllm' unknown"),
    ],
)
def test_bad_input_is_one_line_error(args, message, tmp_path, capsys):
    assert cli.main(["sweep", "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_unwritable_output_dir_is_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert cli.main(["sweep", "--out", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert "output directory is not writable" in err and err.count("\n") == 1


def test_test_text_must_not_be_a_plan_split(setup, tmp_path):
    from mlaquant.errors import MLAQuantError

    root = setup["root"]
    cfg = load_sweep_config(None, {**CFG, "calibration_data": str(root / "cal.txt")})
    with pytest.raises(MLAQuantError, match="calibration split the plans are chosen on"):
        sweep(setup["model"], cfg, tmp_path / "o", root / "cal.txt", quiet=True)


def test_sweep_calibrates_its_plans_once(setup, tmp_path, monkeypatch):
    root = setup["root"]
    cfg = load_sweep_config(
        None,
        {
            **CFG,
            "codecs": ["int4"],
            "window": 0,
            "peers": [],
            "engines": [],
            "budgets": [0.01, 0.02],
            "calibrate": {"samples": 4, "seq_len": 32, "val_samples": 4, "batch_size": 4, "shift_val_samples": 0},
            "calibration_data": str(root / "cal.txt"),
            "validation_data": str(root / "val.txt"),
        },
    )
    first = sweep(setup["model"], cfg, tmp_path / "out", root / "test.txt", quiet=True)
    rows = rows_by_id(first)
    assert first["target"]["row"] == "plan:budget-0.01" and first["target"]["peers_compared"] == []
    for budget in ("0.01", "0.02"):
        plan = Plan.load(tmp_path / "out" / "plans" / f"budget-{budget}").bind(setup["model"].cfg)
        assert plan.budget == float(budget) and plan.settings["test_samples"] == 0
        assert plan.settings["val_data"] == str(root / "val.txt")
        ev = Evaluator(setup["model"], setup["samples"], batch_size=4)
        result = ev.evaluate(plan.layer_codecs(), model=plan.apply(setup["model"]), window=plan.window)
        assert_metrics(rows[f"plan:budget-{budget}"], result, rel=1e-6)

    def refuse(*a, **k):
        raise AssertionError("calibrated again although the plan on disk has the same settings")

    # the sub-4-bit tier's config, calibrated at the target budget: its own row, on its principal axes
    tier = Plan.load(tmp_path / "out" / "plans" / "3bit-0.01")
    assert tier.settings["candidates"][0].startswith("pca-") and tier.budget == 0.01
    assert rows["plan:3bit-0.01"]["label"] == "calibrated 1.0% plan, 3bit tier"
    assert any(lp.ckv.startswith("band-") for lp in tier.layers) or tier.fallbacks

    monkeypatch.setattr("mlaquant.calib.sweep.calibrate", refuse)
    again = sweep(setup["model"], cfg, tmp_path / "out", root / "test.txt", quiet=True)
    assert again["resumed_rows"] == len(again["rows"]) == 4


def test_every_row_carries_position_buckets_and_the_report_shows_them(setup, tmp_path):
    """Rows (peers included) carry loss per position bucket; with several buckets report.md gains the
    by-position table and sweep.png its second panel."""
    import copy

    import matplotlib.image

    report = copy.deepcopy(setup["report"])
    measured = [r for r in report["rows"] if r["status"] == "ok"]
    for r in measured:
        assert [b["positions"] for b in r["metrics"]["by_position"]] == [[0, 31]]
        assert r["metrics"]["by_position"][0]["loss"] == pytest.approx(r["metrics"]["loss"], abs=1e-6)  # FP32 total
    for r in measured:  # three buckets, as a long sample would give
        b = r["metrics"]["by_position"][0]
        r["metrics"]["by_position"] = [{**b, "positions": [lo, hi]} for lo, hi in ((0, 8), (8, 16), (16, 31))]
    one = write_report(setup["report"], tmp_path / "one")
    three = write_report(report, tmp_path / "three")
    md = three["report.md"].read_text()
    assert "## Δppl by position" in md
    assert "| configuration | bits/value | Δppl @ 0–8 | Δppl @ 8–16 | Δppl @ 16–31 | Δppl all |" in md
    assert "## Δppl by position" not in one["report.md"].read_text()
    wide, narrow = (matplotlib.image.imread(p["sweep.png"]) for p in (three, one))
    assert wide.shape[1] > 1.4 * narrow.shape[1]


def test_with_recall_on_our_rows_carry_the_share_and_the_report_a_recall_table(setup, tmp_path):
    """A SweepRun given a recall check adds each plan's share (what `Recall.share` gives) to its row and FP16's to
    the reference; report.md then lists every row with its gap to FP16 in points. Off (the default), neither."""
    import copy

    from mlaquant.evaluation.recall import Recall

    model, cfg = setup["model"], setup["cfg"]
    assert cfg.recall_prompts == 0 and "recall" not in setup["report"]["reference"]
    assert "## Exact recall" not in (setup["root"] / "out" / "report.md").read_text()
    windows = token_samples(model.tokenizer, setup["root"] / "test.txt", 2, 32, 7, model.cfg.eos_token_id)
    recall = Recall(model, windows, cue=2, span=4, seed=7)
    run = SweepRun(model, setup["samples"], cfg, {}, recall)
    int4 = Plan.uniform("int4", len(model.layers)).bind(model.cfg)
    row = run.measure_plan(int4)
    assert row["recall"] == recall.share(int4) and run.reference()["recall"] == recall.fp16
    report = copy.deepcopy(setup["report"])
    report["settings"] |= {"recall_prompts": 2, "recall_seq_len": 32, "recall_cue": 2, "recall_span": 4}
    report["reference"]["recall"] = 0.5
    measured = [r for r in report["rows"] if r["status"] == "ok" and r["kind"] != "peer"]
    for i, r in enumerate(measured):
        r["recall"] = i / len(measured)
    md = write_report(report, tmp_path / "r")["report.md"].read_text()
    assert "## Exact recall" in md and "FP16 latent cache: 50.0%." in md
    first, last = measured[0], measured[-1]
    assert f"| {first['label']} | {first['bits_per_value']:.2f} | 0.0% | -50.0 |" in md
    want = (len(measured) - 1) / len(measured)
    assert f"| {last['label']} | {last['bits_per_value']:.2f} | {want:.1%} | {100 * (want - 0.5):+.1f} |" in md


def test_a_recall_window_too_short_is_a_config_error():
    with pytest.raises(ConfigError, match="recall_seq_len ≥ 2 × \\(cue \\+ span\\) \\+ cue = 176"):
        load_sweep_config(None, {**CFG, "recall_prompts": 2, "recall_seq_len": 100})
