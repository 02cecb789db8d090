"""Symmetric integer codes, last release's rule against this one's: per codec, SQNR on the calibration rows
and the loss on the test split and on third-party text, uniform plans (every layer the same, no rotation).

    python scripts/measure_levels.py [--codecs int4-row,int4-g32,...] [--samples 32] [--seq-len 512]

"absmax/qmax" is the last release's rule, restated here as the baseline: s = fp16_up(absmax / qmax), codes
−qmax..qmax (15 of int4's 16 levels, 255 of int8's 256). "this release" is `mlaquant.quant.codecs.symmetric_codes`:
the extreme on code −(qmax+1) (llama.cpp q4_0's orientation) and, for int4, the shrink factor of least squared
error. Asymmetric codecs are unchanged (they use every level already). Prints a markdown table with the CPU
capability in its header; `--out` also writes it as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch
from tqdm import tqdm

from mlaquant import load_model
from mlaquant.atomic import write_json
from mlaquant.calib.data import shift_description, shift_source, split_path
from mlaquant.calib.observers import observe
from mlaquant.evaluation.eval import Evaluator
from mlaquant.evaluation.samples import token_samples
from mlaquant.quant import codecs
from mlaquant.quant.codecs import _fp16_round
from mlaquant.runtime.plan import Plan


def absmax_codes(xg: torch.Tensor, qmax: int, factors: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The last release's symmetric rule for groups xg [N, G, g]: (codes in [−qmax, qmax], s = fp16_up(absmax /
    qmax) ≥ 0); `factors` is not used (the signature of `codecs.symmetric_codes`)."""
    s = _fp16_round(xg.abs().amax(-1) / qmax, up=True)
    safe = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)
    return torch.clamp(torch.round(xg / safe), -qmax, qmax), s


@contextlib.contextmanager
def rule(name: str):
    """Encode symmetric integer parts with `name`'s rule inside the block."""
    current = codecs.symmetric_codes
    codecs.symmetric_codes = absmax_codes if name == "absmax/qmax" else current
    try:
        yield
    finally:
        codecs.symmetric_codes = current


def sqnr_db(codec, rows: torch.Tensor) -> float:
    """10·log10(Σx² / Σ(x̂ − x)²) over rows [N, W]."""
    err = (codec.fake_quant(rows) - rows).square().sum()
    return 10 * math.log10(float(rows.square().sum() / err))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--codecs", default="int4-row,int4-g64,int4-g32,int8-row,int8-g64,int8-g32")
    p.add_argument("--samples", type=int, default=32, help="test and third-party samples")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = load_model(args.model)
    n = len(model.layers)
    tok, eos = model.tokenizer, model.cfg.eos_id
    stats = observe(model, token_samples(tok, split_path("calibration"), 64, args.seq_len, 0, eos))
    splits = {
        "test": Evaluator(model, token_samples(tok, split_path("test"), args.samples, args.seq_len, 2, eos)),
        "third-party": Evaluator(model, token_samples(tok, shift_source(), args.samples, args.seq_len, 4, eos)),
    }
    names = [c.strip() for c in args.codecs.split(",") if c.strip()]
    rows = []
    with tqdm(total=2 * len(names), desc="codecs") as bar:
        for name in names:
            for which in ("absmax/qmax", "this release"):
                with rule(which):
                    layer_codecs = Plan.uniform(name, n).bind(model.cfg).layer_codecs()
                    sqnr = [sqnr_db(c, stats[i].sample()) for i, c in enumerate(layer_codecs)]
                    row = {"codec": name, "rule": which, "sqnr_db": sum(sqnr) / n}
                    row |= {k: ev.evaluate(layer_codecs, loss_only=True).loss for k, ev in splits.items()}
                rows.append(row)
                bar.update(1)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; {args.samples} x {args.seq_len} tokens per "
          f"split; third-party: {shift_description()}")
    print("| codec | rule | SQNR dB (calibration rows, mean of layers) | loss test | loss third-party |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['codec']} | {r['rule']} | {r['sqnr_db']:.2f} | {r['test']:+.3%} | {r['third-party']:+.3%} |")
    if args.out:
        write_json(args.out, rows, indent=2)


if __name__ == "__main__":
    main()
