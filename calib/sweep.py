"""`mlaquant sweep`: accuracy against cache memory for many cache configurations on held-out text.

    mlaquant sweep [--model PATH] [--data PATH] [--codecs fp16,int8,int4,...] [--plan DIR ...]
                   [--contexts 512,2048,8192] [--peers transformers,quanto-int4,...] [--out DIR]

Rows, all on the same test tokens (`--data`, default the bundled test split — never a split a plan
was chosen on):
    ours        uniform codecs from `--codecs` (`<ckv>[/<kpe>]`, names as in `mlaquant.quant.codecs`; a `+i8mm`
                suffix also runs the absorbed projections in W8A8, `mlaquant.modeling.int8_proj`)
    window      `window_codecs` with a residual FP16 window of `window` tokens (`<codec>+w<R>`)
    calibrated  plans from `--plan DIR ...`, or calibrated here at each of `budgets` (bundled
                calibration / validation splits, sizes from `calibrate:` in configs/sweep.yaml)
    engine      `engines`: other engines' cache settings as mlaquant codecs (`mlaquant.integrations.engines.FORMATS`,
                values bit-exact with each engine's quantizer)
    peer        `mlaquant.calib.peers`: transformers' default cache, its QuantizedCache, bitsandbytes NF4,
                llama.cpp

Each row reports bytes/token/layer, bits/value, cache MiB at each context, compression against the
FP16 latent and against MHA's per-head K/V, Δppl, KL, top-1 (`mlaquant.evaluation.eval`, against the FP16
latent cache) and batch-1 decode tokens/s. Outputs (`mlaquant.evaluation.report`): DIR/report.md, report.json,
sweep.png, memory.png; calibrated plans go to DIR/plans/. Finished rows are kept in
DIR/.sweep-state.json, keyed by everything that determines them, so a rerun with the same settings
reuses them (an interrupted sweep resumes where it stopped).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

import mlaquant
from mlaquant.atomic import atomic_write
from mlaquant.calib.calibrate import CalibrateConfig, calibrate
from mlaquant.calib.data import split_path
from mlaquant.calib.peers import PeerSpec, PeerUnavailable, torch_threads
from mlaquant.config import ConfigError, load_config, to_dict
from mlaquant.device import add_device_arguments, auto_batch_size
from mlaquant.device import from_args as device_from_args
from mlaquant.errors import MLAQuantError, PlanError
from mlaquant.evaluation import report as report_mod
from mlaquant.evaluation.eval import Evaluator, sample_bytes
from mlaquant.evaluation.samples import token_samples
from mlaquant.integrations.engines import FORMATS
from mlaquant.modeling.model import MLAModel
from mlaquant.quant.codecs import CodecError
from mlaquant.runtime.plan import Plan
from mlaquant.versions import library_versions, package_version

STATE_FILE = ".sweep-state.json"
# what a peer library may raise on shapes or settings it does not support: the row says so and the
# sweep goes on (our own rows are validated up front and never caught)
PEER_FAILURES = (RuntimeError, ValueError, AssertionError, ImportError, TypeError, NotImplementedError)


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


def parse_list(text: str | None, what: str, conv=str) -> list | None:
    """'a,b,c' → [conv(a), ...]; None stays None; an empty list is an error naming the option."""
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise MLAQuantError(f"{what}: empty list")
    try:
        return [conv(t) for t in items]
    except ValueError as e:
        raise MLAQuantError(f"{what}: cannot parse {text!r} ({e})") from e


def check_output_dir(out: Path) -> None:
    """Create `out` and prove it writable before any work is done."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".write-test.", dir=out)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise MLAQuantError(f"{out}: output directory is not writable ({e.strerror or e})") from e


def digest(path: Path) -> str:
    """sha256 over a file, or over every file of a directory (relative names and contents, sorted)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def same_path(a, b) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


@dataclasses.dataclass
class RowSpec:
    """One row to measure: `spec` holds everything that determines its numbers (the resume key)."""

    id: str
    kind: str
    label: str
    spec: dict


def model_dims(model: MLAModel) -> dict:
    c = model.cfg
    return {
        "layers": c.num_hidden_layers,
        "heads": c.num_attention_heads,
        "d_c": c.kv_lora_rank,
        "d_r": c.qk_rope_head_dim,
        "d_n": c.qk_nope_head_dim,
        "d_v": c.v_head_dim,
        "fp16_latent_bytes": (c.kv_lora_rank + c.qk_rope_head_dim) * 2,
        "mha_kv_bytes": c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * 2,
    }


def plan_label(plan: Plan) -> str:
    """'int4-g32/int4-g32 ×3, int8-g64/int8-row ×1' (layer codecs with counts, in layer order)."""
    counts: dict[str, int] = {}
    for lp in plan.layers:
        counts[lp.codec_name] = counts.get(lp.codec_name, 0) + 1
    return ", ".join(f"{n} ×{k}" for n, k in counts.items())


class SweepRun:
    """Measures rows for one model on one token set; the FP16 reference and peer models load lazily."""

    def __init__(
        self, model: MLAModel, samples: torch.Tensor, cfg: SweepConfig, plans: dict[str, Plan]
    ) -> None:
        self.model, self.samples, self.cfg, self.plans = model, samples, cfg, plans
        self._evaluator: Evaluator | None = None
        self._hf = None
        self.prompt = samples[:1, : min(cfg.decode_context, samples.shape[1])]

    @property
    def evaluator(self) -> Evaluator:
        if self._evaluator is None:
            self._evaluator = Evaluator(self.model, self.samples, self.cfg.batch_size)
        return self._evaluator

    def reference(self) -> dict:
        """The FP16-latent cache's own numbers on the test tokens (what every Δppl is relative to)."""
        ev = self.evaluator
        return {"nll": round(ev.ref_nll, 8), "ppl": round(math.exp(ev.ref_nll), 8), "tokens": ev.tokens}

    def measure(self, row: RowSpec) -> dict:
        if row.kind == "peer":
            return self.measure_peer(PeerSpec.parse(row.spec["peer"]))
        if row.kind == "calibrated":
            return self.measure_plan(self.plans[row.id])
        plan = Plan.uniform(row.spec["codec"], len(self.model.layers)).bind(self.model.cfg)  # ours, window, engine
        if row.kind == "engine":
            try:
                plan.layer_codecs()
            except CodecError as e:  # e.g. a 128-value tile on a narrower c_kv: the engine could not store it
                raise PeerUnavailable(f"does not fit this model ({e})") from e
        return self.measure_plan(plan)

    def measure_plan(self, plan: Plan) -> dict:
        codecs = plan.layer_codecs()
        result = self.evaluator.evaluate(codecs, model=plan.apply(self.model), window=plan.window)
        bpt = plan.bytes_per_token() / len(codecs)
        out = {
            "codec": plan.name if plan.name != "calibrated" else plan_label(plan),
            "bytes_per_token_per_layer": bpt,
            "bits_per_value": plan.bits_per_value(),
            "metrics": result.as_dict(),
            "decode_tokens_per_s": self.decode_tokens_per_s(plan),
        }
        if plan.window:
            out["residual_tokens"] = plan.window
            out["residual_bytes_per_token_per_layer"] = self.model.cfg.latent_dim * 2
        return out

    def decode_tokens_per_s(self, plan: Plan) -> float:
        """Batch-1 greedy decode after a `decode_context`-token prefill: 1 / median step time."""
        session = mlaquant.DecodeSession(self.model, plan=plan, backend=self.cfg.decode_backend)
        nxt = session.prefill(self.prompt)[:, -1].argmax(-1)
        times = []
        with torch_threads(self.cfg.decode_threads):
            for _ in range(self.cfg.decode_steps + 1):  # the first step is a warm-up
                t0 = time.perf_counter()
                logits = session.decode(nxt)
                times.append(time.perf_counter() - t0)
                nxt = logits.argmax(-1)
        return 1.0 / statistics.median(times[1:])

    def measure_peer(self, spec: PeerSpec) -> dict:
        from mlaquant.calib import peers

        if spec.name == "bnb-nf4":
            return peers.measure_nf4(self.evaluator, self.cfg.nf4_blocksize)
        if spec.backend == "llama.cpp":
            return peers.measure_llama_cpp(self.evaluator, spec.name.split("-", 1)[1])
        cfg = self.cfg
        if self._hf is None:
            self._hf = peers.TransformersPeers(
                self.model.source,
                self.model.dtype,
                *self.model.cfg.latent_widths,
                cfg.peer_group_size,
                cfg.peer_residual_length,
                self.model.device,
            )
        return self._hf.measure(
            spec, self.evaluator, self.prompt, cfg.decode_steps, cfg.decode_threads, cfg.peer_batch_size
        )


def row_specs(cfg: SweepConfig, plans: dict[str, Plan], plan_digests: dict[str, str]) -> list[RowSpec]:
    rows = [RowSpec(f"ours:{c}", "ours", c, {"codec": c}) for c in cfg.codecs]
    if cfg.window:
        for c in cfg.window_codecs:
            name = f"{c}+w{cfg.window}"
            rows.append(RowSpec(f"window:{name}", "window", name, {"codec": name}))
    formats = {f.name: f for f in FORMATS}
    rows += [RowSpec(f"engine:{name}", "engine", f"{name} ({formats[name].setting})", {"codec": formats[name].codec})
             for name in cfg.engines]
    tiers = {f"plan:{Path(t).stem.removeprefix('calibrate-')}-{cfg.target_budget:g}": Path(t).stem for t in cfg.tiers}
    for pid, plan in plans.items():
        budget = f"{plan.budget:.1%} plan" if plan.budget is not None else "plan"
        label = f"calibrated {budget}" if pid.startswith("plan:budget-") else f"{pid[5:]} ({budget})"
        if pid in tiers:
            label = f"calibrated {budget}, {tiers[pid].removeprefix('calibrate-')} tier"
        rows.append(RowSpec(pid, "calibrated", label, {"plan": plan_digests[pid], "window": plan.window}))
    for name in cfg.peers:
        spec = {"peer": name}
        if name.startswith("llama.cpp-"):
            spec |= {"llama_cpp": package_version("llama-cpp-python")}
        elif name != "bnb-nf4":
            spec |= {
                "group": cfg.peer_group_size,
                "residual": cfg.peer_residual_length,
                "batch": cfg.peer_batch_size,
            }
        else:
            spec |= {"blocksize": cfg.nf4_blocksize}
        rows.append(RowSpec(f"peer:{name}", "peer", name, spec))
    return rows


def load_plans(plan_dirs: list[str], model: MLAModel, data: Path) -> dict[str, Plan]:
    """`--plan DIR ...`: each checked against the model and against the test text, and bound to the model."""
    if not plan_dirs:
        raise MLAQuantError("--plan: empty plan list (give one or more plan directories)")
    plans = {}
    for d in plan_dirs:
        plan = Plan.load(d)
        plan.check_model(model)
        for key in ("data", "val_data"):
            if same_path(plan.settings.get(key), data):
                raise PlanError(f"{d}: plan was chosen on {data} ({key}); report on held-out text (--data)")
        plans[f"plan:{Path(d).resolve().name}"] = plan.bind(model.cfg)
    return plans


def calibrated_plans(model: MLAModel, cfg: SweepConfig, out: Path, quiet: bool) -> dict[str, Plan]:
    """Plans at each budget in DIR/plans/budget-<b>, and of each tier config at the target budget in
    DIR/plans/<tier>-<b>, reusing one calibrated earlier with the same settings; bound to `model`."""
    runs = [(f"budget-{b:g}", calibrate_config(cfg, b)) for b in cfg.budgets]
    runs += [(f"{Path(t).stem.removeprefix('calibrate-')}-{cfg.target_budget:g}",
              calibrate_config(cfg, cfg.target_budget, t)) for t in cfg.tiers]
    plans = {}
    fingerprint = model.fingerprint()
    for name, ccfg in runs:
        plan_dir = out / "plans" / name
        want = {
            **to_dict(ccfg),
            "data": str(cfg.calibration_data or split_path("calibration")),
            "val_data": str(cfg.validation_data or split_path("validation")),
        }
        plan = None
        if (plan_dir / "plan.yaml").is_file():
            old = Plan.load(plan_dir)
            if old.fingerprint == fingerprint and all(old.settings.get(k) == v for k, v in want.items()):
                plan = old
        if plan is None:
            plan, _ = calibrate(model, ccfg, cfg.calibration_data, cfg.validation_data, quiet=quiet)
            plan.save(plan_dir)
            plan = Plan.load(plan_dir)
        plans[f"plan:{name}"] = plan.bind(model.cfg)
    return plans


def load_state(out: Path, key: str) -> dict:
    """{'rows': {id: row}, 'reference': {...}} of an earlier run with the same key, else empty."""
    path = out / STATE_FILE
    try:
        state = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        state = {}
    return state if state.get("key") == key else {"rows": {}}


def save_state(out: Path, state: dict) -> None:
    atomic_write(out / STATE_FILE, json.dumps(state, indent=1))


def resolve_plans(
    model: MLAModel, cfg: SweepConfig, out: Path, data: Path, plan_dirs: list[str] | None, quiet: bool
) -> tuple[dict[str, Plan], dict[str, str], str]:
    """(plans by row id, their content digests, a sentence on where they come from)."""
    if plan_dirs is not None:
        plans = load_plans(plan_dirs, model, data)
        paths = {f"plan:{Path(d).resolve().name}": Path(d) for d in plan_dirs}
        source = "plans from --plan: " + ", ".join(str(d) for d in plan_dirs)
    else:
        for key, split in (("calibration_data", "calibration"), ("validation_data", "validation")):
            if same_path(getattr(cfg, key) or split_path(split), data):
                raise MLAQuantError(
                    f"--data {data} is the {split} split the plans are chosen on; use held-out text"
                )
        plans = calibrated_plans(model, cfg, out, quiet)
        paths = {pid: out / "plans" / pid[len("plan:") :] for pid in plans}
        c = calibrate_config(cfg, cfg.target_budget)
        source = (
            f"calibrated here at budgets {', '.join(f'{b:.1%}' for b in cfg.budgets)}: "
            f"{c.samples}×{c.seq_len} calibration tokens, {c.val_samples}×{c.seq_len} validation tokens, "
            f"headroom {c.headroom}"
        )
    return plans, {pid: digest(p) for pid, p in paths.items()}, source


def run_rows(run: SweepRun, specs: list[RowSpec], out: Path, key: str, quiet: bool) -> tuple[dict, dict, int]:
    """Measure the rows not finished under `key` before; returns (rows by id, reference, rows reused)."""
    state = load_state(out, key)
    done = state.pop("rows")
    state["key"] = key
    rows: dict[str, dict] = {}
    resumed = 0
    with tqdm(total=len(specs), desc="sweep", disable=quiet, file=sys.stderr) as bar:
        for spec in specs:
            bar.set_postfix_str(spec.id)
            old = done.get(spec.id)
            if old is not None and old["spec"] == spec.spec and old["status"] == "ok":
                rows[spec.id] = old
                resumed += 1
            else:
                rows[spec.id] = _measure(run, spec)
                state["reference"] = run.reference()
                save_state(out, {**state, "rows": {**done, **rows}})
            bar.update(1)
    return rows, state.get("reference") or run.reference(), resumed


def sweep(
    model: MLAModel,
    cfg: SweepConfig,
    out: str | Path,
    data: str | Path | None = None,
    plan_dirs: list[str] | None = None,
    quiet: bool = False,
) -> dict:
    """Measure every row and write the report into `out`; returns the report dict."""
    t0 = time.perf_counter()
    out = Path(out)
    check_output_dir(out)
    if model.tokenizer is None:
        raise MLAQuantError(f"{model.source}: no tokenizer.json; the sweep needs text → tokens")
    data = Path(data) if data is not None else split_path("test")
    batch = auto_batch_size(model.device, sample_bytes(model, cfg.seq_len), cfg.batch_size, default=8)
    cfg = dataclasses.replace(cfg, batch_size=batch)
    for name in (*cfg.codecs, *cfg.window_codecs):
        Plan.uniform(name, len(model.layers)).bind(model.cfg).layer_codecs()  # a codec that does not fit the widths
    plans, digests, plan_source = resolve_plans(model, cfg, out, data, plan_dirs, quiet)
    samples = token_samples(model.tokenizer, data, cfg.samples, cfg.seq_len, cfg.seed, model.cfg.eos_id)
    specs = row_specs(cfg, plans, digests)
    fingerprint = model.fingerprint()
    key_src = {
        "mlaquant": mlaquant.__version__,
        "torch": str(torch.__version__),
        "model": fingerprint,
        "data": digest(data),
        "tokens": hashlib.sha256(samples.numpy().tobytes()).hexdigest(),
        "eval": [
            cfg.batch_size,
            cfg.decode_context,
            cfg.decode_steps,
            cfg.decode_backend,
            cfg.decode_threads,
        ],
    }
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()
    rows, reference, resumed = run_rows(SweepRun(model, samples, cfg, plans), specs, out, key, quiet)
    dims = model_dims(model)
    final = [report_mod.add_derived(rows[s.id], list(cfg.contexts), dims, samples.shape[1]) for s in specs]
    target = next((pid for pid, p in plans.items() if p.budget == cfg.target_budget), None)
    report = {
        "version": 1,
        "settings": {
            **to_dict(cfg),
            "data": str(data),
            "plan_source": plan_source,
            "threads": torch.get_num_threads(),
            "decode_threads": cfg.decode_threads or torch.get_num_threads(),
        },
        "versions": library_versions("transformers", "bitsandbytes", "optimum-quanto", "hqq", "tokenizers",
                                      "llama-cpp-python"),
        "model": {"path": str(model.source), "fingerprint": fingerprint, "dims": dims},
        "tokens": {"samples": int(samples.shape[0]), "seq_len": int(samples.shape[1])},
        "reference": reference,
        "rows": final,
        "pareto": report_mod.pareto_front(final),
        "target": report_mod.target_verdict(final, target),
        "resumed_rows": resumed,
    }
    report["findings"] = report_mod.findings(report)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report_mod.write_report(report, out)
    return report


def _measure(run: SweepRun, spec: RowSpec) -> dict:
    t0 = time.perf_counter()
    base = {"id": spec.id, "kind": spec.kind, "label": spec.label, "spec": spec.spec}
    try:
        numbers = run.measure(spec)
        status = "ok"
    except PeerUnavailable as e:
        numbers, status = {}, f"not run: {e}"
    except PEER_FAILURES as e:
        if spec.kind != "peer":
            raise
        numbers, status = {}, f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    label = numbers.pop("label", spec.label)
    return {
        **base,
        "label": label,
        "status": status,
        **numbers,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument(
        "--data", default=None, help="held-out text: file, directory or JSONL (default: bundled test)"
    )
    p.add_argument(
        "--codecs", default=None, help="comma-separated uniform codecs '<ckv>[/<kpe>]' (default: config)"
    )
    p.add_argument(
        "--plan", nargs="*", default=None, metavar="DIR", help="plan directories (default: calibrate)"
    )
    p.add_argument(
        "--budgets", default=None, help="comma-separated budgets to calibrate at (default 0.005,0.01,0.02)"
    )
    p.add_argument(
        "--contexts", default=None, help="context lengths for the cache MiB columns (default 512,2048,8192)"
    )
    p.add_argument("--peers", default=None, help="comma-separated peers, or 'none' (default: config)")
    p.add_argument("--samples", type=int, default=None, help="test samples (default 16)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per test sample (default 512)")
    p.add_argument("--config", default=None, help="sweep YAML (default: configs/sweep.yaml)")
    p.add_argument("--out", default="sweep", help="output directory (default: ./sweep)")
    add_device_arguments(p)


def run(args: argparse.Namespace) -> int:
    from mlaquant.modeling.loader import load_model

    overrides = {
        "codecs": parse_list(args.codecs, "--codecs"),
        "budgets": parse_list(args.budgets, "--budgets", float),
        "contexts": parse_list(args.contexts, "--contexts", int),
        "peers": [] if args.peers == "none" else parse_list(args.peers, "--peers"),
        "samples": args.samples,
        "seq_len": args.seq_len,
    }
    try:
        cfg = load_sweep_config(args.config, {k: v for k, v in overrides.items() if v is not None})
    except CodecError as e:
        raise MLAQuantError(f"--codecs: {e}") from e
    if args.plan is not None and not args.plan:
        raise MLAQuantError("--plan: empty plan list (give one or more plan directories)")
    device, dtype = device_from_args(args)  # before anything is written
    out = Path(args.out)
    check_output_dir(out)
    model = load_model(args.model, device, dtype)
    report = sweep(model, cfg, out, args.data, args.plan, quiet=args.quiet)
    print(report_mod.markdown(report).split("\n## Notes")[0])
    print(f"\nreport written to {out}/report.md (+ report.json, sweep.png, memory.png)")
    return 0
