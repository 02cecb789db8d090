"""Peer baselines for `mlaquant sweep`, measured on the same checkpoint and tokens as our own rows.

    transformers         the checkpoint run by transformers (DeepseekV2/V3ForCausalLM) with its default
                         `DynamicCache`, which holds the latent [c_kv | k_pe] in the model dtype
    quanto-int4, -int2   transformers' `QuantizedCache`, optimum-quanto backend (asymmetric, groups of
                         `group_size` channels per token, FP scale + zero point per group)
    hqq-int4, -int2      the same cache with the HQQ backend (half-quadratic optimised zero points)
    bnb-nf4              bitsandbytes' blockwise NF4 codec (`quantize_4bit`) applied to the latent rows
    llama.cpp-f16|q8_0|q4_0  llama.cpp itself (llama-cpp-python, `mlaquant.integrations.llamacpp`) with its latent
                         cache of that type, teacher-forced prefills of the same tokens

The transformers peers run teacher-forced *step decoding*: one token per forward, every earlier token
read back from the cache, batched over the samples. So a `QuantizedCache` is measured as it behaves —
up to `residual_length` recent tokens kept in the model dtype, the rest re-quantized whenever the
residual fills. NF4 plugs into `mlaquant.evaluation.eval.Evaluator` like our codecs (the latent fake-quantized
before attention, every token through the quantized cache).

Bytes are counted from what each cache stores: the tensors it holds after the run (codes, scales,
zero points, NF4 absmax) divided by the tokens they cover. A peer that cannot run here raises
`PeerUnavailable` with a one-line reason, which the report prints in place of the numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import re
import statistics
import time
from pathlib import Path

import torch

from mlaquant.errors import MLAQuantError
from mlaquant.evaluation.eval import EvalResult, Evaluator, Scores
from mlaquant.versions import package_version

PEERS = ("transformers", "quanto-int4", "quanto-int2", "hqq-int4", "hqq-int2", "bnb-nf4",
         "llama.cpp-f16", "llama.cpp-q8_0", "llama.cpp-q4_0")
LLAMA_CPP_CODECS = {"f16": "fp16", "q8_0": "q8_0", "q4_0": "q4_0"}  # what each llama.cpp cache stores
_QUANT_RE = re.compile(r"^(quanto|hqq)-int(\d)$")
BACKEND_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
BACKEND_PACKAGE = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
BNB_BLOCKSIZES = (4096, 2048, 1024, 512, 256, 128, 64, 32)


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with n torch threads (None: leave as is). Batch-1 decode of a small model is
    latency-bound; one thread avoids OpenMP stalls that dominate step times on a shared machine."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class PeerUnavailable(MLAQuantError):
    """A peer that cannot run here (library missing, shapes it does not support); the message says why."""


@dataclasses.dataclass(frozen=True)
class PeerSpec:
    """One peer row: `transformers`, `<quanto|hqq>-int<bits>` or `bnb-nf4`."""

    name: str
    backend: str | None = None
    nbits: int | None = None

    @classmethod
    def parse(cls, name: str) -> PeerSpec:
        text = name.strip().lower()
        if text in ("transformers", "bnb-nf4"):
            return cls(text)
        if text.startswith("llama.cpp-") and text.split("-", 1)[1] in LLAMA_CPP_CODECS:
            return cls(text, "llama.cpp")
        m = _QUANT_RE.match(text)
        if m is None or int(m.group(2)) not in BACKEND_BITS[m.group(1)]:
            raise MLAQuantError(
                f"peer {name!r} unknown (known: transformers, bnb-nf4, quanto-int2|4, hqq-int1|2|3|4|8, "
                "llama.cpp-f16|q8_0|q4_0)"
            )
        return cls(text, m.group(1), int(m.group(2)))


def common_group(size: int, *widths: int) -> int:
    """Largest power-of-two group ≤ size dividing every width (QuantizedCache groups k_pe like c_kv)."""
    g = 1 << max(0, int(size).bit_length() - 1)
    while g > 1 and any(w % g for w in widths):
        g //= 2
    return g


def score_logits(evaluator: Evaluator, logits: list[torch.Tensor]) -> EvalResult:
    """Metrics of next-token logits [B, T, V] per evaluator batch against its FP16-latent reference
    (`mlaquant.evaluation.eval.Scores`, as `Evaluator.evaluate`: loss = ppl/ppl_fp16 − 1, KL(fp16 ‖ peer), top-1)."""
    scores = Scores()
    for ids, ref_logp, lg in zip(evaluator.batches, evaluator.ref_logp, logits):
        scores.add(lg[:, :-1].to(ids.device).float(), ids, ref_logp)
    return scores.result(evaluator.tokens, evaluator.ref, loss_only=False)


class NF4Codec:
    """bitsandbytes NF4 on each part of a latent row; duck-types `LayerCodec` for `mlaquant.evaluation.eval`.

    Each part (c_kv, k_pe) is quantized with `quantize_4bit(quant_type="nf4")` in blocks of `block`
    channels (the largest bnb block size ≤ `blocksize` dividing the part; blocks never span rows). A part
    narrower than bnb's smallest block (32) stays FP16. Stored per row: W/2 code bytes + one FP32
    absmax per block (bnb keeps absmax in FP32); the 16-entry NF4 code table is per tensor, not per row.
    """

    def __init__(self, d_c: int, d_r: int, blocksize: int = 64) -> None:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise PeerUnavailable("bitsandbytes not installed (pip install bitsandbytes)")
        from bitsandbytes import functional as bnbf

        self._bnbf = bnbf
        self.blocks = [next((b for b in BNB_BLOCKSIZES if b <= blocksize and w % b == 0), None) for w in (d_c, d_r)]
        self.widths = (d_c, d_r)
        self.width = d_c + d_r
        probe = torch.randn(4, self.width)
        self.row_bytes = self._stored_bytes(probe) // 4
        self.name = "/".join("fp16" if b is None else f"nf4-b{b}" for b in self.blocks)

    def _parts(self, rows: torch.Tensor):
        return zip(rows.split(list(self.widths), dim=-1), self.blocks)

    def _stored_bytes(self, rows: torch.Tensor) -> int:
        total = 0
        for part, block in self._parts(rows):
            if block is None:
                total += part.numel() * 2
                continue
            q, state = self._bnbf.quantize_4bit(part.contiguous(), blocksize=block, quant_type="nf4")
            total += q.numel() * q.element_size() + state.absmax.numel() * state.absmax.element_size()
        return total

    def fake_quant(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., d_c + d_r] → dequantize_4bit(quantize_4bit(rows)) per part, in rows' dtype."""
        out = []
        for part, block in self._parts(rows):
            if block is None:
                out.append(part.half().to(rows.dtype))
                continue
            q, state = self._bnbf.quantize_4bit(part.contiguous(), blocksize=block, quant_type="nf4")
            out.append(self._bnbf.dequantize_4bit(q, state).to(rows.dtype))
        return torch.cat(out, dim=-1)


def _tensor_bytes(obj) -> tuple[int, int, int]:
    """(code bytes, float metadata bytes, float metadata elements) of a stored object: a tensor, a
    quanto tensor subclass (walked through `__tensor_flatten__`), or tuples / dicts of those (HQQ's
    (codes, meta)). Integer tensors are codes; floating tensors are scales and zero points."""
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, tuple | list):
        parts = [_tensor_bytes(x) for x in obj]
        return sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts)
    if not isinstance(obj, torch.Tensor):
        return 0, 0, 0
    if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
        names, _ = obj.__tensor_flatten__()
        return _tensor_bytes([getattr(obj, n) for n in names])
    nbytes = obj.numel() * obj.element_size()
    return (0, nbytes, obj.numel()) if obj.is_floating_point() else (nbytes, 0, 0)


class TransformersPeers:
    """The checkpoint in transformers, for the `transformers` and `QuantizedCache` peer rows."""

    def __init__(
        self,
        path: str | Path,
        dtype: torch.dtype,
        d_c: int,
        d_r: int,
        group_size: int,
        residual_length: int,
        device: torch.device | str = "cpu",
    ) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()  # the sweep has its own
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(self.device).eval()
        self.d_c, self.d_r = d_c, d_r
        self.group = common_group(group_size, d_c, d_r)
        self.residual_length = residual_length
        self.dtype_bytes = torch.empty(0, dtype=dtype, device="meta").element_size()

    def label(self, spec: PeerSpec) -> str:
        if spec.backend is None:
            return f"transformers DynamicCache ({str(self.model.dtype).removeprefix('torch.')} latent)"
        return f"QuantizedCache {spec.backend} int{spec.nbits} g{self.group} R={self.residual_length}"

    def new_cache(self, spec: PeerSpec):
        from transformers import DynamicCache, QuantizedCache

        if spec.backend is None:
            return DynamicCache(config=self.model.config)
        module, package = BACKEND_PACKAGE[spec.backend]
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            raise PeerUnavailable(f"{package} not installed (pip install {package})")
        return QuantizedCache(
            spec.backend,
            self.model.config,
            nbits=spec.nbits,
            q_group_size=self.group,
            residual_length=self.residual_length,
        )

    @torch.no_grad()
    def step_logits(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """Teacher-forced step decoding of ids [B, T] through `cache` → logits [B, T, V] float32."""
        B, T = ids.shape
        ids = ids.to(self.device)
        out = torch.empty(B, T, self.model.config.vocab_size, device=self.device)
        for t in range(T):
            pos = torch.full((B, 1), t, dtype=torch.long, device=self.device)
            step = self.model(ids[:, t : t + 1], cache=cache, use_cache=True, position_ids=pos)
            out[:, t] = step.logits[:, 0]
        return out

    def storage(self, cache, batch: int) -> dict:
        """Bytes per token per layer of what `cache` holds (quantized part, and the residual's rate)."""
        width = self.d_c + self.d_r
        layers = cache.layers
        if not hasattr(layers[0], "_quantized_keys"):
            total = sum(layer.keys.numel() * layer.keys.element_size() for layer in layers)
            total += sum(layer.values.numel() * layer.values.element_size() for layer in layers)
            tokens = layers[0].keys.shape[-2] * batch
            bpt = total / (len(layers) * tokens)
            return {"bytes_per_token_per_layer": bpt, "bits_per_value": 8 * bpt / width}
        code = meta_bytes = meta_count = tokens = 0
        for layer in layers:
            for stored in (layer._quantized_keys, layer._quantized_values):
                c, mb, mc = _tensor_bytes(stored)
                code, meta_bytes, meta_count = code + c, meta_bytes + mb, meta_count + mc
            residual = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0
            tokens += (layer.cumulative_length - residual) * batch
        bpt = (code + meta_bytes) / tokens
        return {
            "bytes_per_token_per_layer": bpt,
            "bits_per_value": 8 * bpt / width,
            # the same storage with 16-bit scales / zero points (what an FP16/BF16 model would hold)
            "bits_per_value_16bit_meta": 8 * (code + 2 * meta_count) / tokens / width,
            # most recent tokens held unquantized at most (the residual is flushed when it reaches R)
            "residual_tokens": self.residual_length - 1,
            "residual_bytes_per_token_per_layer": width * self.dtype_bytes,
        }

    @torch.no_grad()
    def decode_tokens_per_s(self, spec: PeerSpec, prompt: torch.Tensor, steps: int) -> float:
        """Batch-1 greedy decode speed after a prefill of prompt [1, C]: 1 / median step time."""
        cache = self.new_cache(spec)
        prompt = prompt.to(self.device)
        C = prompt.shape[1]
        logits = self.model(prompt, cache=cache, use_cache=True).logits[:, -1]
        times = []
        for k in range(steps + 1):  # the first step is a warm-up
            nxt = logits.argmax(-1, keepdim=True)
            pos = torch.tensor([[C + k]], device=self.device)
            t0 = time.perf_counter()
            logits = self.model(nxt, cache=cache, use_cache=True, position_ids=pos).logits[:, -1]
            times.append(time.perf_counter() - t0)
        return 1.0 / statistics.median(times[1:])

    def measure(
        self,
        spec: PeerSpec,
        evaluator: Evaluator,
        prompt: torch.Tensor,
        steps: int,
        threads: int | None,
        batch_size: int,
    ) -> dict:
        """One peer row: step decoding of the evaluator's samples in batches of `batch_size` (each step
        is one transformers forward, so larger batches mean fewer Python-bound steps)."""
        samples = evaluator.samples
        logits, storage = [], {}
        for ids in samples.split(batch_size):
            cache = self.new_cache(spec)
            logits.append(self.step_logits(ids, cache))
            storage = self.storage(cache, ids.shape[0])
        per_batch = torch.cat(logits).split([ids.shape[0] for ids in evaluator.batches])
        with torch_threads(threads):
            speed = self.decode_tokens_per_s(spec, prompt, steps)
        codec = "fp32 latent" if spec.backend is None else f"{spec.backend}-int{spec.nbits}-g{self.group}"
        return {
            "label": self.label(spec),
            "codec": codec,
            **storage,
            "metrics": score_logits(evaluator, list(per_batch)).as_dict(),
            "decode_tokens_per_s": speed,
        }


def measure_nf4(evaluator: Evaluator, blocksize: int) -> dict:
    """The bnb NF4 row: our evaluator with every layer's latent through `NF4Codec`."""
    model = evaluator.model
    codec = NF4Codec(*model.cfg.latent_widths, blocksize)
    result = evaluator.evaluate([codec] * len(model.layers))
    notes = "" if None not in codec.blocks else "a part narrower than bnb's smallest block (32) is kept FP16"
    return {
        "label": f"bitsandbytes NF4 ({codec.name})",
        "codec": codec.name,
        "bytes_per_token_per_layer": float(codec.row_bytes),
        "bits_per_value": 8 * codec.row_bytes / codec.width,
        "metrics": result.as_dict(),
        "decode_tokens_per_s": None,
        "decode_note": "fake-quantized reference codec; no NF4 cache to decode from",
        "notes": notes,
    }


def measure_llama_cpp(evaluator: Evaluator, cache_type: str) -> dict:
    """A llama.cpp row: its logits on the evaluator's tokens, its latent cache `cache_type`, scored against our
    FP16-latent reference (`score_logits`); PeerUnavailable where llama.cpp cannot run the model here."""
    from mlaquant.integrations import llamacpp
    from mlaquant.integrations.distributions import cache_dir
    from mlaquant.quant.codecs import LayerCodec

    reason = llamacpp.unavailable()
    if reason is not None:
        raise PeerUnavailable(reason)
    model = evaluator.model
    gguf = llamacpp.gguf_for(model.source, cache_dir() / "gguf")
    logits = [llamacpp.token_logits(gguf, ids.cpu(), cache_type, n_threads=1) for ids in evaluator.batches]
    part = LLAMA_CPP_CODECS[cache_type]
    row = LayerCodec.from_names(part, part, *model.cfg.latent_widths)
    return {
        "label": f"llama.cpp {cache_type} (llama-cpp-python {package_version('llama-cpp-python')})",
        "codec": row.name,
        "bytes_per_token_per_layer": float(row.row_bytes),
        "bits_per_value": 8 * row.row_bytes / row.width,
        "metrics": score_logits(evaluator, logits).as_dict(),
        "decode_tokens_per_s": None,
        "decode_note": "scored from llama.cpp's prefill logits",
    }

