"""`mlaquant generate`: complete a prompt with the latent-cache decoder and report tokens/s.

Stops when every sequence has produced an end-of-sequence id of the model's config (`--ignore-eos`
decodes all `--max-new-tokens`). `--json` prints one JSON object on stdout (`json_summary`) and the
human-readable lines on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from mlaquant.device import add_device_arguments
from mlaquant.device import from_args as device_from_args
from mlaquant.errors import MLAQuantError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from mlaquant.attention.backends import Backend

    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--plan", default="fp16", help="fp16 | int8 | int4 | <ckv>/<kpe> codecs | a plan directory")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--backend", default="auto", choices=Backend.choices(),
                   help="decode attention: auto = triton on CUDA where the kernel reads the codec; on CPU the fast "
                   "cpu path where this machine's routing rule says it is faster, else torch; torch = the FP32 "
                   "reference")
    p.add_argument(
        "--guard-config",
        default=None,
        help="runtime guard YAML (default: configs/guard.yaml); it acts on calibrated plans only",
    )
    p.add_argument("--no-guard", action="store_true", help="decode without the runtime guard")
    p.add_argument("--ignore-eos", action="store_true", help="keep decoding past an end-of-sequence token")
    p.add_argument("--json", action="store_true", help="print one JSON summary on stdout (human text to stderr)")
    add_device_arguments(p)


def json_summary(args: argparse.Namespace, model, prompt: list[int], new: list[int], seconds: float, guard) -> dict:
    """What `generate --json` prints: prompt and completion (text and ids), why it stopped, speed, guard events."""
    return {
        "model": model.source,
        "plan": args.plan,
        "prompt": args.prompt,
        "completion": model.tokenizer.decode(new),
        "prompt_tokens": len(prompt),
        "tokens": new,
        "new_tokens": len(new),
        "stopped_at_eos": bool(new) and new[-1] in model.cfg.eos_ids and not args.ignore_eos,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(len(new) / seconds, 2) if seconds > 0 else None,
        "guard": None
        if guard is None
        else {"fallback_events": len(guard.fallback_events), "recalibrations": len(guard.recalibrations)},
    }


def run(args: argparse.Namespace) -> int:
    from mlaquant.attention import ops
    from mlaquant.modeling.loader import load_model
    from mlaquant.runtime.guard import Guard
    from mlaquant.runtime.session import generate

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
        stop_at_eos=not args.ignore_eos,
        guard=guard,
    )[0]
    elapsed = time.perf_counter() - start
    human = sys.stderr if args.json else sys.stdout
    if not (args.json and args.quiet):
        print(args.prompt + model.tokenizer.decode(new), file=human)
        backend = ops.describe_backend(args.backend, model.device)
        print(
            f"-- {len(new)} tokens in {elapsed:.2f} s: {len(new) / elapsed:.1f} tokens/s "
            f"(prompt {len(prompt)} tokens, plan {args.plan}, backend {backend}, incl. prefill)",
            file=human,
        )
        if guard is not None:
            print(
                f"-- guard: {len(guard.fallback_events)} fallback event(s), {len(guard.recalibrations)} clip-range "
                "re-estimation(s)",
                file=human,
            )
    if args.json:
        print(json.dumps(json_summary(args, model, prompt, new, elapsed, guard)))
    return 0
