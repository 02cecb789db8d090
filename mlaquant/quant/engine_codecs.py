"""The quantizers of other engines' latent caches, reproduced (`mlaquant.quant.codecs.EngineCodec` stores a part with
them), so their cache settings can be priced
on the user's model (`mlaquant engines`, the sweep's engine rows). Values are bit-exact with each engine's
quantizer (source below); the bytes per row are the engine's, laid out the mlaquant way (codes at byte 0,
then one scale per group), not in the engine's byte order.

    kind     engine setting it reproduces (part)                         per group of G     bytes for W
    e4m3     vLLM / SGLang `fp8` at k_scale 1.0 (both parts);             -                  W
             vLLM `nvfp4_ds_mla` RoPE part
    fp8-ds   vLLM `fp8_ds_mla` c_kv part: e4m3, FP32 power-of-two scale    G = 128, 4 B       W + 4·W/128
    nvfp4    vLLM `nvfp4_ds_mla` c_kv part: e2m1, e4m3 scale               G = 16, 1 B        W/2 + W/16
    mxfp4    SGLang FP4 MLA pool (`nvfp4`, `fp4_mx_block16`): e2m1, UE8M0  G = 16, 1 B        W/2 + W/16
    q8_0     llama.cpp `-ctk q8_0`: int8, FP16 scale                       G = 32, 2 B        W + W/16
    q4_0     llama.cpp `-ctk q4_0`: int4, FP16 scale                       G = 32, 2 B        W/2 + W/16

Rules (x a group, FP32 arithmetic in the order written; e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6):
    e4m3    q = e4m3_rne(clamp(x, ±448)). vLLM `concat_and_cache_mla` with skip_scale (k_scale 1.0, the
            scale vLLM 0.33.0 runs MLA with: docs/engines.md), the Triton mirror in
            vllm/models/deepseek_v32/common/kernels.py `_fused_norm_rope_kernel` (MLA_CACHE_FP8); SGLang
            `MLATokenToKVPool.set_kv_buffer` (a plain cast).
    fp8-ds  s = 2^ceil(log2(max(amax · fp32(1/448), 1e-4))), q = e4m3_rne(x / s): the same file, branch
            MLA_CACHE_DS_MLA (the wheel's Triton writer; vLLM's CUDA `concat_and_cache_ds_mla`, not in the
            wheel, may store amax/448 unrounded — it decodes the same way).
    nvfp4   sf = e4m3_rne(max(amax · fp32(1/6), 2^-9)), q = e2m1_rne_satfinite(x · fp32(1/sf)): the same file,
            branch MLA_CACHE_NVFP4 (inline PTX cvt.rn.satfinite.e2m1x2: ties to the even code).
    mxfp4   e = ceil(log2(max(amax / 6, 1e-10))), stored e + 127, q = e2m1 by thresholds ≥ (ties up in
            magnitude) of x / 2^e: SGLang `FP4MXBlock16KVQuantizeUtil.batched_quantize`
            (sglang/srt/layers/quantization/kvfp4_tensor.py), executed in tests/test_engine_codecs.py.
    q8_0    d = amax / 127, q = roundf(x · (1/d)) (halves away from zero), d stored FP16 (RNE):
            ggml `quantize_row_q8_0_ref`; gguf-py `Q8_0.quantize_blocks`, executed in the tests.
    q4_0    m = the value of largest magnitude (first on ties), d = m / −8, q = min(15, trunc(x · (1/d) + 8.5)),
            x̂ = (q − 8) · fp16(d): ggml `quantize_row_q4_0_ref`; gguf-py `Q4_0.quantize_blocks`, executed.
Engine kernels compute some of these on the GPU with approximate log2 / division: a group whose amax sits
exactly on a power-of-two boundary may get the neighbouring scale there.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0  # largest finite e4m3fn value
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# e2m1 decision points between neighbouring magnitudes, and whether a tie goes up: round-to-nearest-even goes
# to the even code (nvfp4), SGLang's thresholds always go up (mxfp4)
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
RNE_TIE_UP = (False, True, False, True, False, True, False)


def e2m1_codes(x: Tensor, ties_up: bool) -> Tensor:
    """x fp32 (already scaled) → e2m1 codes uint8 (bit 3 sign, bits 0-2 magnitude index), saturating at 6:
    ties to the even code, or always up with `ties_up` (SGLang's `>=` thresholds)."""
    a = x.abs()
    idx = torch.zeros_like(a, dtype=torch.uint8)
    for bound, up in zip(E2M1_BOUNDS, RNE_TIE_UP):
        idx += (a >= bound) if (ties_up or up) else (a > bound)
    return idx | ((x < 0).to(torch.uint8) << 3)


def e2m1_values(codes: Tensor) -> Tensor:
    """e2m1 codes uint8 → fp32 values."""
    table = torch.tensor(E2M1, device=codes.device)
    v = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -v, v)


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 [N, W] nibbles → [N, W/2] bytes, element 2j in the low nibble of byte j."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """[N, W/2] bytes → uint8 [N, W] nibbles (element 2j from the low nibble of byte j)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def roundf(x: Tensor) -> Tensor:
    """C's roundf: nearest, halves away from zero."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def pow2_ceil(y: Tensor) -> Tensor:
    """2^ceil(log2(y)) for y > 0, exactly (from the binary exponent, not a rounded logarithm)."""
    mantissa, exponent = torch.frexp(y)  # y = m · 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(y), exponent - (mantissa == 0.5).to(exponent.dtype))


def _cat(codes: Tensor, scales: Tensor) -> Tensor:
    """codes uint8 [N, c] and per-group scales [N, G] (any dtype, viewed as bytes) → rows uint8 [N, c + ...]."""
    return torch.cat([codes, scales.contiguous().view(torch.uint8).view(codes.shape[0], -1)], dim=1)


def _scales(rows: Tensor, code_bytes: int, dtype: torch.dtype, groups: int) -> Tensor:
    """The per-group scales stored after the codes → [N, G] in `dtype`."""
    raw = rows[:, code_bytes:]  # a dense copy: the scales may sit at any byte offset and row stride
    return torch.empty(raw.shape, dtype=torch.uint8, device=raw.device).copy_(raw).view(dtype).view(-1, groups)


def _encode_e4m3(xg: Tensor) -> Tensor:
    return xg.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).view(xg.shape[0], -1)


def _decode_e4m3(rows: Tensor, groups: int, g: int) -> Tensor:
    return rows.contiguous().view(torch.float8_e4m3fn).float()


def _encode_fp8_ds(xg: Tensor) -> Tensor:
    amax = xg.abs().amax(-1)
    s = pow2_ceil(torch.clamp_min(amax * torch.tensor(1.0 / FP8_MAX), 1e-4))  # [N, G] fp32
    q = (xg / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return _cat(q.view(xg.shape[0], -1), s)


def _decode_fp8_ds(rows: Tensor, groups: int, g: int) -> Tensor:
    q = rows[:, : groups * g].contiguous().view(torch.float8_e4m3fn).float().view(-1, groups, g)
    return q * _scales(rows, groups * g, torch.float32, groups).unsqueeze(-1)


def _encode_nvfp4(xg: Tensor) -> Tensor:
    amax = xg.abs().amax(-1)
    sf = torch.clamp_min(amax * torch.tensor(1.0 / 6.0), 2.0**-9).to(torch.float8_e4m3fn)  # [N, G]
    q = e2m1_codes(xg * (1.0 / sf.float()).unsqueeze(-1), ties_up=False)
    return _cat(pack_nibbles(q.view(xg.shape[0], -1)), sf.view(torch.uint8))


def _decode_nvfp4(rows: Tensor, groups: int, g: int) -> Tensor:
    v = e2m1_values(unpack_nibbles(rows[:, : groups * g // 2])).view(-1, groups, g)
    sf = rows[:, groups * g // 2 :].contiguous().view(torch.float8_e4m3fn).float()
    return v * sf.unsqueeze(-1)


def _encode_mxfp4(xg: Tensor) -> Tensor:
    amax = xg.abs().amax(-1, keepdim=True)
    e = torch.ceil(torch.log2(torch.clamp(amax / 6.0, min=1e-10)))  # [N, G, 1]
    q = e2m1_codes(xg / torch.exp2(e), ties_up=True)
    return _cat(pack_nibbles(q.view(xg.shape[0], -1)), (e + 127).squeeze(-1).to(torch.uint8))


def _decode_mxfp4(rows: Tensor, groups: int, g: int) -> Tensor:
    v = e2m1_values(unpack_nibbles(rows[:, : groups * g // 2])).view(-1, groups, g)
    e = rows[:, groups * g // 2 :].float() - 127
    return v * torch.exp2(e).unsqueeze(-1)


def _encode_q8_0(xg: Tensor) -> Tensor:
    d = xg.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = roundf(xg * inv).to(torch.int8).view(torch.uint8)
    return _cat(q.view(xg.shape[0], -1), d.squeeze(-1).to(torch.float16))


def _decode_q8_0(rows: Tensor, groups: int, g: int) -> Tensor:
    q = rows[:, : groups * g].view(torch.int8).float().view(-1, groups, g)
    return q * _scales(rows, groups * g, torch.float16, groups).float().unsqueeze(-1)


def _encode_q4_0(xg: Tensor) -> Tensor:
    m = xg.gather(-1, xg.abs().argmax(-1, keepdim=True))  # [N, G, 1], the first largest on ties
    d = m / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(xg * inv + 8.5).clamp(0, 15).to(torch.uint8)
    return _cat(pack_nibbles(q.view(xg.shape[0], -1)), d.squeeze(-1).to(torch.float16))


def _decode_q4_0(rows: Tensor, groups: int, g: int) -> Tensor:
    q = unpack_nibbles(rows[:, : groups * g // 2]).float().view(-1, groups, g)
    return (q - 8) * _scales(rows, groups * g // 2, torch.float16, groups).float().unsqueeze(-1)


# kind → x fp32 [N, G, g] → rows uint8 [N, row_bytes]; and rows, G, g → values fp32 [N, G, g]
ENCODERS = {"e4m3": _encode_e4m3, "fp8-ds": _encode_fp8_ds, "nvfp4": _encode_nvfp4, "mxfp4": _encode_mxfp4,
            "q8_0": _encode_q8_0, "q4_0": _encode_q4_0}
DECODERS = {"e4m3": _decode_e4m3, "fp8-ds": _decode_fp8_ds, "nvfp4": _decode_nvfp4, "mxfp4": _decode_mxfp4,
            "q8_0": _decode_q8_0, "q4_0": _decode_q4_0}
