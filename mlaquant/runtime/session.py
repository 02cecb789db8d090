"""`DecodeSession`: prefill + step decode of a batch over the latent cache, and `generate`.

Prefill runs each sequence in chunks (`configs/runtime.yaml`: 512 tokens below 2k context, 768 for
2k–8k, 1024 above) so memory stays bounded by chunk × context. Each chunk's latent rows are written to
the cache first and attention reads them back from the cache, so every token — prompt or generated —
attends through exactly what the cache stores (the strict form of the numerics contract:
teacher-forced logits of a prefill equal step-by-step decode).

Decode absorbs W_UK into the query and W_UV into the output and runs MQA over the cached rows through
`mlaquant.attention.ops.mla_decode` (torch reference on CPU, Triton on CUDA); a layer whose codec the guard
widened has two cache segments, whose partial softmaxes merge by log-sum-exp.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from mlaquant.attention import ops
from mlaquant.attention.backends import check_backend
from mlaquant.attention.buffers import Buffers
from mlaquant.attention.reference import causal_attention, masked_attention, merge_exact_lse
from mlaquant.config import RuntimeConfig, load_runtime_config
from mlaquant.device import place
from mlaquant.errors import MLAQuantError
from mlaquant.modeling.model import MLAModel
from mlaquant.runtime.cache import LatentCache
from mlaquant.runtime.plan import Plan, resolve_plan

log = logging.getLogger(__name__)


def _as_batch(input_ids, lengths) -> tuple[torch.Tensor, list[int]]:
    """[B, T] tensor (+ optional lengths) or a list of token lists → right-padded [B, T], lengths."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids if input_ids.dim() == 2 else input_ids[None]
        lens = [ids.shape[1]] * ids.shape[0] if lengths is None else [int(n) for n in lengths]
    else:
        seqs = [list(s) for s in input_ids]
        lens = [len(s) for s in seqs]
        # assembled on the host, moved to the model's device by the caller
        ids = torch.zeros(len(seqs), max(lens, default=0), dtype=torch.long, device="cpu")
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = torch.tensor(s, dtype=torch.long, device="cpu")
    if len(lens) != ids.shape[0] or min(lens, default=0) < 1 or max(lens) > ids.shape[1]:
        raise MLAQuantError(f"prefill: lengths {lens} do not fit input_ids of shape {list(ids.shape)} (each ≥ 1)")
    return ids.long(), lens


class DecodeSession:
    """Prefill + decode for a batch of sequences over a (possibly quantized) paged latent cache.

    plan: "fp16" | "fp32" | "bf16" | "int8" | "int4" | "<ckv>/<kpe>" codec names | a plan directory |
    a `Plan`. backend: a `mlaquant.attention.backends.Backend` name, checked against the model's device once
    ("auto": per attention call the first backend of the device that takes it — Triton on CUDA where the kernel
    reads the codec, on CPU the fast path where this machine's routing rule says it is faster —, else torch).
    guard: an object with `after_prefill(session, rows)` and `after_decode(session, rows)` hooks
    (see `mlaquant.runtime.guard.Guard`), or None. device / dtype (`mlaquant.device`: "auto", "cpu", "cuda[:N]";
    "auto", "float32", "bfloat16", "float16"): when given, the model is moved / cast first, in place
    (`mlaquant.device.place`); the session runs wherever the model is, and a plan fits any device and dtype.
    """

    def __init__(
        self,
        model: MLAModel,
        plan: str | Path | Plan = "fp16",
        backend: str = "auto",
        runtime: str | Path | dict | RuntimeConfig | None = None,
        guard=None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> None:
        model = place(model, device, dtype)
        self.plan = resolve_plan(plan, model)
        self.backend = check_backend(backend, model.device)  # an explicit backend that cannot run raises
        self.model = self.plan.apply(model, self.backend)
        self.runtime = load_runtime_config(runtime)
        self.guard = guard
        cfg = model.cfg
        self.d_c = cfg.kv_lora_rank
        self.codecs = self.plan.layer_codecs()
        self.scale = model.layers[0].self_attn.scale
        self.cache: LatentCache | None = None
        self.lengths: list[int] = []
        self.fallback_events: list[dict] = []
        self.scratch = Buffers()  # the torch decode path's buffers, reused step after step

    def _new_cache(self, batch: int) -> LatentCache:
        return LatentCache(self.codecs, batch, self.runtime.block_size, self.model.device, self.plan.window)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor | Sequence[Sequence[int]], lengths=None) -> torch.Tensor:
        """Start a batch: input_ids [B, T] (right-padded when `lengths` differ) or a list of token lists.

        Returns logits [B, T, V] float32 on the model's device (positions past a sequence's length are NaN).
        """
        ids, lens = _as_batch(input_ids, lengths)
        ids = ids.to(self.model.device)
        B, T = ids.shape
        self.cache = self._new_cache(B)
        self.lengths = [0] * B
        written: list[list[torch.Tensor]] = [[] for _ in self.model.layers]
        logits = torch.full((B, T, self.model.cfg.vocab_size), float("nan"), device=ids.device)
        for b in range(B):
            chunk = self.runtime.chunk_for(lens[b])
            for start in range(0, lens[b], chunk):
                end = min(start + chunk, lens[b])
                logits[b, start:end] = self._prefill_chunk(b, ids[b : b + 1, start:end], start, written)[0]
            self.lengths[b] = lens[b]
        if self.guard is not None:
            self.guard.after_prefill(self, [torch.cat(rows) for rows in written])
        return logits

    def _prefill_chunk(self, b: int, ids: torch.Tensor, start: int, written: list) -> torch.Tensor:
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]

        def attend(layer: int, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            window = self.plan.window
            before = self.cache.recent_rows(layer, b) if window else None
            self.cache.write(layer, b, rows[0])
            if self.guard is not None:
                written[layer].append(rows[0])
            if not window:
                cached = self.cache.read(layer, b)[None]  # [1, L, d_c + d_r] float32
                return causal_attention(q.float(), cached, cached[..., : self.d_c], self.scale)
            near = torch.cat((before, rows[0].half().float()))[None]  # [1, W, d_c + d_r]: the FP16 window
            quantized = self.cache.read_quantized(layer, b)[None]
            near_kv = (near, near[..., : self.d_c])
            return causal_attention(q.float(), quantized, quantized[..., : self.d_c], self.scale, near_kv, window)

        return self.model.forward_absorbed(ids, positions, attend)

    @torch.no_grad()
    def decode(self, next_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Append one token per sequence: next_ids [B] → logits [B, V] float32 on the model's device."""
        if self.cache is None:
            raise MLAQuantError("decode: call prefill() first")
        ids = torch.as_tensor(next_ids, dtype=torch.long, device=self.model.device).reshape(-1, 1)
        if ids.shape[0] != self.cache.batch:
            raise MLAQuantError(f"decode: got {ids.shape[0]} tokens for a batch of {self.cache.batch}")
        positions = torch.tensor(self.lengths, device=ids.device)[:, None]
        new_rows: list[torch.Tensor] = []

        def attend(layer: int, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            for b in range(ids.shape[0]):
                self.cache.write(layer, b, rows[b])
            new_rows.append(rows[:, 0])
            return self.attend_cache(layer, q[:, 0].float())[:, None]

        logits = self.model.forward_absorbed(ids, positions, attend)[:, 0]
        self.lengths = [n + 1 for n in self.lengths]
        if self.guard is not None:
            self.guard.after_decode(self, new_rows)
        return logits

    def attend_cache(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """One query per sequence q [B, H, d_c + d_r] over all of `layer`'s cached rows → [B, H, d_c]."""
        outs, lses = [], []
        for seg in self.cache.layers[layer]:
            if sum(seg.lens) == 0:
                continue
            out, lse = ops.mla_decode(
                q,
                seg.pool,
                seg.block_table(),
                seg.seq_lens(),
                seg.codec,
                self.d_c,
                self.scale,
                self.backend,
                self.scratch,
            )
            outs.append(out)
            lses.append(lse)
        if self.plan.window:
            out, lse = self._attend_window(layer, q)
            outs.append(out)
            lses.append(lse)
        return merge_exact_lse(outs, lses)

    def _attend_window(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention partial over the FP16 window rows: q [B, H, D] → out [B, H, d_c], lse [B, H]."""
        recent = [self.cache.recent_rows(layer, b) for b in range(q.shape[0])]
        rows = torch.nn.utils.rnn.pad_sequence(recent, batch_first=True)  # [B, W, D]
        lens = torch.tensor([r.shape[0] for r in recent], device=q.device)
        valid = torch.arange(rows.shape[1], device=q.device)[None] < lens[:, None]
        visible = valid[:, None, None]  # [B, 1, 1, W]: every valid window row precedes the query
        out, lse = masked_attention(q[:, None], rows, rows[..., : self.d_c], self.scale, visible, with_lse=True)
        return out[:, 0], lse[:, :, 0]

    def cache_nbytes(self) -> int:
        """Bytes the cache stores for the tokens so far (codes, scales, zero points; no page padding)."""
        return 0 if self.cache is None else self.cache.nbytes()

    def widen_layer(self, layer: int, reason: str) -> bool:
        """Switch `layer` to its next wider codec for new tokens; False when already at FP16 or wider."""
        codec = self.cache.codec(layer)
        ckv, kpe = codec.ckv.spec.wider() or codec.ckv.spec, codec.kpe.spec.wider() or codec.kpe.spec
        if ckv == codec.ckv.spec and kpe == codec.kpe.spec:
            return False
        wider = self.plan.layer_codec(layer, ckv.name, kpe.name)
        self.cache.widen(layer, wider)
        event = {"layer": layer, "token": self.lengths[0], "from": codec.name, "to": wider.name, "reason": reason}
        self.fallback_events.append(event)
        log.warning("guard: layer %d %s → %s at token %d (%s)", layer, codec.name, wider.name, event["token"], reason)
        return True


@torch.no_grad()
def generate(
    model: MLAModel,
    prompt_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    plan: str | Path | Plan = "fp16",
    backend: str = "auto",
    stop_at_eos: bool = False,
    guard=None,
) -> list[list[int]]:
    """Complete each prompt by `max_new_tokens` tokens (greedy at temperature 0, else nucleus sampling).

    prompt_ids: [T], [B, T] or a list of token lists. `guard` (e.g. `mlaquant.runtime.guard.Guard()`) watches
    the cache as in `DecodeSession`. Returns the new tokens of each sequence.
    """
    if max_new_tokens < 0 or temperature < 0 or not 0 < top_p <= 1:
        raise MLAQuantError(
            f"generate: need max_new_tokens ≥ 0, temperature ≥ 0, 0 < top_p ≤ 1 (got "
            f"{max_new_tokens}, {temperature}, {top_p})"
        )
    if isinstance(prompt_ids, torch.Tensor):
        prompts = prompt_ids.reshape(-1, prompt_ids.shape[-1]).tolist()
    else:
        prompts = [list(prompt_ids)] if prompt_ids and isinstance(prompt_ids[0], int) else [list(p) for p in prompt_ids]
    session = DecodeSession(model, plan=plan, backend=backend, guard=guard)
    gen = torch.Generator(device=session.model.device).manual_seed(seed) if seed is not None else None
    logits = session.prefill(prompts)
    last = torch.stack([logits[b, len(p) - 1] for b, p in enumerate(prompts)])
    out: list[list[int]] = [[] for _ in prompts]
    eos_ids = set(model.cfg.eos_ids) if stop_at_eos else set()
    for step in range(max_new_tokens):
        nxt = sample_next(last, temperature, top_p, gen)
        for b, t in enumerate(nxt.tolist()):
            out[b].append(t)
        if eos_ids and all(o[-1] in eos_ids for o in out):
            break
        if step + 1 < max_new_tokens:
            last = session.decode(nxt)
    return out


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] → token ids [B]: argmax at temperature 0, else nucleus (top-p) sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the top token
    sorted_p = sorted_p * keep
    choice = torch.multinomial(sorted_p / sorted_p.sum(-1, keepdim=True), 1, generator=gen)
    return order.gather(-1, choice)[:, 0]
