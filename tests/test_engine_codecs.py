"""Engine cache formats (`mlaquant.quant.engine_codecs`): llama.cpp's q8_0 / q4_0 against gguf-py's quantizers
(llama.cpp's own Python port, bit-exact with ggml-quants.c by its tests), bytes per token against the engines' sizes,
and the rounding rules that differ between engines (SGLang's FP4 against its own code: tests/test_engines.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlaquant.integrations.engines import FORMATS
from mlaquant.quant.codecs import CodecSpec, LayerCodec, RowCodec
from mlaquant.quant.engine_codecs import e2m1_codes, e2m1_values, pow2_ceil


def _rows(n: int = 48, width: int = 160, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g) * torch.logspace(-3, 3, n).unsqueeze(1)
    x[0] = 0.0  # an all-zero block: d = 0
    x[1, :32] = torch.linspace(-1, 1, 32)  # extremes of equal magnitude on both sides (first one wins)
    return x


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_ggml_blocks_match_gguf_py(kind):
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    x = _rows()
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    theirs = quants.quantize(x.numpy(), qtype)  # [N, blocks * bytes per block]: per block d (fp16) | qs
    block = 34 if kind == "q8_0" else 18
    theirs = theirs.reshape(x.shape[0], -1, block)
    codec = RowCodec.build(CodecSpec.parse(kind), 160)
    ours = codec.encode(x).numpy()
    code_bytes = codec.layout.code_bytes
    d_ours = ours[:, code_bytes:].reshape(x.shape[0], -1, 2)
    assert np.array_equal(d_ours, theirs[..., :2])  # the FP16 scales, bit for bit
    if kind == "q8_0":
        assert np.array_equal(ours[:, :code_bytes].reshape(x.shape[0], -1, 32), theirs[..., 2:])
    # values: gguf-py's dequantization of its blocks equals our decode exactly (q4_0 packs halves, not pairs)
    want = quants.dequantize(theirs.reshape(x.shape[0], -1), qtype)
    assert np.array_equal(codec.decode(torch.from_numpy(ours)).numpy(), want)


def test_engine_formats_have_the_engines_bytes_per_token():
    """DeepSeek widths (d_c 512, d_r 64): vLLM's fp8 576 B, fp8_ds_mla 656 B, nvfp4_ds_mla 352 B; SGLang's FP4
    pool 288 + 36 = 324 B (MLATokenToKVPoolFP4._create_buffers); llama.cpp's q8_0 18 blocks × 34 B, q4_0 × 18 B."""
    want = {"vllm fp8": 576, "vllm fp8_ds_mla": 656, "vllm nvfp4_ds_mla": 352, "sglang fp8_e4m3": 576,
            "sglang nvfp4": 324, "llama.cpp f16": 1152, "llama.cpp q8_0": 612, "llama.cpp q4_0": 324}
    assert {f.name: LayerCodec.from_names(*f.codec.split("/"), 512, 64).row_bytes for f in FORMATS} == want


def test_e2m1_rounding_ties_even_for_nvfp4_and_up_for_sglang():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -5.0])
    even = e2m1_values(e2m1_codes(x, ties_up=False))
    up = e2m1_values(e2m1_codes(x, ties_up=True))
    assert even.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -4.0]  # cvt.rn: to the even code
    assert up.tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0, -0.5, -6.0]  # SGLang's `>=` thresholds


def test_fp8_ds_scale_is_the_power_of_two_at_or_above():
    y = torch.tensor([1.0, 1.5, 2.0, 2.0001, 0.375, 1e-4])
    assert pow2_ceil(y).tolist() == [1.0, 2.0, 2.0, 4.0, 0.5, 2.0**-13]
    codec = RowCodec.build(CodecSpec.parse("fp8-ds"), 128)
    x = _rows(width=128)
    scale = codec.encode(x)[:, 128:].contiguous().view(torch.float32).squeeze(1)
    amax = x.abs().amax(1)
    assert torch.equal(scale, pow2_ceil(torch.clamp_min(amax * torch.tensor(1 / 448.0), 1e-4)))
    assert ((codec.fake_quant(x) - x).abs() <= scale.unsqueeze(1) * 16).all()  # e4m3: 3 mantissa bits at ≤ 448


def test_engine_codecs_decode_where_the_kernels_do_not():
    """The Triton kernel refuses engine formats (auto then decodes on the torch reference)."""
    pytest.importorskip("triton", reason="needs triton (not installed)")
    import mlaquant.kernels.mla_decode as kernels
    for f in FORMATS:
        codec = LayerCodec.from_names(*f.codec.split("/"), 128, 32)
        assert (kernels.supports(codec) is None) == (f.codec == "fp16/fp16"), f.name
