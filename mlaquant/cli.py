"""The `mlaquant` command: one entry point, subcommands imported lazily.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`.
The CLI is the entry above every layer, so its table of module names (strings, imported only when
that subcommand runs) names `mlaquant.calib.calibrate`, `mlaquant.calib.sweep` and (nested under
`bench`, `NESTED`) `mlaquant.calib.bench_gpu`: the one reference
from `mlaquant/` up into `calib/` (tests/test_layering.py checks that no import statement makes one).
Errors that users can fix (bad paths, bad configs, mismatched plans) are `MLAQuantError`s and print
as one line with exit code 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mlaquant.errors import MLAQuantError

# subcommand -> its own subcommands that live above it (mlaquant.calib), named here as strings too
NESTED = {"bench": {"gpu": ("mlaquant.calib.bench_gpu", "GPU acceptance run: tests, kernels, calibrate, decode")}}

# subcommand -> the settings to lower when it runs out of GPU memory
OOM_SETTINGS = {
    "generate": "--max-new-tokens or the prompt length",
    "bench": "--contexts / --batches",
    "train": "batch_size in the train config",
    "calibrate": "--batch-size (or --seq-len), or use --stream",
    "sweep": "--samples / --seq-len (batch_size in the sweep config)",
    "export": "--samples / --seq-len",
}

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "generate": ("mlaquant.generate_cli", "greedy/sampled completion with the latent-cache decoder"),
    "bench": ("mlaquant.bench", "benchmarks (decode step time against transformers)"),
    "train": ("mlaquant.train", "train the bundled MLA code model on the Python standard library"),
    "calibrate": ("mlaquant.calib.calibrate", "calibrate a per-layer cache plan under an accuracy budget"),
    "sweep": ("mlaquant.calib.sweep", "accuracy-vs-memory report over cache codecs and plans"),
    "export": ("mlaquant.export", "export a plan for vLLM / SGLang"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlaquant", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            mod = importlib.import_module(module)
            nested = mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
            for sub_name, (sub_module, sub_help) in NESTED.get(name, {}).items():
                inner = importlib.import_module(sub_module)
                sp = nested.add_parser(sub_name, help=sub_help)
                inner.add_arguments(sp)
                sp.set_defaults(_run=inner.run)
    return parser


def oom_message(command: str, error: Exception) -> str:
    """One line for a device out-of-memory error: what ran out and the setting to lower."""
    first = str(error).splitlines()[0] if str(error) else "out of memory"
    return f"device out of memory ({first[:120]}); lower {OOM_SETTINGS.get(command, 'the batch size')}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    import torch

    try:
        return int(args._run(args) or 0)
    except torch.OutOfMemoryError as e:
        if args.debug:
            raise
        print(f"mlaquant {args.command}: error: {oom_message(args.command, e)}", file=sys.stderr)
        return 2
    except (MLAQuantError, FileNotFoundError, ValueError) as e:
        if args.debug:
            raise
        print(f"mlaquant {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mlaquant {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
