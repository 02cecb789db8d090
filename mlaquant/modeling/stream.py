"""Layer-at-a-time execution of a checkpoint, for calibrating and exporting models too big to load.

`StreamedModel` never holds more than one decoder layer. A pass over a set of token batches goes
layer-major: read one layer's tensors from the memory-mapped safetensors shards (FP8 block-scaled
weights dequantized on the fly by the loader), run every batch through it, keep the outputs, free the
layer, move on. Peak memory ≈ one layer + the hidden states of all samples at one layer boundary.

On a CUDA `device` this is sequential onloading: one decoder layer's weights on the GPU at a time (read
from the memory-mapped shards, FP8 blocks dequantized on the GPU), the kept hidden states on the GPU
while they fit in `device_bytes` (default: half the GPU memory free at start), then in pinned CPU
memory up to `spill_bytes`, then on disk. On the CPU the first tier is empty: memory up to
`spill_bytes` (counted over everything the model keeps), then files in a private temporary directory.

Each step runs `MLAModel.forward` itself, on a one-layer view (`_View`) and on the same batches as a
loaded model, so every number — latent ranges, losses, the plan — is bit-identical to the full-load
run. `StreamedModel` implements `mlaquant.modeling.protocol.LatentModel` as `MLAModel` does, so the one
`mlaquant.evaluation.eval.Evaluator` and `mlaquant.calib.observers.observe` run either (layer-major here, through
`StreamedModel.run`); `mlaquant calibrate --stream` uses it.

Memory accounting, per pass: the current layer (its parameters in the compute dtype, plus the
checkpoint bytes of the tensor being converted), two hidden-state sets [N, T, hidden] (a layer's
inputs and outputs), and whatever the caller keeps (the evaluator's per-layer reference inputs and
reference log-probabilities — spilled to disk past the budget).
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import functools
import itertools
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mlaquant.errors import CheckpointError
from mlaquant.modeling.loader import TensorReader, read_config, read_parameter, resolve_model_path, weight_files
from mlaquant.modeling.model import (
    DecoderLayer,
    MLAModel,
    RMSNorm,
    RotaryEmbedding,
    weights_fingerprint,
    with_latent_rotation,
)

DEFAULT_SPILL_BYTES = 1 << 30


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where there is none (macOS, musl)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _return_freed_memory() -> None:
    """Give the heap pages of a freed layer back to the OS. glibc keeps freed blocks below its mmap
    threshold in the heap, so without this the process keeps the high-water mark of every layer."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class _SpillPool:
    """Decides, per kept tensor, where it lives: on the compute device while the kept device bytes stay
    ≤ device_bytes (a tensor already there stays), else in (pinned, for a CUDA device) CPU memory while the
    kept host bytes stay ≤ max_bytes, else on disk. `device` is where `Store` hands tensors back."""

    def __init__(self, directory: Path, max_bytes: int, device: torch.device, device_bytes: int = 0) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.device = device
        self.device_bytes = device_bytes
        self.in_memory = 0
        self.on_device = 0
        self._names = itertools.count()

    def keep(self, t: torch.Tensor) -> torch.Tensor | Path:
        n = t.numel() * t.element_size()
        if t.device.type != "cpu" and self.on_device + n <= self.device_bytes:
            self.on_device += n
            return t
        if self.in_memory + n <= self.max_bytes:
            self.in_memory += n
            if t.device.type == "cpu":
                return t
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
            return host.copy_(t)
        path = self.directory / f"{next(self._names)}.safetensors"
        save_file({"t": t.contiguous().cpu()}, str(path))
        return path

    def fetch(self, item: torch.Tensor | Path) -> torch.Tensor:
        """A kept tensor, on the compute device."""
        if isinstance(item, Path):
            return load_file(str(item), device=str(self.device))["t"]
        return item.to(self.device, non_blocking=True)

    def release(self, item: torch.Tensor | Path) -> None:
        if isinstance(item, Path):
            item.unlink(missing_ok=True)
        elif item.device.type != "cpu":
            self.on_device -= item.numel() * item.element_size()
        else:
            self.in_memory -= item.numel() * item.element_size()


class Store:
    """Per-batch tensors of one kind (e.g. every batch's hidden state entering layer i)."""

    def __init__(self, pool: _SpillPool) -> None:
        self.pool = pool
        self.items: list[torch.Tensor | Path] = []
        self._finalizer = weakref.finalize(self, _release_all, pool, self.items)

    def append(self, t: torch.Tensor) -> None:
        self.items.append(self.pool.keep(t))

    def __getitem__(self, b: int) -> torch.Tensor:
        return self.pool.fetch(self.items[b])

    def __len__(self) -> int:
        return len(self.items)

    def release(self) -> None:
        """Free the memory / files now (also happens when the store is garbage-collected)."""
        self._finalizer()


def _release_all(pool: _SpillPool, items: list) -> None:
    for item in items:
        pool.release(item)
    items.clear()


class _View(nn.Module):
    """The part of an `MLAModel` that `MLAModel.forward` touches when it runs layer i alone (layers = a
    list with the layer at index i) or only the head (layers = L placeholders, start_layer = L)."""

    def __init__(
        self, rotary: RotaryEmbedding, dtype: torch.dtype, layers: list, norm=None, lm_head=None, embed=None
    ) -> None:
        super().__init__()
        self.rotary = rotary
        self.dtype = dtype
        self.layers = nn.ModuleList(layers)
        self.norm = norm if norm is not None else nn.Identity()
        self.lm_head = lm_head if lm_head is not None else nn.Identity()
        self.embed_tokens = embed


class StreamedModel:
    """A checkpoint directory run one decoder layer at a time: a `mlaquant.modeling.protocol.LatentModel`
    (`cfg`, `layers` (only its length), `tokenizer`, `source`, `fingerprint()`, `rotated`, `store`, `run`), as
    `MLAModel` is, without W8A8 projections.

    `resident_layers` / `max_resident_layers` count decoder layers alive in memory (tests use them).
    """

    supports_int8_projections = False  # `with_int8_projections` rewrites resident layers; none is resident here

    def __init__(
        self,
        path: str | Path | None = None,
        dtype: str | torch.dtype | None = "auto",
        spill_bytes: int = DEFAULT_SPILL_BYTES,
        spill_dir: str | Path | None = None,
        device: str | torch.device = "cpu",
        device_bytes: int | None = None,
    ) -> None:
        """dtype: of the weights ("auto": bfloat16 on CUDA, float32 on CPU); device: where each layer runs
        ("auto", "cpu", "cuda[:N]"); device_bytes: hidden-state bytes kept on a CUDA device (None: half the
        memory free now); spill_bytes: host bytes kept before spilling to files in `spill_dir`."""
        from mlaquant.device import free_bytes, resolve_device, resolve_dtype

        self.device = resolve_device(device)
        dtype = resolve_dtype(dtype, self.device)
        path = resolve_model_path(path)
        if not path.is_dir():
            raise CheckpointError(f"{path}: model directory not found")
        self.path = path
        self.cfg = read_config(path)
        self._files = weight_files(path)
        self.dtype = dtype
        self.source = str(path)
        self.layers = range(self.cfg.num_hidden_layers)
        self.rotations: dict[int, torch.Tensor] = {}
        self.rotary = RotaryEmbedding(self.cfg).to(self.device)
        self._meta = self._meta_model()
        tmp = Path(tempfile.mkdtemp(prefix="mlaquant-stream-", dir=spill_dir))
        if device_bytes is None:
            device_bytes = (free_bytes(self.device) or 0) // 2
        self.pool = _SpillPool(tmp, spill_bytes, self.device, device_bytes)
        # the directory goes with the pool, which `rotated` copies and every Store keep alive
        weakref.finalize(self.pool, shutil.rmtree, tmp, True)
        self._resident: weakref.WeakSet = weakref.WeakSet()
        self.max_resident_layers = 0
        self._fingerprint: str | None = None
        self.tokenizer = None
        tok = path / "tokenizer.json"
        if tok.is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(tok))

    def _meta_model(self) -> MLAModel:
        with torch.device("meta"):
            return MLAModel(self.cfg)

    def __repr__(self) -> str:
        return f"StreamedModel({self.source}, layers={len(self.layers)}, rotated={sorted(self.rotations)})"

    @property
    def resident_layers(self) -> int:
        return len(self._resident)

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> StreamedModel:
        """Run later layers on `device` in `dtype` (nothing is resident to move); returns self."""
        if device is not None:
            self.device = self.pool.device = torch.device(device)
            self.rotary = self.rotary.to(self.device)
        if dtype is not None:
            self.dtype = dtype
        return self

    def rotated(self, rotations: dict[int, torch.Tensor]) -> StreamedModel:
        """The streamed twin of `with_latent_rotation(model, rotations)` (shares files and spill pool)."""
        new = copy.copy(self)
        new.rotations = {**self.rotations, **rotations}
        return new

    def store(self) -> Store:
        """An empty `Store` in the model's spill pool: where a caller keeps per-batch tensors across `run`s."""
        return Store(self.pool)

    # --- tensors -----------------------------------------------------------------------------------

    def _tensor(self, reader: TensorReader, name: str, shape: tuple) -> torch.Tensor:
        """Our parameter `name` from the checkpoint, converted exactly as `load_model` converts it."""
        cfg = self.cfg
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            name = "embed_tokens.weight"
        t = read_parameter(reader, cfg, name, shape, self.path)
        return t.to(device=self.device, dtype=self.dtype if t.is_floating_point() else t.dtype)

    def _load(self, module: nn.Module, prefix: str) -> nn.Module:
        """Materialize a meta `module` (our names under `prefix`) from the checkpoint."""
        params = module.state_dict(keep_vars=True)
        # a reader per tensor: its memory maps close as soon as the tensor is converted, so mapped
        # checkpoint pages never add up to more than one tensor
        state = {
            n: self._tensor(TensorReader(self._files, self.device), prefix + n, p.shape) for n, p in params.items()
        }
        module.load_state_dict(state, strict=False, assign=True)
        left = [n for n, t in itertools.chain(module.named_parameters(), module.named_buffers()) if t.is_meta]
        if left:
            raise CheckpointError(f"{self.path}: no checkpoint tensor for {prefix}{left[0]}")
        return module.eval()

    def load_layer(self, i: int) -> DecoderLayer:
        """Decoder layer i in the compute dtype (with its latent rotation folded in, if any)."""
        with torch.device("meta"):
            layer = DecoderLayer(self.cfg, i)
        layer = self._load(layer, f"layers.{i}.")
        if i in self.rotations:
            # the exact code `with_latent_rotation` runs on a loaded model, on a view holding this layer
            layer = with_latent_rotation(self._view_of(i, layer), {i: self.rotations[i]}).layers[i]
        self._resident.add(layer)
        self.max_resident_layers = max(self.max_resident_layers, len(self._resident))
        return layer

    def _view_of(self, i: int, layer: nn.Module) -> _View:
        return _View(self.rotary, self.dtype, [None] * i + [layer])

    def _embed_view(self) -> _View:
        with torch.device("meta"):
            embed = nn.Embedding(self.cfg.vocab_size, self.cfg.hidden_size)
        return _View(self.rotary, self.dtype, [], embed=self._load(embed, "embed_tokens."))

    def _head_view(self) -> _View:
        cfg = self.cfg
        with torch.device("meta"):
            norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        norm, head = self._load(norm, "norm."), self._load(head, "lm_head.")
        return _View(self.rotary, self.dtype, [None] * len(self.layers), norm, head)

    def fingerprint(self) -> str:
        """`MLAModel.fingerprint()` of the loaded checkpoint, computed one tensor at a time (cached)."""
        if self._fingerprint is None:
            named = sorted(self._meta.state_dict().items())
            tensors = ((n, self._tensor(TensorReader(self._files), n, p.shape)) for n, p in named)
            self._fingerprint = weights_fingerprint(self.cfg, tensors)
            _return_freed_memory()
        return self._fingerprint

    # --- the layer-major pass ----------------------------------------------------------------------

    @torch.no_grad()
    def run(
        self,
        batches: list[torch.Tensor],
        latent_rows: Callable | None = None,
        start_layer: int = 0,
        hidden: Store | None = None,
        layer_inputs: list[Store] | None = None,
        window: int = 0,
        on_logits: Callable[[int, torch.Tensor], None] | None = None,
        progress=None,
    ) -> None:
        """Every batch [B, T] through layers start_layer.. , one layer at a time.

        Same arguments as `MLAModel.forward`, for all batches at once: `hidden` holds each batch's input
        of `start_layer` (default: the embeddings); `layer_inputs`, if a list, receives one Store per layer
        with every batch's input of that layer (the caller owns them); `on_logits(b, logits [B, T, V])` is
        called per batch, in order, after the last layer (no head is loaded without it).
        """
        batches = [ids.to(self.device) for ids in batches]
        owned = hidden is None
        if hidden is None:
            view = self._embed_view()
            hidden = Store(self.pool)
            for ids in batches:
                hidden.append(MLAModel.forward(view, ids).to(self.dtype))
            del view
        for i in range(start_layer, len(self.layers)):
            view = self._view_of(i, self.load_layer(i))
            out = Store(self.pool)
            for b, ids in enumerate(batches):
                h = MLAModel.forward(view, ids, latent_rows, start_layer=i, hidden=hidden[b], window=window)
                out.append(h.to(self.dtype))  # the identity head returned h.float()
            del view
            _return_freed_memory()
            if layer_inputs is not None:
                layer_inputs.append(hidden)
            elif owned:
                hidden.release()
            hidden, owned = out, True
        view = self._head_view() if on_logits is not None else None
        for b, ids in enumerate(batches):
            if view is not None:
                on_logits(b, MLAModel.forward(view, ids, start_layer=len(self.layers), hidden=hidden[b]))
            if progress is not None:
                progress.update(1)
        if owned:
            hidden.release()
