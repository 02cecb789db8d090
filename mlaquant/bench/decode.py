"""`mlaquant bench`: speed benchmarks, always a ratio against a baseline measured in the same run.

    mlaquant bench decode   per-step decode time at several contexts on a model with DeepSeek-V2-Lite
                            attention shapes (random weights): ours (absorbed, paged latent cache, FP16 /
                            INT8 / INT4) against transformers' DeepseekV2 (re-expands K/V every step)
    mlaquant bench kernels  the Triton kernels on a CUDA device (see mlaquant.bench.kernels)
    mlaquant bench gpu      the GPU acceptance run → report.md + report.json (mlaquant.bench.gpu,
                            registered by mlaquant.cli)
    mlaquant bench memory   cache bytes per token per layer: FP16 latent vs the per-head K/V of MHA
                            with the same heads, for DeepSeek-V3, V2-Lite and the bundled model

Both caches are filled with the same latent rows (no prefill), then each side decodes `--steps` tokens;
the median step time is reported. Steps of all sides are interleaved round by round, so a drift of
the machine's speed hits every side alike. Each side's MLPs are also timed alone on one token, in the
same rounds, which splits the step into MLP and the rest (attention, its projections, norms,
lm_head): "without MLP" is the ratio of the rests. "weights" times one pass of a token through every
weight matrix our step reads (projections, W_UK / W_UV, MLPs, lm_head) and nothing else: at batch 1
that streaming is the floor of our step, and "ceiling" — transformers' step over it — the largest
whole-step speed-up FP32 weights allow.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mlaquant.device import add_device_arguments
from mlaquant.device import from_args as device_from_args
from mlaquant.errors import MLAQuantError

V2_LITE_ATTENTION = dict(
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    q_lora_rank=None,
    intermediate_size=5632,
    vocab_size=4096,
    n_routed_experts=4,  # unused: every layer is below first_k_dense_replace, so all MLPs are dense
    first_k_dense_replace=1000,
    max_position_embeddings=32768,
)


def add_arguments(p: argparse.ArgumentParser) -> argparse._SubParsersAction:
    """The `bench` subcommands; returns their subparsers action (`mlaquant.cli` adds `bench gpu` to it)."""
    sub = p.add_subparsers(dest="bench", metavar="WHAT", required=True)
    d = sub.add_parser("decode", help="decode step time: ours vs transformers (CPU ok)")
    d.add_argument("--contexts", default="1024,4096,16384", help="comma-separated context lengths")
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--steps", type=int, default=11,
                   help="timed decode steps per configuration (median); with --batch, at least this many rounds, "
                   "more until each call has run 0.2 s")
    d.add_argument("--codecs", default="fp16,int8,int4", help="our cache codecs to time (first is the base)")
    d.add_argument(
        "--intermediate-size",
        type=int,
        default=V2_LITE_ATTENTION["intermediate_size"],
        help="dense MLP width; a small one leaves mostly attention + projections in the step",
    )
    d.add_argument(
        "--batch",
        default=None,
        help="comma-separated batch sizes: time the decode-attention call per batch, codec and path "
        "(reference / fast) against the machine bound instead of whole steps (mlaquant.bench.attention)",
    )
    d.add_argument(
        "--fast-blocks",
        default="",
        help="with --batch: extra fast-path rows, comma-separated BLOCKxGROUP (tokens per sequence and block "
        "x sequences per group, e.g. 1024x2,4096x1) to tune mlaquant.attention.cpu_decode's defaults",
    )
    d.add_argument("--out", default=None, help="also write the table as JSON here")
    add_device_arguments(d)
    m = sub.add_parser("memory", help="FP16 latent vs per-head K/V cache bytes per token per layer")
    m.add_argument("--model", default=None, help="also a checkpoint directory (default: the bundled model)")
    k = sub.add_parser("kernels", help="Triton kernel benchmark (needs CUDA)")
    from mlaquant.bench import kernels as kernel_bench

    kernel_bench.add_arguments(k)
    k.set_defaults(_kernels=kernel_bench.run)
    return sub


def _median_steps(steps: dict, n: int) -> dict:
    """Median seconds of each named step function over n rounds; each round runs every step once in
    turn, so a drift of the machine's speed (shared memory bandwidth) hits all sides alike."""
    for step in steps.values():
        step()  # warm-up
    times = {name: [] for name in steps}
    for _ in range(n):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _ours_step(model, rows: list[torch.Tensor], codec: str):
    from mlaquant.runtime.cache import LatentCache
    from mlaquant.runtime.session import DecodeSession

    session = DecodeSession(model, plan=codec, backend="torch")
    session.cache = LatentCache(session.codecs, 1, session.runtime.block_size, model.device)
    for layer, r in enumerate(rows):
        session.cache.write(layer, 0, r)
    session.lengths = [rows[0].shape[0]]
    token = torch.tensor([1], device=model.device)
    return lambda: session.decode(token)


def _mlps_step(mlps: list, hidden: int, weight: torch.Tensor):
    """One token [1, 1, hidden] (on `weight`'s device, in its dtype) through every layer's MLP in turn."""
    x = torch.randn(1, 1, hidden, generator=torch.Generator(device="cpu").manual_seed(0), device="cpu").to(weight)

    def step() -> None:
        with torch.no_grad():
            for mlp in mlps:
                mlp(x)

    return step


def _weights_step(model):
    """One token through every weight matrix a decode step of `model` reads (all of them in a dense
    model such as the benchmark's), as matrix-vector products."""
    weights = [m.weight for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    weights.append(model.lm_head.weight)
    g = torch.Generator(device="cpu").manual_seed(0)
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], generator=g, device="cpu").to(w) for w in weights}

    def step() -> None:
        with torch.no_grad():
            for w in weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w)

    return step


def _transformers_step(hf, rows: list[torch.Tensor], d_c: int):
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    for layer, r in enumerate(rows):
        cache.update(r[None, None, :, :d_c].clone(), r[None, None, :, d_c:].clone(), layer)
    length = [rows[0].shape[0]]
    device = hf.device

    def step() -> None:
        pos = torch.tensor([[length[0]]], device=device)
        with torch.no_grad():
            hf(torch.tensor([[1]], device=device), cache=cache, position_ids=pos, use_cache=True)
        length[0] += 1

    return step


def bench_decode(
    contexts: list[int],
    layers: int,
    steps: int,
    codecs: list[str],
    intermediate_size: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = "auto",
) -> list[dict]:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from mlaquant.modeling.loader import load_model

    torch.manual_seed(0)
    shapes = {**V2_LITE_ATTENTION, "intermediate_size": intermediate_size or V2_LITE_ATTENTION["intermediate_size"]}
    hf = DeepseekV2ForCausalLM(DeepseekV2Config(num_hidden_layers=layers, **shapes)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = load_model(tmp, device, dtype)
    hf = hf.to(device=ours.device, dtype=ours.dtype)
    d_c, hidden = V2_LITE_ATTENTION["kv_lora_rank"], V2_LITE_ATTENTION["hidden_size"]
    parts = {
        "transformers_mlp_s": _mlps_step([layer.mlp for layer in hf.model.layers], hidden, ours.lm_head.weight),
        "ours_mlp_s": _mlps_step([layer.mlp for layer in ours.layers], hidden, ours.lm_head.weight),
        "ours_weights_s": _weights_step(ours),
    }
    results = []
    for ctx in contexts:
        g = torch.Generator(device="cpu").manual_seed(ctx)
        width = d_c + V2_LITE_ATTENTION["qk_rope_head_dim"]
        rows = [torch.randn(ctx, width, generator=g, device="cpu").to(ours.device) for _ in range(layers)]
        steps_by_name = {"transformers_s": _transformers_step(hf, rows, d_c)}
        steps_by_name |= {f"{codec}_s": _ours_step(ours, rows, codec) for codec in codecs}
        row = {"context": ctx, **_median_steps(steps_by_name | parts, steps)}
        base = row[f"{codecs[0]}_s"]
        row["speedup_vs_transformers"] = row["transformers_s"] / base
        row["speedup_without_mlp"] = (row["transformers_s"] - row["transformers_mlp_s"]) / (base - row["ours_mlp_s"])
        row["speedup_ceiling"] = row["transformers_s"] / row["ours_weights_s"]
        results.append(row)
        print(format_row(row, codecs), flush=True)
    return results


def format_header(codecs: list[str]) -> str:
    cols = ["context", "transformers ms/step"] + [f"ours {c} ms/step" for c in codecs]
    cols += [f"{c} / {codecs[0]}" for c in codecs[1:]] + [f"speedup ({codecs[0]} vs transformers)"]
    cols += ["MLP ms (transformers / ours)", "speedup without MLP", "ours' weights ms", "ceiling (weights only)"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def format_row(row: dict, codecs: list[str]) -> str:
    base = row[f"{codecs[0]}_s"]
    cells = [str(row["context"]), f"{row['transformers_s'] * 1e3:.1f}"]
    cells += [f"{row[f'{c}_s'] * 1e3:.2f}" for c in codecs]
    cells += [f"{row[f'{c}_s'] / base:.2f}" for c in codecs[1:]]
    cells.append(f"{row['speedup_vs_transformers']:.1f}×")
    cells.append(f"{row['transformers_mlp_s'] * 1e3:.1f} / {row['ours_mlp_s'] * 1e3:.1f}")
    cells.append(f"{row['speedup_without_mlp']:.1f}×")
    cells += [f"{row['ours_weights_s'] * 1e3:.1f}", f"{row['speedup_ceiling']:.1f}×"]
    return "| " + " | ".join(cells) + " |"


# (name, H, d_c, d_r, d_n, d_v) of published configs
PUBLISHED_SHAPES = [("DeepSeek-V3 / R1", 128, 512, 64, 128, 128), ("DeepSeek-V2-Lite", 16, 512, 64, 128, 128)]


def memory_table(model_path: str | None) -> str:
    """Markdown: FP16 cache bytes per token per layer, MLA latent vs MHA per-head K/V."""
    from mlaquant.modeling.loader import read_config, resolve_model_path

    path = resolve_model_path(model_path)
    cfg = read_config(path)
    shapes = [
        *PUBLISHED_SHAPES,
        (
            f"{path.name} (this checkpoint)",
            cfg.num_attention_heads,
            cfg.kv_lora_rank,
            cfg.qk_rope_head_dim,
            cfg.qk_nope_head_dim,
            cfg.v_head_dim,
        ),
    ]
    lines = [
        "| model | H | MLA latent (d_c + d_r) × 2 B | MHA K/V H × (d_n + d_r + d_v) × 2 B | ratio |",
        "|---|---|---|---|---|",
    ]
    for name, h, d_c, d_r, d_n, d_v in shapes:
        latent, mha = (d_c + d_r) * 2, h * (d_n + d_r + d_v) * 2
        lines.append(f"| {name} | {h} | {latent} | {mha} | {mha / latent:.1f}× |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.bench == "kernels":
        return args._kernels(args)
    if args.bench == "memory":
        print(memory_table(args.model))
        return 0
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError as e:
        raise MLAQuantError(f"--contexts must be comma-separated integers, got {args.contexts!r}") from e
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    device, dtype = device_from_args(args)
    if args.batch:
        return _run_attention(args, contexts, codecs)
    print(
        f"decode step, DeepSeek-V2-Lite attention shapes, {args.layers} layers, dense MLP {args.intermediate_size}, "
        f"batch 1, {torch.get_num_threads()} threads, torch {torch.__version__}, {device}, {dtype} weights"
    )
    print(format_header(codecs))
    results = bench_decode(contexts, args.layers, args.steps, codecs, args.intermediate_size, device, dtype)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


def _fast_blocks(text: str) -> list[tuple[int, int]]:
    """`--fast-blocks` "1024x2,4096x1" → [(1024, 2), (4096, 1)]."""
    blocks = []
    for item in filter(None, text.split(",")):
        parts = item.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise MLAQuantError(f"--fast-blocks: {item!r} is not BLOCKxGROUP (two positive integers, e.g. 1024x2)")
        blocks.append((int(parts[0]), int(parts[1])))
    return blocks


def _run_attention(args: argparse.Namespace, contexts: list[int], codecs: list[str]) -> int:
    from mlaquant.bench import attention as bench_attention

    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError as e:
        raise MLAQuantError(f"--batch must be comma-separated integers, got {args.batch!r}") from e
    fast_blocks = _fast_blocks(args.fast_blocks)
    from mlaquant.attention import native

    unpack = (
        "C helper (mlaquant.attention.native)" if native.unpack_int4() else "torch ops (MLAQUANT_NATIVE=0 or no cc)"
    )
    print(
        f"decode attention call, DeepSeek-V2-Lite shapes (H 16, d_c 512, d_r 64), {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, int4 unpack: {unpack}"
    )
    print(bench_attention.format_header())
    results = bench_attention.bench_attention(batches, contexts, codecs, args.steps, fast_blocks)
    print("\nW8A8 projections at decode (int8_matmul, backend cpu) vs FP32 GEMMs, V2-Lite layer shapes")
    projections = bench_attention.bench_projections(batches, args.steps)
    print(bench_attention.format_projection_table(projections))
    if args.out:
        Path(args.out).write_text(json.dumps({"attention": results, "projections": projections}, indent=2))
    return 0
