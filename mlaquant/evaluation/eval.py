"""Teacher-forced accuracy of a cache plan: relative perplexity increase, KL and top-1 agreement.

The plan's codecs fake-quantize (encode → decode) every layer's latent rows before attention, so each
token attends to exactly what a quantized cache would return for all earlier tokens and itself — the
strict form of the numerics contract, equal to step-by-step decode over the quantized cache (a test
proves it). The reference is the FP16 cache ("fp16" plan) on the same tokens.

    loss  = ppl_plan / ppl_fp16 − 1 = exp(mean NLL_plan − mean NLL_fp16) − 1
    kl    = mean over predicted tokens of KL(p_fp16 ‖ p_plan)          (nats)
    top1  = fraction of predicted tokens whose argmax agrees with FP16's

`by_position` repeats the loss per bucket of target positions ([lo, hi) of `POSITION_EDGES`, the
position counted from the start of the sample): where in a long context the quantized cache costs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mlaquant.errors import MLAQuantError
from mlaquant.modeling.protocol import LatentModel
from mlaquant.quant.codecs import LayerCodec

# Bucket edges of target positions for `EvalResult.by_position` (a sample of T tokens fills those below T).
POSITION_EDGES = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def position_spans(width: int, first: int = 0, edges: tuple[int, ...] = POSITION_EDGES) -> list[tuple[int, int]]:
    """The buckets of `edges` that target positions first … first + width − 1 reach, each clipped to
    those positions: [(start, end), ...], end exclusive (index into a per-position array of `width`
    entries, entry 0 = position `first`, as start − first … end − first)."""
    spans = [(max(lo, first), min(hi, first + width)) for lo, hi in zip(edges, edges[1:])]
    return [(a, b) for a, b in spans if a < b]


@dataclasses.dataclass
class EvalResult:
    """Metrics of one plan on one token set (loss/kl/top1 against the FP16 cache), and `by_position`:
    one dict per position bucket {positions: [lo, hi), tokens, nll, loss}."""

    nll: float
    ppl: float
    loss: float
    kl: float
    top1: float
    tokens: int
    by_position: list[dict] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: (round(v, 8) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass
class Scores:
    """Running sums of one plan's evaluation over the predicted tokens (shared by the in-memory and
    streamed evaluators and the peers): total NLL, KL and top-1 agreement, and `nll_pos` [T-1] float64,
    the NLL summed over samples per target position."""

    nll: float = 0.0
    kl: float = 0.0
    agree: float = 0.0
    nll_pos: torch.Tensor | None = None
    samples: int = 0

    def add(self, logits: torch.Tensor, ids: torch.Tensor, ref_logp: torch.Tensor | None) -> torch.Tensor:
        """logits [B, T-1, V] predicting ids[:, 1:] ([B, T]); ref_logp (FP16 reference) None = loss only.
        Returns the log-probabilities [B, T-1, V] FP32."""
        logp = F.log_softmax(logits, -1)
        target = logp.gather(-1, ids[:, 1:, None])  # [B, T-1, 1]
        self.nll -= target.sum().item()
        pos = -target[..., 0].double().sum(0).cpu()  # [T-1]
        self.nll_pos = pos if self.nll_pos is None else self.nll_pos + pos
        self.samples += ids.shape[0]
        if ref_logp is not None:
            ref = ref_logp.float()
            self.kl += (ref.exp() * (ref - logp)).sum().item()
            self.agree += (logp.argmax(-1) == ref.argmax(-1)).sum().item()
        return logp

    def result(self, tokens: int, ref: Scores, loss_only: bool) -> EvalResult:
        """Metrics against the FP16 reference's `ref` over the same `tokens` predicted tokens."""
        nll = self.nll / tokens
        return EvalResult(
            nll=nll,
            ppl=math.exp(nll),
            loss=math.exp(nll - ref.nll / tokens) - 1,
            kl=math.nan if loss_only else self.kl / tokens,
            top1=math.nan if loss_only else self.agree / tokens,
            tokens=tokens,
            by_position=self.by_position(ref),
        )

    def by_position(self, ref: Scores) -> list[dict]:
        """Per bucket of `POSITION_EDGES`: its target positions [lo, hi), tokens, mean NLL and the loss
        against `ref` on those positions."""
        out = []
        for lo, hi in position_spans(self.nll_pos.numel()):
            n = self.samples * (hi - lo)
            nll, ref_nll = float(self.nll_pos[lo:hi].sum()) / n, float(ref.nll_pos[lo:hi].sum()) / n
            out.append({"positions": [lo, hi], "tokens": n, "nll": nll, "loss": math.exp(nll - ref_nll) - 1})
        return out


def fake_quant_hook(codecs: list[LayerCodec | None], window: int = 0) -> Callable:
    """latent_rows hook quantizing layer i's rows with codecs[i] (None leaves the layer exact).

    With a residual window the cache holds rows as FP16 and quantizes them from FP16 when they leave
    the window, so the hook returns (fake_quant(fp16(rows)), fp16(rows)) for `MLAModel.forward`.
    """

    def hook(layer: int, rows: torch.Tensor):
        codec = codecs[layer]
        if codec is None:
            return rows
        if not torch.isfinite(rows).all():
            raise MLAQuantError(f"layer {layer}: latent rows contain NaN/Inf")
        if not window:
            return codec.fake_quant(rows)
        near = rows.half().to(rows.dtype)
        return codec.fake_quant(near), near

    return hook


class Evaluator:
    """Scores plans on fixed samples [N, T] against the FP16-cache reference, computed once.

    The reference's per-layer hidden states are kept so that a plan changing only layers ≥ i
    re-runs from layer i (`first_layer`). `model` is any `mlaquant.modeling.protocol.LatentModel`: a loaded
    `MLAModel` runs batch after batch, a `StreamedModel` layer-major with what is kept in its spill pool; the
    numbers are the same.
    """

    def __init__(self, model: LatentModel, samples: torch.Tensor, batch_size: int = 8, progress=None) -> None:
        if samples.dim() != 2 or samples.shape[1] < 2:
            raise MLAQuantError(f"evaluation samples must be [N, T ≥ 2], got {list(samples.shape)}")
        self.model = model
        self.samples = samples
        self.batches = [b.to(model.device) for b in samples.split(batch_size)]
        self.fp16 = [LayerCodec.from_names("fp16", "fp16", *model.cfg.latent_widths) for _ in model.layers]
        self.tokens = samples.shape[0] * (samples.shape[1] - 1)
        self.ref = self._reference(progress)

    @property
    def ref_nll(self) -> float:
        """The FP16 reference's mean NLL per predicted token."""
        return self.ref.nll / self.tokens

    def _reference(self, progress) -> Scores:
        """Run the FP16-cache reference once, keeping every layer's inputs per batch (`ref_inputs[layer][b]`
        [B, T, hidden]) and every batch's log-probabilities (`ref_logp[b]` [B, T-1, V] float16); returns its
        scores."""
        self.ref_logp = self.model.store()
        self.ref_inputs: list = []
        ref = Scores()

        def reference(b: int, logits: torch.Tensor) -> None:
            self.ref_logp.append(ref.add(logits[:, :-1], self.batches[b], None).half())

        hook = fake_quant_hook(self.fp16)
        self.model.run(self.batches, hook, layer_inputs=self.ref_inputs, on_logits=reference, progress=progress)
        return ref

    def evaluate(
        self,
        codecs: list[LayerCodec | None],
        first_layer: int = 0,
        model: LatentModel | None = None,
        window: int = 0,
        loss_only: bool = False,
    ) -> EvalResult:
        """Metrics with layer i's latent through codecs[i] (None = FP16). Layers < first_layer must be
        None or FP16 (they are replayed from the reference). `model` replaces the reference model
        (e.g. with rotated latents, `Plan.apply`); its layers < first_layer must be the reference's.
        `window` > 0 keeps each query's most recent `window` rows FP16 (a plan's residual window).
        `loss_only` skips KL and top-1 (reported as NaN): the plan search needs only the loss."""
        model = self.model if model is None else model
        hook_codecs = [c if c is not None else f for c, f in zip(codecs, self.fp16)]
        scores = Scores()
        self._score(model, hook_codecs, first_layer, window, scores, loss_only)
        return scores.result(self.tokens, self.ref, loss_only)

    def _score(self, model, hook_codecs: list[LayerCodec], first_layer: int, window: int, scores, loss_only) -> None:
        """Run every batch from `first_layer` with the latents through `hook_codecs`, adding to `scores`."""

        def score(b: int, logits: torch.Tensor) -> None:
            scores.add(logits[:, :-1], self.batches[b], None if loss_only else self.ref_logp[b])

        hook = fake_quant_hook(hook_codecs, window)
        model.run(self.batches, hook, first_layer, self.ref_inputs[first_layer], window=window, on_logits=score)


def sample_bytes(model: LatentModel, seq_len: int) -> int:
    """Working memory one evaluated sample of `seq_len` tokens needs on the device (upper estimate): FP32
    scores and probabilities [H, T, T], expanded FP32 K/V, FP32 logits / log-probs, and every layer's input
    hidden state kept by the evaluator's reference (weights' dtype)."""
    c, T = model.cfg, seq_len
    h = c.num_attention_heads
    attention = 2 * h * T * T * 4 + 2 * T * h * (c.qk_head_dim + c.v_head_dim) * 4
    logits = 3 * T * c.vocab_size * 4
    hidden = T * c.hidden_size * torch.empty(0, dtype=model.dtype, device="meta").element_size()
    return attention + logits + hidden * (len(model.layers) + 4)
