"""Row codecs of the quantized latent cache: one cached token row ↔ bytes.

A layer's cached row is `[c_kv (d_c) | k_pe (d_r)]`; each part is stored by its own `RowCodec` and
a `LayerCodec` concatenates the two byte strings. Everything is vectorised over rows (no Python
loops) and runs on any device torch runs on.

    PartLayout   one part's bytes (table below), computed once by `PartLayout.of(spec, width)`
    RowLayout    a layer's row: c_kv part at byte 0, k_pe part at byte `kpe_offset` = ckv.row_bytes
    RowCodec     abstract part codec; `RowCodec.build(spec, width, ...)` picks the kind's class:
                 `FloatCodec` (fp32/bf16/fp16), `IntCodec` (int8/int4), `Fp8Codec` (fp8, fp8-g<N>)
    LayerCodec   the two part codecs of a layer and their `RowLayout`

The cache sizes its pools and the kernels find codes, scales and zero points from these layouts.

Codec names (`CodecSpec.parse` / `.name`): `fp32`, `bf16`, `fp16`, for the integer kinds
`int8|int4` + `-row` (one group = the whole part) or `-g<N>` (groups of N channels) + optional
`-asym`, and `fp8` (e4m3 with one static scale per layer) or `fp8-g<N>` (e4m3 with a dynamic FP16
scale per group of N channels). Bare `int8` means `int8-g64`, bare `int4` means `int4-g32`, both symmetric.

Byte layout of one part of width W with G = W / group_size groups (all multi-byte values
little-endian; groups run along the channel dimension, channel c belongs to group c // group_size):

    fp32 / bf16 / fp16   W values                                      4W / 2W / 2W bytes
    int8 symmetric       W int8 codes q | G fp16 scales s              W + 2G bytes
    int8 asymmetric      W uint8 codes q | G fp16 scales s | G fp16 lo  W + 4G bytes
    int4 symmetric       W/2 bytes of codes | G fp16 scales s          W/2 + 2G bytes
    int4 asymmetric      W/2 bytes of codes | G fp16 scales s | G fp16 lo  W/2 + 4G bytes
    fp8 (static)         W e4m3 codes (the scale lives in the plan, not the row)   W bytes
    fp8-g<N> (dynamic)   W e4m3 codes | G fp16 scales s                W + 2G bytes

In `PartLayout` fields: codes at byte 0 (`code_bytes` of them), scales at `scale_offset` = code_bytes,
lo at `zero_offset` = code_bytes + 2G, `n_groups` = G; float and static fp8 parts have n_groups = 0 and
no scale or zero offsets (None).

  symmetric:  x̂ = q * s,       q = clamp(round(x / s), -(qmax+1), qmax), s signed: every level used, as in
              llama.cpp's q4_0 — the group's value of largest magnitude e lands on code -(qmax+1) (s has the
              opposite sign of e), |s| = |e|·f/(qmax+1) rounded up to FP16, f the shrink factor of SCALE_FACTORS
              (int4: 1, 0.975, ..., 0.75; int8: 1) with the least squared error over the group (`symmetric_codes`)
  asymmetric: x̂ = q * s + lo,  q = clamp(round((x - lo) / s), 0, 2*qmax+1), lo ≤ min(group),
              s ≥ (max(group) - lo) / (2*qmax+1)                       (qmax = 127 int8, 7 int4)
  int4 packing: byte j holds channel 2j in its low nibble and channel 2j+1 in its high nibble;
  symmetric codes are stored biased, as q + 8 (0..15).
  fp8:        x̂ = e4m3(clamp(x / s, -448, 448)) * s   (e4m3fn, round to nearest even, saturating)
              dynamic: s ≥ absmax(group) / 448, an FP16 value rounded up like the integer scales;
              static:  s = absmax(calibrated bounds) / 448 in FP32, one scale for every static-fp8
              part of a layer (vLLM's per-layer `k_scale` covers the whole [c_kv | k_pe] row);
              without bounds s = 1.0, what engines use when a checkpoint carries no scales.

Scales and zero points are computed in FP32, then rounded to FP16 — a scale's magnitude *up* and `lo`
*down* to the next FP16 value, so the range stays representable (this matters for tiny ranges where FP16 is
subnormal) — and the codes are computed with the FP16 values, so decoding is exactly consistent with
encoding. Asymmetric codes: |x - x̂| ≤ s/2 for every unclipped value. Symmetric codes: |x - x̂| ≤ |s|/2 for
values inside the code range [-(qmax+1.5)·|s|, (qmax+0.5)·|s|] (oriented by the sign of s), the rest
saturate (for f = 1 only values on e's far side, by at most |s|); no group's squared error exceeds that of
its f = 1 candidate. An all-zero group gets s = 0 and
decodes to exact zeros. Decoding computes `q * s (+ lo)` in FP32.

Worked examples, DeepSeek d_c = 512, d_r = 64 (one token, one layer):

    fp16 / fp16                 1024 + 128                      = 1152 B  (16.0 bits/value)
    int8-g64 / fp16             (512 + 8*2) + 128               =  656 B  ( 9.11 bits/value)
    int8-g64 / int8-g64         (512 + 8*2) + (64 + 1*2)        =  594 B  ( 8.25 bits/value)
    int4-g32 / fp16             (256 + 16*2) + 128              =  416 B  ( 5.78 bits/value)
    int4-g32 / int8-g32         (256 + 16*2) + (64 + 2*2)       =  356 B  ( 4.94 bits/value)
    int4-g32-asym / int8-g32    (256 + 16*4) + (64 + 2*2)       =  388 B  ( 5.39 bits/value)
    fp8 / fp8                   512 + 64                        =  576 B  ( 8.0 bits/value, vLLM fp8)
    fp8-g128 / bf16             (512 + 4*2) + 128               =  648 B  ( 9.0 bits/value)

Rows carry no padding: `row_bytes` is exactly codes + scales + zero points.

Calibrated clipping: `RowCodec.build(..., clip_lo, clip_hi)` takes per-channel bounds [W] from calibration;
values are clamped to them before each row's group range is taken (each row's scales still come from
its own range at write time). For symmetric codecs pass `clip_lo = -clip_hi` (an absmax bound); a
missing side is mirrored for symmetric codecs and unbounded for asymmetric ones. A static `fp8` part
uses the bounds only to set its scale (`fp8_scale`, or absmax(bounds) / 448); its effective clip range
is the saturation range ±448·s, which is what `clip_lo`/`clip_hi`/`clip_rate` then report.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from mlaquant.errors import MLAQuantError
from mlaquant.quant import band_codecs, engine_codecs

FLOAT_KINDS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT_KINDS = {"int8": 8, "int4": 4}
DEFAULT_GROUP = {"int8": 64, "int4": 32}
FP8 = "fp8"
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
# other engines' cache formats (`mlaquant.quant.engine_codecs`): kind → (group size or None, code bits,
# scale bytes/group)
ENGINE_KINDS = {
    "e4m3": (None, 8, 0),
    "fp8-ds": (128, 8, 4),
    "nvfp4": (16, 4, 1),
    "mxfp4": (16, 4, 1),
    "q8_0": (32, 8, 2),
    "q4_0": (32, 4, 2),
}
# symmetric integer scales: |s| = |extreme| · f / (qmax + 1) for f in these, the one of least squared error
# (`symmetric_codes`; `python scripts/measure_levels.py` measured each against absmax / qmax)
SCALE_FACTORS = {"int8": (1.0,), "int4": tuple(1.0 - k / 40 for k in range(11))}
_NAME_RE = re.compile(r"^(int8|int4)(?:-(row|g(\d+)))?(?:-(sym|asym))?$")
BAND = "band"  # channel bands of 8/4/3/2/0 bits (`mlaquant.quant.band_codecs`): 'band-<bits>x<width>-...'
_BAND_RE = re.compile(r"^band((?:-\d+x\d+)+)$")
_FP8_RE = re.compile(r"^fp8(?:-g(\d+))?$")


class CodecError(MLAQuantError, ValueError):
    """A codec name or codec/width combination that cannot be built (the message names it)."""


@dataclass(frozen=True)
class CodecSpec:
    """How one part of a row (c_kv or k_pe) is stored. `group_size=None` = one group per row (for fp8:
    one static scale per layer, not stored in the row)."""

    kind: str
    group_size: int | None = None
    symmetric: bool = True
    bands: tuple[tuple[int, int], ...] = ()  # (bits, channels) per band, for kind 'band' only

    def __post_init__(self) -> None:
        if self.kind == BAND:
            self._check_bands()
            return
        if self.bands:
            raise CodecError(f"codec '{self.kind}' takes no bands")
        if self.kind not in FLOAT_KINDS and self.kind not in INT_KINDS and self.kind != FP8:
            if self.kind not in ENGINE_KINDS:
                known = ", ".join([*FLOAT_KINDS, *INT_KINDS, FP8, *ENGINE_KINDS])
                raise CodecError(f"codec kind '{self.kind}' unknown (known: {known})")
            if self.group_size != ENGINE_KINDS[self.kind][0] or not self.symmetric:
                raise CodecError(f"codec '{self.kind}' is an engine format: its grouping is fixed")
        if self.kind in FLOAT_KINDS and (self.group_size is not None or not self.symmetric):
            raise CodecError(f"codec '{self.kind}' takes no group size or asymmetry")
        if self.kind == FP8 and not self.symmetric:
            raise CodecError("codec 'fp8' is symmetric only")
        g = self.group_size
        if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g <= 0):
            raise CodecError(f"codec '{self.kind}': group_size must be a positive int, got {g!r}")

    def _check_bands(self) -> None:
        if not self.bands or self.group_size is not None or not self.symmetric:
            raise CodecError("codec 'band' needs bands (bits, width) and takes no group size or asymmetry")
        for bits, width in self.bands:
            if bits not in band_codecs.BAND_BITS or width <= 0 or width % band_codecs.BAND_QUANTUM:
                raise CodecError(f"codec band: a band of {width} channels at {bits} bits (bits one of "
                                 f"{band_codecs.BAND_BITS}, width a positive multiple of {band_codecs.BAND_QUANTUM})")

    @classmethod
    def parse(cls, name: str) -> CodecSpec:
        """'fp16', 'int8' (= int8-g64), 'int8-row', 'int8-g32', 'int4' (= int4-g32), 'int4-g64-asym',
        'band-4x48-2x64-0x16', ..."""
        text = name.strip().lower() if isinstance(name, str) else name
        if text in FLOAT_KINDS:
            return cls(text)
        mb = _BAND_RE.match(text) if isinstance(text, str) else None
        if mb is not None:
            return cls(BAND, bands=tuple(tuple(int(v) for v in b.split("x")) for b in mb.group(1)[1:].split("-")))
        if text in ENGINE_KINDS:
            return cls(text, ENGINE_KINDS[text][0])
        m8 = _FP8_RE.match(text) if isinstance(text, str) else None
        if m8 is not None:
            return cls(FP8, None if m8.group(1) is None else int(m8.group(1)))
        m = _NAME_RE.match(text) if isinstance(text, str) else None
        if m is None:
            raise CodecError(
                f"codec name {name!r} not understood (expected fp32, bf16, fp16, fp8[-g<N>], "
                "int8|int4[-row|-g<N>][-asym], e.g. 'int4-g32', 'int8-row-asym', band-<bits>x<width>-..., or an "
                f"engine format: {', '.join(ENGINE_KINDS)})"
            )
        kind, group, group_n, sym = m.groups()
        if group is None:
            group_size = DEFAULT_GROUP[kind]
        elif group == "row":
            group_size = None
        else:
            group_size = int(group_n)
        return cls(kind, group_size, sym != "asym")

    @property
    def name(self) -> str:
        """Canonical name: `parse(spec.name) == spec`."""
        if self.kind in FLOAT_KINDS or self.kind in ENGINE_KINDS:
            return self.kind
        if self.kind == BAND:
            return BAND + "".join(f"-{bits}x{width}" for bits, width in self.bands)
        if self.kind == FP8:
            return FP8 if self.group_size is None else f"{FP8}-g{self.group_size}"
        group = "row" if self.group_size is None else f"g{self.group_size}"
        return f"{self.kind}-{group}" + ("" if self.symmetric else "-asym")

    @property
    def bits(self) -> int:
        """Code bits per value (scales and zero points not included)."""
        if self.kind in FLOAT_KINDS:
            return torch.finfo(FLOAT_KINDS[self.kind]).bits
        if self.kind == FP8:
            return 8
        if self.kind in ENGINE_KINDS:
            return ENGINE_KINDS[self.kind][1]
        if self.kind == BAND:  # the widest band's (the layout counts each band's own)
            return max(bits for bits, _ in self.bands)
        return INT_KINDS[self.kind]

    @property
    def is_float(self) -> bool:
        return self.kind in FLOAT_KINDS

    @property
    def is_engine(self) -> bool:
        """Another engine's cache format (`ENGINE_KINDS`, `mlaquant.quant.engine_codecs`)."""
        return self.kind in ENGINE_KINDS

    @property
    def is_static_fp8(self) -> bool:
        """fp8 with one calibrated scale per layer (vLLM's `fp8` cache), as opposed to `fp8-g<N>`."""
        return self.kind == FP8 and self.group_size is None

    def wider(self) -> CodecSpec | None:
        """Fallback order int4 → int8 (same grouping/symmetry) → fp16; fp8 and engine formats → fp16; float
        kinds → None."""
        if self.kind == "int4":
            return CodecSpec("int8", self.group_size, self.symmetric)
        if self.kind in ("int8", FP8) or self.is_engine:
            return CodecSpec("fp16")
        if self.kind == BAND:
            return CodecSpec("int8")
        return None


def _fp16_round(x: Tensor, up: bool) -> Tensor:
    """FP32 → the nearest FP16 value ≥ x (`up`) or ≤ x, as float32 (finite x; may overflow to ±inf)."""
    h = x.to(torch.float16)
    miss = h.float() < x if up else h.float() > x
    # Step one FP16 ulp through the bit pattern: device-agnostic, no half nextafter needed.
    # Zeros are normalised to +0 (stepping up) or -0 (stepping down) so the step never crosses the sign.
    zero = torch.zeros_like(h) if up else torch.full_like(h, -0.0)
    bits = torch.where(h == 0, zero, h).view(torch.int16).to(torch.int32)
    towards_larger_magnitude = (bits >= 0) == up
    stepped = torch.where(towards_larger_magnitude, bits + 1, bits - 1).to(torch.int16).view(torch.float16)
    return torch.where(miss, stepped, h).float()


@dataclass(frozen=True)
class PartLayout:
    """Byte layout of one part (c_kv or k_pe) of a cached row, as the module docstring's table gives it:
    the one place these numbers are computed (`PartLayout.of`); codecs, the cache and the kernels read them.

    `group_size` channels per group (the part's width for float kinds and static fp8); `n_groups` groups
    with a stored FP16 scale (0 for float kinds and static fp8); `code_bytes` bytes of codes at byte 0;
    `scale_offset` / `zero_offset` byte offsets of the n_groups FP16 scales / FP16 lo values inside the
    part (None where absent); `row_bytes` the part's bytes per row, nothing else stored.
    """

    spec: CodecSpec
    width: int
    group_size: int
    n_groups: int
    code_bytes: int
    scale_offset: int | None
    zero_offset: int | None
    row_bytes: int

    @classmethod
    def of(cls, spec: CodecSpec, width: int) -> PartLayout:
        """The layout of a part of `width` channels stored as `spec`; CodecError when they do not fit."""
        if width <= 0:
            raise CodecError(f"codec {spec.name}: width must be > 0, got {width}")
        width = int(width)
        if spec.kind == BAND:
            return cls._band(spec, width)
        code_bytes = width * spec.bits // 8
        if spec.is_float:
            return cls(spec, width, width, 0, code_bytes, None, None, code_bytes)
        g = spec.group_size or width
        if width % g:
            raise CodecError(f"codec {spec.name}: group size {g} does not divide width {width}")
        if spec.bits == 4 and width % 2:
            raise CodecError(f"codec {spec.name}: 4-bit codes need an even width, got {width}")
        if spec.is_engine:
            scale_bytes = ENGINE_KINDS[spec.kind][2]
            n_groups = width // g if scale_bytes else 0
            offset = code_bytes if n_groups else None
            return cls(spec, width, g, n_groups, code_bytes, offset, None, code_bytes + scale_bytes * n_groups)
        n_groups = 0 if spec.is_static_fp8 else width // g
        params = 1 if spec.symmetric else 2  # FP16 arrays per group: s, or s and lo
        zero_offset = None if spec.symmetric else code_bytes + 2 * n_groups
        scale_offset = code_bytes if n_groups else None
        return cls(spec, width, g, n_groups, code_bytes, scale_offset, zero_offset, code_bytes + 2 * n_groups * params)


    @classmethod
    def _band(cls, spec: CodecSpec, width: int) -> PartLayout:
        """A band part: the bands' packed codes in order, then one FP16 scale per band of > 0 bits."""
        if sum(w for _, w in spec.bands) != width:
            raise CodecError(f"codec {spec.name}: bands cover {sum(w for _, w in spec.bands)} channels, width {width}")
        code_bytes = sum(bits * w // 8 for bits, w in spec.bands)
        n_scales = sum(1 for bits, _ in spec.bands if bits)
        return cls(spec, width, width, n_scales, code_bytes, code_bytes if n_scales else None, None,
                   code_bytes + 2 * n_scales)


@dataclass(frozen=True)
class RowLayout:
    """One layer's cached row `[c_kv part | k_pe part]`: the c_kv part at byte 0, the k_pe part at byte
    `kpe_offset` (= ckv.row_bytes), `row_bytes` bytes and `width` = d_c + d_r values in all."""

    ckv: PartLayout
    kpe: PartLayout

    @property
    def kpe_offset(self) -> int:
        return self.ckv.row_bytes

    @property
    def row_bytes(self) -> int:
        return self.ckv.row_bytes + self.kpe.row_bytes

    @property
    def width(self) -> int:
        return self.ckv.width + self.kpe.width


class _LaidOut:
    """`width` (values) and `row_bytes` (stored bytes) of whatever `self.layout` describes."""

    layout: PartLayout | RowLayout

    @property
    def width(self) -> int:
        return self.layout.width

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes


class RowCodec(_LaidOut, ABC):
    """Encodes rows [..., width] (float) to bytes [..., row_bytes] (uint8) and back, for one part.

    Built by `RowCodec.build(spec, width, ...)`, which picks the kind's class (`FloatCodec`, `IntCodec`,
    `Fp8Codec`). `layout` (a `PartLayout`) describes the bytes; `clip_lo` / `clip_hi` are the per-channel
    clip bounds float32 [width] (None when unclipped).
    """

    def __init__(self, layout: PartLayout, clip_lo: Tensor | None, clip_hi: Tensor | None) -> None:
        self.layout = layout
        self.spec = layout.spec
        self.clip_lo, self.clip_hi = self._clip_bounds(clip_lo, clip_hi)

    @staticmethod
    def build(
        spec: CodecSpec,
        width: int,
        clip_lo: Tensor | None = None,
        clip_hi: Tensor | None = None,
        fp8_scale: float | None = None,
    ) -> RowCodec:
        """The codec of a part of `width` channels stored as `spec`, clipped to the per-channel bounds
        [width] when given; `fp8_scale` is the static fp8 scale (ignored by every other codec, fp8-g<N> too)."""
        layout = PartLayout.of(spec, width)
        if spec.kind == FP8:
            return Fp8Codec(layout, clip_lo, clip_hi, fp8_scale)
        if spec.is_engine:
            return EngineCodec(layout, clip_lo, clip_hi)
        if spec.kind == BAND:
            return BandCodec(layout, clip_lo, clip_hi)
        return (FloatCodec if spec.is_float else IntCodec)(layout, clip_lo, clip_hi)

    def _clip_bounds(self, lo: Tensor | None, hi: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        if lo is None and hi is None:
            return None, None
        for name, t in (("clip_lo", lo), ("clip_hi", hi)):
            if t is not None and tuple(t.shape) != (self.width,):
                shape = list(t.shape)
                raise CodecError(f"codec {self.spec.name}: {name} must be [{self.width}], got {shape}")
        if self.spec.symmetric:
            lo = -hi if lo is None else lo
            hi = -lo if hi is None else hi
        else:
            where = (hi if lo is None else lo).device
            lo = torch.full((self.width,), -torch.inf, device=where) if lo is None else lo
            hi = torch.full((self.width,), torch.inf, device=where) if hi is None else hi
        lo, hi = lo.detach().float(), hi.detach().float()
        if torch.isnan(lo).any() or torch.isnan(hi).any() or (lo > hi).any():
            raise CodecError(f"codec {self.spec.name}: clip bounds contain NaN or clip_lo > clip_hi")
        return lo, hi

    def _repr_extra(self) -> str:
        return ", clipped" if self.clip_lo is not None else ""

    def __repr__(self) -> str:
        return f"RowCodec({self.spec.name}, width={self.width}, row_bytes={self.row_bytes}{self._repr_extra()})"

    def _clip(self, x: Tensor) -> Tensor:
        if self.clip_lo is None:
            return x
        return torch.clamp(x, self.clip_lo.to(x.device), self.clip_hi.to(x.device))

    def _raise_if(self, bad_in: bool, bad_out: bool, what: str) -> None:
        if bad_in:
            raise ValueError(f"codec {self.spec.name}: input contains NaN or Inf")
        if bad_out:
            raise ValueError(f"codec {self.spec.name}: {what}")

    def encode(self, x: Tensor) -> Tensor:
        """[..., width] float → uint8 [..., row_bytes]. NaN/Inf input raises ValueError."""
        if x.shape[-1:] != (self.width,) or not x.is_floating_point():
            raise ValueError(
                f"codec {self.spec.name}: expected float rows [..., {self.width}], got {x.dtype} {list(x.shape)}"
            )
        lead = x.shape[:-1]
        if x.numel() == 0:  # no rows (an empty page or prompt): nothing to scale
            return torch.empty(*lead, self.row_bytes, dtype=torch.uint8, device=x.device)
        return self._encode_rows(x.reshape(-1, self.width)).reshape(*lead, self.row_bytes)

    @abstractmethod
    def _encode_rows(self, x: Tensor) -> Tensor:
        """[N, width] float → uint8 [N, row_bytes]."""

    def decode(self, codes: Tensor, dtype: torch.dtype = torch.float32, out: Tensor | None = None) -> Tensor:
        """uint8 [..., row_bytes] → [..., width] in `dtype` (computed in FP32, then cast). With `out`
        (float32, contiguous, [..., width]; `dtype` is then not used) the values are written there and
        `out` is returned: the decode path reuses one buffer step after step instead of allocating."""
        if codes.dtype != torch.uint8 or codes.shape[-1:] != (self.row_bytes,):
            raise ValueError(
                f"codec {self.spec.name}: expected uint8 [..., {self.row_bytes}], got {codes.dtype} {list(codes.shape)}"
            )
        if out is not None and (
            out.dtype != torch.float32 or out.shape != (*codes.shape[:-1], self.width) or not out.is_contiguous()
        ):
            raise ValueError(
                f"codec {self.spec.name}: out must be contiguous float32 {[*codes.shape[:-1], self.width]}, "
                f"got {out.dtype} {list(out.shape)}{'' if out.is_contiguous() else ' (strided)'}"
            )
        return self._decode(codes, dtype, out)

    @abstractmethod
    def _decode(self, codes: Tensor, dtype: torch.dtype, out: Tensor | None) -> Tensor:
        """Checked uint8 [..., row_bytes] (rows may be strided) → [..., width] in `dtype`, or into `out`."""

    def fake_quant(self, x: Tensor) -> Tensor:
        """decode(encode(x)) in x's dtype — bit-identical to that composition by construction."""
        return self.decode(self.encode(x), dtype=x.dtype)

    def clip_rate(self, x: Tensor) -> float:
        """Fraction of the values of x [..., width] outside [clip_lo, clip_hi] (0.0 without clipping)."""
        if self.clip_lo is None or x.numel() == 0:
            return 0.0
        lo, hi = self.clip_lo.to(x.device), self.clip_hi.to(x.device)
        return ((x < lo) | (x > hi)).float().mean().item()

    def relative_error(self, x: Tensor, reduction: str = "mean") -> Tensor | float:
        """||fake_quant(x) - x|| / ||x|| per row ([...] tensor, reduction='none') or its mean (float)."""
        return _relative_error(self.fake_quant(x), x, reduction)


class FloatCodec(RowCodec):
    """fp32 / bf16 / fp16: the values themselves, `width` of them per row (clip bounds are kept for
    `clip_rate` but never applied: a float part is stored as it comes)."""

    def _encode_rows(self, x: Tensor) -> Tensor:
        out = x.to(FLOAT_KINDS[self.spec.kind], copy=True).contiguous()  # codes never alias the input
        if not torch.isfinite(out).all():  # NaN / Inf input stays NaN / Inf: one check on the hot path
            self._raise_if(not torch.isfinite(x).all(), True, "values exceed the range of " + self.spec.kind)
        return out.view(torch.uint8)

    def _decode(self, codes: Tensor, dtype: torch.dtype, out: Tensor | None) -> Tensor:
        try:  # a strided slice of whole rows reinterprets in place; the cast is the only copy
            vals = codes.view(FLOAT_KINDS[self.spec.kind])
        except RuntimeError:
            vals = codes.contiguous().view(FLOAT_KINDS[self.spec.kind])
        return vals.to(dtype, copy=True) if out is None else out.copy_(vals)  # never a view of the cache


class IntCodec(RowCodec):
    """int8 / int4, symmetric or asymmetric, with one FP16 scale (and FP16 lo) per group of channels."""

    @property
    def qmax(self) -> int:
        """Largest positive code (127 / 7); symmetric codes run -(qmax+1)..qmax, asymmetric ones 0..2*qmax+1."""
        return (1 << (self.spec.bits - 1)) - 1

    @property
    def scale_factors(self) -> tuple[float, ...]:
        """Shrink factors of the symmetric scale search: `SCALE_FACTORS[kind]`."""
        return SCALE_FACTORS[self.spec.kind]

    def _encode_rows(self, x: Tensor) -> Tensor:
        lay = self.layout
        x32 = x.float()
        xg = self._clip(x32).reshape(-1, lay.n_groups, lay.group_size)  # [N, G, g]
        if self.spec.symmetric:
            q, scale = symmetric_codes(xg, self.qmax, self.scale_factors)
            params = [scale]
        else:
            levels = 2 * self.qmax + 1
            lo = _fp16_round(xg.amin(-1), up=False)
            scale = _fp16_round((xg.amax(-1) - lo) / levels, up=True)
            safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
            q = torch.clamp(torch.round((xg - lo.unsqueeze(-1)) / safe), 0, levels)
            params = [scale, lo]
        p = torch.stack(params, 0)
        bad_in, bad_out = torch.stack([~torch.isfinite(x32).all(), ~torch.isfinite(p).all()]).tolist()
        self._raise_if(bad_in, bad_out, "group range exceeds the FP16 range of scales/zero points")
        codes = self._pack(q.view(-1, lay.width))
        tail = [t.to(torch.float16).view(torch.uint8) for t in params]  # [N, 2G] each, little-endian
        return torch.cat([codes, *tail], dim=1)

    def _pack(self, q: Tensor) -> Tensor:
        """Integer-valued float codes [N, W] → code bytes [N, code_bytes]."""
        if self.spec.kind == "int8":
            return q.to(torch.int8).view(torch.uint8) if self.spec.symmetric else q.to(torch.uint8)
        nib = (q + 8 if self.spec.symmetric else q).to(torch.uint8).view(-1, self.width // 2, 2)
        return nib[..., 0] | (nib[..., 1] << 4)

    def _unpack(self, codes: Tensor, out: Tensor | None = None) -> Tensor:
        """Code bytes [N, code_bytes] (rows may be strided) → float32 codes [N, W] (signed for symmetric),
        written into `out` [N, W] when given, else into one new tensor: decode scales it in place."""
        if self.spec.kind == "int8":
            signed = codes.view(torch.int8) if self.spec.symmetric else codes
            return signed.float() if out is None else out.copy_(signed)
        if out is None:
            out = torch.empty(codes.shape[0], self.width, device=codes.device)
        nib = out.view(-1, self.width // 2, 2)
        nib[..., 0] = codes & 0x0F
        nib[..., 1] = codes >> 4
        return out.sub_(8) if self.spec.symmetric else out

    def _decode(self, codes: Tensor, dtype: torch.dtype, out: Tensor | None) -> Tensor:
        lay = self.layout
        lead = codes.shape[:-1]
        codes = codes.reshape(-1, lay.row_bytes)
        flat = None if out is None else out.view(-1, lay.width)
        x = self._unpack(codes[:, : lay.code_bytes], flat).view(-1, lay.n_groups, lay.group_size)
        scale = packed_as(codes[:, lay.scale_offset : lay.scale_offset + 2 * lay.n_groups], torch.float16)
        x.mul_(scale.float().unsqueeze(-1))
        if lay.zero_offset is not None:
            lo = packed_as(codes[:, lay.zero_offset : lay.zero_offset + 2 * lay.n_groups], torch.float16)
            x.add_(lo.float().unsqueeze(-1))
        return x.view(-1, lay.width).to(dtype).reshape(*lead, lay.width) if out is None else out


def symmetric_codes(xg: Tensor, qmax: int, factors: tuple[float, ...]) -> tuple[Tensor, Tensor]:
    """Symmetric codes and signed FP16 scales of groups xg fp32 [N, G, g] (module docstring, "symmetric"):
    (q fp32 [N, G, g] in [-(qmax+1), qmax], s fp32 [N, G], FP16 values). Candidates per group: the signed
    extreme e on code -(qmax+1) (q4_0's orientation: s has the opposite sign of e) with |s| = fp16_up(|e| · f
    / (qmax+1)) for f in `factors`; the one with the least Σ (q·s − x)² wins (the first on ties). The
    candidates are scored together, `SEARCH_ROWS` rows at a time."""
    n_neg = qmax + 1
    ext = xg.gather(-1, xg.abs().argmax(-1, keepdim=True))  # [N, G, 1] signed extreme
    f = torch.tensor(factors, dtype=torch.float32, device=xg.device)
    magnitude = _fp16_round(ext.abs() * f / n_neg, up=True)  # [N, G, F]
    s = torch.where(magnitude > 0, magnitude * torch.where(ext > 0, -1.0, 1.0), 0.0)  # all-zero group: s = +0
    if len(factors) > 1:
        best = torch.cat([_least_error(xg[i : i + SEARCH_ROWS], s[i : i + SEARCH_ROWS], -n_neg, qmax)
                          for i in range(0, xg.shape[0], SEARCH_ROWS)])
        s = s.gather(-1, best.unsqueeze(-1))
    s = s.squeeze(-1)  # [N, G]
    return _codes(xg, s, -n_neg, qmax, torch.empty_like(xg)), s


SEARCH_ROWS = 4096  # rows per batch of the scale search: [4096, G, F, g] fp32, 25 MB for 160 channels, 11 factors


def _least_error(xg: Tensor, s: Tensor, lo: int, hi: int) -> Tensor:
    """Index [N, G] of the candidate scale s [N, G, F] with the least Σ_g (clamp(round(x / s), lo, hi)·s − x)²
    over each group xg [N, G, g] (the first on ties)."""
    x = xg.unsqueeze(2)  # [N, G, 1, g]
    sc = s.unsqueeze(-1)  # [N, G, F, 1]
    q = torch.div(x, torch.where(sc != 0, sc, torch.ones_like(sc))).round_().clamp_(lo, hi)
    return q.mul_(sc).sub_(x).square_().sum(-1).argmin(-1)


def _codes(xg: Tensor, s: Tensor, lo: int, hi: int, out: Tensor) -> Tensor:
    """clamp(round(xg / s), lo, hi) for groups xg [N, G, g] and scales s [N, G] (s = 0: codes 0), into `out`."""
    safe = torch.where(s != 0, s, torch.ones_like(s)).unsqueeze(-1)
    return torch.div(xg, safe, out=out).round_().clamp_(lo, hi)


class Fp8Codec(RowCodec):
    """e4m3 codes: `fp8` with one static FP32 scale per layer (`fp8_scale`, not stored in the row), or
    `fp8-g<N>` with a dynamic FP16 scale per group (`fp8_scale` None). A static part's clip bounds set
    only its scale; `clip_lo` / `clip_hi` then report its saturation range ±448·s."""

    def __init__(
        self, layout: PartLayout, clip_lo: Tensor | None, clip_hi: Tensor | None, fp8_scale: float | None
    ) -> None:
        super().__init__(layout, clip_lo, clip_hi)
        self.fp8_scale = None
        if not self.spec.is_static_fp8:
            return
        if fp8_scale is None:
            fp8_scale = 1.0 if self.clip_lo is None else fp8_static_scale(self.clip_lo, self.clip_hi)
        if not (isinstance(fp8_scale, (int, float)) and math.isfinite(fp8_scale) and fp8_scale > 0):
            raise CodecError(f"codec fp8: static scale must be a finite float > 0, got {fp8_scale!r}")
        self.fp8_scale = float(torch.tensor(fp8_scale, dtype=torch.float32, device="cpu"))
        # a codec's constants live on the CPU; `_clip` moves them to the rows' device
        bound = torch.full((self.width,), FP8_MAX * self.fp8_scale, device="cpu")
        self.clip_lo, self.clip_hi = -bound, bound

    def _repr_extra(self) -> str:
        return super()._repr_extra() if self.fp8_scale is None else f", scale={self.fp8_scale:.6g}"

    def _encode_rows(self, x: Tensor) -> Tensor:
        """[N, W] float → uint8 [N, row_bytes] (e4m3 codes, then FP16 scales for fp8-g<N>)."""
        lay = self.layout
        x32 = x.float()
        if self.fp8_scale is not None:
            q = torch.clamp(x32 / self.fp8_scale, -FP8_MAX, FP8_MAX)  # saturate, as engines do
            bad_in = bool(~torch.isfinite(x32).all())
            self._raise_if(bad_in, False, "")
            return q.to(torch.float8_e4m3fn).view(torch.uint8)
        xg = self._clip(x32).reshape(-1, lay.n_groups, lay.group_size)  # [N, G, g]
        scale = _fp16_round(xg.abs().amax(-1) / FP8_MAX, up=True)  # [N, G]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        q = torch.clamp(xg / safe, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        bad_in, bad_out = torch.stack([~torch.isfinite(x32).all(), ~torch.isfinite(scale).all()]).tolist()
        self._raise_if(bad_in, bad_out, "group range exceeds the FP16 range of scales")
        tail = scale.to(torch.float16).view(torch.uint8)  # [N, 2G], little-endian
        return torch.cat([q.view(-1, lay.width), tail], dim=1)

    def _decode(self, codes: Tensor, dtype: torch.dtype, out: Tensor | None) -> Tensor:
        lay = self.layout
        lead = codes.shape[:-1]
        codes = codes.reshape(-1, lay.row_bytes)
        q = codes[:, : lay.code_bytes].contiguous().view(torch.float8_e4m3fn).float()  # [N, W]
        if self.fp8_scale is not None:
            x = q * self.fp8_scale
        else:
            scale = packed_as(codes[:, lay.scale_offset : lay.scale_offset + 2 * lay.n_groups], torch.float16)
            x = (q.view(-1, lay.n_groups, lay.group_size) * scale.float().unsqueeze(-1))
        x = x.view(-1, lay.width).reshape(*lead, lay.width)
        return x.to(dtype) if out is None else out.copy_(x)


class BandCodec(RowCodec):
    """A part in channel bands of 8/4/3/2/0 bits (`mlaquant.quant.band_codecs`: packing): each band of > 0 bits
    symmetric with every level and one FP16 scale per row, as `symmetric_codes` encodes a group (shrink
    factors of int4 up to 4 bits, of int8 above); a 0-bit band decodes to zeros. Clip bounds are applied to the
    values before each band's range is taken, as for `IntCodec`."""

    def _encode_rows(self, x: Tensor) -> Tensor:
        x32 = self._clip(x.float())
        self._raise_if(not bool(torch.isfinite(x32).all()), False, "")
        codes, scales, start = [], [], 0
        for bits, w in self.spec.bands:
            band, start = x32[:, start : start + w], start + w
            if not bits:
                continue
            kind = "int8" if bits > 4 else "int4"
            q, s = symmetric_codes(band.unsqueeze(1), (1 << (bits - 1)) - 1, SCALE_FACTORS[kind])
            self._raise_if(False, not bool(torch.isfinite(s).all()), "band range exceeds the FP16 range of scales")
            u = q.squeeze(1).to(torch.int16) + (0 if bits == 8 else 1 << (bits - 1))
            codes.append(band_codecs.pack(u.to(torch.int8).view(torch.uint8) if bits == 8 else u.to(torch.uint8), bits))
            scales.append(s)
        if not scales:  # every band 0 bits: nothing is stored
            return torch.empty(len(x32), 0, dtype=torch.uint8, device=x32.device)
        return torch.cat([*codes, torch.cat(scales, 1).to(torch.float16).view(torch.uint8)], dim=1)

    def _decode(self, codes: Tensor, dtype: torch.dtype, out: Tensor | None) -> Tensor:
        lay = self.layout
        lead = codes.shape[:-1]
        rows = codes.reshape(math.prod(lead), lay.row_bytes)
        scales = packed_as(rows[:, lay.code_bytes :], torch.float16).float() if lay.n_groups else None
        x = torch.zeros(rows.shape[0], lay.width, device=rows.device) if out is None else out.view(-1, lay.width)
        offset, start, k = 0, 0, 0
        for bits, w in self.spec.bands:
            if bits:
                u = band_codecs.unpack(rows[:, offset : offset + bits * w // 8], bits, w)
                q = u.view(torch.int8).float() if bits == 8 else u.float() - (1 << (bits - 1))
                x[:, start : start + w] = q * scales[:, k : k + 1]
                offset, k = offset + bits * w // 8, k + 1
            else:
                x[:, start : start + w] = 0.0
            start += w
        return x.view(*lead, lay.width).to(dtype) if out is None else out


class EngineCodec(RowCodec):
    """One part stored as another engine's cache format (`mlaquant.quant.engine_codecs`, kinds `ENGINE_KINDS`):
    `layout.n_groups` groups of `layout.group_size` values, codes at byte 0, then one scale per group. Clip
    bounds are kept for `clip_rate` but never applied: engines do not clip."""

    def _encode_rows(self, x: Tensor) -> Tensor:
        x32 = x.float()
        self._raise_if(not bool(torch.isfinite(x32).all()), False, "")
        return engine_codecs.ENCODERS[self.spec.kind](x32.view(-1, self.layout.n_groups or 1, self.layout.group_size))

    def _decode(self, codes: Tensor, dtype: torch.dtype, out: Tensor | None) -> Tensor:
        lay = self.layout
        lead = codes.shape[:-1]
        rows = codes.reshape(-1, lay.row_bytes)
        x = engine_codecs.DECODERS[self.spec.kind](rows, lay.n_groups or 1, lay.group_size).reshape(*lead, lay.width)
        return x.to(dtype) if out is None else out.copy_(x)


def packed_as(raw: Tensor, dtype: torch.dtype) -> Tensor:
    """Bytes uint8 [N, k·itemsize] at any offset and stride → a fresh dense copy viewed as `dtype` [N, k]."""
    return torch.empty(raw.shape, dtype=torch.uint8, device=raw.device).copy_(raw).view(dtype)


def _relative_error(xq: Tensor, x: Tensor, reduction: str) -> Tensor | float:
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    x32 = x.float()
    err = torch.linalg.vector_norm(xq.float() - x32, dim=-1)
    norm = torch.linalg.vector_norm(x32, dim=-1)
    rel = torch.where(norm > 0, err / torch.where(norm > 0, norm, torch.ones_like(norm)), err)
    return rel if reduction == "none" else rel.mean().item()


class LayerCodec(_LaidOut):
    """One layer's row = [c_kv part | k_pe part], concatenated bytes; `layout` (a `RowLayout`) places
    the parts (k_pe part at byte `layout.kpe_offset`)."""

    def __init__(self, ckv: RowCodec, kpe: RowCodec) -> None:
        self.ckv, self.kpe = ckv, kpe
        self.layout = RowLayout(ckv.layout, kpe.layout)

    @staticmethod
    def from_names(
        ckv: str | CodecSpec,
        kpe: str | CodecSpec,
        d_c: int,
        d_r: int,
        clip_lo: Tensor | None = None,
        clip_hi: Tensor | None = None,
        fp8_scale: float | None = None,
    ) -> LayerCodec:
        """Build from codec names; `clip_lo`/`clip_hi` are per-channel bounds over the whole row [d_c + d_r]
        (use ±inf for channels that should not be clipped). Static `fp8` parts share one scale: `fp8_scale`
        if given, else absmax of their bounds / 448, else 1.0."""
        specs = [s if isinstance(s, CodecSpec) else CodecSpec.parse(s) for s in (ckv, kpe)]
        # a group at least as wide as the part is the whole row ("int8" = int8-g64 on a 32-wide k_pe);
        # for fp8 that is a group of exactly the part's width (no group size means the static scale)
        specs = [
            replace(s, group_size=w if s.kind == FP8 else None)
            if s.group_size is not None and s.group_size >= w and not s.is_engine
            else s
            for s, w in zip(specs, (d_c, d_r))
        ]
        for name, t in (("clip_lo", clip_lo), ("clip_hi", clip_hi)):
            if t is not None and tuple(t.shape) != (d_c + d_r,):
                raise CodecError(f"layer codec: {name} must have shape [{d_c + d_r}], got {list(t.shape)}")
        part = lambda t, sl: None if t is None else t[sl]
        c, r = slice(0, d_c), slice(d_c, d_c + d_r)
        static = [sl for s, sl in zip(specs, (c, r)) if s.is_static_fp8]
        if static and fp8_scale is None and (clip_lo is not None or clip_hi is not None):
            fp8_scale = fp8_static_scale(*(torch.cat([t[sl] for sl in static]) for t in (clip_lo, clip_hi)))
        return LayerCodec(
            RowCodec.build(specs[0], d_c, part(clip_lo, c), part(clip_hi, c), fp8_scale),
            RowCodec.build(specs[1], d_r, part(clip_lo, r), part(clip_hi, r), fp8_scale),
        )

    @property
    def name(self) -> str:
        """'<ckv>/<kpe>', e.g. 'int4-g32/int8-g32'."""
        return f"{self.ckv.spec.name}/{self.kpe.spec.name}"

    def __repr__(self) -> str:
        dims = f"d_c={self.ckv.width}, d_r={self.kpe.width}"
        return f"LayerCodec({self.name}, {dims}, row_bytes={self.row_bytes})"

    def _check_rows(self, rows: Tensor) -> None:
        if rows.shape[-1:] != (self.width,):
            shape = list(rows.shape)
            raise ValueError(f"layer codec {self.name}: expected rows [..., {self.width}], got {shape}")

    def encode(self, rows: Tensor) -> Tensor:
        """[..., d_c + d_r] float → uint8 [..., row_bytes]."""
        self._check_rows(rows)
        c_kv, k_pe = rows.split([self.layout.ckv.width, self.layout.kpe.width], dim=-1)
        return torch.cat([self.ckv.encode(c_kv), self.kpe.encode(k_pe)], dim=-1)

    def decode(self, codes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """uint8 [..., row_bytes] → [..., d_c + d_r] in `dtype`."""
        return torch.cat(self.decode_parts(codes, dtype), dim=-1)

    def decode_parts(
        self, codes: Tensor, dtype: torch.dtype = torch.float32, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """uint8 [..., row_bytes] → (c_kv [..., d_c], k_pe [..., d_r]) in `dtype`, never concatenated;
        written into `out` (two float32 buffers of those shapes) when given."""
        if codes.shape[-1:] != (self.row_bytes,):
            shape = list(codes.shape)
            raise ValueError(f"layer codec {self.name}: expected [..., {self.row_bytes}] bytes, got {shape}")
        c, r = codes.split([self.layout.kpe_offset, self.layout.kpe.row_bytes], dim=-1)
        c_out, r_out = (None, None) if out is None else out
        return self.ckv.decode(c, dtype, c_out), self.kpe.decode(r, dtype, r_out)

    def fake_quant(self, rows: Tensor) -> Tensor:
        """decode(encode(rows)) in rows' dtype."""
        return self.decode(self.encode(rows), dtype=rows.dtype)

    def clip_rate(self, rows: Tensor) -> float:
        """Fraction of the values of rows [..., d_c + d_r] outside the calibrated clip bounds."""
        self._check_rows(rows)
        c_kv, k_pe = rows.split([self.layout.ckv.width, self.layout.kpe.width], dim=-1)
        n_c, n_r = c_kv.numel(), k_pe.numel()
        if n_c + n_r == 0:
            return 0.0
        return (self.ckv.clip_rate(c_kv) * n_c + self.kpe.clip_rate(k_pe) * n_r) / (n_c + n_r)

    def relative_error(self, rows: Tensor, reduction: str = "mean") -> Tensor | float:
        """||fake_quant(rows) - rows|| / ||rows|| over whole rows, per row ('none') or mean."""
        self._check_rows(rows)
        return _relative_error(self.fake_quant(rows), rows, reduction)


def split_pair(name: str) -> tuple[str, str]:
    """'<ckv>/<kpe>' → (ckv, kpe); a single name is both parts ('int8' → ('int8', 'int8')). Names are not
    parsed here (`CodecSpec.parse` does that); more than one '/' → CodecError."""
    ckv, slash, kpe = name.partition("/")
    if "/" in kpe or not ckv or (slash and not kpe):
        raise CodecError(f"codec pair {name!r}: expected '<ckv>/<kpe>' or one codec name")
    return ckv, kpe or ckv


def fp8_static_scale(lo: Tensor | None, hi: Tensor | None) -> float:
    """The static e4m3 scale for values within [lo, hi] (per-channel bounds, either may be None):
    absmax / 448 in FP32, or 1.0 when the bounds are all zero."""
    absmax = max(float(t.detach().abs().max()) if t is not None and t.numel() else 0.0 for t in (lo, hi))
    if not math.isfinite(absmax):
        raise CodecError(f"codec fp8: calibrated bounds are not finite (absmax {absmax})")
    if absmax == 0.0:
        return 1.0
    return float(torch.tensor(absmax, dtype=torch.float32, device="cpu") / FP8_MAX)


def bits_per_value(codec: LayerCodec | RowCodec) -> float:
    """Stored bits per cached value, scales and zero points included: 8 * row_bytes / width."""
    return 8.0 * codec.row_bytes / codec.width
