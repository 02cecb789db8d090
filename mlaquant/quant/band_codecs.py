"""Bit packing of the band codec (`mlaquant.quant.codecs.BandCodec`): a part split into channel bands of 8, 4, 3, 2
or 0 bits per value, for a latent decorrelated by a calibrated rotation (the bits go where the variance is).

Codes of a b-bit band are symmetric, q in [-2^(b-1), 2^(b-1) - 1], stored unsigned as u = q + 2^(b-1) (8-bit
codes as the int8 byte itself, like `IntCodec`), channels of a band packed little-endian within bytes:

    8 bits   one byte per channel
    4 bits   byte j: channel 2j in bits 0-3, channel 2j+1 in bits 4-7
    3 bits   bytes 3j..3j+2 as one little-endian 24-bit word: channel 8j+k in bits 3k..3k+2
    2 bits   byte j: channel 4j+k in bits 2k..2k+1
    0 bits   nothing stored (the band decodes to zeros)

A band's width is a multiple of 8 channels, so every band fills whole bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

BAND_BITS = (0, 2, 3, 4, 8)
BAND_QUANTUM = 8  # channels: every band width is a multiple, so packed bands fill whole bytes


def pack(u: Tensor, bits: int) -> Tensor:
    """Unsigned codes uint8 [N, w] (< 2^bits) → packed bytes uint8 [N, w·bits/8] (module docstring)."""
    n, w = u.shape
    if bits == 8:
        return u.contiguous()
    if bits == 3:
        v = u.view(n, w // 8, 8).to(torch.int32) << (3 * torch.arange(8, dtype=torch.int32, device=u.device))
        word = v.sum(-1)  # [N, w/8], 24 bits each (disjoint bit fields: the sum is an OR)
        return torch.stack([(word >> s) & 0xFF for s in (0, 8, 16)], -1).to(torch.uint8).view(n, -1)
    per = 8 // bits
    shifts = (bits * torch.arange(per, device=u.device)).to(torch.uint8)
    return (u.view(n, w // per, per) << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: Tensor, bits: int, w: int) -> Tensor:
    """Packed bytes uint8 [N, w·bits/8] (rows may be strided) → unsigned codes uint8 [N, w]."""
    n = packed.shape[0]
    if bits == 8:
        return packed.contiguous()
    if bits == 3:
        b = packed.reshape(n, w // 8, 3).to(torch.int32)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)  # [N, w/8]
        shifts = 3 * torch.arange(8, dtype=torch.int32, device=packed.device)
        return ((word.unsqueeze(-1) >> shifts) & 7).to(torch.uint8).view(n, w)
    per = 8 // bits
    shifts = (bits * torch.arange(per, device=packed.device)).to(torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).view(n, w)
