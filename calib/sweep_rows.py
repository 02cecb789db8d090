"""The sweep's rows: which to measure (`RowSpec`, `row_specs`: ours, window, engine, calibrated, peer), each
measured on the test tokens (`SweepRun`: our plans through `mlaquant.evaluation.eval` and a timed decode, the
peers through `mlaquant.calib.peers`), and finished rows kept in DIR/.sweep-state.json under the resume key, so
that a rerun reuses them (`run_rows`)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import mlaquant
from mlaquant.atomic import atomic_write
from mlaquant.calib.peers import PeerSpec, PeerUnavailable, torch_threads
from mlaquant.calib.sweep_config import SweepConfig
from mlaquant.evaluation.eval import Evaluator
from mlaquant.evaluation.recall import Recall
from mlaquant.integrations.engines import FORMATS
from mlaquant.modeling.model import MLAModel
from mlaquant.quant.codecs import CodecError
from mlaquant.runtime.plan import Plan
from mlaquant.versions import package_version

STATE_FILE = ".sweep-state.json"
# what a peer library may raise on shapes or settings it does not support: the row says so and the
# sweep goes on (our own rows are validated up front and never caught)
PEER_FAILURES = (RuntimeError, ValueError, AssertionError, ImportError, TypeError, NotImplementedError)


@dataclasses.dataclass
class RowSpec:
    """One row to measure: `spec` holds everything that determines its numbers (the resume key)."""

    id: str
    kind: str
    label: str
    spec: dict


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


def plan_label(plan: Plan) -> str:
    """'int4-g32/int4-g32 ×3, int8-g64/int8-row ×1' (layer codecs with counts, in layer order)."""
    counts: dict[str, int] = {}
    for lp in plan.layers:
        counts[lp.codec_name] = counts.get(lp.codec_name, 0) + 1
    return ", ".join(f"{n} ×{k}" for n, k in counts.items())


class SweepRun:
    """Measures rows for one model on one token set; the FP16 reference and peer models load lazily. With a
    `recall` check (`mlaquant.evaluation.recall.Recall`) each of our rows also carries its recall share."""

    def __init__(
        self, model: MLAModel, samples: torch.Tensor, cfg: SweepConfig, plans: dict[str, Plan],
        recall: Recall | None = None,
    ) -> None:
        self.model, self.samples, self.cfg, self.plans, self.recall = model, samples, cfg, plans, recall
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
        out = {"nll": round(ev.ref_nll, 8), "ppl": round(math.exp(ev.ref_nll), 8), "tokens": ev.tokens}
        return out if self.recall is None else out | {"recall": self.recall.fp16}

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
        if self.recall is not None:
            out["recall"] = self.recall.share(plan)
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
