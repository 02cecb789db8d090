"""Does rotating k_pe (and q_pe) after RoPE help INT4 RoPE keys? Per layer, the validation loss with only
that layer's k_pe quantized (c_kv left FP16), plain and Hadamard-rotated, beside the size of each RoPE
pair on the calibration rows.

    python scripts/measure_rope_rotation.py [--model DIR] [--samples 64] [--val-samples 32] [--codecs int4-row,...]

Pair magnitude = max over calibration rows of the larger |value| of the two channels RoPE rotates
together; one pair far above the others is what ruins row-wise INT4 for every other channel of the row.
Prints a markdown table; `--out` also writes it as JSON.
"""

from __future__ import annotations

import argparse

from tqdm import tqdm

from mlaquant import load_model
from mlaquant.atomic import write_json
from mlaquant.calib.data import split_path
from mlaquant.calib.observers import observe
from mlaquant.evaluation.eval import Evaluator
from mlaquant.evaluation.samples import token_samples
from mlaquant.modeling.model import hadamard_signs, latent_rotation, with_latent_rotation
from mlaquant.quant.codecs import LayerCodec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--samples", type=int, default=64, help="calibration samples (pair magnitudes)")
    p.add_argument("--val-samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--codecs", default="int4-row,int4-row-asym", help="k_pe codecs to compare")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    model = load_model(args.model)
    d_c, d_r, n = model.cfg.kv_lora_rank, model.cfg.qk_rope_head_dim, len(model.layers)
    eos = model.cfg.eos_id
    cal = token_samples(model.tokenizer, split_path("calibration"), args.samples, args.seq_len, args.seed, eos)
    val = token_samples(model.tokenizer, split_path("validation"), args.val_samples, args.seq_len, args.seed + 1, eos)
    stats = observe(model, cal)
    evaluator = Evaluator(model, val)
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    rows = []
    with tqdm(total=n * len(codecs) * 2, desc="single-layer losses") as bar:
        for i in range(n):
            absmax = stats[i].absmax[d_c:]
            pairs = absmax.view(2, d_r // 2).amax(0)  # rotate-half layout: channel j pairs with j + d_r/2
            rotated = with_latent_rotation(model, {i: latent_rotation(None, hadamard_signs(d_r, i), d_c, d_r)})
            row = {"layer": i, "largest_pair": float(pairs.max()), "median_pair": float(pairs.median())}
            for name in codecs:
                layer_codecs = [None] * n
                layer_codecs[i] = LayerCodec.from_names("fp16", name, d_c, d_r)
                for key, m in ((f"{name}", model), (f"{name} rotated", rotated)):
                    row[key] = evaluator.evaluate(layer_codecs, first_layer=i, model=m, loss_only=True).loss
                    bar.update(1)
            rows.append(row)
    head = ["layer", "largest / median RoPE pair"] + [f"k_pe {c}{r}" for c in codecs for r in ("", " rotated")]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        cells = [str(row["layer"]), f"{row['largest_pair']:.1f} / {row['median_pair']:.1f}"]
        cells += [f"{row[f'{c}{r}']:+.3%}" for c in codecs for r in ("", " rotated")]
        print("| " + " | ".join(cells) + " |")
    if args.out:
        write_json(args.out, rows, indent=2)


if __name__ == "__main__":
    main()
