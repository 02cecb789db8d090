"""llama.cpp as a peer engine: a Hugging Face MLA checkpoint → GGUF, per-token NLLs from llama.cpp (through
llama-cpp-python) with its latent cache in f16 / q8_0 / q4_0, and its batched greedy decode, timed per step, for
`mlaquant bench vllm` (`decode_steps`).

What llama.cpp does with an MLA cache (llama.cpp source, as vendored in llama-cpp-python 0.3.36):

    K cache   one row per token and layer: [c_kv (kv_lora_rank, after kv_a_layernorm) | k_pe (rope dim, after RoPE)]
              of `type_k` (src/models/deepseek2.cpp: Kcur = concat(kv_cmpr, k_pe); src/llama-graph.cpp
              build_attn(llm_graph_input_attn_k *): cpy_k). q8_0 / q4_0 blocks: 32 values, one FP16 scale.
    V cache   none: llama_kv_cache's constructor allocates no V tensor when hparams.is_mla() (has_v = !is_mla);
              build_attn reads V as a view of the first kv_lora_rank columns of the K cache.
    types     llama_init_from_model refuses type_k != type_v for MLA, and a quantized type_v needs flash
              attention, so a q8_0 / q4_0 latent cache is type_k = type_v = that type with flash attention on.
              Every token of a prefill reads its own row back from the cache, quantized: the strict contract
              mlaquant's `Evaluator` simulates.
    queries   the CPU flash-attention kernel (ggml-cpu/ops.cpp) keeps a prefill's queries FP32 against an f16
              cache (ggml_compute_forward_flash_attn_ext_tiled: K, V widened to FP32), but against q8_0 / q4_0
              rounds each query row to the cache type's vec_dot_type, q8_0 (..._f16_one_chunk: q_to_vec_dot),
              so llama.cpp's quantized-cache loss includes q8_0 queries as well as the cache's rounding.

Loading the bundled model takes three adaptations, none of which changes what the model computes:

    depth     the deepseek2 loader needs `q_lora_rank` unless the model has 26 or 27 layers ("lite"), so a
              q_lora-free checkpoint is padded to 26 layers with identity layers appended after the real
              ones: o_proj and every down_proj zero, so each adds exactly 0 to the residual stream
              (`padded_checkpoint`).
    routing   the converter writes llama.cpp's expert gating function only from an explicit
              `scoring_func`; without it llama.cpp gates V3 experts with softmax. The padded config
              states the scoring_func / topk_method mlaquant resolves for the checkpoint (topk_method does
              not reach the GGUF: llama.cpp adds e_score_correction_bias to the selection scores whenever the
              checkpoint has it, src/llama-graph.cpp build_moe_ffn).
    tokenizer the converter identifies the pre-tokenizer by a hash of a test string's tokens; the bundled
              byte-level BPE with the GPT-2 regex is llama.cpp's "gpt-2" but its hash is not in the list,
              so the converter runs in a subprocess (`python -m mlaquant.integrations.llamacpp`) whose
              `TextModel.get_vocab_base_pre` answers "gpt-2" where the hash is unknown. Token ids are fed
              directly, so the pre-tokenizer never runs: these GGUFs are for scoring ids, not for text.
              llama.cpp's BPE loader also needs merges, which mlaquant's synthetic byte tokenizer has none of:
              `add_a_merge` gives it one, never applied to ids.

Converted GGUFs are cached by a digest of the checkpoint's files (`gguf_for`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mlaquant.atomic import atomic_directory
from mlaquant.errors import MLAQuantError

LITE_LAYERS = 26  # a depth the deepseek2 loader accepts without q_lora_rank (26 or 27)
SOURCE_ENV = "MLAQUANT_LLAMA_CPP_SRC"
PADDING_VERSION = 1  # bump when padded_checkpoint's output changes, to invalidate cached GGUFs
LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# cache type → ggml_type: llama_cpp.GGML_TYPE_F16 / _Q8_0 / _Q4_0 (ggml's stable enum values, spelled out so that
# this module imports without llama_cpp; the tests check them against llama_cpp's)
CACHE_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}


def cache_ggml_type(cache_type: str) -> int:
    """The ggml type of a latent cache type (CACHE_TYPES); MLAQuantError naming the known ones otherwise."""
    if cache_type not in CACHE_TYPES:
        raise MLAQuantError(f"cache type {cache_type!r} is not one of {', '.join(CACHE_TYPES)}")
    return CACHE_TYPES[cache_type]


def unavailable() -> str | None:
    """None when llama_cpp imports and the converter source is found, else a one-line reason."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python is not installed ({e})"
    try:
        converter_source()
    except MLAQuantError as e:
        return str(e)
    return None


def converter_source() -> Path:
    """The llama.cpp source directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/: $MLAQUANT_LLAMA_CPP_SRC,
    else vendor/llama.cpp of the installed llama-cpp-python's sdist (`mlaquant.integrations.distributions.fetch`)."""
    if os.environ.get(SOURCE_ENV):
        source = Path(os.environ[SOURCE_ENV])
    else:
        import llama_cpp

        from mlaquant.integrations.distributions import fetch

        source = fetch("llama-cpp-python", llama_cpp.__version__, sdist=True) / "vendor" / "llama.cpp"
    if not (source / "convert_hf_to_gguf.py").is_file() or not (source / "gguf-py").is_dir():
        raise MLAQuantError(f"{source}: no convert_hf_to_gguf.py and gguf-py (llama.cpp source; set ${SOURCE_ENV})")
    return source


def _pad_tensor(suffix: str, t: torch.Tensor) -> torch.Tensor:
    """A padded layer's tensor `suffix` (name after `model.layers.{i}.`) from the template layer's: zero for the
    projections that write to the residual stream (attention out, every down projection), a copy otherwise."""
    if re.search(r"(self_attn\.o_proj|down_proj)(\.weight|\.bias)?$", suffix):
        return torch.zeros_like(t)
    return t.clone()


def padded_state(model_dir: Path, n_layers: int, layers: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (stored dtypes) plus layers n_layers … layers−1, each a copy of layer n_layers−1
    with o_proj and every down_proj zero (`_pad_tensor`). Tensors of layers ≥ n_layers (MTP) are refused."""
    from mlaquant.modeling.loader import TensorReader, weight_files

    reader = TensorReader(weight_files(model_dir))
    state = {name: reader.get(name) for name in sorted(reader.names())}
    extra = sorted({int(m[1]) for m in map(LAYER.fullmatch, state) if m and int(m[1]) >= n_layers})
    if extra:
        raise MLAQuantError(f"{model_dir}: tensors of layers {extra} beyond num_hidden_layers (MTP) cannot be padded")
    template = {m[2]: t for name, t in state.items() if (m := LAYER.fullmatch(name)) and int(m[1]) == n_layers - 1}
    for i in range(n_layers, layers):
        state.update({f"model.layers.{i}.{suffix}": _pad_tensor(suffix, t) for suffix, t in template.items()})
    return state


def padded_checkpoint(model_dir: str | Path, out_dir: str | Path, layers: int = LITE_LAYERS) -> Path:
    """A copy of the HF checkpoint at `out_dir` with identity layers appended up to `layers` (module docstring):
    one model.safetensors, config.json with num_hidden_layers = layers and the checkpoint's resolved scoring_func
    and topk_method, the tokenizer files. Written atomically; returns out_dir."""
    from safetensors.torch import save_file

    from mlaquant.modeling.loader import read_config

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    cfg = read_config(model_dir)
    if cfg.q_lora_rank:
        raise MLAQuantError(f"{model_dir}: q_lora_rank is set; llama.cpp loads it at any depth, no padding needed")
    n = cfg.num_hidden_layers
    if n > layers or any(cfg.is_moe_layer(i) != cfg.is_moe_layer(n - 1) for i in range(n, layers)):
        raise MLAQuantError(f"{model_dir}: cannot pad {n} layers to {layers} with copies of the last (dense vs MoE)")
    raw = json.loads((model_dir / "config.json").read_text())
    raw.update(num_hidden_layers=layers, scoring_func=cfg.scoring_func, topk_method=cfg.topk_method)
    state = padded_state(model_dir, n, layers)
    with atomic_directory(out_dir, mode=0o755) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, tmp / name)
    return out_dir


def _last_line(text: str, default: str) -> str:
    return next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), default)


def convert(model_dir: str | Path, out_file: str | Path, timeout: float = 1800.0) -> Path:
    """HF checkpoint directory → GGUF at `out_file` (outtype f32: weights exact) with llama.cpp's own
    convert_hf_to_gguf.py in a subprocess (`_convert_main`); written beside out_file and renamed into place.
    MLAQuantError with the converter's last stderr line on failure."""
    source, out_file = converter_source(), Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out_file.name}.", suffix=".partial", dir=out_file.parent)
    os.close(fd)
    partial = Path(name)
    path = [str(source), str(source / "gguf-py"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    cmd = [sys.executable, "-m", "mlaquant.integrations.llamacpp", str(model_dir), "--outtype", "f32",
           "--outfile", str(partial)]  # fmt: skip
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        partial.unlink(missing_ok=True)
        raise MLAQuantError(f"{model_dir}: llama.cpp conversion timed out after {timeout:.0f} s") from None
    if run.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise MLAQuantError(f"{model_dir}: llama.cpp conversion failed ({_last_line(run.stderr, 'no output')})")
    os.replace(partial, out_file)
    return out_file


def add_a_merge(model_dir: str | Path) -> None:
    """Give the checkpoint's merge-free byte-level BPE tokenizer (`mlaquant.modeling.synthetic`) one merge, "a" +
    "b" → a new id after the last: llama.cpp's BPE vocabulary loader refuses a GGUF without merges ("cannot find
    tokenizer merges in model file", src/llama-vocab.cpp). Token ids are fed directly, so the merge is never applied;
    the new id must fit in the model's vocab_size. Rewrites tokenizer.json in place (atomically)."""
    from mlaquant.atomic import atomic_write

    path = Path(model_dir) / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab, merges = tok["model"]["vocab"], tok["model"]["merges"]
    if merges:
        return
    new_id = 1 + max([*vocab.values(), *(t["id"] for t in tok.get("added_tokens", []))])
    if new_id >= json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]:
        raise MLAQuantError(f"{model_dir}: no id left in vocab_size for a tokenizer merge")
    vocab["ab"], tok["model"]["merges"] = new_id, [["a", "b"]]
    atomic_write(path, json.dumps(tok, ensure_ascii=False))


def checkpoint_digest(model_dir: str | Path) -> str:
    """sha256 (hex) over config.json, tokenizer.json and every weight file of the checkpoint (sorted by name)."""
    from mlaquant.modeling.loader import weight_files

    model_dir = Path(model_dir)
    files = [model_dir / "config.json", *sorted(set(weight_files(model_dir).values()))]
    if (model_dir / "tokenizer.json").is_file():
        files.append(model_dir / "tokenizer.json")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def gguf_for(model_dir: str | Path, cache_dir: str | Path, layers: int = LITE_LAYERS) -> Path:
    """The padded, converted GGUF of `model_dir` under `cache_dir`, named by the checkpoint's digest, the
    llama-cpp-python version and the depth: built on the first call, returned at once afterwards."""
    import llama_cpp

    key = f"{checkpoint_digest(model_dir)[:16]}-L{layers}-p{PADDING_VERSION}-llama-cpp-python-{llama_cpp.__version__}"
    cache_dir = Path(cache_dir)
    target = cache_dir / f"{key}.gguf"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".{key}.") as tmp:
        return convert(padded_checkpoint(model_dir, Path(tmp) / "padded", layers), target)


def token_logits(
    gguf_path: str | Path, tokens: torch.Tensor, cache_type: str, n_threads: int | None = None, flash_attn: bool = True
) -> torch.Tensor:
    """llama.cpp's next-token logits: tokens int64 [N, T] → float32 [N, T, V], entry [n, t] the logits after
    tokens[n, ≤ t]. Each row is one prefill from an empty cache whose latent is `cache_type` ("f16" | "q8_0" |
    "q4_0"; module docstring); one llama.cpp context serves all rows. `n_threads` (None: llama-cpp-python's
    defaults) runs the prefills; the logits do not depend on it. Quantized caches need flash attention
    (`flash_attn` applies to f16 only)."""
    import llama_cpp

    ggml_type = cache_ggml_type(cache_type)
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise MLAQuantError(f"tokens must be [N, T ≥ 2], got {list(tokens.shape)}")
    T = tokens.shape[1]
    llm = llama_cpp.Llama(
        model_path=str(gguf_path),
        n_ctx=T,
        n_batch=T,
        n_ubatch=T,
        n_threads=n_threads,
        n_threads_batch=n_threads,
        logits_all=True,
        type_k=ggml_type,
        type_v=ggml_type,
        flash_attn=flash_attn or cache_type != "f16",
        verbose=False,
    )
    try:
        rows = []
        for row in tokens.tolist():
            llm.reset()
            llm.eval(row)
            rows.append(torch.from_numpy(llm.scores[:T].copy()))
        return torch.stack(rows)
    finally:
        llm.close()


def token_nll(
    gguf_path: str | Path, tokens: torch.Tensor, cache_type: str, n_threads: int | None = None, flash_attn: bool = True
) -> torch.Tensor:
    """NLL of every next token under llama.cpp (`token_logits`): tokens int64 [N, T] → float64 [N, T−1],
    entry [n, t] = −log p(tokens[n, t+1] | tokens[n, ≤ t])."""
    logp = torch.log_softmax(token_logits(gguf_path, tokens, cache_type, n_threads, flash_attn)[:, :-1].double(), -1)
    return -logp.gather(-1, tokens[:, 1:, None])[..., 0]


def decode_steps(
    gguf_path: str | Path, prompts: list[list[int]], new: int, cache_type: str, n_threads: int, chunk: int = 2048,
    prefill_threads: int | None = None,
) -> tuple[list[list[int]], list[float]]:
    """llama.cpp's batched greedy decode: `prompts` (token ids, one sequence each) prefilled `chunk` tokens a call,
    then `new` steps that each decode one token of every sequence in one `llama_decode` — vLLM's continuous batch
    of equal sequences. Returns (the greedy tokens per prompt, the wall time of each decode step after the first).
    Latent cache `cache_type` (f16 / q8_0 / q4_0, flash attention on: the module docstring), decode on `n_threads`
    threads (llama.cpp runs a multi-token batch on n_threads_batch: both are set), the untimed prefill on
    `prefill_threads` (default: every core), one KV stream per sequence (llama.cpp's default, kv_unified off),
    through llama-cpp-python's C API."""
    import ctypes

    import llama_cpp
    import numpy as np

    ggml_type = cache_ggml_type(cache_type)
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # what Llama(verbose=False) does: errors only
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise MLAQuantError(f"{gguf_path}: llama.cpp could not load the model")
    params = llama_cpp.llama_context_default_params()
    per_seq = -(-(max(map(len, prompts)) + new) // 256) * 256
    params.n_ctx, params.n_seq_max = per_seq * len(prompts), len(prompts)
    params.n_batch = params.n_ubatch = max(chunk, len(prompts))
    params.n_threads = params.n_threads_batch = prefill_threads or os.cpu_count() or n_threads
    params.type_k = params.type_v = ggml_type
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        llama_cpp.llama_model_free(model)
        raise MLAQuantError(f"{gguf_path}: llama.cpp could not make a context ({cache_type} cache, "
                            f"n_ctx {params.n_ctx})")
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    def run(entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(entries)
        if (rc := llama_cpp.llama_decode(ctx, batch)) != 0:
            raise MLAQuantError(f"{gguf_path}: llama_decode returned {rc}")

    def greedy(i: int) -> int:
        row = llama_cpp.llama_get_logits_ith(ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (n_vocab,)).argmax())

    try:
        out = []
        for seq, prompt in enumerate(prompts):
            for start in range(0, len(prompt), params.n_batch):
                part = prompt[start : start + params.n_batch]
                run([(t, start + j, seq, start + j == len(prompt) - 1) for j, t in enumerate(part)])
            out.append([greedy(len(part) - 1)])
        llama_cpp.llama_set_n_threads(ctx, n_threads, n_threads)
        times = []
        for step in range(new - 1):
            started = time.perf_counter()
            run([(toks[-1], len(prompt) + step, seq, True) for seq, (prompt, toks) in enumerate(zip(prompts, out))])
            llama_cpp.llama_synchronize(ctx)
            times.append(time.perf_counter() - started)
            for seq, toks in enumerate(out):
                toks.append(greedy(seq))
        return out, times[1:]
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def _convert_main(argv: list[str]) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py with `argv`, a pre-tokenizer it does not recognize named "gpt-2"
    (module docstring). Called in the conversion subprocess, whose PYTHONPATH holds the converter source."""
    import runpy

    from conversion.base import TextModel

    recognize = TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return recognize(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    runpy.run_module("convert_hf_to_gguf", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _convert_main(sys.argv[1:])
