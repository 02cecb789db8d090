"""Below 2.5 bits per cached value: which scalar codes earn their bytes (the 2-bit tier's ablation).

    python scripts/measure_2bit.py [--samples 32] [--seq-len 512] [--out ablation-2bit.json]

Every row is one configuration in every layer (no search): c_kv on its principal axes (`principal_rotation`, the
3-bit tier's rotation) in channel bands by reverse water-filling at a rate of code bits per c_kv value
(`allocate_bands`), k_pe Hadamard-rotated after RoPE; the loss on the validation and the test split and on the
third-party ("shifted") test text of `mlaquant.calib.data.shift_source` (teacher-forced, every token through the
fake-quantized cache) and the bits per cached value with every byte counted (codes and any per-row scale; static
parameters live in the plan, not in the rows). The codes:

    row-int      the band codec as shipped: per row and band one FP16 scale, symmetric integer codes
                 q ∈ [-2^(b-1), 2^(b-1) - 1] (`mlaquant.quant.codecs.BandCodec`)
    static-int   one scale per channel from the calibration rows (no bytes in the row), mid-rise uniform levels
                 (q + ½)·Δ, Δ chosen per band for least squared error on the calibration rows
    static-lm    one scale per channel (its standard deviation on the calibration rows) and Lloyd-Max levels per
                 band fitted on the calibration rows scaled by it (a 2^b-entry table per band)
    row-lm       per row and band one FP16 scale (the band's RMS), Lloyd-Max levels on the row-scaled values
    fp16         c_kv not quantized (the rate is ignored): what k_pe's code costs alone

k_pe: the shipped int4-row (18 B, Hadamard-rotated after RoPE), the same code family as c_kv at `kpe_bits` in one
band (also after RoPE), or `pre-<codes>` before RoPE: the rows read back un-rotated to each position's angle
(RoPE⁻¹, per cached position) and coded per channel there (static scales; bits per channel block by reverse
water-filling on the pre-RoPE variances at the given rate, channels sorted by variance), RoPE applied again on read.

Allocation by loss (issue 53, item 3): `allocation` "fisher" — the bands of each layer by reverse water-filling on
the principal variances weighted by the loss's Fisher diagonal (`mlaquant.calib.transform.loss_weighted_axes`, the
axes reordered by it; what `allocation: fisher` calibrates), the same rate in every layer; "fisher-across" — one
water-filling over every layer's weighted channels at once (the rate is the mean over the layers; layers that matter
more get more). The Fisher matrices from the first 32 calibration samples (`mlaquant.calib.sensitivity`).

Tokens kept at FP16 (issue 53, item 4): `sinks` S — the first S rows of every sequence stay FP16 in every layer;
`window` R — each query reads its most recent R rows at FP16 (the plan's residual window, `Evaluator.evaluate`'s
`window`; what `DecodeSession` serves with '+w<R>'). Their bytes count as S·16 or R·16 bits per value over
`AMORTISED_OVER` tokens on top of the codes (the issue's accounting), although these losses are at --seq-len.
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from mlaquant import load_model
from mlaquant.atomic import write_json
from mlaquant.calib.data import shift_description, shift_source, split_path
from mlaquant.calib.observers import observe
from mlaquant.calib.sensitivity import latent_fisher
from mlaquant.calib.transform import allocate_bands, loss_weights, principal_rotation
from mlaquant.evaluation.eval import Evaluator
from mlaquant.evaluation.samples import token_samples
from mlaquant.modeling.model import apply_rope, hadamard_signs
from mlaquant.quant.codecs import LayerCodec
from mlaquant.runtime.plan import LayerPlan, Plan

LLOYD_ITERATIONS = 40
ROWS = [  # label, c_kv rate (code bits per value), c_kv codes, k_pe (codes, bits) or a codec name
    ("row-int 2.0 / int4-row", 2.0, "row-int", "int4-row"),
    ("static-int 2.0 / int4-row", 2.0, "static-int", "int4-row"),
    ("static-lm 2.0 / int4-row", 2.0, "static-lm", "int4-row"),
    ("row-lm 2.0 / int4-row", 2.0, "row-lm", "int4-row"),
    ("row-int 1.5 / int4-row", 1.5, "row-int", "int4-row"),
    ("static-lm 1.5 / int4-row", 1.5, "static-lm", "int4-row"),
    ("row-lm 1.5 / int4-row", 1.5, "row-lm", "int4-row"),
    ("static-lm 2.0 / static-lm k_pe 3", 2.0, "static-lm", ("static-lm", 3)),
    ("static-lm 2.0 / static-lm k_pe 2", 2.0, "static-lm", ("static-lm", 2)),
    ("static-lm 1.5 / static-lm k_pe 3", 1.5, "static-lm", ("static-lm", 3)),
    ("static-lm 1.5 / static-lm k_pe 2", 1.5, "static-lm", ("static-lm", 2)),
    ("row-lm 1.5 / row-lm k_pe 3", 1.5, "row-lm", ("row-lm", 3)),
    ("row-int 2.0 / pre-RoPE static-int k_pe 4", 2.0, "row-int", ("pre-static-int", 4.0)),
    ("row-int 2.0 / pre-RoPE static-int k_pe 3", 2.0, "row-int", ("pre-static-int", 3.0)),
    ("row-int 2.0 / pre-RoPE static-int k_pe 2.5", 2.0, "row-int", ("pre-static-int", 2.5)),
    ("row-int 2.0 / pre-RoPE static-int k_pe 2", 2.0, "row-int", ("pre-static-int", 2.0)),
    ("static-int 2.0 / pre-RoPE static-int k_pe 3", 2.0, "static-int", ("pre-static-int", 3.0)),
    ("static-int 1.5 / pre-RoPE static-int k_pe 3", 1.5, "static-int", ("pre-static-int", 3.0)),
    ("static-int 1.5 / int4-row", 1.5, "static-int", "int4-row"),
    ("row-int 2.0 / int4-row + 4 sinks", 2.0, "row-int", "int4-row", {"sinks": 4}),
    ("row-int 1.5 / int4-row + 4 sinks", 1.5, "row-int", "int4-row", {"sinks": 4}),
    ("row-int 1.5 / int4-row + window 16", 1.5, "row-int", "int4-row", {"window": 16}),
    ("row-int 1.5 / int4-row + window 32", 1.5, "row-int", "int4-row", {"window": 32}),
    ("row-int 1.0 / int4-row + window 32", 1.0, "row-int", "int4-row", {"window": 32}),
    ("row-int 1.5 / int4-row + 4 sinks + window 16", 1.5, "row-int", "int4-row", {"sinks": 4, "window": 16}),
    ("row-int 1.0 / int4-row", 1.0, "row-int", "int4-row"),
    ("row-int 1.0 / int4-row + window 16", 1.0, "row-int", "int4-row", {"window": 16}),
    ("row-int 1.0 / int4-row + window 64", 1.0, "row-int", "int4-row", {"window": 64}),
    ("row-int 1.0 / band-3x32 + window 32", 1.0, "row-int", "band-3x32", {"window": 32}),
    ("row-int 1.0 / band-2x32 + window 32", 1.0, "row-int", "band-2x32", {"window": 32}),
    ("row-int 1.5 / int4-row, loss-weighted", 1.5, "row-int", "int4-row", {"allocation": "fisher"}),
    ("row-int 1.25 / int4-row", 1.25, "row-int", "int4-row"),
    ("row-int 1.25 / int4-row, loss-weighted", 1.25, "row-int", "int4-row", {"allocation": "fisher"}),
    ("row-int 1.0 / int4-row, loss-weighted", 1.0, "row-int", "int4-row", {"allocation": "fisher"}),
    *((f"row-int {rate} / int4-row, loss-weighted across layers", rate, "row-int", "int4-row",
       {"allocation": "fisher-across"}) for rate in (1.5, 1.25, 1.0)),
    # where the loss of the 2.3-bit row comes from: k_pe alone, and c_kv alone (k_pe at INT8, near lossless)
    ("c_kv fp16 / int4-row", 16.0, "fp16", "int4-row"),
    ("row-int 1.5 / int8-row, loss-weighted", 1.5, "row-int", "int8-row", {"allocation": "fisher"}),
]
AMORTISED_OVER = 2048  # tokens: FP16 sink and window rows count (16 bits per value) over a sequence this long


def lloyd_max(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Lloyd-Max levels (ascending, float32 [2^bits]) of the values x [n], started at their quantiles."""
    x = x.double().flatten()
    k = 1 << bits
    levels = torch.quantile(x, (torch.arange(k, dtype=torch.float64) + 0.5) / k)
    for _ in range(LLOYD_ITERATIONS):
        edges = (levels[1:] + levels[:-1]) / 2
        cell = torch.bucketize(x, edges)
        sums = torch.zeros(k, dtype=torch.float64).index_add_(0, cell, x)
        counts = torch.bincount(cell, minlength=k).double()
        levels = torch.where(counts > 0, sums / counts.clamp_min(1), levels)
    return levels.float()


def nearest(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """x [..., w] → the nearest of `levels` [L] (ascending) per value."""
    edges = (levels[1:] + levels[:-1]) / 2
    return levels[torch.bucketize(x.contiguous(), edges)]


class BandQuantizer:
    """One part's fake quantizer: channels of `bands` ((bits, width), ...) coded as `codes` (module docstring),
    fitted on calibration rows [n, width]. `row_bytes`: what the row stores."""

    def __init__(self, bands, codes: str, rows: torch.Tensor) -> None:
        self.bands, self.codes, self.fitted = bands, codes, []
        start = 0
        for bits, w in bands:
            x = rows[:, start : start + w]
            start += w
            if bits == 0:
                self.fitted.append(None)
            elif codes == "static-lm":
                std = x.pow(2).mean(0).sqrt().clamp_min(1e-8)
                self.fitted.append((std, lloyd_max(x / std, bits)))
            elif codes == "static-int":
                std = x.pow(2).mean(0).sqrt().clamp_min(1e-8)
                self.fitted.append((std, self._uniform(x / std, bits)))
            elif codes == "row-lm":
                rms = x.pow(2).mean(1, keepdim=True).sqrt().clamp_min(1e-8)
                self.fitted.append(lloyd_max(x / rms, bits))
            else:
                raise ValueError(codes)

    @staticmethod
    def _uniform(z: torch.Tensor, bits: int) -> torch.Tensor:
        """Mid-rise uniform levels (q + ½)·Δ, q ∈ [-2^(b-1), 2^(b-1) - 1], Δ of least squared error on z."""
        q = torch.arange(-(1 << (bits - 1)), 1 << (bits - 1), dtype=torch.float32) + 0.5
        best = None
        for step in torch.linspace(0.05, 3.0, 120):
            err = (nearest(z, q * step) - z).pow(2).mean()
            if best is None or err < best[0]:
                best = (err, q * step)
        return best[1]

    @property
    def row_bytes(self) -> int:
        codes = sum(bits * w for bits, w in self.bands) / 8
        return int(codes + (2 * sum(1 for b, _ in self.bands if b) if self.codes.startswith("row") else 0))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out, start = [], 0
        for (_, w), fit in zip(self.bands, self.fitted):
            band = x[..., start : start + w]
            start += w
            if fit is None:
                out.append(torch.zeros_like(band))
            elif self.codes == "row-lm":
                rms = band.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-8).half().float()
                out.append(nearest(band / rms, fit) * rms)
            else:
                std, levels = fit
                out.append(nearest(band / std, levels) * std)
        return torch.cat(out, dim=-1)


class PreRopeQuantizer:
    """k_pe coded before RoPE (module docstring): rows in the cache's frame [..., d_r] (RoPE'd, then ·R_r) → R_rᵀ →
    RoPE⁻¹ at positions 0 … T−1 → `BandQuantizer` of `bands` over the channels in descending-variance order → RoPE →
    ·R_r. `pre` [n, d_r]: calibration rows before RoPE."""

    def __init__(self, bands, codes: str, pre: torch.Tensor, r_r: torch.Tensor, rotary) -> None:
        self.order = pre.pow(2).mean(0).argsort(descending=True)
        self.inverse = self.order.argsort()
        self.quant = BandQuantizer(bands, codes, pre[:, self.order])
        self.r_r, self.rotary = r_r, rotary

    @property
    def row_bytes(self) -> int:
        return self.quant.row_bytes

    def __call__(self, k: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(torch.arange(k.shape[-2])[None], torch.float32)
        pre = apply_rope(k @ self.r_r.T, cos, -sin)
        coded = self.quant(pre[..., self.order])[..., self.inverse]
        return apply_rope(coded, cos, sin) @ self.r_r


class LayerQuantizer:
    """`fake_quant` for one layer's rotated rows [..., d_c + d_r]: c_kv by `ckv`, k_pe by `kpe` (a BandQuantizer or a
    LayerCodec's k_pe part, through the codec's own fake_quant)."""

    def __init__(self, ckv: BandQuantizer, kpe, d_c: int, sinks: int = 0) -> None:
        self.ckv, self.kpe, self.d_c, self.sinks = ckv, kpe, d_c, sinks

    def fake_quant(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [B, T, d_c + d_r] → the rows as the cache returns them (the first `sinks` positions FP16)."""
        c, k = rows[..., : self.d_c], rows[..., self.d_c :]
        c = self.ckv(c) if isinstance(self.ckv, BandQuantizer) else self.ckv.fake_quant(rows)[..., : self.d_c]
        k = self.kpe(k) if callable(self.kpe) else self.kpe.fake_quant(rows)[..., self.d_c :]
        out = torch.cat((c, k), dim=-1)
        if self.sinks:
            out[:, : self.sinks] = rows[:, : self.sinks].half().to(out.dtype)
        return out


def layer_setups(model, stats):
    """Per layer: (R_c [d_c, d_c] principal axes by variance, the rotated c_kv variances, rotated k_pe rows,
    rotated c_kv rows) on the calibration subsample, and the plan whose rotations the model takes."""
    d_c, d_r = model.cfg.latent_widths
    setups, layers, tensors = [], [], {}
    for i, s in enumerate(stats):
        rows = s.sample()
        r, _ = principal_rotation(rows[:, :d_c])
        c = rows[:, :d_c] @ r
        var = c.pow(2).mean(0)
        signs = hadamard_signs(d_r, 7919 + i)
        tensors[f"layer{i}.ckv_rotation"] = r
        tensors[f"layer{i}.rope_rotation_signs"] = signs
        layers.append(LayerPlan("fp16", "fp16", rotate=True, rotate_rope=True))
        setups.append((var, c))
    plan = Plan(layers=layers, fingerprint=model.fingerprint(), tensors=tensors).bind(model.cfg)
    rot = plan.rotations()
    kpe_rows = [s.sample()[:, d_c:] @ rot[i][d_c:, d_c:] for i, s in enumerate(stats)]
    return plan, [(var, c, k) for (var, c), k in zip(setups, kpe_rows)]


def prerope_rows(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer the k_pe of `ids` [N, T] before RoPE, [N·T, d_r] (the model's latent with RoPE undone)."""
    d_c = model.cfg.kv_lora_rank
    rows = [[] for _ in model.layers]
    cos, sin = model.rotary(torch.arange(ids.shape[1])[None], torch.float32)

    def keep(i, latent):
        rows[i].append(apply_rope(latent[..., d_c:], cos, -sin).reshape(-1, latent.shape[-1] - d_c))
        return latent

    for batch in ids.split(8):
        model.forward(batch, latent_rows=keep)
    return [torch.cat(r) for r in rows]


class Permuted:
    """A c_kv codec on the channels taken in `order` [d_c] (the loss-weighted axes are a column permutation of the
    principal ones): `fake_quant` of rows [..., d_c + d_r] with c_kv reordered, coded and put back."""

    def __init__(self, order: torch.Tensor, codec: LayerCodec, d_c: int) -> None:
        self.order, self.inverse, self.codec, self.d_c = order, order.argsort(), codec, d_c

    def fake_quant(self, rows: torch.Tensor) -> torch.Tensor:
        c = rows[..., : self.d_c][..., self.order]
        coded = self.codec.fake_quant(torch.cat((c, rows[..., self.d_c :]), -1))
        return torch.cat((coded[..., : self.d_c][..., self.inverse], coded[..., self.d_c :]), -1)


def c_kv_bands(setups, rate: float, allocation: str | None, fisher: list | None, d_c: int) -> list[tuple]:
    """Per layer (its c_kv channel order [d_c] or None for the principal one, its bands) for `allocation` (None:
    the variances; "fisher", "fisher-across": module docstring)."""
    if allocation is None:
        return [(None, allocate_bands(var, rate)) for var, _, _ in setups]
    weights = [loss_weights(torch.eye(d_c), var, f) for (var, _, _), f in zip(setups, fisher)]  # principal frame
    orders = [w.argsort(descending=True) for w in weights]
    ordered = [w[order].clamp_min(0).float() for w, order in zip(weights, orders)]
    if allocation == "fisher":
        return [(order, allocate_bands(w, rate)) for order, w in zip(orders, ordered)]
    return list(zip(orders, split_bands(allocate_bands(torch.cat(ordered), rate), d_c)))


def split_bands(bands, width: int) -> list[tuple]:
    """Bands ((bits, channels), ...) over consecutive layers of `width` channels each → per layer its bands."""
    out, layer, room = [], [], width
    for bits, w in bands:
        while w:
            take = min(w, room)
            layer.append((bits, take))
            w, room = w - take, room - take
            if not room:
                out.append(tuple(layer))
                layer, room = [], width
    return out


def quantizers(model, setups, rate: float, codes: str, kpe, plan, pre, sinks: int = 0, allocation=None,
               fisher=None) -> tuple[list, float]:
    """Per layer its LayerQuantizer for one ablation row (the first `sinks` rows FP16; c_kv bands by `allocation`,
    `c_kv_bands`), and the row's bits per cached value (codes and scales; sinks and windows not counted here)."""
    d_c, d_r = model.cfg.latent_widths
    out, total = [], 0
    rotations = plan.rotations()
    allocated = c_kv_bands(setups, rate, allocation, fisher, d_c)
    for i, ((_, c, k), (order, bands)) in enumerate(zip(setups, allocated)):
        if codes == "fp16":
            ckv, ckv_bytes = LayerCodec.from_names("fp16", "fp16", d_c, d_r), 2 * d_c
        elif codes == "row-int":
            name = "band" + "".join(f"-{b}x{w}" for b, w in bands)
            ckv = LayerCodec.from_names(name, "fp16", d_c, d_r)
            ckv_bytes = ckv.row_bytes - 2 * d_r
            ckv = ckv if order is None else Permuted(order, ckv, d_c)
        else:
            ckv = BandQuantizer(bands, codes, c)
            ckv_bytes = ckv.row_bytes
        if isinstance(kpe, str):
            part = LayerCodec.from_names("fp16", kpe, d_c, d_r)
            kq, kpe_bytes = part, part.row_bytes - 2 * d_c
        elif kpe[0].startswith("pre-"):
            p_var = pre[i].pow(2).mean(0).sort(descending=True).values
            bands = allocate_bands(p_var, kpe[1], block=8)
            kq = PreRopeQuantizer(bands, kpe[0].removeprefix("pre-"), pre[i], rotations[i][d_c:, d_c:], model.rotary)
            kpe_bytes = kq.row_bytes
        else:
            kq = BandQuantizer(((kpe[1], d_r),), kpe[0], k)
            kpe_bytes = kq.row_bytes
        out.append(LayerQuantizer(ckv, kq, d_c, sinks))
        total += ckv_bytes + kpe_bytes
    return out, 8 * total / (len(setups) * (d_c + d_r))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--samples", type=int, default=32, help="validation, test and shifted samples")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--out", default=None)
    p.add_argument("--rows", default=None, help="only the rows whose label contains one of these (comma-separated)")
    args = p.parse_args()
    model = load_model(args.model)
    tok, eos = model.tokenizer, model.cfg.eos_id
    cal = token_samples(tok, split_path("calibration"), 64, args.seq_len, 0, eos)
    plan, setups = layer_setups(model, observe(model, cal))
    pre = prerope_rows(model, cal[:16])
    rotated = plan.apply(model)
    sources = (("validation", split_path("validation"), 1), ("test", split_path("test"), 2),
               ("shifted", shift_source("test"), 3))
    splits = {name: Evaluator(rotated, token_samples(tok, source, args.samples, args.seq_len, seed, eos))
              for name, source, seed in sources}
    results, fisher = [], None
    rows = [r for r in ROWS if not args.rows or any(s in r[0] for s in args.rows.split(","))]
    for label, rate, codes, kpe, *extra in tqdm(rows, desc="ablation"):
        kept = extra[0] if extra else {}
        sinks, window, allocation = kept.get("sinks", 0), kept.get("window", 0), kept.get("allocation")
        if allocation and fisher is None:
            fisher = latent_fisher(rotated, cal, 8)  # in the principal axes' frame: the rotated model's rows
        qs, bits = quantizers(model, setups, rate, codes, kpe, plan, pre, sinks, allocation, fisher)
        bits += 16 * (sinks + window) / AMORTISED_OVER
        losses = {k: ev.evaluate(qs, loss_only=True, window=window).loss for k, ev in splits.items()}
        results.append({"row": label, "bits_per_value": bits, **losses})
    print(f"{args.samples} x {args.seq_len} tokens per split; rotations, allocations, scales and levels from 64 "
          f"calibration samples; shifted: {shift_description()}; CPU capability "
          + torch.backends.cpu.get_cpu_capability())
    print("| configuration | bits/value | validation | test | shifted |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['row']} | {r['bits_per_value']:.3f} | {r['validation']:+.3%} | {r['test']:+.3%} "
              f"| {r['shifted']:+.3%} |")
    if args.out:
        write_json(args.out, results, indent=2)


if __name__ == "__main__":
    main()
