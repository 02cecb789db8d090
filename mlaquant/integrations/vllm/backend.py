"""The plan as a vLLM MLA attention backend: each layer's cache holds that layer's planned codes; decode runs on them.

Imported by vLLM only: every MLA layer of a model that declares its plan gets it from the plugin's quantization
config (`mlaquant.integrations.vllm.quant_config`), and with MLAQUANT_PLAN vLLM resolves its MLA backend names to it
(`mlaquant.integrations.vllm.plugin`); it imports vLLM. The plan and the weights it must match (`plan_source`): the
declared plan and its checkpoint sample, or MLAQUANT_PLAN's plan and its full fingerprint.

Per layer (the index read from `kv_b_proj.prefix`), with the plan's codec C, rotations R_c [d_c, d_c] / R_r
[d_r, d_r] (identity where the plan has none) and P the RoPE de-interleave (vLLM's DeepSeek applies RoPE
interleaved, mlaquant caches k_pe as [even dims | odd dims]; scores are invariant under a joint permutation):

    cache      uint8 [num_blocks, P, C.row_bytes] (P = 16 on CPU, any multiple of 16): token in slot s = row s of the
               flattened pages, the bytes of
               C.encode([c_kv·R_c | k_pe·P·R_r]) (`mlaquant.integrations.vllm.pages.LayerPages`, vLLM-free and
               tested without vLLM; byte layout: `mlaquant.quant.codecs`). vLLM sizes the pages from
               `PlanMLABackend.customize_spec` (vllm/v1/attention/backend.py `customize_spec`, applied per layer in
               vllm/v1/worker/gpu_model_runner.py `get_kv_cache_spec`), so each layer has its own bytes per token.
    weights    R_c folded into kv_b_proj.weight (W·R_c) in the impl's `process_weights_after_loading`, which the
               layer calls *before* it splits kv_b_proj into W_UK_T / W_UV (mla_attention.py
               `MLAAttention.process_weights_after_loading`): the absorbed query and output are in R_c's space.
    decode     `forward_mqa`: q = [q_nope·W_UK·R_c | q_pe·P·R_r] → `mlaquant.attention.ops.mla_decode` over the
               layer's pages and vLLM's block table (C kernels on CPU, the Triton kernel on CUDA, else the torch
               reference: `MLAQUANT_VLLM_DECODE_BACKEND`, default auto) → out [N, H, d_c] in latent space; the
               layer applies W_UV. A decode request may carry several query tokens (speculative decoding's verify
               step; the builder declares VARLEN query lengths): each is a decode row of its own, attending up to
               its position (`pages.decode_rows`) — on the codes, never a dequantized context.
    prefill    `forward_mha`: the new rows are already in the cache (vLLM writes before it attends), so each
               prefill sequence attends over *all* its rows read back from the cache — context (a prefix-cache hit,
               the earlier chunks of a chunked prefill) and new tokens alike, the strict form of mlaquant's numerics
               contract (`DecodeSession.prefill` does the same): the loss a plan reports is the loss vLLM serves.
               K / V are expanded from the rows (fewer FLOPs than the absorbed form for long prompts: d_n + d_r and
               d_v per head against d_c + d_r and d_c).

vLLM internals used beyond the backend interface (the reason `SUPPORTED_VLLM` pins versions): `CPUMLAImpl`
(vllm/v1/attention/backends/mla/cpu_mla.py) as the base; `MLACommonMetadataBuilder(metadata_cls=...)`, whose
metadata class checks latent widths against 320 / 512 / 576 in `__post_init__` (ours accepts what the plan's codecs
take), and its `_build_decode` (ours adds the decode requests' query_start_loc); and
`compilation_config.static_forward_context` (layer name → layer), where the impl finds its layer to give it a backend
class carrying that layer's bytes per token (MLAQUANT_PLAN; a declared plan sets it while the layer is built).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from mlaquant.attention.backends import check_backend, cpu_routing
from mlaquant.integrations.vllm.declaration import QUANT_METHOD, model_checkpoint_sample
from mlaquant.integrations.vllm.pages import LayerPages, causal_sdpa, cuda_codec_problem, decode_rows, rope_order
from mlaquant.integrations.vllm.settings import DECODE_BACKEND_ENV, VLLMPluginError, plan_directory
from mlaquant.modeling.loader import read_config
from mlaquant.modeling.model import MLAConfig
from mlaquant.runtime.plan import Plan

_LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class ServedPlan:
    """The plan bound to the served model's config, checked against its weights."""

    plan: Plan
    cfg: MLAConfig
    directory: Path

    def row_bytes(self, prefix: str) -> int:
        """Cache bytes per token of the layer named `prefix` (a module name with `layers.N.` in it)."""
        return self.plan.layer_codec(layer_index(prefix)).row_bytes


@functools.cache
def served_plan(plan_dir: str, model_dir: str, checkpoint_sample: str | None = None) -> ServedPlan:
    """Load the plan at `plan_dir` for the checkpoint at `model_dir` (once per process): layer count, latent widths
    and the weights must match (VLLMPluginError naming the mismatch). The weights are checked by `checkpoint_sample`
    (`mlaquant.integrations.vllm.declaration`: headers and ~1 KB per tensor) where the model directory declares
    one — the export checked the full fingerprint — else, for a calibrated plan, by the full fingerprint (every
    tensor read once)."""
    from mlaquant.errors import MLAQuantError
    from mlaquant.modeling.stream import StreamedModel

    try:
        plan = Plan.load(plan_dir)
        cfg = read_config(Path(model_dir))
    except MLAQuantError as e:
        raise VLLMPluginError(str(e)) from e
    if len(plan.layers) != cfg.num_hidden_layers:
        raise VLLMPluginError(f"{plan_dir}: plan has {len(plan.layers)} layers, model {model_dir} has "
                              f"{cfg.num_hidden_layers}")
    if checkpoint_sample is not None:
        found = model_checkpoint_sample(Path(model_dir))
        if found != checkpoint_sample:
            raise VLLMPluginError(f"{model_dir}: its weights' sample {found[:12]} is not the {checkpoint_sample[:12]} "
                                  "the plan was exported with: these weights are not the plan's model")
    elif plan.fingerprint is not None:
        found = StreamedModel(model_dir, device="cpu").fingerprint()
        if found != plan.fingerprint:
            raise VLLMPluginError(f"{plan_dir}: plan fingerprint {plan.fingerprint[:12]} does not match model "
                                  f"{model_dir} ({found[:12]}): this plan was calibrated for another model")
    return ServedPlan(plan.bind(cfg), cfg, Path(plan_dir))


def plan_source(vllm_config) -> tuple[str, str, str | None]:
    """(plan directory, model directory, checkpoint sample or None) of the model vLLM builds: its quantization
    config's where the model declares its plan (`mlaquant.integrations.vllm.quant_config`), else MLAQUANT_PLAN's."""
    quant = vllm_config.quant_config
    if quant is not None and quant.get_name() == QUANT_METHOD:
        return str(quant.plan_dir), str(quant.model_dir), quant.checkpoint_sample
    return str(plan_directory()), str(vllm_config.model_config.model), None


def layer_index(prefix: str) -> int:
    """The decoder layer of a module prefix such as 'model.layers.3.self_attn.kv_b_proj'."""
    found = _LAYER_RE.search(prefix)
    if found is None:
        raise VLLMPluginError(f"cannot read a layer index from the module name {prefix!r}")
    return int(found.group(1))


class PlanMLABackend(CPUMLABackend):
    """vLLM's MLA backend for a mlaquant plan: any latent width, cache bytes per layer from the plan."""

    row_bytes: int | None = None  # set on the per-layer subclasses (`for_row_bytes`)
    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CPU_MLA"

    @staticmethod
    def get_impl_cls() -> type[PlanMLAImpl]:
        return PlanMLAImpl

    @staticmethod
    def get_builder_cls() -> type[PlanMLAMetadataBuilder]:
        return PlanMLAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any: the plan's codecs are checked against the model's widths when the plan loads

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]  # every decode path reads any page size (pages.py); vLLM's CPU platform sets 16

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size % 16 == 0

    @classmethod
    def customize_spec(cls, spec):
        """The layer's spec with its pages as `row_bytes` bytes per token (uint8)."""
        if cls.row_bytes is None:
            raise VLLMPluginError("mlaquant backend: a layer's cache spec was asked before its plan codec was set "
                                  "(this vLLM builds KV specs before process_weights_after_loading)")
        return dataclasses.replace(spec, dtype=torch.uint8, state_content_bytes=cls.row_bytes)

    @classmethod
    def for_row_bytes(cls, row_bytes: int) -> type[PlanMLABackend]:
        return _backend_class(row_bytes)


@functools.cache
def _backend_class(row_bytes: int) -> type[PlanMLABackend]:
    return type(f"PlanMLABackend{row_bytes}B", (PlanMLABackend,), {"row_bytes": row_bytes})


@dataclasses.dataclass
class PlanMLADecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's decode metadata with where each decode request's query tokens start: query_start_loc int32 [B + 1]
    (more than one query token per request under speculative decoding)."""

    query_start_loc: torch.Tensor | None = None


@dataclasses.dataclass
class PlanMLAMetadata(MLACommonMetadata):
    """vLLM's MLA metadata with the prefill sequences' total lengths (context + new tokens) and without the
    320 / 512 / 576 width check."""

    prefill_seq_lens: list[int] | None = None

    def __post_init__(self) -> None:
        return None


class PlanMLAMetadataBuilder(MLACommonMetadataBuilder[PlanMLAMetadata]):
    """vLLM's MLA metadata builder; decode requests of any query length (VARLEN: speculative decoding's verify
    steps, and short extends, decode on the codes with a causal limit per query token, `pages.decode_rows`)."""

    query_len_support = QueryLenSupport.VARLEN

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, metadata_cls=None, **kwargs) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, metadata_cls=PlanMLAMetadata, **kwargs)

    def _build_decode(self, block_table_tensor, seq_lens_device, max_seq_len, query_start_loc_cpu,
                      query_start_loc_device, num_decode_tokens, max_query_len, dcp_tot_seq_lens_device):
        return PlanMLADecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens_device,
                                     dcp_tot_seq_lens=dcp_tot_seq_lens_device,
                                     query_start_loc=query_start_loc_device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> PlanMLAMetadata:
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if meta.num_prefills:
            lens = common_attn_metadata.seq_lens[meta.num_decodes : meta.num_decodes + meta.num_prefills]
            meta.prefill_seq_lens = lens.tolist()
        return meta


class PlanMLAImpl(CPUMLAImpl):
    """One layer's attention over its planned codes (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.kv_cache_dtype != "auto":
            raise VLLMPluginError(f"--kv-cache-dtype {self.kv_cache_dtype} with the mlaquant backend: keep 'auto', "
                                  "the cache codecs come from the plan")
        served = served_plan(*plan_source(get_current_vllm_config()))
        self.layer_index = layer_index(self.kv_b_proj.prefix)
        d_c, d_r = served.cfg.latent_widths
        if (self.kv_lora_rank, self.qk_rope_head_dim) != (d_c, d_r):
            raise VLLMPluginError(f"layer {self.layer_index}: vLLM's latent is {self.kv_lora_rank} + "
                                  f"{self.qk_rope_head_dim}, the plan's model {d_c} + {d_r}")
        self.d_c = d_c
        self.codec = served.plan.layer_codec(self.layer_index)
        rotation = served.plan.rotations().get(self.layer_index)
        r_c, r_r = (None, None) if rotation is None else (rotation[:d_c, :d_c], rotation[d_c:, d_c:])
        self.pages = LayerPages(self.codec, d_c, None if r_c is None or torch.equal(r_c, torch.eye(d_c)) else r_c,
                                None if r_r is None or torch.equal(r_r, torch.eye(d_r)) else r_r,
                                rope_order(d_r, served.cfg.rope_interleave))
        self.decode_backend = os.environ.get(DECODE_BACKEND_ENV, "auto")
        lp = served.plan.layers[self.layer_index]
        if lp.int8_matmul or served.plan.window:
            raise VLLMPluginError(f"{served.directory}: W8A8 projections and residual FP16 windows run in mlaquant's "
                                  "own decoder only; serve a plan without them")
        self.layer = None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Fold R_c into kv_b_proj (before the layer splits it into W_UK_T / W_UV) and give the layer the backend
        class that sizes its pages to this layer's codec."""
        w, r_c = self.kv_b_proj.weight, self.pages.r_c
        if r_c is not None:
            if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise VLLMPluginError(f"layer {self.layer_index}: a rotated plan needs an unquantized kv_b_proj "
                                      f"(found {w.dtype})")
            w.data.copy_((w.data.float() @ r_c.to(w.device)).to(w.dtype))
        self.decode_backend = check_backend(self.decode_backend, w.device).value
        if w.device.type == "cpu" and self.decode_backend in ("auto", "cpu"):
            cpu_routing()  # builds the C kernels now (seconds), not inside the first request's decode step
        if w.device.type == "cuda" and self.decode_backend in ("auto", "triton"):
            problem = cuda_codec_problem(self.codec, str(w.device))
            if problem is not None:
                raise VLLMPluginError(f"layer {self.layer_index}: codec {self.codec.name} cannot run on "
                                      f"{torch.cuda.get_device_name(w.device)}: {problem}")
            self.decode_backend = "triton"
        forward_context = get_current_vllm_config().compilation_config.static_forward_context
        mine = [m for m in forward_context.values() if getattr(m, "impl", None) is self]
        if len(mine) != 1:
            raise VLLMPluginError(f"layer {self.layer_index}: its attention layer is not in vLLM's "
                                  "static_forward_context (this vLLM is not one the plugin supports)")
        self.layer = mine[0]
        self.layer.attn_backend = PlanMLABackend.for_row_bytes(self.codec.row_bytes)

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        """Encode the new rows with the layer's codec and store them at their slots (`LayerPages.write`)."""
        if kv_cache.numel():
            self.pages.write(self._pages(kv_cache), slot_mapping, kv_c_normed, k_pe)

    def _pages(self, kv_cache: torch.Tensor) -> torch.Tensor:
        return kv_cache.view(-1, kv_cache.shape[-2], self.codec.row_bytes)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        """q: (q_nope·W_UK_T [N, H, d_c], q_pe [N, H, d_r]) or their concatenation, N the decode requests' query
        tokens → (out [N, H, d_c] in q's dtype, lse [N, H] float32). Each token attends over its request's cached
        rows up to and including its own position (`pages.decode_rows`): several per request under speculative
        decoding, all on the stored codes."""
        q_lat, q_pe = (q[0], q[1]) if isinstance(q, tuple) else q.split([self.d_c, q.shape[-1] - self.d_c], -1)
        decode = attn_metadata.decode
        block_table, seq_lens = decode_rows(decode.block_table, decode.seq_lens, decode.query_start_loc,
                                            q_lat.shape[0])
        out, lse = self.pages.decode(q_lat, q_pe, self._pages(kv_c_and_k_pe_cache), block_table, seq_lens,
                                     self.scale, self.decode_backend)
        return out.to(q_lat.dtype), lse

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                    output_scale=None) -> None:
        """Prefill tokens q [T, H, d_n + d_r] → output [T, H·d_v]: each sequence's queries over all its rows as the
        cache returns them, K / V expanded from those rows by kv_b_proj (in R_c's space: the fold), causal SDPA."""
        if output_scale is not None:
            raise VLLMPluginError("the mlaquant backend does not write quantized attention outputs")
        prefill = attn_metadata.prefill
        starts = prefill.query_start_loc.tolist()
        pages = self._pages(kv_c_and_k_pe_cache)
        heads, d_n, d_v = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        w_dtype = self.kv_b_proj.weight.dtype
        out = output.view(-1, heads, d_v)
        for i, seq_len in enumerate(attn_metadata.prefill_seq_lens):
            lo, hi = starts[i], starts[i + 1]
            rows = self.pages.read(pages, prefill.block_table[i], seq_len)  # [L, d_c + d_r] float32
            kv = self.kv_b_proj(rows[:, : self.d_c].to(w_dtype))[0].view(seq_len, heads, d_n + d_v)
            k_nope, v = kv.float().split([d_n, d_v], dim=-1)
            k = torch.cat((k_nope, rows[:, None, self.d_c :].expand(-1, heads, -1)), dim=-1)  # [L, H, d_n + d_r]
            q_nope, q_pe = q[lo:hi].split([d_n, self.qk_rope_head_dim], dim=-1)
            query = torch.cat((q_nope.float(), self.pages.rope(q_pe)), dim=-1)  # [T, H, d_n + d_r]
            out[lo:hi] = causal_sdpa(query, k, v, self.scale).to(out.dtype)
