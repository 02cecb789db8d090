"""The `mlaquant` command: one entry point, subcommands imported lazily.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`.
The CLI is the entry above every layer, so its table of module names (strings, imported only when
that subcommand runs) names `mlaquant.calib.calibrate`, `mlaquant.calib.sweep` and the `mlaquant.bench`
modules (`mlaquant.bench.gpu` nested under `bench`, `NESTED`): the one reference from `mlaquant/` up into
`calib/` and `mlaquant.bench` (tests/test_layering.py checks that no import statement makes one).
Errors that users can fix (bad paths, bad configs, mismatched plans) are `MLAQuantError`s and print
as one line with exit code 2; `--debug` shows the traceback instead.

Global flags (before or after the subcommand): `--quiet` (warnings only, no progress bars),
`--verbose` (debug logging); log records go to stderr. `python -m mlaquant` runs the same `main`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from mlaquant import __version__
from mlaquant.errors import MLAQuantError

# subcommand -> its own subcommands that live in modules of their own (mlaquant.bench.gpu), named here as strings too
NESTED = {"bench": {"gpu": ("mlaquant.bench.gpu", "GPU acceptance run: tests, kernels, calibrate, decode"),
                    "vllm": ("mlaquant.bench.vllm", "decode speed and KV capacity inside vLLM: plugin vs CPU_MLA")}}

# subcommand -> the settings to lower when it runs out of GPU memory
OOM_SETTINGS = {
    "generate": "--max-new-tokens or the prompt length",
    "bench": "--contexts / --batches",
    "train": "batch_size in the train config",
    "calibrate": "--batch-size (or --seq-len), or use --stream",
    "sweep": "--samples / --seq-len (batch_size in the sweep config)",
    "export": "--samples / --seq-len",
    "engines": "--tokens / --contexts",
    "recall": "--prompts / --seq-len",
}

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "generate": ("mlaquant.generate_cli", "greedy/sampled completion with the latent-cache decoder"),
    "bench": ("mlaquant.bench.decode", "benchmarks (decode step time against transformers)"),
    "train": ("mlaquant.bundled.train", "train the bundled MLA code model on the Python standard library"),
    "calibrate": ("mlaquant.calib.calibrate", "calibrate a per-layer cache plan under an accuracy budget"),
    "sweep": ("mlaquant.calib.sweep", "accuracy-vs-memory report over cache codecs and plans"),
    "export": ("mlaquant.integrations.export", "export a plan for vLLM / SGLang"),
    "engines": ("mlaquant.calib.engines", "what each engine cache setting costs on a model"),
    "recall": ("mlaquant.calib.recall", "exact recall over a long context, FP16 against each plan"),
}


def _add_verbosity(p: argparse.ArgumentParser, default) -> None:
    """--quiet / --verbose; subcommand copies default to SUPPRESS so they never reset the global value."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true", default=default, help="warnings only, no progress bars")
    group.add_argument("-v", "--verbose", action="store_true", default=default, help="debug logging")


class StderrHandler(logging.StreamHandler):
    """Log records to whatever `sys.stderr` is when they are emitted (not the stream at creation)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_logging(args: argparse.Namespace) -> None:
    """Root level from --quiet / --verbose, and one StderrHandler on the root logger."""
    root = logging.getLogger()
    root.setLevel(logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO)
    if not any(isinstance(h, StderrHandler) for h in root.handlers):
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlaquant", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"mlaquant {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    _add_verbosity(parser, False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        _add_verbosity(p, argparse.SUPPRESS)
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
    configure_logging(args)
    # Large CPU tensors on transparent huge pages, unless the user set it: torch's allocator reads this at its first
    # allocation. Calibration's activations come and go by the GB; on small pages a fifth to a quarter of its wall
    # time went to page faults (docs/commands.md, "Calibration time").
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
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
