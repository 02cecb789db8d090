"""W8A8 absorbed projections: the layers a plan marks `int8_matmul` run q_nope·W_UK, W_UV and o_proj in INT8.

Absorbed MLA decode multiplies each head's query by W_UK and each head's latent output by W_UV before
o_proj. With `int8_matmul` on, these three products are W8A8 GEMMs (the `mlaquant.kernels.int8_gemm`
arithmetic, no outlier columns):

    activations  per row, on the fly: x8 = round(x · 127 / absmax(row)), s_x = absmax / 127
                 (a row is one (token, head) for W_UK and W_UV, one token for o_proj)
    weights      per output channel, once: w8 = round(w · 127 / absmax), s_w = absmax / 127
    product      exact INT32 sums, FP32 epilogue s_x · s_w · Σ x8·w8, returned in the activation dtype

Per head h, weights in nn.Linear layout [out, in]:

    q_abs[..., h, :d_c] = W8A8(q_nope[..., h, :], W_UK[h]^T  [d_c, d_n])
    o[..., h, :]        = W8A8(o_lat[..., h, :],  W_UV[h]    [d_v, d_c])
    out[...]            = W8A8(o[...].flatten(),  o_proj.weight [hidden, H·d_v]) + o_proj.bias

The weights are quantized from the layer as given, i.e. after a plan's latent rotation is folded into
kv_b_proj. One product's error bound is `int8_gemm`'s (its docstring); the effect on the model is measured
like a cache codec's: by the calibration search (`int8_matmul` in configs/calibrate.yaml, which turns it
off again layer by layer while the plan is over budget) and by the sweep.

Backends: "torch" sums the INT8 products exactly in FP64, batched over heads; "cpu" runs them as real
int8 x int8 -> int32 GEMMs, exact as long as K · 127² < 2^31 (K ≤ 133 144; longer rows fall back to the FP64
sums), so its results are bit-identical to "torch": activation codes, every head's sums and the epilogue in
one call of the C kernels (`mlaquant.attention.native` `w8a8` on weights packed once per layer: avx2 maddubs +
madd with the sign trick, or VNNI) where a vector ISA variant is built,
else `torch._int_mm` per head where torch's int8 GEMM has VNNI (without it slower than an FP32 GEMM:
docs/cpu.md), else the FP64 sums; "triton" runs every head in one launch (`int8_gemm_grouped`; CUDA, or CPU
under TRITON_INTERPRET=1); "auto" picks triton on CUDA and cpu on CPU.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from mlaquant.attention import backends, native
from mlaquant.modeling.model import MLAAttention, MLAModel, shallow_copy
from mlaquant.quant.int8_quant import OUT_DTYPES, quantize_activation, quantize_weight_per_channel

INT32_EXACT_K = (2**31 - 1) // 127**2 + 1  # below this many products an INT32 sum of int8 x int8 cannot overflow


def quantize_grouped(w: Tensor) -> tuple[Tensor, Tensor]:
    """[G, N, K] float → (codes int8 [G, N, K], scales fp32 [G, N]), per output channel of each group."""
    codes, scales = zip(*(quantize_weight_per_channel(g) for g in w.detach()))
    return torch.stack(codes), torch.stack(scales)


class Int8Weight:
    """A grouped W8A8 weight: codes int8 [G, N, K] in ±127 and scales fp32 [G, N] per output channel of each group.
    On the CPU its C route packs the codes once (`native.pack_w8`, about the codes' size again) and keeps the
    kernel variant of its first call, so a decode step pays one C call, not a pack and a lookup."""

    def __init__(self, codes: Tensor, scale: Tensor) -> None:
        self.codes, self.scale = codes, scale
        self._native: tuple[native.Kernels, native.PackedW8] | None = None

    @classmethod
    def quantized(cls, w: Tensor) -> Int8Weight:
        """The codes of float w [G, N, K] (`quantize_grouped`)."""
        return cls(*quantize_grouped(w))

    def __call__(self, x: Tensor, backend: str = "auto") -> Tensor:
        """x [..., G, K] float → [..., G, N]: row m of group g gives s_x[m, g] · scale[g, n] · Σ_k x8[m, g, k] ·
        codes[g, n, k], in x's dtype (FP32 for other dtypes)."""
        lead, (g, k), n = x.shape[:-2], x.shape[-2:], self.codes.shape[1]
        out_dtype = x.dtype if x.dtype in OUT_DTYPES else torch.float32
        if x.device.type == "cpu" and backend in ("auto", "cpu") and k < INT32_EXACT_K:
            fast = self._native if self._native is not None else self._prepare()
            if fast:  # one C call: activation codes, exact INT32 sums and the epilogue
                return fast[0].w8a8(x.reshape(-1, g, k).float().contiguous(), fast[1]).view(*lead, g, n).to(out_dtype)
        return self._without_native(x, backend, out_dtype)

    def _prepare(self) -> tuple[native.Kernels, native.PackedW8] | tuple[()]:
        """The vector kernels and the packed codes, kept; () where no vector variant is built (not kept: a later
        build may bring one)."""
        kern = native.vector_kernels()
        if kern is None:
            return ()
        self._native = (kern, native.pack_w8(self.codes, self.scale.float()))
        return self._native

    def _without_native(self, x: Tensor, backend: str, out_dtype: torch.dtype) -> Tensor:
        """The routes other than the C kernels: triton, torch's int8 GEMM where it has VNNI, the exact FP64 sums."""
        lead, (g, k) = x.shape[:-2], x.shape[-2:]
        resolved = backends.resolve_backend(backend, x.device, "int8_gemm_grouped")
        if resolved is backends.Backend.TRITON:
            return backends.load_kernel("int8_gemm_grouped")(x, self.codes, self.scale, out_dtype)
        x8, sx, _ = quantize_activation(x.reshape(-1, k))
        x8 = x8.view(-1, g, k)
        if resolved is backends.Backend.CPU and k < INT32_EXACT_K and backends.torch_int8_vnni():
            acc = int_mm_sums(x8, self.codes).transpose(0, 1).float()
        else:
            acc = torch.einsum("mgk,gnk->mgn", x8.double(), self.codes.double()).float()  # exact sums
        y = acc * sx.view(-1, g, 1) * self.scale
        return y.to(out_dtype).reshape(*lead, g, self.codes.shape[1])


def grouped_int8_matmul(x: Tensor, w_int8: Tensor, w_scale: Tensor, backend: str = "auto") -> Tensor:
    """W8A8 product per group: x [..., G, K] float, w_int8 [G, N, K], w_scale [G, N] → [..., G, N] (`Int8Weight`
    of these codes, packed for this one call on the C route)."""
    return Int8Weight(w_int8, w_scale)(x, backend)


def int_mm_sums(x8: Tensor, w_int8: Tensor) -> Tensor:
    """Exact INT32 sums [G, M, N] of x8 int8 [M, G, K] with w_int8 int8 [G, N, K] (K < INT32_EXACT_K): one
    `torch._int_mm` per group."""
    acc = torch.empty(w_int8.shape[0], x8.shape[0], w_int8.shape[1], dtype=torch.int32, device=x8.device)
    for i in range(w_int8.shape[0]):
        torch._int_mm(x8[:, i], w_int8[i].t(), out=acc[i])
    return acc


@dataclasses.dataclass
class Int8Projections:
    """One layer's absorbed projections as INT8 codes + FP32 per-output-channel scales."""

    w_uk: Int8Weight  # [H, d_c, d_n]
    w_uv: Int8Weight  # [H, d_v, d_c]
    w_o: Int8Weight  # [1, hidden, H·d_v]
    o_bias: Tensor | None  # [hidden]
    backend: str = "auto"

    @classmethod
    def of(cls, attn: MLAAttention, backend: str = "auto") -> Int8Projections:
        w_uk, w_uv = attn._w_uk_uv()  # [H, d_n, d_c], [H, d_v, d_c]
        bias = attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None
        return cls(Int8Weight.quantized(w_uk.transpose(1, 2)), Int8Weight.quantized(w_uv),
                   Int8Weight.quantized(attn.o_proj.weight[None]), bias, backend)

    def query(self, q_nope: Tensor) -> Tensor:
        """q_nope [B, T, H, d_n] → q_nope·W_UK [B, T, H, d_c]."""
        return self.w_uk(q_nope, self.backend)

    def output(self, o_lat: Tensor) -> Tensor:
        """o_lat [B, T, H, d_c] → o_proj(W_UV·o_lat) [B, T, hidden]."""
        o = self.w_uv(o_lat, self.backend)
        out = self.w_o(o.flatten(-2).unsqueeze(-2), self.backend)[..., 0, :]
        return out if self.o_bias is None else out + self.o_bias.to(out.dtype)


def with_int8_projections(model: MLAModel, layers, backend: str = "auto") -> MLAModel:
    """A model whose listed layers run their absorbed projections in W8A8 (`Int8Projections`); shares every
    parameter with `model`. Their full-sequence forward then attends in latent space (see
    `MLAAttention.forward_sequence`), so teacher-forced evaluation computes what decode computes."""
    layers = set(layers)
    if not layers:
        return model
    new = shallow_copy(model)
    copied = []
    for i, layer in enumerate(model.layers):
        if i in layers:
            layer = shallow_copy(layer)
            attn = shallow_copy(layer.self_attn)
            attn.int8 = Int8Projections.of(attn, backend)
            layer.self_attn = attn
        copied.append(layer)
    new.layers = nn.ModuleList(copied)
    return new
