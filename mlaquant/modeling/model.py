"""The MLA language model (DeepSeek-V2/V3 architecture): config, RoPE/YaRN, attention, MLP/MoE.

Notation (DeepSeek names): H heads, d_c = kv_lora_rank, d_r = qk_rope_head_dim, d_n =
qk_nope_head_dim, d_v = v_head_dim; W_UK [H, d_n, d_c] and W_UV [H, d_v, d_c] are the two halves of
`kv_b_proj`.

Two attention paths over the same latent:

    latent row   r_t  = [c_kv_t | k_pe_t]                     (d_c + d_r values, the only thing cached)
    expanded     k_t,h = [W_UK,h c_kv_t | k_pe_t],  v_t,h = W_UV,h c_kv_t       (forward(), prefill oracle)
    absorbed     q_abs,h = [W_UK,h^T q_nope,h | q_pe,h];  s_t,h = q_abs,h · r_t   (decode: MQA over rows)
                 o_h = W_UV,h (Σ_t p_t,h c_kv_t)            V is a view of c_kv

`MLAModel.forward` runs the expanded path over a whole sequence (the absorbed one in layers whose
projections run in INT8); `MLAModel.forward_absorbed` runs the absorbed path and hands each layer's
new latent rows and absorbed queries to an `attend` callback, so
the decode session (and its quantized cache) decides what every query reads.

Interleaved RoPE checkpoints (DeepSeek-V2, V3 with `rope_interleave`) are de-interleaved once at load
time by permuting the rope rows of the query and `kv_a_proj_with_mqa` weights; rotate-half RoPE on the
permuted layout gives identical scores, and cached `k_pe` rows hold [even dims | odd dims].

Precision (the numerics contract, whatever the weights' dtype — FP32, BF16 or FP16): projections run in
the weights' dtype; RoPE tables, q_pe / k_pe after RoPE, the latent rows [c_kv | k_pe] (so what a cache
encodes), the absorbed query q_nope·W_UK (upcast after the product), attention scores, softmax,
log-sum-exp and the attention output are FP32 — every upcast explicit below — and the output is cast
back to the weights' dtype only to enter W_UV / o_proj. Logits are returned FP32 (lm_head in the weights'
dtype, then upcast), so log-softmax, NLL, KL and top-1 are computed in FP32.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mlaquant.attention.reference import causal_attention
from mlaquant.errors import CheckpointError

MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")

Attend = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class MLAConfig:
    """The fields of a DeepSeek-V2/V3 `config.json` this model uses (names as in the file)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    moe_intermediate_size: int = 0
    n_routed_experts: int | None = None
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id of the config (`eos_token_id` may be an int, a list or None)."""
        eos = self.eos_token_id
        if eos is None:
            return ()
        return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    @property
    def eos_id(self) -> int | None:
        """The first end-of-sequence id (what joins documents into token samples), or None."""
        return self.eos_ids[0] if self.eos_ids else None

    @classmethod
    def from_hf(cls, raw: dict, where: str = "config.json") -> MLAConfig:
        """Parse a Hugging Face DeepSeek-V2/V3 config dict; errors name the file and fields."""
        model_type = raw.get("model_type")
        missing = [f for f in MLA_FIELDS if raw.get(f) is None]
        if missing:
            raise CheckpointError(
                f"{where}: not an MLA model (model_type {model_type!r}); missing MLA fields: {', '.join(missing)}"
            )
        if model_type not in ("deepseek_v2", "deepseek_v3"):
            raise CheckpointError(f"{where}: model_type must be deepseek_v2 or deepseek_v3, got {model_type!r}")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(raw.get(f), int):
                raise CheckpointError(f"{where}: field '{f}' missing or not an integer")
        rope = dict(raw.get("rope_parameters") or {})
        scaling = raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type not in ("default", "yarn"):
            raise CheckpointError(f"{where}: rope type {rope_type!r} is not supported (default or yarn)")
        rope_scaling = None
        if rope_type == "yarn":
            rope_scaling = {**scaling, **{k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type")}}
        v3 = model_type == "deepseek_v3"
        kwargs = {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw and raw[f.name] is not None}
        kwargs.update(
            model_type=model_type,
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            # DeepSeek-V2 checkpoints always rotate interleaved pairs (complex RoPE).
            rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,
            topk_method=raw.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
            scoring_func=raw.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            n_group=raw.get("n_group") or 1,
            topk_group=raw.get("topk_group") or 1,
        )
        if "norm_topk_prob" not in raw and v3:
            kwargs["norm_topk_prob"] = True
        cfg = cls(**kwargs)
        if cfg.hidden_act != "silu":
            raise CheckpointError(f"{where}: hidden_act {cfg.hidden_act!r} is not supported (silu)")
        if cfg.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise CheckpointError(f"{where}: topk_method {cfg.topk_method!r} is not supported")
        if cfg.qk_rope_head_dim % 2:
            raise CheckpointError(f"{where}: qk_rope_head_dim must be even, got {cfg.qk_rope_head_dim}")
        return cfg

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: d_c + d_r."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def latent_widths(self) -> tuple[int, int]:
        """(d_c, d_r) = (kv_lora_rank, qk_rope_head_dim): the widths of a cached row's two parts."""
        return self.kv_lora_rank, self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.n_routed_experts) and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: MLAConfig) -> float:
    """1/sqrt(d_n + d_r), times YaRN's mscale(mscale_all_dim)^2 when set."""
    scale = cfg.qk_head_dim**-0.5
    ys = cfg.rope_scaling
    if ys and ys.get("mscale_all_dim"):
        m = _yarn_mscale(float(ys["factor"]), float(ys["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def rope_frequencies(cfg: MLAConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [d_r/2] (float32) and the cos/sin amplitude (YaRN attention factor)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ys = cfg.rope_scaling
    if not ys:
        return 1.0 / pos_freqs, 1.0
    orig = ys["original_max_position_embeddings"]
    factor = ys.get("factor") or cfg.max_position_embeddings / orig
    mscale, mscale_all = ys.get("mscale"), ys.get("mscale_all_dim")
    if ys.get("attention_factor") is not None:
        amp = float(ys["attention_factor"])
    elif mscale and mscale_all:
        amp = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    else:
        amp = _yarn_mscale(factor)
    beta_fast, beta_slow = ys.get("beta_fast") or 32, ys.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if ys.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(amp)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions; rotate-half layout (see module docstring for interleaved checkpoints)."""

    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        inv_freq, self.amplitude = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse: bool = True):
        # device moves apply, dtype casts do not: `model.to(torch.bfloat16)` keeps RoPE frequencies FP32
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int [..., T] → cos, sin: [..., T, d_r]."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.amplitude).to(dtype), (emb.sin() * self.amplitude).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, ..., d_r]; cos/sin: [B, T, d_r] broadcast over the middle dims."""
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLAAttention(nn.Module):
    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, hd, bias = cfg.num_attention_heads, cfg.qk_head_dim, cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, H * hd, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * hd, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, cfg.hidden_size, bias=bias)
        self.scale = softmax_scale(cfg)
        # orthogonal [d_c, d_c] applied to c_kv before it is cached; kv_b_proj then holds W·R
        self.latent_rotation: torch.Tensor | None = None
        # orthogonal [d_r, d_r] applied to both q_pe and k_pe after RoPE (every score q_pe·k_pe unchanged)
        self.rope_rotation: torch.Tensor | None = None
        # W8A8 absorbed projections (mlaquant.modeling.int8_proj.Int8Projections) when a plan turns on int8_matmul
        self.int8 = None

    def _query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] → q_nope [B, T, H, d_n], rotated q_pe [B, T, H, d_r]."""
        cfg = self.cfg
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(*x.shape[:2], cfg.num_attention_heads, cfg.qk_head_dim)  # [B, T, H, d_n + d_r]
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe.float(), cos.float(), sin.float())  # FP32 [B, T, H, d_r]
        return q_nope, q_pe if self.rope_rotation is None else q_pe @ self.rope_rotation

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] → cache rows [B, T, d_c + d_r] float32 = [normed c_kv | rotated k_pe]."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv).float()  # the latent is FP32 whatever the weights
        if self.latent_rotation is not None:
            c_kv = c_kv @ self.latent_rotation
        k_pe = apply_rope(k_pe.float(), cos.float(), sin.float())
        if self.rope_rotation is not None:
            k_pe = k_pe @ self.rope_rotation
        return torch.cat((c_kv, k_pe), dim=-1)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, d_n, d_c] and W_UV [H, d_v, d_c] (views of kv_b_proj.weight)."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def forward_sequence(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: torch.Tensor | None = None,
        rows_near: torch.Tensor | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        """Causal attention over the whole sequence: x [B, T, hidden] → [B, T, hidden].

        rows (optional) replaces this layer's latent [B, T, d_c + d_r] (e.g. the fake-quantized rows a
        cache would return). With `rows_near` [B, T, d_c + d_r] and `window` R, query t reads rows_near for
        keys t−R < s ≤ t and `rows` for older keys: an exact simulation of a cache that keeps its most
        recent R rows unquantized. K/V are expanded from the latent, except in a layer whose absorbed
        projections run in INT8 (`self.int8`): it attends the absorbed way (MQA over the rows, V = c_kv,
        then W_UV and o_proj), the full-sequence twin of its decode.
        """
        rows = self.latent(x, cos, sin) if rows is None else rows
        attend = self._expanded_attention if self.int8 is None else self._latent_attention
        return attend(x, cos, sin, rows, rows_near, window)

    def _expanded_attention(self, x, cos, sin, rows, rows_near, window: int) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q_nope, q_pe = self._query(x, cos, sin)

        w_dtype = self.kv_b_proj.weight.dtype

        def expand(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            c_kv, k_pe = r.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
            kv = self.kv_b_proj(c_kv.to(w_dtype)).view(B, T, cfg.num_attention_heads, -1)  # [B, T, H, d_n + d_v]
            k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
            k_pe = k_pe.float()[:, :, None].expand(-1, -1, cfg.num_attention_heads, -1)
            return torch.cat((k_nope.float(), k_pe), dim=-1), v  # k FP32 [B, T, H, d_n + d_r]

        k, v = expand(rows)
        near = None if rows_near is None else expand(rows_near)
        out = causal_attention(torch.cat((q_nope.float(), q_pe), dim=-1), k, v, self.scale, near, window)
        return self.o_proj(out.reshape(B, T, -1).to(w_dtype))

    def _latent_attention(self, x, cos, sin, rows, rows_near, window: int) -> torch.Tensor:
        d_c = self.cfg.kv_lora_rank
        near = None if rows_near is None else (rows_near, rows_near[..., :d_c])
        o_lat = causal_attention(self.absorbed_query(x, cos, sin), rows, rows[..., :d_c], self.scale, near, window)
        return self.output_from_latent(o_lat)

    def absorbed_query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] → q_abs [B, T, H, d_c + d_r] float32 = [q_nope·W_UK | q_pe] (the product in the
        weights' dtype, then upcast)."""
        q_nope, q_pe = self._query(x, cos, sin)
        if self.int8 is not None:
            return torch.cat((self.int8.query(q_nope).float(), q_pe), dim=-1)
        w_uk, _ = self._w_uk_uv()
        return torch.cat((torch.einsum("bthn,hnc->bthc", q_nope, w_uk).float(), q_pe), dim=-1)

    def output_from_latent(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [B, T, H, d_c] (attention output in latent space, any float dtype) → [B, T, hidden] in the
        weights' dtype via W_UV and o_proj."""
        w_dtype = self.kv_b_proj.weight.dtype
        o_lat = o_lat.to(w_dtype)
        if self.int8 is not None:
            return self.int8.output(o_lat).to(w_dtype)
        _, w_uv = self._w_uk_uv()
        o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv)
        return self.o_proj(o.reshape(*o.shape[:2], -1))


def weights_fingerprint(cfg: MLAConfig, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 (hex) over `cfg` and, per (name, tensor) in the order given (sorted by name by both callers),
    the name, the shape and a strided bf16 sample (every ⌊numel/4096⌋-th element) of the tensor.

    Dtype-independent up to bf16 rounding; tensors are consumed one at a time, so a generator that reads
    each from disk keeps one in memory (`StreamedModel.fingerprint`).
    """
    h = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode())
    for name, t in named_tensors:
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].to(torch.bfloat16).cpu()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(sample.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Top-k expert choice: V2 softmax (greedy / group-limited greedy), V3 sigmoid + bias, group top-k."""

    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def _group_mask(self, choice: torch.Tensor, group_score: Callable) -> torch.Tensor:
        cfg, N = self.cfg, choice.shape[0]
        groups = choice.view(N, cfg.n_group, -1)
        top = group_score(groups).topk(cfg.topk_group, dim=-1).indices  # [N, topk_group]
        keep = torch.zeros(N, cfg.n_group, dtype=torch.bool, device=choice.device).scatter_(1, top, True)
        return keep[..., None].expand_as(groups).reshape(N, -1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] → (weights [N, k] float32, expert ids [N, k])."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        if cfg.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        if cfg.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias.float()
            keep = self._group_mask(choice, lambda g: g.topk(2, dim=-1).values.sum(-1))
            ids = choice.masked_fill(~keep, float("-inf")).topk(cfg.num_experts_per_tok, dim=-1).indices
            weights = scores.gather(1, ids)
        else:
            if cfg.topk_method == "group_limited_greedy":
                keep = self._group_mask(scores, lambda g: g.max(dim=-1).values)
                scores = scores.masked_fill(~keep, 0.0)
            weights, ids = scores.topk(cfg.num_experts_per_tok, dim=-1)
        if cfg.topk_method == "noaux_tc":  # V3: optional normalisation, then always scaled
            if cfg.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return weights * cfg.routed_scaling_factor, ids
        if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:  # V2: normalised or scaled, not both
            return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids
        return weights * cfg.routed_scaling_factor, ids


class MoE(nn.Module):
    """Routed experts (stacked weights [E, ...]) plus shared experts."""

    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        E, hid, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Router(cfg)
        self.w_gate = nn.Parameter(torch.empty(E, inter, hid))
        self.w_up = nn.Parameter(torch.empty(E, inter, hid))
        self.w_down = nn.Parameter(torch.empty(E, hid, inter))
        self.shared_experts = MLP(hid, inter * cfg.n_shared_experts) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, hidden]
        weights, ids = self.gate(flat)
        out = torch.zeros_like(flat)
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            h = flat[token]
            h = F.linear(F.silu(F.linear(h, self.w_gate[e])) * F.linear(h, self.w_up[e]), self.w_down[e])
            out.index_add_(0, token, h * weights[token, slot, None].to(h.dtype))
        out = out.view(shape)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MLAConfig, i: int) -> None:
        super().__init__()
        self.self_attn = MLAAttention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))


class MLAModel(nn.Module):
    """DeepSeek-V2/V3 causal LM. Parameter names follow the Hugging Face checkpoints.

    Implements `mlaquant.modeling.protocol.LatentModel` (with `rotated`, `store`, `run`), like the
    layer-streamed `mlaquant.modeling.stream.StreamedModel`.
    """

    supports_int8_projections = True  # `mlaquant.modeling.int8_proj.with_int8_projections` applies

    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg)
        self.tokenizer = None
        self.source: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def fingerprint(self) -> str:
        """sha256 over the config and a strided bf16 sample of every weight (dtype-independent).

        Plans record it so a plan calibrated on one model is refused by another, including the same
        architecture with different (or deliberately modified) weights.
        """
        return weights_fingerprint(self.cfg, sorted(self.state_dict().items()))

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        latent_rows: Callable | None = None,
        start_layer: int = 0,
        hidden: torch.Tensor | None = None,
        layer_inputs: list | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        """Full-sequence causal forward with expanded K/V. input_ids [B, T] → logits [B, T, V] float32.

        `latent_rows(layer, rows)` may replace each layer's latent (e.g. fake quantization): it returns
        rows, or (rows, rows_near) to simulate a cache whose most recent `window` rows are rows_near.
        `hidden` [B, T, hidden] resumes at `start_layer` from a saved input of that layer (calibration
        re-runs only the layers after the one it perturbs); `layer_inputs`, if a list, receives every
        layer's input hidden state.
        """
        # by the class, not self: StreamedModel runs this on a one-layer view (`stream._View`) that is no MLAModel
        return MLAModel._logits(self, input_ids, latent_rows, start_layer, hidden, layer_inputs, window)

    def latent_gradients(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """How the loss moves with the cache: per layer ∂ℓ/∂rows [B, T, d_c + d_r] float32 for input_ids [B, T],
        ℓ the summed next-token cross-entropy of the batch and rows each layer's latent as `latent` returns it; the
        total derivative (through the later layers' latents too), the weights given none."""
        nudges: list[torch.Tensor] = []  # zeros added to each layer's rows: the total derivative, later layers' too

        def track(i: int, latent: torch.Tensor) -> torch.Tensor:
            nudges.append(torch.zeros_like(latent, requires_grad=True))
            return latent + nudges[-1]

        ids = input_ids.to(self.device)
        with torch.enable_grad():
            logits = self._logits(ids, track)
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
            )
            return [g.float() for g in torch.autograd.grad(loss, nudges)]

    def _logits(self, input_ids, latent_rows, start_layer=0, hidden=None, layer_inputs=None, window=0):
        """`forward`'s body, differentiable (`latent_gradients` runs it with gradients on)."""
        T = input_ids.shape[1]
        cos, sin = self.rotary(torch.arange(T, device=input_ids.device)[None], torch.float32)
        h = self.embed_tokens(input_ids) if hidden is None else hidden
        for i in range(start_layer, len(self.layers)):
            layer = self.layers[i]
            if layer_inputs is not None:
                layer_inputs.append(h)
            x = layer.input_layernorm(h)
            rows = near = None
            if latent_rows is not None:
                rows = latent_rows(i, layer.self_attn.latent(x, cos, sin))
                if isinstance(rows, tuple):
                    rows, near = rows
            h = layer._mlp(h + layer.self_attn.forward_sequence(x, cos, sin, rows, near, window))
        return self.lm_head(self.norm(h)).float()

    def rotated(self, rotations: dict[int, torch.Tensor]) -> MLAModel:
        """`with_latent_rotation(self, rotations)`."""
        return with_latent_rotation(self, rotations)

    def store(self) -> list[torch.Tensor]:
        """An empty list: where a caller keeps per-batch tensors across `run`s (all in memory)."""
        return []

    def run(
        self,
        batches: list[torch.Tensor],
        latent_rows: Callable | None = None,
        start_layer: int = 0,
        hidden: list[torch.Tensor] | None = None,
        layer_inputs: list | None = None,
        window: int = 0,
        on_logits: Callable[[int, torch.Tensor], None] | None = None,
        progress=None,
    ) -> None:
        """Every batch [B, T] through layers start_layer.. (`forward`), batch after batch: the loaded twin of
        `StreamedModel.run`, same arguments. `hidden[b]` resumes batch b at `start_layer`; `layer_inputs`, if a
        list, receives one list per layer (start_layer..) of every batch's input hidden state [B, T, hidden];
        `on_logits(b, logits [B, T, V] float32)` is called per batch, in order; `progress` advances per batch."""
        kept = [[] for _ in range(start_layer, len(self.layers))]  # per layer, every batch's input
        for b, ids in enumerate(batches):
            inputs = [] if layer_inputs is not None else None
            h = None if hidden is None else hidden[b]
            logits = self(ids.to(self.device), latent_rows, start_layer, h, inputs, window)
            for per_layer, x in zip(kept, inputs or ()):
                per_layer.append(x)
            if on_logits is not None:
                on_logits(b, logits)
            if progress is not None:
                progress.update(1)
        if layer_inputs is not None:
            layer_inputs.extend(kept)

    @torch.no_grad()
    def forward_absorbed(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Absorbed-attention forward of new tokens whose attention is computed by `attend`.

        input_ids, positions: [B, T]. `attend(layer, q_abs [B, T, H, d_c + d_r], rows [B, T, d_c + d_r])`
        stores the new rows wherever the caller keeps the cache and returns the attention output in latent
        space o_lat [B, T, H, d_c] (softmax(q_abs·rows^T · scale) @ c_kv over what each query may see).
        Returns logits [B, T, V] float32.
        """
        cos, sin = self.rotary(positions, torch.float32)
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            o_lat = attend(i, attn.absorbed_query(x, cos, sin), attn.latent(x, cos, sin))  # FP32 in and out
            h = layer._mlp(h + attn.output_from_latent(o_lat))
        return self.lm_head(self.norm(h)).float()


def hadamard_signs(n: int, seed: int) -> torch.Tensor:
    """Seeded random ±1 signs [n] (float32) for `hadamard_rotation`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen, device="cpu").float() * 2 - 1


def hadamard_rotation(signs: torch.Tensor) -> torch.Tensor:
    """Orthogonal R = diag(signs) · H_n / √n [n, n] (Sylvester Hadamard; n = len(signs), a power of two)."""
    n = signs.numel()
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two width, got {n}")
    h = torch.ones(1, 1, device=signs.device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return signs.float()[:, None] * h / math.sqrt(n)


def shallow_copy(module: nn.Module) -> nn.Module:
    new = copy.copy(module)
    new._modules = dict(module._modules)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    return new


def latent_rotation(
    ckv_signs: torch.Tensor | None, rope_signs: torch.Tensor | None, d_c: int, d_r: int
) -> torch.Tensor:
    """Block-diagonal orthogonal R [d_c + d_r, d_c + d_r] = diag(R_c, R_r) for `with_latent_rotation`:
    `hadamard_rotation` of each part's signs, the identity for a part without signs."""
    r_c = torch.eye(d_c, device="cpu") if ckv_signs is None else hadamard_rotation(ckv_signs.cpu())
    r_r = torch.eye(d_r, device="cpu") if rope_signs is None else hadamard_rotation(rope_signs.cpu())
    return torch.block_diag(r_c, r_r)


def with_latent_rotation(model: MLAModel, rotations: dict[int, torch.Tensor]) -> MLAModel:
    """A model computing the same function whose layer i caches rows·R_i (exact in real arithmetic).

    R_i = diag(R_c, R_r) [d_c + d_r, d_c + d_r] block-diagonal orthogonal (`latent_rotation`). R_c is
    folded into W_UK and W_UV (kv_b_proj.weight·R_c), so absorbed decode reads rotated c_kv at no extra
    cost; only the cache write multiplies by R_c. RoPE sits between the weights and k_pe / q_pe, so R_r
    cannot be folded: both are multiplied by R_r after RoPE (q_pe·R_r · k_pe·R_r = q_pe · k_pe), a
    d_r × d_r product per query head and per written row. An identity block is skipped. Shares every
    other parameter with `model`.
    """
    new = shallow_copy(model)
    layers = []
    for i, layer in enumerate(model.layers):
        rot = rotations.get(i)
        if rot is not None:
            d_c, d_r = layer.self_attn.cfg.latent_widths
            if tuple(rot.shape) != (d_c + d_r, d_c + d_r):
                want = [d_c + d_r] * 2
                raise ValueError(f"layer {i}: latent rotation must be {want}, got {list(rot.shape)}")
            layer = shallow_copy(layer)
            attn = shallow_copy(layer.self_attn)
            w = attn.kv_b_proj.weight
            # rotations stay FP32 (they act on the FP32 latent); the fold is computed in FP32, stored as w
            r_c = rot[:d_c, :d_c].to(device=w.device, dtype=torch.float32)
            r_r = rot[d_c:, d_c:].to(device=w.device, dtype=torch.float32)
            if not torch.equal(r_c, torch.eye(d_c, device=w.device)):
                with torch.device("meta"):
                    kv_b = nn.Linear(attn.kv_b_proj.in_features, attn.kv_b_proj.out_features, bias=False)
                kv_b.weight = nn.Parameter((w.float() @ r_c).to(w.dtype), requires_grad=False)
                attn.kv_b_proj = kv_b
                attn.latent_rotation = r_c
            if not torch.equal(r_r, torch.eye(d_r, device=w.device)):
                attn.rope_rotation = r_r
            layer.self_attn = attn
        layers.append(layer)
    new.layers = nn.ModuleList(layers)
    return new
