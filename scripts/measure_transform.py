"""Which pieces of the sub-4-bit tier earn their bytes: rotation kind, bit allocation, weighting, k_pe width.

    python scripts/measure_transform.py [--samples 32] [--seq-len 512] [--out ablation.json]

Every row is a plan with the same codecs in every layer (no search), c_kv in channel bands of the band codec
(`mlaquant.quant.codecs.BandCodec`), k_pe Hadamard-rotated after RoPE in the codec named: the loss on the validation
and the test split (teacher-forced, every token through the cache) and the bits per cached value with every
byte counted. Rotations and allocations come from 64 calibration samples:

    rotation    none | Hadamard | PCA (`mlaquant.calib.transform.principal_rotation`)
    allocation  uniform bits | reverse water-filling on 16-channel blocks (`allocate_bands`)
    weighting   the rotated variances as they are, or times r_iᵀ·E[q qᵀ]·r_i (how the absorbed query sees
                channel i: a score's error is q·e)
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from mlaquant import load_model
from mlaquant.atomic import write_json
from mlaquant.attention.reference import causal_attention
from mlaquant.calib.data import split_path
from mlaquant.calib.observers import observe
from mlaquant.calib.transform import allocate_bands, principal_rotation
from mlaquant.evaluation.eval import Evaluator
from mlaquant.evaluation.samples import token_samples
from mlaquant.modeling.model import hadamard_rotation, hadamard_signs
from mlaquant.runtime.plan import LayerPlan, Plan

ROWS = [  # label, rotation, allocation (rate of c_kv code bits per value), weighting, k_pe codec
    ("int3 rows, no rotation", "none", ("uniform", 3), None, "int4-row"),
    ("int3 rows, Hadamard", "hadamard", ("uniform", 3), None, "int4-row"),
    ("int3 rows, PCA", "pca", ("uniform", 3), None, "int4-row"),
    ("Hadamard, water-filling 2.5", "hadamard", ("water", 2.5), None, "int4-row"),
    ("PCA, water-filling 2.5", "pca", ("water", 2.5), None, "int4-row"),
    ("PCA, water-filling 2.5, query-weighted", "pca", ("water", 2.5), "query", "int4-row"),
    ("PCA, water-filling 2.0", "pca", ("water", 2.0), None, "int4-row"),
    ("PCA, water-filling 2.0, query-weighted", "pca", ("water", 2.0), "query", "int4-row"),
    ("PCA, water-filling 1.5", "pca", ("water", 1.5), None, "int4-row"),
    ("PCA, water-filling 2.0, k_pe int8-row", "pca", ("water", 2.0), None, "int8-row"),
]


def query_moments(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer E[q qᵀ] [d_c, d_c] of the absorbed query's c_kv part over every token and head of ids [N, T]."""
    d_c = model.cfg.kv_lora_rank
    sums, count = [torch.zeros(d_c, d_c) for _ in model.layers], 0

    def attend(i, q, rows):
        flat = q[..., :d_c].reshape(-1, d_c)
        sums[i] += flat.T @ flat
        return causal_attention(q, rows, rows[..., :d_c], model.layers[i].self_attn.scale)

    for batch in ids.split(4):
        model.forward_absorbed(batch, torch.arange(batch.shape[1]).expand(batch.shape[0], -1), attend)
        count += batch.numel() * model.cfg.num_attention_heads
    return [s / count for s in sums]


def row_plan(model, stats, queries, rotation: str, allocation, weighting, kpe: str) -> Plan:
    """The plan of one ablation row: per layer its c_kv rotation and band codec, k_pe Hadamard-rotated."""
    d_c, d_r = model.cfg.latent_widths
    layers, tensors = [], {}
    for i, s in enumerate(stats):
        c = s.sample()[:, :d_c]
        if rotation == "pca":
            r, _ = principal_rotation(c)
        elif rotation == "hadamard":
            r = hadamard_rotation(hadamard_signs(d_c, i))
        else:
            r = torch.eye(d_c)
        var = ((c @ r) ** 2).mean(0)
        if weighting == "query":
            var = var * torch.einsum("ji,jk,ki->i", r, queries[i], r)
        order = var.argsort(descending=True)
        r, var = r[:, order], var[order]
        kind, rate = allocation
        bands = ((int(rate), d_c),) if kind == "uniform" else allocate_bands(var, rate)
        tensors[f"layer{i}.ckv_rotation"] = r
        tensors[f"layer{i}.rope_rotation_signs"] = hadamard_signs(d_r, 7919 + i)
        name = "band" + "".join(f"-{b}x{w}" for b, w in bands)
        layers.append(LayerPlan(name, kpe, rotate=True, rotate_rope=True))
    return Plan(layers=layers, fingerprint=model.fingerprint(), tensors=tensors).bind(model.cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--samples", type=int, default=32, help="validation and test samples")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = load_model(args.model)
    tok, eos = model.tokenizer, model.cfg.eos_id
    cal = token_samples(tok, split_path("calibration"), 64, args.seq_len, 0, eos)
    stats = observe(model, cal)
    with torch.no_grad():
        queries = query_moments(model, cal[:8])
    splits = {name: Evaluator(model, token_samples(tok, split_path(name), args.samples, args.seq_len, seed, eos))
              for name, seed in (("validation", 1), ("test", 2))}
    results = []
    for label, rotation, allocation, weighting, kpe in tqdm(ROWS, desc="ablation"):
        plan = row_plan(model, stats, queries, rotation, allocation, weighting, kpe)
        codecs, rotated = plan.layer_codecs(), plan.apply(model)
        losses = {k: ev.evaluate(codecs, model=rotated, loss_only=True).loss for k, ev in splits.items()}
        results.append({"row": label, "bits_per_value": plan.bits_per_value(), **losses,
                        "layer0": plan.layers[0].codec_name})
    print(f"{args.samples} x {args.seq_len} tokens per split; rotations and allocations from 64 calibration samples")
    print("| configuration | bits/value | validation | test | layer 0's codec |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['row']} | {r['bits_per_value']:.3f} | {r['validation']:+.3%} | {r['test']:+.3%} | {r['layer0']} |")
    if args.out:
        write_json(args.out, results, indent=2)


if __name__ == "__main__":
    main()
