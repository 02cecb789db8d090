"""llama.cpp's latent cache types (f16 / q8_0 / q4_0) on the same tokens as mlaquant's FP16-cache reference:
mean NLL per predicted token (and its difference from FP16's), perplexity, and the loss against mlaquant FP16.

    python scripts/measure_llamacpp.py [--model DIR] [--data PATH] [--samples 8] [--seq-len 512] [--seed 0]

loss = exp(nll − nll_mlaquant_fp16) − 1. llama.cpp runs the model padded to 26 identity-extended layers and
converted to GGUF (f32 weights), cached under --cache-dir (`mlaquant.integrations.llamacpp`). Prints a markdown table
headed by the machine's CPU capability and the versions.
"""

from __future__ import annotations

import argparse
import math
import platform
import time

import torch

from mlaquant import load_model
from mlaquant.calib.data import split_path
from mlaquant.evaluation.eval import Evaluator
from mlaquant.evaluation.samples import token_samples
from mlaquant.integrations.distributions import cache_dir
from mlaquant.integrations.llamacpp import CACHE_TYPES, gguf_for, token_nll
from mlaquant.modeling.loader import resolve_model_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the bundled model)")
    p.add_argument("--data", default=None, help="text source (default: the bundled test split)")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: llama-cpp-python's)")
    p.add_argument("--cache-dir", default=None, help="where converted GGUFs are kept (default: mlaquant's cache)")
    args = p.parse_args()

    import llama_cpp

    model_dir = resolve_model_path(args.model)
    model = load_model(model_dir)
    data = args.data or split_path("test")
    tokens = token_samples(model.tokenizer, data, args.samples, args.seq_len, args.seed, model.cfg.eos_id)
    start = time.perf_counter()
    ref = Evaluator(model, tokens).ref_nll
    rows = [("mlaquant", "fp16", ref, time.perf_counter() - start)]
    start = time.perf_counter()
    gguf = gguf_for(model_dir, args.cache_dir or cache_dir() / "gguf")
    print(f"GGUF {gguf} ({time.perf_counter() - start:.1f} s)")
    for cache_type in CACHE_TYPES:
        start = time.perf_counter()
        nll = token_nll(gguf, tokens, cache_type, n_threads=args.threads).mean().item()
        rows.append(("llama.cpp", cache_type, nll, time.perf_counter() - start))

    print(
        f"CPU {torch.backends.cpu.get_cpu_capability()} ({platform.machine()}), torch {torch.__version__}, "
        f"llama-cpp-python {llama_cpp.__version__}; {model_dir.name}; {data}: "
        f"{tokens.shape[0]} × {tokens.shape[1]} tokens, seed {args.seed}\n"
    )
    print("| engine | latent cache | mean NLL | NLL − FP16 | ppl | loss vs mlaquant FP16 | wall s |")
    print("|---|---|---|---|---|---|---|")
    for engine, cache_type, nll, wall in rows:
        print(
            f"| {engine} | {cache_type} | {nll:.6f} | {nll - ref:+.2e} | {math.exp(nll):.4f} "
            f"| {math.exp(nll - ref) - 1:+.4%} | {wall:.1f} |"
        )


if __name__ == "__main__":
    main()
