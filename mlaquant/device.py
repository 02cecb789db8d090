"""Where and in what precision a command runs: `--device` / `--dtype`, resolved once for every command.

    --device auto | cpu | cuda | cuda:N     auto = the first CUDA device when torch sees one, else cpu
    --dtype  auto | float32 | bfloat16 | float16    auto = bfloat16 on CUDA, float32 on CPU

The dtype is the dtype of the model's *weights* only. Whatever it is, the latent rows, attention scores,
softmax, log-sum-exp, logits and losses are FP32 (the numerics contract, `mlaquant.modeling.model`). A CUDA
out-of-memory error surfaces as one line naming the setting to lower (`mlaquant.cli.oom_message`).
"""

from __future__ import annotations

import argparse
import resource

import torch

from mlaquant.errors import DeviceError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICE_CHOICES = "auto, cpu, cuda, cuda:N"


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' (or a torch.device) → torch.device; CUDA that is not there → DeviceError."""
    if isinstance(name, torch.device):
        name = str(name)
    name = str(name).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"--device {name!r} not understood (choose one of: {DEVICE_CHOICES})") from None
    if device.type == "cpu" or device.type == "meta":
        return device
    if device.type != "cuda":
        raise DeviceError(f"--device {name!r}: unsupported device type (choose one of: {DEVICE_CHOICES})")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__})")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


def resolve_dtype(name: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """'auto' (or None) | 'float32' | 'bfloat16' | 'float16' (or a torch.dtype) → the weights' dtype on `device`."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise DeviceError(f"--dtype {name}: weights must be one of {', '.join(DTYPES)}")
        return name
    if name is None or str(name).lower() == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    dtype = DTYPES.get(str(name).lower())
    if dtype is None:
        raise DeviceError(f"--dtype {name!r} not understood (choose one of: auto, {', '.join(DTYPES)})")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 → 'bfloat16' (the names --dtype takes)."""
    return str(dtype).removeprefix("torch.")


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """--device and --dtype, in one argument group (the same on every command that runs the model)."""
    g = p.add_argument_group("device")
    g.add_argument("--device", default="auto", help=f"{DEVICE_CHOICES} (default auto: CUDA when available)")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="weights dtype (default auto: bfloat16 on CUDA, float32 on CPU); latent, scores and loss stay FP32",
    )


def from_args(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """The (device, dtype) of parsed `add_device_arguments` flags ("auto" for a namespace without them)."""
    device = resolve_device(getattr(args, "device", "auto"))
    return device, resolve_dtype(getattr(args, "dtype", "auto"), device)


def settings(device: torch.device, dtype: torch.dtype) -> dict:
    """What a plan records about where it was calibrated (not part of its fingerprint)."""
    out = {"device": str(device), "dtype": dtype_name(dtype)}
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
    return out


def peak_memory(device: torch.device | None = None) -> dict:
    """Peak RSS of this process and, on CUDA, peak allocated device memory since the last reset (MiB)."""
    out = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if device is not None and torch.device(device).type == "cuda":
        out["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out


def free_bytes(device: torch.device) -> int | None:
    """Free device memory in bytes on CUDA (what the allocator could still get), None elsewhere."""
    if torch.device(device).type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def auto_batch_size(device: torch.device, bytes_per_sample: int, given: int | None, default: int, cap: int = 64) -> int:
    """Samples per batch: `given` when set; on CUDA as many as fit in half the free memory at
    `bytes_per_sample` (1 ≤ b ≤ cap); elsewhere `default`."""
    if given is not None:
        return given
    free = free_bytes(device)
    if free is None:
        return default
    return max(1, min(cap, free // 2 // max(1, bytes_per_sample)))


def place(model, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None):
    """`model` (an `MLAModel` or `StreamedModel`) moved to `device` with weights in `dtype`; None keeps
    either as it is. Like `nn.Module.to`, this changes the model in place and returns it."""
    if device is None and dtype is None:
        return model
    target = resolve_device(device) if device is not None else model.device
    return model.to(device=target, dtype=resolve_dtype(dtype, target) if dtype is not None else model.dtype)
