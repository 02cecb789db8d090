"""`mlaquant generate`: complete a prompt with the latent-cache decoder and report tokens/s."""

from __future__ import annotations

import argparse
import time

from mlaquant.device import add_device_arguments
from mlaquant.device import from_args as device_from_args
from mlaquant.errors import MLAQuantError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--plan", default="fp16", help="fp16 | int8 | int4 | <ckv>/<kpe> codecs | a plan directory")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument(
        "--guard-config",
        default=None,
        help="runtime guard YAML (default: configs/guard.yaml); it acts on calibrated plans only",
    )
    p.add_argument("--no-guard", action="store_true", help="decode without the runtime guard")
    add_device_arguments(p)


def run(args: argparse.Namespace) -> int:
    from mlaquant.guard import Guard
    from mlaquant.loader import load_model
    from mlaquant.session import generate

    model = load_model(args.model, *device_from_args(args))
    if model.tokenizer is None:
        raise MLAQuantError(f"{model.source}: no tokenizer.json, cannot encode --prompt text")
    prompt = model.tokenizer.encode(args.prompt).ids
    if not prompt:
        raise MLAQuantError("--prompt encodes to no tokens")
    guard = None if args.no_guard else Guard(args.guard_config)
    start = time.perf_counter()
    new = generate(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        plan=args.plan,
        backend=args.backend,
        guard=guard,
    )[0]
    elapsed = time.perf_counter() - start
    print(args.prompt + model.tokenizer.decode(new))
    print(
        f"-- {len(new)} tokens in {elapsed:.2f} s: {len(new) / elapsed:.1f} tokens/s "
        f"(prompt {len(prompt)} tokens, plan {args.plan}, incl. prefill)"
    )
    if guard is not None:
        print(
            f"-- guard: {len(guard.fallback_events)} fallback event(s), {len(guard.recalibrations)} clip-range "
            "re-estimation(s)"
        )
    return 0
