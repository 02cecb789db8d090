"""The MLA decode-attention op over a paged, quantized latent cache: one definition, two backends.

Decode with W_UK absorbed into the query is MQA with one KV head whose rows are the cached
`[c_kv | k_pe]` latents (the notation and both attention paths: the docstring of `mlaquant/modeling/model.py`):

    score[b, h, t] = scale * (q[b, h, :d_c] · c_kv[b, t] + q[b, h, d_c:] · k_pe[b, t])   t < seq_lens[b]
    out[b, h]      = softmax_t(score[b, h]) @ c_kv[b]          (V is a view of c_kv; W_UV comes later)
    lse[b, h]      = logsumexp_t(score[b, h])                  (natural log, for merging split-KV partials)

Paged cache: `pool[block, slot]` holds one encoded row (`LayerCodec` bytes); token t of sequence b
lives in block `block_table[b, t // block_size]`, slot `t % block_size`. Entries of `block_table` past
a sequence's last block, and slots past `seq_lens[b]` in its last block, may hold anything and are
never read.

Backends (`mlaquant.attention.backends`): "torch" is the FP32 reference (`mlaquant.attention.reference`); "triton"
the kernel `mlaquant.kernels.mla_decode.mla_decode`, on CUDA or on CPU under TRITON_INTERPRET=1; "cpu" the fast CPU
path `mlaquant.attention.cpu_decode.mla_decode_cpu` (integer scores, blocked P·V, its error bound in its docstring);
"auto" asks the backends of the device in order whether they take the call (`backends.choose_backend`: on CUDA the
kernel where it reads the codec, on CPU the fast path where this machine's routing rule says it is faster), else
torch. Every backend runs on the one checked input contract, `mlaquant.attention.decode_inputs.DecodeInputs`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mlaquant.attention.backends import Backend, choose_backend, cpu_routing, resolve_backend
from mlaquant.attention.buffers import Buffers
from mlaquant.attention.decode_inputs import DecodeInputs
from mlaquant.quant.codecs import LayerCodec


def mla_decode(
    q: Tensor,
    pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    codec: LayerCodec,
    d_c: int,
    scale: float,
    backend: str | Backend = "auto",
    scratch: Buffers | None = None,
) -> tuple[Tensor, Tensor]:
    """Absorbed MLA decode attention over a paged quantized cache.

    q: [B, H, d_c + d_r] absorbed query (q_nope·W_UK concatenated with rotated q_pe), float32.
    pool: uint8 [num_blocks, block_size, codec.row_bytes] (a layer's paged cache).
    block_table: int32 [B, max_blocks] (block ids per sequence, unused entries arbitrary).
    seq_lens: int32 [B] (tokens to attend per sequence, >= 1; 0 gives out 0 and lse -inf).
    Returns out [B, H, d_c] = softmax(q·[c_kv|k_pe]^T * scale) @ c_kv, float32, and
    lse [B, H] float32 (natural-log log-sum-exp of the scaled scores).
    backend: a `Backend` name (an explicit one that cannot run this call → BackendError saying why).
    scratch: buffers the torch path reuses between calls; the Triton kernel and the cpu path need none.
    """
    inputs = DecodeInputs(q, pool, block_table, seq_lens, codec, d_c)
    return choose_backend(backend, codec, q.device, seq_lens).run(inputs, scale, scratch)


def describe_backend(backend: str | Backend, device: torch.device | str) -> str:
    """What `mla_decode(..., backend=backend)` runs on `device`, in words (for reports): on CPU under "auto",
    the routing rule of this machine (`cpu_routing`)."""
    resolved = resolve_backend(backend, device)
    if resolved is Backend.CPU and Backend.parse(backend) is Backend.AUTO:
        return f"auto (cpu fast path where faster here, else torch: {cpu_routing().describe()})"
    return resolved.value
