"""`PlanCache`: a transformers `Cache` that stores DeepSeek-V2/V3's latent in a plan's codecs.

transformers ≥ 5 runs MLA with the latent cached, not K/V: every attention layer calls

    kv_nope, k_rot = cache.update(kv_nope, k_rot, layer_idx)
        in:  kv_nope [B, 1, T, d_c]  normed c_kv of the T new tokens      (the model's dtype)
             k_rot   [B, 1, T, d_r]  k_pe after RoPE
        out: kv_nope [B, 1, L, d_c], k_rot [B, 1, L, d_r]  every cached token, new ones included

and expands K/V from what it gets back. `PlanCache` encodes the new rows with the plan's `LayerCodec`
into a paged `LatentCache` (one per layer) and returns all rows decoded — so transformers' own model
attends through exactly the quantized rows mlaquant's `DecodeSession` attends through, its own rows
included (prefill too: the strict form of the numerics contract).

Two mappings sit between transformers' rows and a plan's rows (mlaquant's layout):
- RoPE channel order: mlaquant caches k_pe as [even dims | odd dims] (`mlaquant.modeling.loader` de-interleaves
  interleaved checkpoints). transformers' DeepseekV3 with `rope_interleave` already returns that order;
  DeepseekV2 (complex RoPE) returns interleaved pairs (x0, x1, x2, ...), permuted here on the way in
  and back on the way out.
- Rotations: transformers' weights are unrotated, so a rotated layer's rows are quantized as x·R and
  handed back as decoded·Rᵀ (R = diag(R_c, R_r), `Plan.rotations`).

Memory (`nbytes`) counts what the codecs store (codes, scales, zero points), as `DecodeSession.cache_nbytes`.
Greedy search only: beam reordering and cropping raise an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from mlaquant.errors import MLAQuantError, PlanError
from mlaquant.modeling.loader import read_parameter
from mlaquant.modeling.model import MLAConfig, MLAModel, weights_fingerprint
from mlaquant.quant.codecs import LayerCodec
from mlaquant.runtime.cache import LatentCache
from mlaquant.runtime.plan import Plan, resolve_plan


def rope_to_plan_order(d_r: int) -> torch.Tensor:
    """Index [d_r]: interleaved RoPE channels (x0, x1, x2, ...) → mlaquant's [x0, x2, .. | x1, x3, ..]."""
    return torch.cat((torch.arange(0, d_r, 2), torch.arange(1, d_r, 2)))


class _StateDictReader:
    """The `TensorReader` interface over a transformers model's state dict (checkpoint names)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def names(self) -> Iterator[str]:
        return iter(self.state)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise MLAQuantError(f"transformers model has no tensor '{name}'")
        return self.state[name]


class ModelIdentity:
    """What `Plan.check_model` reads (`cfg`, `source`, `fingerprint()`) for a transformers model or config.

    The fingerprint is `MLAModel.fingerprint()` of the same weights: each tensor converted as
    `mlaquant.modeling.loader.load_model` converts it (experts stacked, RoPE rows de-interleaved), one at a time.
    A config alone has no weights: a calibrated (fingerprinted) plan is refused.
    """

    def __init__(self, cfg: MLAConfig, source: str, hf_model=None) -> None:
        self.cfg, self.source, self.hf_model = cfg, source, hf_model
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        if self.hf_model is None:
            raise PlanError(
                f"a calibrated plan needs the model's weights to check its fingerprint; pass the model, "
                f"not only its config ({self.source})"
            )
        if self._fingerprint is None:
            reader = _StateDictReader(self.hf_model.state_dict())
            with torch.device("meta"):
                named = sorted(MLAModel(self.cfg).state_dict().items())
            tensors = ((n, self._tensor(reader, n, tuple(p.shape))) for n, p in named)
            self._fingerprint = weights_fingerprint(self.cfg, tensors)
        return self._fingerprint

    def _tensor(self, reader: _StateDictReader, name: str, shape: tuple) -> torch.Tensor:
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            name = "embed_tokens.weight"
        return read_parameter(reader, self.cfg, name, shape, Path(self.source))


def model_identity(model_or_config) -> ModelIdentity | MLAModel:
    """An `MLAModel` as is; a transformers DeepseekV2/V3 model or its config → `ModelIdentity`."""
    if isinstance(model_or_config, MLAModel):
        return model_or_config
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "to_dict"):
        raise MLAQuantError(
            f"PlanCache: expected a transformers DeepseekV2/V3 model or config, or an MLAModel; got "
            f"{type(model_or_config).__name__}"
        )
    source = getattr(config, "_name_or_path", "") or type(config).__name__
    hf_model = model_or_config if hasattr(model_or_config, "state_dict") else None
    return ModelIdentity(MLAConfig.from_hf(config.to_dict(), f"{source} (config)"), source, hf_model)


class PlanLayer(CacheLayerMixin):
    """One decoder layer's latent rows in a `LatentCache` under the plan's `LayerCodec` (see module docstring).

    rotation: [d_c + d_r, d_c + d_r] float32 orthogonal R or None; rope_order: index [d_r] mapping
    transformers' k_rot channels to the plan's, or None when they agree.
    """

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, codec: LayerCodec, d_c: int, rotation=None, rope_order=None, block_size: int = 64) -> None:
        super().__init__()
        self.codec, self.d_c, self.block_size = codec, d_c, block_size
        self.rotation, self.rope_order = rotation, rope_order
        self.rope_back = None if rope_order is None else torch.argsort(rope_order)
        self.cache: LatentCache | None = None
        self.dtype = torch.float32

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.cache = LatentCache([self.codec], key_states.shape[0], self.block_size, key_states.device)
        if self.rotation is not None:
            self.rotation = self.rotation.to(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states = kv_nope [B, 1, T, d_c], value_states = k_rot [B, 1, T, d_r] (new tokens) →
        (kv_nope [B, 1, L, d_c], k_rot [B, 1, L, d_r]) of all L cached tokens, decoded, in the input dtype."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[1] != 1 or key_states.shape[0] != self.cache.batch:
            raise MLAQuantError(
                f"PlanCache: expected latent rows [{self.cache.batch}, 1, T, {self.d_c}], got {list(key_states.shape)}"
            )
        k_rot = value_states if self.rope_order is None else value_states[..., self.rope_order.to(self.device)]
        rows = torch.cat((key_states, k_rot), dim=-1)[:, 0].float()  # [B, T, d_c + d_r], plan order
        if self.rotation is not None:
            rows = rows @ self.rotation
        for b in range(rows.shape[0]):
            self.cache.write(0, b, rows[b])
        cached = torch.stack([self.cache.read(0, b) for b in range(rows.shape[0])])  # [B, L, d_c + d_r] float32
        if self.rotation is not None:
            cached = cached @ self.rotation.T
        kv_nope, k_rot = cached.to(self.dtype)[:, None].split([self.d_c, cached.shape[-1] - self.d_c], dim=-1)
        if self.rope_back is not None:
            k_rot = k_rot[..., self.rope_back.to(self.device)]
        return kv_nope, k_rot

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self.cache is None else self.cache.length(0)

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes()

    def reset(self) -> None:
        self.cache = None
        self.is_initialized = False

    def _refuse(self, what: str) -> None:
        if self.get_seq_length() > 0:
            raise MLAQuantError(f"PlanCache does not support {what} (greedy or sampled search only)")

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self._refuse("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        self._refuse("cropping (assisted generation)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse("repeating a filled cache (batch_repeat_interleave)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("selecting sequences of a filled cache (batch_select_indices)")


def _check_supported(plan: Plan) -> None:
    """Refuse plan features that live outside the cache (mlaquant's own decoder only)."""
    if plan.window:
        raise PlanError(
            f"PlanCache: plan has a residual FP16 window of {plan.window} tokens, which transformers' attention "
            "cannot read per query; use DecodeSession, or the plan without '+w'"
        )
    int8 = [i for i, lp in enumerate(plan.layers) if lp.int8_matmul]
    if int8:
        raise PlanError(
            f"PlanCache: plan runs W8A8 absorbed projections (int8_matmul) in layers {int8}, which transformers' "
            "model does not; use DecodeSession, or a plan without '+i8mm'"
        )


class PlanCache(Cache):
    """transformers `Cache` for DeepseekV2/V3ForCausalLM whose latent rows are stored in `plan`'s codecs.

    plan: whatever `DecodeSession` takes — a plan directory, a `Plan`, or codec names ("fp32", "fp16",
    "int8", "int4", "<ckv>/<kpe>"). model_or_config: the transformers model the cache is used with (its
    weights are fingerprinted against a calibrated plan), its config (uniform plans only), or the
    `MLAModel` loaded from the same checkpoint. A plan made for another model raises `PlanError`.

        model = AutoModelForCausalLM.from_pretrained(DIR)
        model.generate(ids, past_key_values=PlanCache("plans/default", model), do_sample=False)
    """

    def __init__(self, plan: str | Path | Plan, model_or_config, block_size: int = 64) -> None:
        identity = model_identity(model_or_config)
        cfg = identity.cfg
        self.plan = resolve_plan(plan, identity)
        _check_supported(self.plan)
        rotations = self.plan.rotations()
        rope_order = rope_to_plan_order(cfg.qk_rope_head_dim) if cfg.model_type == "deepseek_v2" else None
        layers = [
            PlanLayer(codec, cfg.kv_lora_rank, rotations.get(i), rope_order, block_size)
            for i, codec in enumerate(self.plan.layer_codecs())
        ]
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        """Bytes the plan's codecs store for the tokens so far, all layers (codes, scales, zero points;
        no page padding) — equal to `DecodeSession.cache_nbytes()` for the same tokens."""
        return sum(layer.nbytes() for layer in self.layers)
