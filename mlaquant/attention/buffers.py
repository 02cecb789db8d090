"""Named buffers reused from call to call: the one buffer pool of the decode paths.

A fresh multi-MB tensor per call costs page faults whenever the allocator has handed its memory back to the
OS (glibc's largest mmap threshold is 32 MiB; the CPU fast path's per-block buffers are a few MB each), so the
torch reference (`Buffers` held by a `DecodeSession`, step after step) and the CPU fast path (one `Buffers`
per thread) take their working tensors from here. The measurements behind it: docs/cpu.md.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class Buffers:
    """One byte buffer per name on one device, kept and grown on demand: a buffer outgrown is replaced by one of
    max(asked, GROWTH × old) bytes, so a buffer that grows by one token per step is reallocated rarely. Not for
    concurrent use (one per thread)."""

    GROWTH = 1.25

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}
        self._views: dict[str, tuple[tuple, Tensor]] = {}  # name → ((shape, dtype, device), the last view)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> Tensor:
        """A contiguous tensor [shape] of `dtype` on `device` (contents undefined), valid until `name` is taken
        again."""
        device = torch.device(device)
        key = (tuple(shape), dtype, device)
        last = self._views.get(name)
        if last is not None and last[0] == key:
            return last[1]
        size = math.prod(shape) * dtype.itemsize
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size or buf.device != device:
            grown = size if buf is None or buf.device != device else max(size, int(buf.numel() * self.GROWTH))
            self._buffers.pop(name, None)  # free the old buffer before taking the new one
            buf = self._buffers[name] = torch.empty(grown, dtype=torch.uint8, device=device)
        view = buf[:size].view(dtype).view(shape)
        self._views[name] = (key, view)
        return view
