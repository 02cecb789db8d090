"""The C helper of the fast CPU path: integer kernels on the stored codes (`mlaquant/attention/csrc/decode_kernels.c`:
dots, scores with their FP32 epilogue, P·V) and the int4 unpack (`mlaquant/attention/csrc/unpack_int4.c`), built with
the system C compiler at first use and called through ctypes.

ISA variants. decode_kernels.c is compiled once per variant with a macro (`ISAS`: scalar = portable C; avx2 =
-mavx2 -mfma -mf16c; avx512vnni = -mavx512f -mavx512bw -mavx512vl -mavx512vnni; avxvnni = -mavx2 -mavxvnni), always
with -ffp-contract=off: every variant performs the same FP32 operations in the same order and the same exact
integer sums, so all give the same bits (tests/test_native.py forces each in turn). The scalar build (which also
holds the unpack) is built first; its `mlaq_cpu_features` probe (`__builtin_cpu_supports`) says what the CPU runs.
`MLAQUANT_NATIVE_ISA=auto` (default) takes the first of avx512vnni, avxvnni, avx2 that the CPU supports and
torch's `get_cpu_capability()` allows (AVX2: no avx512; DEFAULT or a non-x86 one: scalar only), so a run under
`ATEN_CPU_CAPABILITY=avx2` behaves as on an AVX2-only CPU; `MLAQUANT_NATIVE_ISA=scalar|avx2|avx512vnni|avxvnni`
forces one (a CPU that cannot run it is a BackendError naming what it lacks).

Build: `$CC` (default `cc`) -O3 -fopenmp -shared into a temporary directory, loaded, the file removed (once per
process and variant: ~0.4 s scalar, ~1.6-1.9 s a vector variant on a 2-core machine; no cache to go stale).
OpenMP: where torch links libgomp (its Linux wheels do) the library binds to that same runtime and its thread
pool, and each call takes `torch.get_num_threads()` threads; without -fopenmp support it builds single-threaded.
No compiler, a failed build or MLAQUANT_NATIVE=0: `kernels()` and `unpack_int4()` are None and the torch ops run
instead (one warning names the reason, except for MLAQUANT_NATIVE=0).
"""

from __future__ import annotations

import ctypes
import dataclasses
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

from mlaquant.errors import BackendError

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "unpack_int4.c"
KERNELS = CSRC / "decode_kernels.c"
ISAS = ("scalar", "avx2", "avx512vnni", "avxvnni")
ISA_FLAGS = {
    "scalar": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c"],
    "avxvnni": ["-mavx2", "-mavxvnni", "-mf16c"],
}
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avxvnni")  # mlaq_cpu_features bits
ISA_NEEDS = {
    "scalar": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512vnni": ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "f16c"),
    "avxvnni": ("avx2", "avxvnni", "f16c"),
}
AUTO_ORDER = ("avx512vnni", "avxvnni", "avx2")
CAPABILITY_ALLOWS = {"AVX512": set(ISAS), "AVX2": {"scalar", "avx2", "avxvnni"}}  # others: scalar only
VECTOR_ISAS = ("avx2", "avx512vnni", "avxvnni")
KINDS = {("int8", True): 0, ("int8", False): 1, ("int4", True): 2, ("int4", False): 3}  # (kind, symmetric) → C
BAND_KINDS = {8: 0, 4: 2, 3: 4, 2: 5}  # a band's bits → C kind (symmetric codes; 3 and 2 bits a bit stream)
MAX_PARTS = 8  # parts per scores call (decode_kernels.c): a band c_kv's stored bands, then k_pe


def _compile(compiler: str, sources: list[Path], flags: list[str], out: Path) -> str | None:
    """Build `sources` into `out`, with OpenMP if the compiler has it; None, or the compiler's first error line."""
    base = [compiler, "-O3", "-shared", "-fPIC", "-ffp-contract=off", *flags, *map(str, sources), "-o", str(out)]
    error = ""
    for extra in (["-fopenmp"], []):
        run = subprocess.run(base + extra, capture_output=True, text=True)
        if run.returncode == 0:
            return None
        error = next((line for line in run.stderr.splitlines() if line.strip()), f"exit status {run.returncode}")
    return error


_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "unpack_int4": [_P, _I64, _I64, _I64, _P, _INT, _INT],
    "mlaq_dots": [_P, _I64, _I64, _I64, _INT, _P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _I64, _INT],
    "mlaq_scores": [_P, _P, _I64, _I64, _I64, _INT, _P, _P, _P, _I64, _P, _I64, _INT, _P, _INT],
    "mlaq_pv": [_P, _P, _I64, _I64, _I64, _INT, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64, _P, _P, _P, _INT,
                _INT],
    "mlaq_exp2": [_P, _I64, ctypes.c_float, _P, _P],
    "mlaq_decode": [_P, _I64, _I64, _I64, _P, _P, _I64, _INT, _P, _P, _P, _I64, _P, _I64, _P, _P, _INT, _P, _INT],
    "mlaq_w8a8": [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _INT],
    "mlaq_quantize": [_P, _I64, _I64, _I64, _I64, ctypes.c_float, _P, _P],
}


@functools.cache
def _library(isa: str = "scalar") -> ctypes.CDLL | None:
    """The built helper of one ISA variant (the scalar one also holds the int4 unpack), or None (MLAQUANT_NATIVE=0,
    no compiler, or a failed build: warned once)."""
    if os.environ.get("MLAQUANT_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        warnings.warn(f"mlaquant.attention.native: no C compiler ({compiler!r} not found): the fast CPU path runs "
                      "torch ops", stacklevel=3)
        return None
    return build(isa, compiler)


def build(isa: str, compiler: str = "cc", kernels_source: Path = KERNELS) -> ctypes.CDLL | None:
    """A fresh build of variant `isa` from `kernels_source` (decode_kernels.c; another copy of it for an A/B of two
    versions, scripts/native_ab.py), loaded and typed, or None with a warning where it fails (`_library` keeps the
    one build per process the decode path uses)."""
    sources = [SOURCE, kernels_source] if isa == "scalar" else [kernels_source]
    with tempfile.TemporaryDirectory(prefix="mlaquant-native-") as tmp:
        path = Path(tmp) / f"mlaquant_{isa}.so"
        error = _compile(compiler, sources, [f"-DMLAQ_ISA={ISAS.index(isa)}", *ISA_FLAGS[isa]], path)
        if error is not None:
            what = " + ".join(s.name for s in sources) + ("" if isa == "scalar" else f" ({isa})")
            warnings.warn(f"mlaquant.attention.native: building {what} failed ({error}): the fast CPU path runs "
                          "torch ops" + ("" if isa == "scalar" else " or a lower ISA"), stacklevel=4)
            return None
        lib = ctypes.CDLL(str(path))  # mapped: the file can go with its directory
    for name, args in _SIGNATURES.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = None
    lib.mlaq_cpu_features.restype = ctypes.c_uint
    lib.mlaq_isa.restype = ctypes.c_int
    bits = lib.mlaq_cpu_features()  # probed once per build: every call asks (`kernels` runs per decode call)
    lib.features = frozenset(name for i, name in enumerate(FEATURES) if bits >> i & 1)
    lib.kernels = Kernels(lib, isa)
    return lib


def cpu_features() -> frozenset[str]:
    """The x86 features of this CPU (and OS) that the variants need (`FEATURES`), from the scalar build's probe;
    empty where it is not built or the CPU is not x86."""
    lib = _library()
    return lib.features if lib is not None else frozenset()


def runnable(isa: str, features: frozenset[str] | None = None) -> bool:
    """Whether this CPU can run variant `isa`."""
    features = cpu_features() if features is None else features
    return all(f in features for f in ISA_NEEDS[isa])


def auto_isa(features: frozenset[str] | None = None, capability: str | None = None) -> str:
    """The variant `MLAQUANT_NATIVE_ISA=auto` takes: the first of `AUTO_ORDER` the CPU runs and torch's CPU
    capability allows (`CAPABILITY_ALLOWS`), else scalar."""
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    allowed = CAPABILITY_ALLOWS.get(capability, {"scalar"})
    return next((isa for isa in AUTO_ORDER if isa in allowed and runnable(isa, features)), "scalar")


def requested_isa() -> str:
    """MLAQUANT_NATIVE_ISA, checked: 'auto' or one of `ISAS` (else BackendError)."""
    isa = os.environ.get("MLAQUANT_NATIVE_ISA", "auto").strip().lower() or "auto"
    if isa != "auto" and isa not in ISAS:
        raise BackendError(f"MLAQUANT_NATIVE_ISA={isa!r}: choose auto or one of {', '.join(ISAS)}")
    return isa


def kernels(isa: str | None = None) -> Kernels | None:
    """The integer kernels of variant `isa` (None: MLAQUANT_NATIVE_ISA, auto by default), built on first use; None
    where the helper cannot be built (module docstring). A forced variant this CPU cannot run: BackendError."""
    if _library() is None:
        return None
    wanted = requested_isa() if isa is None else isa
    if wanted != "auto":
        if not runnable(wanted):
            lacks = [f for f in ISA_NEEDS[wanted] if f not in cpu_features()]
            raise BackendError(f"native ISA {wanted!r} cannot run on this CPU (it lacks {', '.join(lacks)}); "
                               f"MLAQUANT_NATIVE_ISA=auto picks {auto_isa()!r} here")
        lib = _library(wanted)
        return None if lib is None else lib.kernels
    first = auto_isa()
    for candidate in (*(AUTO_ORDER[AUTO_ORDER.index(first):] if first != "scalar" else ()), "scalar"):
        lib = _library(candidate) if candidate == "scalar" or runnable(candidate) else None
        if lib is not None:  # a variant that fails to build (an old compiler) gives way to the next one
            return lib.kernels
    return None


def vector_kernels() -> Kernels | None:
    """`kernels()` where its variant is a vector one (`VECTOR_ISAS`), else None (scalar or not built)."""
    k = kernels()
    return k if k is not None and k.isa in VECTOR_ISAS else None


def chosen_isa() -> str | None:
    """The variant `kernels()` runs here, or None where the helper is not built."""
    k = kernels()
    return None if k is None else k.isa


@dataclasses.dataclass(frozen=True)
class Part:
    """One integer row part as the C kernels read it: kind code (`KINDS`), channels, channels per group, byte
    offsets of the FP16 scales and (asym, else 0) zero points from the part's first byte."""

    kind: int
    width: int
    group_size: int
    scale_offset: int
    zero_offset: int

    @property
    def groups(self) -> int:
        return self.width // self.group_size


@dataclasses.dataclass(frozen=True)
class Rows:
    """Where n block rows of a part live: row t at `buffer`'s byte `offset` + (pages[t // page_rows] · page_rows +
    t % page_rows) · stride, or offset + t · stride without pages (int64 page ids of a paged pool, read in place)."""

    buffer: Tensor
    offset: int
    stride: int
    pages: Tensor | None = None
    page_rows: int = 1

    def args(self) -> tuple[int, int | None, int, int]:
        pages = None if self.pages is None else self.pages.data_ptr()
        return self.buffer.data_ptr() + self.offset, pages, self.page_rows, self.stride


def _vector(x: Tensor, n: int, what: str) -> int:
    """The address of x, a contiguous CPU fp32 tensor of n values."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() != n or not x.is_contiguous():
        raise ValueError(f"{what} must be contiguous CPU fp32 [{n}], got {x.dtype} {tuple(x.shape)}")
    return x.data_ptr()


def _check(x: Tensor, dtype: torch.dtype, what: str, rows: int, cols: int) -> None:
    """x must be a CPU `dtype` tensor [≥ rows, ≥ cols] whose rows are consecutive elements."""
    if x.dtype != dtype or x.device.type != "cpu" or x.dim() != 2 or x.shape[0] < rows or x.shape[1] < cols or (
            x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"{what} must be CPU {dtype} [{rows}, ≥{cols}] with consecutive elements per row, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")


@dataclasses.dataclass(frozen=True)
class PackedW8:
    """W8A8 weights as `mlaq_w8a8` reads them (decode_kernels.c): codes int8 [G, Np / 8, K4 / 4, 8, 4] (Np = N
    rounded up to 16, K4 = K up to 4; block b, quad q holds channels 4q..4q+3 of outputs 8b..8b+7; zeros past N
    and K) and scales fp32 [G, Np] (zeros past N), for n outputs of k channels."""

    codes: Tensor
    scales: Tensor
    n: int
    k: int


def pack_w8(w_int8: Tensor, w_scale: Tensor) -> PackedW8:
    """`PackedW8` of per-output-channel codes w_int8 int8 [G, N, K] in ±127 (the kernels' sign trick cannot take
    −128) and their scales w_scale fp32 [G, N]."""
    if w_int8.dtype != torch.int8 or w_int8.dim() != 3 or tuple(w_scale.shape) != tuple(w_int8.shape[:2]):
        raise ValueError(f"pack_w8: w_int8 int8 [G, N, K] and w_scale [G, N], got {w_int8.dtype} "
                         f"{tuple(w_int8.shape)}, {tuple(w_scale.shape)}")
    if w_int8.numel() and int(w_int8.min()) == -128:
        raise ValueError("pack_w8: w_int8 holds -128; the W8A8 kernels take codes in ±127 (quantize_grouped's range)")
    g, n, k = w_int8.shape
    np_, k4 = -(-n // 16) * 16, -(-k // 4) * 4
    codes = torch.zeros(g, np_, k4, dtype=torch.int8)
    codes[:, :n, :k] = w_int8
    scales = torch.zeros(g, np_, dtype=torch.float32)
    scales[:, :n] = w_scale
    codes = codes.view(g, np_ // 8, 8, k4 // 4, 4).transpose(2, 3).contiguous()
    return PackedW8(codes, scales, n, k)


class Kernels:
    """One built ISA variant of decode_kernels.c (its module comment has the formulas)."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self.lib, self.isa = lib, isa

    def dots(self, a: Tensor, w: Tensor, kind: int, k: int) -> Tensor:
        """Exact int32 [B, M, N] = Σ_k a[b, m, k] · c'(w[b, n], k) for a int8 [B, M, K] and code rows w uint8 or
        int8 [B, N, bytes] (K or K / 2 bytes of codes first; any batch and row strides, consecutive bytes)."""
        batch, m, _ = a.shape
        n = w.shape[1]
        if a.dtype != torch.int8 or w.dtype not in (torch.int8, torch.uint8) or a.stride(2) != 1 or w.stride(2) != 1:
            raise ValueError(f"dots: a int8 and w int8/uint8 with consecutive last dims, got {a.dtype} {a.stride()}, "
                             f"{w.dtype} {w.stride()}")
        out = torch.empty(batch, m, n, dtype=torch.int32)
        self.lib.mlaq_dots(a.data_ptr(), a.stride(0), a.stride(1), m, kind, w.data_ptr(), w.stride(0), w.stride(1), n,
                           k, out.data_ptr(), m * n, n, batch, torch.get_num_threads())
        return out

    def quantize(self, x: Tensor, group_size: int, factor: float) -> tuple[Tensor, Tensor]:
        """(q8 int8 [B, H, W], qs · factor fp32 [B, H, W / group_size]), both contiguous, of the query x fp32 [B, H, W]
        (finite; read in place where its rows are evenly spaced, as in a channel slice of the whole query), bit for bit
        `cpu_decode.quantize_query`'s followed by `qs * factor` (one call for what took ten torch ops)."""
        batch, heads, width = x.shape
        if x.dtype != torch.float32 or width % group_size:
            raise ValueError(f"quantize: x fp32 [B, H, W] with W a multiple of {group_size}, got {x.dtype} "
                             f"{tuple(x.shape)}")
        if x.stride(2) != 1 or (batch > 1 and x.stride(0) != heads * x.stride(1)):  # rows r * stride(1) apart
            x = x.contiguous()
        q8 = torch.empty(batch, heads, width, dtype=torch.int8)
        qs = torch.empty(batch, heads, width // group_size, dtype=torch.float32)
        self.lib.mlaq_quantize(x.data_ptr(), batch * heads, x.stride(1), width, group_size, factor, q8.data_ptr(),
                               qs.data_ptr())
        return q8, qs

    def w8a8(self, x: Tensor, w: PackedW8) -> Tensor:
        """fp32 [M, G, N]: the W8A8 product of x fp32 [M, G, K] (contiguous) with the packed weights `w` (per-row
        activation codes, exact INT32 sums, the FP32 epilogue), bit for bit what `int8_proj.grouped_int8_matmul`'s
        torch route computes (K below its INT32_EXACT_K)."""
        m, g, k = x.shape
        if x.dtype != torch.float32 or not x.is_contiguous() or (g, k) != (w.codes.shape[0], w.k):
            raise ValueError(f"w8a8: x contiguous fp32 [M, {w.codes.shape[0]}, {w.k}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        out = torch.empty(m, g, w.n, dtype=torch.float32)
        self.lib.mlaq_w8a8(x.data_ptr(), m, g, k, w.codes.data_ptr(), w.n, w.scales.data_ptr(), out.data_ptr(),
                           torch.get_num_threads())
        return out

    def scores(self, rows: Rows, n: int, parts: list[tuple[Part, int, Tensor, Tensor]], out: Tensor,
               accumulate: bool, maxes: Tensor | None = None) -> None:
        """out[h, :n] (+)= the scores of n rows summed over 1-`MAX_PARTS` integer parts (part, its byte offset in the
        row, q8 int8 [H, W] and qs fp32 [H, G] contiguous), in order: the bits of one call per part, the later ones
        accumulating. out fp32 [H, ≥n]; `rows` locates the rows' first byte; maxes fp32 [H] (contiguous): each
        head's max over the n scores, when given."""
        heads = parts[0][2].shape[0]
        _check(out, torch.float32, "scores: out", heads, n)
        if not 1 <= len(parts) <= MAX_PARTS:
            raise ValueError(f"scores: 1 to {MAX_PARTS} parts per call, got {len(parts)}")
        desc = []
        for part, offset, q8, qs in parts:
            if not (q8.is_contiguous() and qs.is_contiguous()) or q8.shape != (heads, part.width) or qs.shape != (
                    heads, part.groups) or q8.dtype != torch.int8 or qs.dtype != torch.float32:
                raise ValueError(f"scores: q8 int8 [{heads}, {part.width}] and qs fp32 [{heads}, {part.groups}] "
                                 f"contiguous, got {q8.dtype} {tuple(q8.shape)}, {qs.dtype} {tuple(qs.shape)}")
            desc += [part.kind, part.width, part.group_size, part.scale_offset, part.zero_offset, offset]
        desc_arr = (ctypes.c_int64 * len(desc))(*desc)
        q8s = (ctypes.c_void_p * len(parts))(*(p[2].data_ptr() for p in parts))
        qss = (ctypes.c_void_p * len(parts))(*(p[3].data_ptr() for p in parts))
        self.lib.mlaq_scores(*rows.args(), n, len(parts), desc_arr, q8s, qss, heads, out.data_ptr(), out.stride(0),
                             int(accumulate), None if maxes is None else _vector(maxes, heads, "scores: maxes"),
                             torch.get_num_threads())

    def pv(self, rows: Rows, n: int, part: Part, probs: Tensor, acc: Tensor,
           softmax: tuple[Tensor, Tensor, Tensor, bool] | None = None) -> None:
        """acc[h, :W] += the P·V of n rows on their codes (acc fp32 [H, ≥W]; probs fp32 [H, ≥n] in [0, 1]); or, with
        softmax = (m, l, bmax, first) fp32 [H] each (m, l the running max and sum, updated; bmax this block's maxes
        from `scores`), probs are the block's base-2 scores and the kernel runs the block's online-softmax step
        (decode_kernels.c, mlaq_pv)."""
        heads = probs.shape[0]
        _check(probs, torch.float32, "pv: probs", heads, n)
        _check(acc, torch.float32, "pv: acc", heads, part.width)
        state = [None, None, None, 0]
        if softmax is not None:
            state = [_vector(v, heads, f"pv: {w}") for v, w in zip(softmax[:3], ("m", "l", "bmax"))] + [int(softmax[3])]
        self.lib.mlaq_pv(*rows.args(), n, part.kind, part.width, part.group_size, part.scale_offset, part.zero_offset,
                         probs.data_ptr(), probs.stride(0), heads, acc.data_ptr(), acc.stride(0), *state,
                         torch.get_num_threads())

    def decode(self, pool: Tensor, pages: list[Tensor], lens: list[int], block_tokens: int,
               parts: list[tuple[Part, int, Tensor, Tensor]], acc: Tensor, m: Tensor, total: Tensor,
               value_channels: tuple[int, ...] = (0,), threads: int | None = None) -> None:
        """The in-place decode of B sequences whose parts are all integer, in one call (decode_kernels.c,
        mlaq_decode): pool uint8 [blocks, page_rows, row_bytes] contiguous, pages[b] int64 (contiguous) and lens[b]
        > 0 sequence b's pages and tokens, parts (part, byte offset in the row, q8 int8 [B, H, W], qs fp32 [B, H, G],
        contiguous) the c_kv part first; acc fp32 [B, H, W], m, total fp32 [B, H] (contiguous): the online-softmax
        state (running max and sum, set by the first block). value_channels: the first channel in acc of each of
        the first len(value_channels) parts, the ones P·V reads (a band c_kv: one per stored band). threads: the
        OpenMP threads (default torch's): at least B of them take whole sequences, fewer split each sequence's
        blocks."""
        batch, heads = acc.shape[:2]
        page_rows = pool.shape[1]
        if not pool.is_contiguous() or block_tokens % page_rows or len(pages) != batch or min(lens) < 1:
            raise ValueError(f"decode: contiguous pool, block_tokens a multiple of {page_rows}, one page list and "
                             f"length ≥ 1 per sequence (got {len(pages)} for {batch}, lens {lens})")
        if not 1 <= len(parts) <= MAX_PARTS or not 1 <= len(value_channels) <= len(parts) or any(
                ch < 0 or ch + p[0].width > acc.shape[2] for ch, p in zip(value_channels, parts)):
            raise ValueError(f"decode: 1 to {MAX_PARTS} parts, the first {len(value_channels)} of them inside acc's "
                             f"{acc.shape[2]} channels at {list(value_channels)}")
        for t, shape in ((acc, None), (m, (batch, heads)), (total, (batch, heads))):
            if t.dtype != torch.float32 or not t.is_contiguous() or (shape is not None and tuple(t.shape) != shape):
                raise ValueError(f"decode: acc, m, total contiguous fp32, m and total [{batch}, {heads}]")
        desc = []
        for part, offset, q8, qs in parts:
            if q8.shape != (batch, heads, part.width) or qs.shape != (batch, heads, part.groups) or not (
                    q8.is_contiguous() and qs.is_contiguous()) or q8.dtype != torch.int8 or qs.dtype != torch.float32:
                raise ValueError(f"decode: q8 int8 [{batch}, {heads}, {part.width}], qs fp32 [{batch}, {heads}, "
                                 f"{part.groups}] contiguous")
            desc += [part.kind, part.width, part.group_size, part.scale_offset, part.zero_offset, offset]
        arr = lambda kind, values: (kind * len(values))(*values)  # noqa: E731
        q8s = [p[2].data_ptr() + b * p[2].stride(0) for b in range(batch) for p in parts]
        qss = [p[3].data_ptr() + b * p[3].stride(0) * 4 for b in range(batch) for p in parts]
        self.lib.mlaq_decode(pool.data_ptr(), page_rows, pool.shape[2], batch,
                             arr(ctypes.c_void_p, [p.data_ptr() for p in pages]), arr(ctypes.c_int64, lens),
                             block_tokens, len(parts), arr(ctypes.c_int64, desc), arr(ctypes.c_void_p, q8s),
                             arr(ctypes.c_void_p, qss), heads,
                             arr(ctypes.c_void_p, [acc.data_ptr() + b * acc.stride(0) * 4 for b in range(batch)]),
                             acc.stride(1), m.data_ptr(), total.data_ptr(), len(value_channels),
                             arr(ctypes.c_int64, list(value_channels)),
                             torch.get_num_threads() if threads is None else threads)

    def exp2(self, x: Tensor, m: float) -> tuple[Tensor, float]:
        """(exp2(x − m) fp32 [n], its sum in the kernels' lane order) for x fp32 [n] (tests)."""
        x = x.contiguous()
        out, total = torch.empty_like(x), ctypes.c_float()
        self.lib.mlaq_exp2(x.data_ptr(), x.numel(), m, out.data_ptr(), ctypes.addressof(total))
        return out, total.value


def describe() -> str:
    """The native helper in use, in words: its ISA variant and why (for the bench header and reports)."""
    if _library() is None:
        why = "MLAQUANT_NATIVE=0" if os.environ.get("MLAQUANT_NATIVE", "1") == "0" else "not built (no C compiler?)"
        return f"none ({why}): torch ops"
    isa, requested = chosen_isa(), requested_isa()
    capability = torch.backends.cpu.get_cpu_capability()
    how = "forced by MLAQUANT_NATIVE_ISA" if requested != "auto" else f"auto: CPU and torch capability {capability}"
    return f"{isa} ({how})"


def _unpack_int4(raw: Tensor, out: Tensor, signed: bool) -> Tensor:
    """Packed int4 codes uint8 [n, b] on the CPU (rows any stride apart, bytes consecutive; channel 2j in the low
    nibble of byte j) → codes int8 [n, 2b] written into `out` (uint8 [n, 2b], contiguous): [low nibbles | high
    nibbles] per row, unsigned 0..15, or less 8 with `signed` (symmetric codes, stored q + 8)."""
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
