"""The C helper of the fast CPU decode path: the int4 unpack (`mlaquant/csrc/unpack_int4.c`), built with the
system C compiler at first use and called through ctypes.

Why C: torch has no int4 dtype, so `mlaquant.cpu_decode` unpacks int4 codes with three word-wide ops (an AND,
a shift, an AND), each a pass over the block, and pays per row where rows are short (the 32 bytes of an
int4 k_pe row). The C loop makes one pass, 8 bytes per step, and can take the symmetric codes' bias off
on the way (codes q instead of q + 8, so no bias term in the GEMMs' sums): `mlaquant bench decode --batch
1,16` times the fast path with it and, in its "fast torch-unpack" rows of the same rounds, without it
(README, "The decode-attention call").

Build: `$CC` (default `cc`) -O3 -fopenmp -shared into a temporary directory, loaded, the file removed (about
0.2 s, once per process; no cache to go stale). OpenMP: where torch links libgomp (its Linux wheels do) the
library binds to that same runtime and its thread pool; without -fopenmp support it builds single-threaded.
No compiler, a failed build or MLAQUANT_NATIVE=0: `unpack_int4` is None and the torch ops run instead
(one warning names the reason, except for MLAQUANT_NATIVE=0).
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("csrc") / "unpack_int4.c"


def _compile(compiler: str, out: Path) -> str | None:
    """Build SOURCE into `out`, with OpenMP if the compiler has it; None, or the compiler's first error line."""
    base = [compiler, "-O3", "-shared", "-fPIC", str(SOURCE), "-o", str(out)]
    error = ""
    for flags in (["-fopenmp"], []):
        run = subprocess.run(base + flags, capture_output=True, text=True)
        if run.returncode == 0:
            return None
        error = next((line for line in run.stderr.splitlines() if line.strip()), f"exit status {run.returncode}")
    return error


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built helper, or None (MLAQUANT_NATIVE=0, no compiler, or a failed build: warned once)."""
    if os.environ.get("MLAQUANT_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        warnings.warn(f"mlaquant.native: no C compiler ({compiler!r} not found): int4 codes unpack with torch ops",
                      stacklevel=3)
        return None
    with tempfile.TemporaryDirectory(prefix="mlaquant-native-") as tmp:
        path = Path(tmp) / "unpack_int4.so"
        error = _compile(compiler, path)
        if error is not None:
            warnings.warn(f"mlaquant.native: building {SOURCE.name} failed ({error}): int4 codes unpack with torch ops",
                          stacklevel=3)
            return None
        lib = ctypes.CDLL(str(path))  # mapped: the file can go with its directory
    lib.unpack_int4.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_int, ctypes.c_int]
    lib.unpack_int4.restype = None
    return lib


def _unpack_int4(raw: Tensor, out: Tensor, signed: bool) -> Tensor:
    """Packed int4 codes uint8 [n, b] on the CPU (rows any stride apart, bytes consecutive; channel 2j in the
    low nibble of byte j) → codes int8 [n, 2b] written into `out` (uint8 [n, 2b], contiguous): [low nibbles |
    high nibbles] per row, unsigned 0..15, or less 8 with `signed` (symmetric codes, stored q + 8)."""
    n, width = raw.shape
    if raw.dtype != torch.uint8 or raw.device.type != "cpu" or (n > 1 and raw.stride(1) != 1):
        raise ValueError(f"unpack_int4: raw must be CPU uint8 rows of consecutive bytes, got {raw.dtype} "
                         f"{tuple(raw.shape)} strides {raw.stride()} on {raw.device}")
    if out.dtype != torch.uint8 or tuple(out.shape) != (n, 2 * width) or not out.is_contiguous():
        raise ValueError(f"unpack_int4: out must be contiguous uint8 {(n, 2 * width)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    stride = raw.stride(0) if n > 1 else width
    _library().unpack_int4(raw.data_ptr(), n, stride, width, out.data_ptr(), int(signed), torch.get_num_threads())
    return out.view(torch.int8)


def unpack_int4() -> Callable[[Tensor, Tensor, bool], Tensor] | None:
    """The C int4 unpack (`_unpack_int4`: raw uint8 [n, b], out uint8 [n, 2b], signed → int8 [n, 2b]), or None
    where it cannot be built (module docstring); built on the first call."""
    return _unpack_int4 if _library() is not None else None
