"""The backends of the decode op (`mlaquant.attention.ops.mla_decode`) and the one question each answers.

    Backend                                  the names: auto | torch | triton | cpu (the CLI's --backend choices)
    backend.supports(codec, device, seq_lens=None) -> reason | None
        seq_lens None   can this backend run `codec` on `device` at all (an explicit backend must, else
                        BackendError with the reason);
        seq_lens [B]    does "auto" take this call: the torch reference always; Triton where it reads the codec;
                        the CPU fast path where this machine's routing rule (`CpuRouting`) says it is faster.
    backend.run(inputs, scale, scratch) -> (out [B, H, d_c], lse [B, H])   for checked `DecodeInputs`

"auto" asks the backends of the tensors' device in order (`AUTO_ORDER`: CUDA triton then torch, CPU cpu then torch)
and runs the first that takes the call. The routing thresholds and the measurements behind them: docs/cpu.md.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import math
import os
import time

import torch
from torch import Tensor

from mlaquant.attention import cpu_decode, native
from mlaquant.attention.buffers import Buffers
from mlaquant.attention.decode_inputs import DecodeInputs
from mlaquant.attention.reference import mla_decode_reference
from mlaquant.errors import BackendError
from mlaquant.quant.codecs import LayerCodec, split_pair

# where "auto" on CPU takes the fast path (`CpuBackend.supports`, by the rule of `cpu_routing`; the measurements
# behind each threshold, on an AVX-512 VNNI CPU and under ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA=AVX2:
# docs/cpu.md)
CPU_FAST_MIN_TOKENS = 8192  # cached tokens per call (all sequences together): a float c_kv (FP32 GEMMs)
# a codec with an integer part read by the C kernels: this many tokens per non-empty sequence on average, by ISA
# variant (avxvnni not measured: the avx2 figure)
CPU_NATIVE_MIN_MEAN = {"avx512vnni": 1024, "avxvnni": 2048, "avx2": 2048}
# ... and below this many per sequence, only where a one-time probe of the codec measured them faster here
# (`native_faster`): near the threshold the two are within 10-20 % and which one wins moves with the host's load
CPU_NATIVE_PROBE_BELOW = 8192
# an integer c_kv through torch._int_mm (no C kernels; only where torch's int8 GEMM has VNNI):
CPU_FAST_ROW_MEAN = 2048  # a row-wise one: CPU_FAST_MIN_TOKENS in all, or this many per sequence on average
CPU_FAST_GROUPED_TOKENS = 16384  # a grouped one: this many in all ...
CPU_FAST_MIN_MEAN = 1024  # ... and this many per sequence on average
# with torch ops, integer parts of more stored groups run one GEMM per group and block: slower than the reference
# (`mlaquant bench decode --batch 1,16`: int4-g32 c_kv, 16 groups, ran slower at batch 1)
CPU_INT_MM_MAX_GROUPS = 8

# op -> (module, function) of its Triton implementation
KERNELS = {
    "mla_decode": ("mlaquant.kernels.mla_decode", "mla_decode"),
    "int8_gemm": ("mlaquant.kernels.int8_gemm", "int8_gemm"),
    "int8_gemm_grouped": ("mlaquant.kernels.int8_gemm", "int8_gemm_grouped"),
}


class Backend(str, enum.Enum):
    """Which implementation runs an op."""

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    CPU = "cpu"

    @classmethod
    def parse(cls, name: str | Backend) -> Backend:
        """The member named `name`; an unknown name → BackendError listing the choices."""
        try:
            return cls(name)
        except ValueError:
            raise BackendError(f"unknown backend {name!r} (choose one of: {', '.join(cls.choices())})") from None

    @classmethod
    def choices(cls) -> list[str]:
        return [b.value for b in cls]


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def load_kernel(op: str = "mla_decode"):
    """The Triton function of `op` (a key of KERNELS), or raise BackendError saying why it cannot be loaded."""
    module_name, name = KERNELS[op]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BackendError(f"backend 'triton': cannot import {module_name} ({e})") from e
    kernel = getattr(module, name, None)
    if kernel is None:
        raise BackendError(f"backend 'triton': {module_name} has no function {name}")
    return kernel


@dataclasses.dataclass(frozen=True)
class CpuRouting:
    """Which rule "auto" follows on this CPU (`cpu_routing`): torch's CPU capability, the C kernels' ISA variant
    (None: not built), and whether torch's int8 GEMM (`torch._int_mm`, oneDNN) has VNNI here."""

    capability: str
    native_isa: str | None
    torch_vnni: bool

    @property
    def integer(self) -> str:
        """How integer caches go: "native" (C kernels, a vector ISA), "int_mm" (torch ops, VNNI) or "reference"."""
        if self.native_isa in native.VECTOR_ISAS:
            return "native"
        return "int_mm" if self.torch_vnni else "reference"

    def describe(self) -> str:
        """The rule in words, for reports and for the reasons of `takes` (built once per thread count)."""
        return _described(self, torch.get_num_threads())

    def takes(self, codec: LayerCodec, seq_lens: Tensor) -> str | None:
        """None when the fast path is faster here for a call over seq_lens int [B], else why the reference runs: a
        codec with an integer part only where the C kernels run (a vector ISA) — from `CPU_NATIVE_MIN_MEAN[isa]`
        tokens per non-empty sequence on average, and below `CPU_NATIVE_PROBE_BELOW` where `native_faster` measured
        it faster — or where torch's int8 GEMM has VNNI (at most
        `CPU_INT_MM_MAX_GROUPS` stored groups per integer part, the `CPU_FAST_*` thresholds), never otherwise; a
        float codec from `CPU_FAST_MIN_TOKENS` in all."""
        live = [n for n in seq_lens.tolist() if n > 0]  # one torch op: this runs before every decode call
        total = sum(live)
        mean = total / max(1, len(live))

        def short() -> str:
            return f"the reference is faster here for {total} tokens over {len(live)} sequences ({self.describe()})"

        ints = [rc for rc in (codec.ckv, codec.kpe) if rc.spec.kind in ("int8", "int4")]
        if not ints:
            return None if total >= CPU_FAST_MIN_TOKENS else short()
        if self.integer == "native":
            floor = CPU_NATIVE_MIN_MEAN.get(self.native_isa, 2048)
            if mean < floor:
                return short()
            if mean < CPU_NATIVE_PROBE_BELOW:
                sequences, tokens = min(len(live), torch.get_num_threads()), 1 << (int(mean).bit_length() - 1)
                if not native_faster(codec.name, codec.ckv.width, codec.kpe.width, sequences, tokens):
                    return (f"the reference measured faster here for {codec.name} at {sequences} x {tokens} tokens "
                            f"(probe; {self.describe()})")
            return None
        if self.integer == "reference":
            return f"integer parts stay on the reference here ({self.describe()})"
        if any(rc.layout.n_groups > CPU_INT_MM_MAX_GROUPS for rc in ints):
            return f"more than {CPU_INT_MM_MAX_GROUPS} groups per part: one torch._int_mm per group is slower"
        ckv = codec.ckv
        if ckv.spec.kind not in ("int8", "int4"):
            fast = total >= CPU_FAST_MIN_TOKENS
        elif ckv.layout.n_groups == 1:
            fast = total >= CPU_FAST_MIN_TOKENS or mean >= CPU_FAST_ROW_MEAN
        else:
            fast = total >= CPU_FAST_GROUPED_TOKENS and mean >= CPU_FAST_MIN_MEAN
        return None if fast else short()


@functools.cache
def _described(routing: CpuRouting, threads: int) -> str:
    if routing.integer == "native":
        integer = (f"integer caches by the {routing.native_isa} C kernels from "
                   f"{CPU_NATIVE_MIN_MEAN.get(routing.native_isa, 2048)} tokens per sequence (below "
                   f"{CPU_NATIVE_PROBE_BELOW} where a probe of the codec measures them faster), fewer sequences "
                   f"than {threads} threads on {cpu_decode.split_threads(threads)} (probed)")
    elif routing.integer == "int_mm":
        integer = "integer caches by torch._int_mm (VNNI) from the measured thresholds"
    else:
        integer = "integer caches on the reference (no C kernels, and torch's int8 GEMM has no VNNI here)"
    return (f"CPU capability {routing.capability}, native {routing.native_isa or 'none'}; {integer}; float caches by "
            f"FP32 GEMMs from {CPU_FAST_MIN_TOKENS} tokens per call")


@functools.cache
def native_faster(codec_name: str, d_c: int, d_r: int, sequences: int, tokens: int) -> bool:
    """Whether the fast path (the C kernels) beats the reference on this machine for the codec `codec_name`
    ('<ckv>/<kpe>', widths d_c, d_r) at `sequences` sequences of `tokens` cached tokens (`cpu_decode.probe_inputs`):
    a one-time probe per process and class, the fastest of three interleaved calls each way after one untimed call
    of each (its first fast call runs the threads probe, `cpu_decode.split_threads`): 40–350 ms a class at 1–2
    sequences of 2,048–4,096 tokens on a 2-core Zen 3."""
    inputs = cpu_decode.probe_inputs(LayerCodec.from_names(*split_pair(codec_name), d_c, d_r), sequences, tokens)
    calls = {"fast": lambda: cpu_decode.mla_decode_cpu(inputs, d_c**-0.5),
             "reference": lambda: mla_decode_reference(inputs, d_c**-0.5)}
    best = dict.fromkeys(calls, math.inf)
    for call in calls.values():
        call()
    for _ in range(3):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best["fast"] <= best["reference"]


def torch_int8_vnni() -> bool:
    """Whether torch's int8 GEMM runs on VNNI here: an AVX-512 capability (an AVX2 one caps oneDNN below it) on a
    CPU with AVX-512 VNNI. AVX-VNNI-only CPUs count as without: oneDNN's use of it was not measured."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    return bool(probe()) if probe is not None else "avx512vnni" in native.cpu_features()


@functools.cache
def cpu_routing() -> CpuRouting:
    """The routing rule "auto" follows on this CPU, read once per process like the C kernels' build
    (`native._library`; set MLAQUANT_NATIVE / MLAQUANT_NATIVE_ISA before the first decode call): it is asked
    before every decode call, where rebuilding it showed in the time of short calls (docs/results/cpu-history.md,
    Round 12). A test that changes its inputs clears it (`cpu_routing.cache_clear()`)."""
    return CpuRouting(torch.backends.cpu.get_cpu_capability(), native.chosen_isa(), torch_int8_vnni())


class TorchBackend:
    """The FP32 reference (`mlaquant.attention.reference.mla_decode_reference`): any codec, any device."""

    name = Backend.TORCH

    def supports(self, codec: LayerCodec | None, device: torch.device, seq_lens: Tensor | None = None) -> str | None:
        return None

    def run(self, inputs: DecodeInputs, scale: float, scratch: Buffers | None = None) -> tuple[Tensor, Tensor]:
        return mla_decode_reference(inputs, scale, scratch)


class TritonBackend:
    """The Triton kernel of `op` (a key of KERNELS; the decode op `mlaquant.kernels.mla_decode.mla_decode` by
    default): on CUDA, or on CPU under TRITON_INTERPRET=1 (never chosen by "auto" there); the decode kernel for the
    codecs it reads (its `supports`)."""

    name = Backend.TRITON

    def __init__(self, op: str = "mla_decode") -> None:
        self.op = op

    def supports(self, codec: LayerCodec | None, device: torch.device, seq_lens: Tensor | None = None) -> str | None:
        if device.type == "cpu" and not _triton_interpret():
            return "backend 'triton' on CPU needs TRITON_INTERPRET=1 (or use backend 'torch')"
        if device.type not in ("cpu", "cuda"):
            return f"backend 'triton' does not run on device '{device.type}' (use backend 'torch')"
        try:
            load_kernel(self.op)
        except BackendError as e:
            return str(e)
        if codec is None:
            return None
        return importlib.import_module(KERNELS[self.op][0]).supports(codec, on_gpu=device.type == "cuda")

    def run(self, inputs: DecodeInputs, scale: float, scratch: Buffers | None = None) -> tuple[Tensor, Tensor]:
        i = inputs
        return load_kernel("mla_decode")(i.q, i.pool, i.block_table, i.seq_lens, i.codec, i.d_c, scale)


class CpuBackend:
    """The fast CPU path (`mlaquant.attention.cpu_decode.mla_decode_cpu`): CPU tensors, any codec; "auto" takes it
    where `routing` (default: this machine's, `cpu_routing`) says it is faster, and then runs integer parts by the
    C kernels only where they have a vector ISA. `auto=False` (an explicit "cpu"): whatever is built, a forced
    scalar variant included."""

    name = Backend.CPU

    def __init__(self, routing: CpuRouting | None = None, auto: bool = False) -> None:
        self.routing, self.auto = routing, auto

    def supports(self, codec: LayerCodec | None, device: torch.device, seq_lens: Tensor | None = None) -> str | None:
        if device.type != "cpu":
            return f"backend 'cpu' runs on CPU tensors only, got device '{device.type}'"
        if seq_lens is None:
            return None
        return (self.routing or cpu_routing()).takes(codec, seq_lens)

    def run(self, inputs: DecodeInputs, scale: float, scratch: Buffers | None = None) -> tuple[Tensor, Tensor]:
        if not self.auto:
            return cpu_decode.mla_decode_cpu(inputs, scale)
        return cpu_decode.mla_decode_cpu(inputs, scale, c_kernels=(self.routing or cpu_routing()).integer == "native")


BACKENDS = {Backend.TORCH: TorchBackend(), Backend.TRITON: TritonBackend(), Backend.CPU: CpuBackend()}
# the backends "auto" asks, in order, per device type (any other device: torch)
AUTO_ORDER = {"cuda": (TritonBackend(), TorchBackend()), "cpu": (CpuBackend(auto=True), TorchBackend())}


def check_backend(backend: str | Backend, device: torch.device | str, op: str = "mla_decode") -> Backend:
    """`backend` parsed, checked once for `op` (a key of KERNELS; a session does it at construction): an explicit
    backend that cannot run on `device` → BackendError with the reason; "auto" always passes (it chooses per
    call)."""
    backend = Backend.parse(backend)
    if backend is not Backend.AUTO:
        impl = TritonBackend(op) if backend is Backend.TRITON else BACKENDS[backend]
        reason = impl.supports(None, torch.device(device))
        if reason is not None:
            raise BackendError(reason)
    return backend


def choose_backend(backend: str | Backend, codec: LayerCodec, device: torch.device | str, seq_lens: Tensor):
    """The backend object that runs one decode call: an explicit one checked for `codec` (BackendError with the
    reason), "auto" the first of `AUTO_ORDER[device.type]` whose `supports` takes the call."""
    backend, device = Backend.parse(backend), torch.device(device)
    if backend is not Backend.AUTO:
        impl = BACKENDS[backend]
        reason = impl.supports(codec, device)
        if reason is not None:
            raise BackendError(reason)
        return impl
    for impl in AUTO_ORDER.get(device.type, (TorchBackend(),)):
        if impl.supports(codec, device, seq_lens) is None:
            return impl
    raise AssertionError("the torch reference takes every call")


def resolve_backend(backend: str | Backend, device: torch.device | str, op: str = "mla_decode") -> Backend:
    """The backend that runs `op` (a key of KERNELS) on tensors on `device`: an explicit one checked (BackendError
    when it cannot run there), "auto" → triton on CUDA where the op's kernel imports (else torch), cpu on CPU,
    torch elsewhere. The decode op goes further per call (`choose_backend`)."""
    backend, device = check_backend(backend, device, op), torch.device(device)
    if backend is not Backend.AUTO:
        return backend
    if device.type == "cpu":
        return Backend.CPU
    if device.type == "cuda" and TritonBackend(op).supports(None, device) is None:
        return Backend.TRITON
    return Backend.TORCH
