"""`Plan`: which codec each layer's latent cache gets, with its calibrated ranges and guard bounds.

A plan directory holds two files, written atomically (temp dir, then rename):

    plan.yaml           human-readable: per-layer codecs, measured losses, bytes/token, the model
                        fingerprint, the budget and settings used, fallbacks taken, versions
    scales.safetensors  per-layer tensors: `layer{i}.clip_lo` / `layer{i}.clip_hi` [d_c + d_r] float32
                        (calibrated per-channel clip ranges of the cached rows), `layer{i}.range_lo`
                        / `range_hi` (observed min / max, for the runtime guard) and, for rotated layers,
                        `layer{i}.rotation_signs` [d_c] (c_kv·R_c, R_c = diag(signs)·H/√d_c) or
                        `layer{i}.ckv_rotation` [d_c, d_c] (c_kv·R_c, R_c the principal axes of c_kv on the
                        calibration rows, `mlaquant.calib.transform`) and / or
                        `layer{i}.rope_rotation_signs` [d_r] (k_pe·R_r and q_pe·R_r after RoPE), see
                        `mlaquant.modeling.model.with_latent_rotation` — quantization parameters live here,
                        never in file names

Uniform plans need no calibration: "fp32", "bf16", "fp16", "int8", "int4", or "<ckv>/<kpe>" codec
names (e.g. "int4-g32/int8-g32"); they fit any model and carry no fingerprint.

A plan reads its codecs, sizes and rotations at the latent widths (d_c, d_r) of the model it is bound to
(`Plan.bind(model.cfg)`; `resolve_plan` binds); the binding is not saved, plan files are the same either way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mlaquant.atomic import atomic_directory
from mlaquant.config import from_dict, to_dict
from mlaquant.errors import MLAQuantError, PlanError
from mlaquant.modeling.model import MLAConfig, latent_rotation
from mlaquant.quant.codecs import CodecError, CodecSpec, LayerCodec, bits_per_value, split_pair
from mlaquant.versions import library_versions

PLAN_VERSION = 1


@dataclasses.dataclass
class LayerPlan:
    """One layer's cache format and what calibration measured for it."""

    ckv: str
    kpe: str
    clip: bool = False
    # c_kv cached as c_kv·R (Hadamard with the stored signs), R folded into W_UK / W_UV
    rotate: bool = False
    # k_pe and q_pe multiplied by a Hadamard R_r after RoPE (stored signs), scores unchanged
    rotate_rope: bool = False
    # validation loss increase (relative ppl) with only this layer quantized; None when not measured
    loss: float | None = None
    # guard bound: the worst per-row relative error seen on calibration rows
    max_rel_error: float | None = None
    # absorbed projections (q_nope·W_UK, W_UV, o_proj) as W8A8 GEMMs (mlaquant.modeling.int8_proj)
    int8_matmul: bool = False
    note: str = ""

    @property
    def codec_name(self) -> str:
        return f"{self.ckv}/{self.kpe}"


@dataclasses.dataclass
class Plan:
    layers: list[LayerPlan]
    version: int = PLAN_VERSION
    fingerprint: str | None = None
    # residual window: the most recent `window` rows of every layer stay FP16 (0 = off)
    window: int = 0
    budget: float | None = None
    metrics: dict = dataclasses.field(default_factory=dict)
    settings: dict = dataclasses.field(default_factory=dict)
    fallbacks: list = dataclasses.field(default_factory=list)
    versions: dict = dataclasses.field(default_factory=dict)
    tensors: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # (d_c, d_r) of the model set by `bind`; not a field, so never in plan.yaml (nor kept by dataclasses.replace)
        self.latent_widths: tuple[int, int] | None = None

    def bind(self, cfg: MLAConfig) -> Plan:
        """Bind this plan to the latent widths (d_c, d_r) = `cfg.latent_widths` of the model it runs on, which
        `layer_codec(s)`, `rotations`, `bytes_per_token`, `bits_per_value` and `apply` read; returns the plan."""
        self.latent_widths = cfg.latent_widths
        return self

    def _widths(self) -> tuple[int, int]:
        if self.latent_widths is None:
            raise PlanError("plan is not bound to a model's latent widths: call plan.bind(model.cfg) first "
                            "(resolve_plan binds)")
        return self.latent_widths

    @classmethod
    def uniform(cls, name: str, num_layers: int) -> Plan:
        """The same codec in every layer: 'fp16', 'int8', 'int4', ... or '<ckv>/<kpe>', with optional
        suffixes '+w<R>' (a residual FP16 window of R tokens, e.g. 'int4+w64') and '+i8mm' (W8A8 absorbed
        projections, e.g. 'int4+i8mm')."""
        name, *suffixes = name.split("+")
        window, int8_matmul = 0, False
        for suffix in suffixes:
            if suffix == "i8mm":
                int8_matmul = True
            elif suffix.startswith("w") and suffix[1:].isdigit():
                window = int(suffix[1:])
            else:
                raise CodecError(f"unknown plan suffix '+{suffix}' (use '+w<R>' for a window of R tokens, '+i8mm')")
        ckv, kpe = split_pair(name)
        for n in (ckv, kpe):
            CodecSpec.parse(n)
        ckv, kpe = CodecSpec.parse(ckv).name, CodecSpec.parse(kpe).name
        layers = [LayerPlan(ckv, kpe, int8_matmul=int8_matmul) for _ in range(num_layers)]
        return cls(layers=layers, window=window)

    @property
    def name(self) -> str:
        names = {(lp.codec_name, lp.int8_matmul) for lp in self.layers}
        if len(names) != 1 or self.fingerprint:
            return "calibrated"
        codec, int8_matmul = names.pop()
        return codec + (f"+w{self.window}" if self.window else "") + ("+i8mm" if int8_matmul else "")

    def layer_codec(self, i: int, ckv: str | None = None, kpe: str | None = None) -> LayerCodec:
        """Layer i's codec (optionally with other codec names but the same calibrated clip ranges)."""
        lp = self.layers[i]
        lo = self.tensors.get(f"layer{i}.clip_lo") if lp.clip else None
        hi = self.tensors.get(f"layer{i}.clip_hi") if lp.clip else None
        return LayerCodec.from_names(ckv or lp.ckv, kpe or lp.kpe, *self._widths(), lo, hi)

    def rotations(self) -> dict[int, torch.Tensor]:
        """Layer → [d_c + d_r, d_c + d_r] float32 block-diagonal rotation for the layers that rotate a part: c_kv
        by its stored matrix (`ckv_rotation`) or Hadamard signs, k_pe by Hadamard signs."""
        d_c, d_r = self._widths()
        t = self.tensors
        out = {}
        for i, lp in enumerate(self.layers):
            if not (lp.rotate or lp.rotate_rope):
                continue
            matrix = t.get(f"layer{i}.ckv_rotation") if lp.rotate else None
            signs = t[f"layer{i}.rotation_signs"] if lp.rotate and matrix is None else None
            out[i] = latent_rotation(signs, t[f"layer{i}.rope_rotation_signs"] if lp.rotate_rope else None, d_c, d_r)
            if matrix is not None:
                out[i][:d_c, :d_c] = matrix.float()
        return out

    def apply(self, model, backend: str = "auto"):
        """The model this plan's cache rows belong to (a `mlaquant.modeling.protocol.LatentModel`): rotated
        layers folded in (`model.rotated`), `int8_matmul` layers with W8A8 absorbed projections on `backend`
        (`model` itself when the plan needs neither)."""
        from mlaquant.modeling.int8_proj import with_int8_projections

        rotations = self.rotations()
        model = model.rotated(rotations) if rotations else model
        return with_int8_projections(model, [i for i, lp in enumerate(self.layers) if lp.int8_matmul], backend)

    def layer_codecs(self) -> list[LayerCodec]:
        return [self.layer_codec(i) for i in range(len(self.layers))]

    def bytes_per_token(self) -> int:
        """Cache bytes per token summed over layers (codes, scales, zero points)."""
        return sum(c.row_bytes for c in self.layer_codecs())

    def bits_per_value(self) -> float:
        codecs = self.layer_codecs()
        return sum(bits_per_value(c) for c in codecs) / len(codecs)

    def check_model(self, model) -> None:
        """Refuse a plan made for another model (layer count, widths, weights fingerprint)."""
        if len(self.layers) != model.cfg.num_hidden_layers:
            raise PlanError(f"plan has {len(self.layers)} layers, model has {model.cfg.num_hidden_layers}")
        if self.fingerprint is not None and self.fingerprint != model.fingerprint():
            raise PlanError(
                f"plan fingerprint {self.fingerprint[:12]} does not match model {model.fingerprint()[:12]} "
                f"({model.source}): this plan was calibrated for another model"
            )

    def save(self, out_dir: str | Path) -> Path:
        """Write plan.yaml + scales.safetensors atomically into out_dir (replacing an old plan there)."""
        with atomic_directory(out_dir) as tmp:
            meta = to_dict(self)
            meta.pop("tensors")
            meta["versions"] = {**self.versions, **library_versions()}
            (tmp / "plan.yaml").write_text(yaml.safe_dump(meta, sort_keys=False, width=110))
            tensors = {k: v.detach().float().contiguous().cpu() for k, v in self.tensors.items()}
            save_file(tensors, str(tmp / "scales.safetensors"), metadata={"format": "mlaquant-plan"})
        return Path(out_dir)

    @classmethod
    def load(cls, plan_dir: str | Path) -> Plan:
        plan_dir = Path(plan_dir)
        meta_file, scales_file = plan_dir / "plan.yaml", plan_dir / "scales.safetensors"
        for f in (meta_file, scales_file):
            if not f.is_file():
                raise PlanError(f"{plan_dir}: not a plan directory ({f.name} missing)")
        try:
            meta = yaml.safe_load(meta_file.read_text())
        except yaml.YAMLError as e:
            raise PlanError(f"{meta_file}: corrupt plan ({e.__class__.__name__})") from e
        if not isinstance(meta, dict) or not isinstance(meta.get("layers"), list):
            raise PlanError(f"{meta_file}: corrupt plan (no 'layers' list)")
        if meta.get("version") != PLAN_VERSION:
            raise PlanError(f"{meta_file}: plan version {meta.get('version')!r}, this mlaquant reads {PLAN_VERSION}")
        try:
            layers = [from_dict(LayerPlan, lp, f"{meta_file}: layers[{i}]") for i, lp in enumerate(meta["layers"])]
            meta["layers"] = layers
            plan = from_dict(cls, meta, str(meta_file))
            for lp in layers:
                CodecSpec.parse(lp.ckv), CodecSpec.parse(lp.kpe)
        except (MLAQuantError, TypeError) as e:
            raise PlanError(f"{meta_file}: corrupt plan ({e})") from e
        try:
            plan.tensors = load_file(str(scales_file))
        except (SafetensorError, OSError) as e:
            raise PlanError(f"{scales_file}: corrupt scales file ({e})") from e
        for i, lp in enumerate(layers):
            pca = f"layer{i}.ckv_rotation" in plan.tensors
            needs = (
                (lp.clip, "clip_hi"),
                (lp.clip, "clip_lo"),
                (lp.rotate and not pca, "rotation_signs"),
                (lp.rotate_rope, "rope_rotation_signs"),
            )
            for flag, key in needs:
                if flag and f"layer{i}.{key}" not in plan.tensors:
                    raise PlanError(f"{scales_file}: layer {i} needs tensor 'layer{i}.{key}', which is missing")
        return plan


def resolve_plan(plan: str | Path | Plan, model) -> Plan:
    """A Plan from a Plan, a plan directory, or a uniform codec name; checked against and bound to `model`."""
    if isinstance(plan, Plan):
        resolved = plan
    elif isinstance(plan, Path) or Path(plan).exists():
        resolved = Plan.load(plan)
    else:
        try:
            resolved = Plan.uniform(str(plan), model.cfg.num_hidden_layers)
        except CodecError as e:
            raise PlanError(f"plan '{plan}' is neither a plan directory nor codec names ({e})") from e
    resolved.check_model(model)
    return resolved.bind(model.cfg)
