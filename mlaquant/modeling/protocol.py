"""`LatentModel`: what calibration and evaluation ask of a model, loaded whole or streamed layer by layer.

`mlaquant.modeling.model.MLAModel` and `mlaquant.modeling.stream.StreamedModel` both implement it, with
bit-identical numbers, so `mlaquant.evaluation.eval.Evaluator`, `mlaquant.calib.observers.observe` and
`mlaquant calibrate` run either without asking which it is. The pass they share is `run`: every batch of token
ids through the decoder layers with a `latent_rows` hook — batch-major on a loaded model, layer-major (one
decoder layer resident) on a streamed one — with the same arguments, the same hook calls per (layer, batch) and
the same logits per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Protocol, runtime_checkable

import torch

from mlaquant.modeling.model import MLAConfig


class TensorStore(Protocol):
    """Per-batch tensors a caller keeps across passes, indexed by batch: a list (loaded model) or a
    `mlaquant.modeling.stream.Store` (streamed model; spills to pinned memory or disk past its budget)."""

    def append(self, t: torch.Tensor) -> None: ...

    def __getitem__(self, b: int) -> torch.Tensor: ...

    def __len__(self) -> int: ...


@runtime_checkable
class LatentModel(Protocol):
    """A model whose latent rows can be observed, rotated and fake-quantized, and whose logits are scored.

    `cfg` the model config, `layers` its decoder layers (only `len` is read), `tokenizer` a `tokenizers`
    tokenizer or None, `source` where it was loaded from; `device` / `dtype` where and in what its weights
    run. `supports_int8_projections`: whether `mlaquant.modeling.int8_proj.with_int8_projections` (W8A8
    absorbed projections) applies to it.
    """

    cfg: MLAConfig
    layers: Sized
    tokenizer: object | None
    source: str | None
    supports_int8_projections: bool

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def fingerprint(self) -> str:
        """sha256 of the config and the weights (`mlaquant.modeling.model.weights_fingerprint`)."""
        ...

    def rotated(self, rotations: dict[int, torch.Tensor]) -> LatentModel:
        """The same function with layer i caching rows·R_i, R_i [d_c + d_r, d_c + d_r] float32 orthogonal
        (`mlaquant.modeling.model.with_latent_rotation`); shares the weights with this model."""
        ...

    def store(self) -> TensorStore:
        """An empty per-batch tensor store, kept where this model keeps its own (memory, or its spill pool)."""
        ...

    def run(
        self,
        batches: list[torch.Tensor],
        latent_rows: Callable | None = None,
        start_layer: int = 0,
        hidden: TensorStore | None = None,
        layer_inputs: list | None = None,
        window: int = 0,
        on_logits: Callable[[int, torch.Tensor], None] | None = None,
        progress=None,
    ) -> None:
        """Every batch of token ids [B, T] int64 through layers start_layer.. (`MLAModel.forward` semantics).

        `latent_rows(layer, rows [B, T, d_c + d_r])` may replace each layer's latent rows (or return
        (rows, rows_near) with `window` > 0); `hidden[b]` [B, T, hidden] resumes batch b at `start_layer`
        (default: the embeddings); `layer_inputs`, if a list, receives one `TensorStore` per layer
        (start_layer..) of every batch's input hidden state; `on_logits(b, logits [B, T, V] float32)` is called
        per batch, in batch order; `progress.update(1)` per batch.
        """
        ...
