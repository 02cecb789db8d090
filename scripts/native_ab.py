"""A/B of two versions of the C kernels (mlaquant/attention/csrc/decode_kernels.c) in one process: both built for
the ISA variant the decode path would run here (MLAQUANT_NATIVE_ISA to force one), then the fast-path decode call
(`ops.mla_decode`, backend cpu, the bench's problems: `mlaquant.bench.attention`) of each case timed in interleaved
rounds, A and B alternating which goes first, each timed call after an untimed one. Every call's outputs must equal
the first one's bit for bit (a kernel change that moves bits fails here). Prints the fastest and median ms per
version and B / A; the CPU capability and variant in the first line.

Usage:
    git show HEAD:mlaquant/attention/csrc/decode_kernels.c > /tmp/old.c
    python scripts/native_ab.py /tmp/old.c mlaquant/attention/csrc/decode_kernels.c \
        --cases int8-row:16:4096,int4-row:16:4096 --rounds 30
A case is codec:batch:context. Both versions must export what the Python side calls (`native._SIGNATURES`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from mlaquant.attention import native
from mlaquant.attention.ops import mla_decode
from mlaquant.bench.attention import D_C, D_R, _problem
from mlaquant.quant.codecs import LayerCodec, split_pair


def _builds(old: Path, new: Path) -> tuple[str, dict]:
    """(the variant, {"A": library, "B": library}); SystemExit where either fails to build."""
    isa = native.requested_isa()
    isa = native.auto_isa() if isa == "auto" else isa
    libs = {tag: native.build(isa, kernels_source=src) for tag, src in (("A", old), ("B", new))}
    failed = [tag for tag, lib in libs.items() if lib is None]
    if failed or isa == "scalar":
        raise SystemExit(f"native_ab: no vector build to compare ({isa}; failed: {failed or 'none'})")
    return isa, libs


def _time_case(spec: str, rounds: int, use) -> dict[str, list[float]]:
    """Seconds per timed call of each version for one codec:batch:context case."""
    name, batch, context = spec.split(":")
    codec = LayerCodec.from_names(*split_pair(name), D_C, D_R)
    q, pool, table, lens = _problem(codec, int(batch), int(context), seed=int(context))
    call = lambda: mla_decode(q, pool, table, lens, codec, D_C, D_C**-0.5, "cpu")  # noqa: E731
    first, times = None, {"A": [], "B": []}
    for r in range(rounds):
        for tag in ("A", "B") if r % 2 == 0 else ("B", "A"):
            use(tag)
            call()
            start = time.perf_counter()
            out = call()
            times[tag].append(time.perf_counter() - start)
            if first is None:
                first = out
            elif not all(torch.equal(a, b) for a, b in zip(first, out)):
                raise SystemExit(f"native_ab: {spec}: version {tag} gives other bits than the first call")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="version A of decode_kernels.c")
    parser.add_argument("new", type=Path, help="version B of decode_kernels.c")
    parser.add_argument("--cases", default="int8-row:16:4096,int4-row:16:4096", help="codec:batch:context, ...")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    isa, libs = _builds(args.old, args.new)
    scalar, current = native._library(), ["A"]
    native._library = lambda which="scalar": scalar if which == "scalar" else libs[current[0]]  # the decode's build
    print(f"-- cpu: torch capability {torch.backends.cpu.get_cpu_capability()}, C kernels {isa}, "
          f"{torch.get_num_threads()} threads")
    for spec in args.cases.split(","):
        t = _time_case(spec, args.rounds, lambda tag: current.__setitem__(0, tag))
        a, b = t["A"], t["B"]
        print(f"{spec}: A fastest {min(a) * 1e3:.2f} median {statistics.median(a) * 1e3:.2f} ms | B fastest "
              f"{min(b) * 1e3:.2f} median {statistics.median(b) * 1e3:.2f} ms | B / A fastest {min(b) / min(a):.3f} "
              f"median {statistics.median(b) / statistics.median(a):.3f}", flush=True)


if __name__ == "__main__":
    main()
