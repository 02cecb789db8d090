"""`mlaquant engines`: what each engine's cache setting costs on a model, and `--verify`, the engines' loader code
executed.

    mlaquant engines [--model M] [--plan DIR] [--codecs C,...] [--data test|third-party|PATH] [--contexts 512,2048]
                     [--tokens 16384] [--seed 0] [--no-llama-cpp] [--json]
    mlaquant engines --verify [--vllm 0.33.0] [--sglang 0.5.23] [--json]

Pricing: every format of `mlaquant.integrations.engines.FORMATS` that fits the model's widths, as a uniform plan, and
the plan and mlaquant codecs given, on the same token windows per context: bytes per token and layer, bits per value,
loss (teacher-forced, every token through the cache, as `calibrate` reports) and the loss by position bucket; with
llama-cpp-python installed, llama.cpp's own loss on the same tokens beside its formats (the cross-check of the
q8_0 / q4_0 emulation; llama.cpp also rounds its queries to q8_0 against a quantized cache, see
`mlaquant.integrations.llamacpp`). Verify: `mlaquant.integrations.engine_check` on the releases given, fetched with
pip on first use.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from tqdm import tqdm

from mlaquant.errors import MLAQuantError
from mlaquant.integrations.engines import ENGINE_VERSIONS, FORMATS, SCALE_NAMES, CacheFormat

LLAMA_CPP_TYPES = {"llama.cpp f16": "f16", "llama.cpp q8_0": "q8_0", "llama.cpp q4_0": "q4_0"}


def price(model, tokens: dict[int, torch.Tensor], rows: list[tuple[str, object]], batch_size: int,
          progress: bool = True) -> tuple[list[dict], dict[int, float]]:
    """Loss of each (label, plan) in `rows` on `tokens` (context → token windows [n, T]), teacher-forced
    through the cache: per label the bytes per token and layer, bits per value, and per context the loss and
    the loss by position bucket; and per context the FP16 reference's mean NLL. Each plan bound to `model`."""
    from mlaquant.evaluation.eval import Evaluator

    evaluators = {t: Evaluator(model, ids, batch_size) for t, ids in tokens.items()}
    out = []
    for label, plan in tqdm(rows, desc="engines", disable=not progress):
        codecs = plan.layer_codecs()
        row = {"label": label, "bytes_per_token_per_layer": plan.bytes_per_token() / len(codecs),
               "bits_per_value": plan.bits_per_value(), "contexts": {}}
        for t, ev in evaluators.items():
            r = ev.evaluate(codecs, model=plan.apply(model), window=plan.window, loss_only=True)
            row["contexts"][t] = {"loss": r.loss, "by_position": r.by_position}
        out.append(row)
    return out, {t: ev.ref_nll for t, ev in evaluators.items()}


def llama_cpp_losses(model, tokens: dict[int, torch.Tensor], ref_nll: dict[int, float]) -> dict[str, dict]:
    """llama.cpp's own loss for each of its formats (label → context → loss), or label → {"skipped": why}."""
    from mlaquant.integrations import llamacpp
    from mlaquant.integrations.distributions import cache_dir

    reason = llamacpp.unavailable()
    if reason is not None:
        return {label: {"skipped": reason} for label in LLAMA_CPP_TYPES}
    try:
        gguf = llamacpp.gguf_for(model.source, cache_dir() / "gguf")
    except MLAQuantError as e:
        return {label: {"skipped": str(e)} for label in LLAMA_CPP_TYPES}
    out = {}
    for label, kind in LLAMA_CPP_TYPES.items():
        out[label] = {t: math.exp(float(llamacpp.token_nll(gguf, ids, kind, n_threads=1).mean()) - ref_nll[t]) - 1
                      for t, ids in tokens.items()}
    return out


def verify(vllm_version: str, sglang_version: str, layer: int = 3) -> dict:
    """The executed checks (`mlaquant.integrations.engine_check`) for those releases: per engine and quant config, each
    of SCALE_NAMES → the parameter it loads into (None: dropped), and whether MLAAttention gets a KV method."""
    from mlaquant.integrations import engine_check

    names = [n.format(i=layer) for n in SCALE_NAMES]
    vroot, sroot = engine_check.engine_root("vllm", vllm_version), engine_check.engine_root("sglang", sglang_version)
    vllm = {r.config: {"mla_kv_method": r.mla_kv_method, "targets": r.targets, "mapped": r.mapped,
                       "warnings": r.warnings} for r in engine_check.vllm_scale_loads(vroot, names, layer)}
    targets, _ = engine_check.sglang_scale_loads(sroot, names, layer)
    skip = {str(i): engine_check.vllm_layer_cache_dtype(vroot, ["0", str(layer)], i) for i in range(layer + 2)}
    return {"versions": {"vllm": vllm_version, "sglang": sglang_version}, "layer": layer, "vllm": vllm,
            "vllm_skip_layers_0_and_layer": skip, "sglang": {"targets": targets}}


def verify_markdown(v: dict) -> str:
    """The verify result as Markdown tables: exported name → engine parameter → applied."""
    lines = [f"vLLM {v['versions']['vllm']} (DeepseekV2ForCausalLM, layer {v['layer']}): checkpoint name → the MLA "
             "parameter it loads into", "", "| checkpoint name | " + " | ".join(v["vllm"]) + " |",
             "|---|" + "---|" * len(v["vllm"])]
    for name in next(iter(v["vllm"].values()))["targets"]:
        cells = [c["targets"][name] or "dropped" for c in v["vllm"].values()]
        lines.append(f"| `{name}` | " + " | ".join(f"`{c}`" if c != "dropped" else c for c in cells) + " |")
    modelopt = v["vllm"]["modelopt"]
    lines += ["", "Under modelopt (the one config that gives MLAAttention KV parameters): the name AutoWeightsLoader's "
              "quant-config mapper hands to DeepseekV2Model.load_weights, and vLLM's warning", "",
              "| checkpoint name | after the mapper | vLLM logs |", "|---|---|---|"]
    for name, mapped in modelopt["mapped"].items():
        warn = next((w for w in modelopt["warnings"] if f"(e.g. {(mapped or '').removeprefix('model.')})" in w), "")
        lines.append(f"| `{name}` | `{mapped}` | {warn} |")
    methods = ", ".join(f"{k}: {'yes' if c['mla_kv_method'] else 'no'}" for k, c in v["vllm"].items())
    lines += ["", f"KV-cache method for MLAAttention: {methods}.", "",
              f"SGLang {v['versions']['sglang']}: checkpoint name → RadixAttention parameter", "",
              "| checkpoint name | parameter |", "|---|---|"]
    lines += [f"| `{n}` | {('`' + t + '`') if t else 'dropped'} |" for n, t in v["sglang"]["targets"].items()]
    skip = ", ".join(f"layer {k}: {d}" for k, d in v["vllm_skip_layers_0_and_layer"].items())
    lines += ["", f"vLLM `--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0 {v['layer']}`: {skip}."]
    return "\n".join(lines) + "\n"


def text_source(data: str):
    """`--data`: 'test' (the bundled test split), 'third-party' (`mlaquant.calib.data.shift_source`), or a path."""
    from mlaquant.calib.data import shift_source, split_path

    return {"test": lambda: split_path("test"), "third-party": shift_source}.get(data, lambda: data)()


def add_arguments(p: argparse.ArgumentParser) -> None:
    from mlaquant.device import add_device_arguments

    p.add_argument("--model", default=None, help="checkpoint directory or Hugging Face id (default: the bundled model)")
    p.add_argument("--plan", default=None, help="a calibrated plan directory to price beside the engine formats")
    p.add_argument("--codecs", default=None, help="mlaquant uniform codecs to price too, e.g. int4-g32/int4-g32")
    p.add_argument("--data", default="test", help="'test' (bundled test split), 'third-party' or a text path")
    p.add_argument("--contexts", default="512,2048", help="window lengths (default 512,2048)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per context (windows = tokens / context)")
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's own numbers")
    p.add_argument("--verify", action="store_true",
                   help="instead: run the engines' loader code (wheels fetched with pip) and print where scales land")
    p.add_argument("--vllm", default=ENGINE_VERSIONS["vllm"], help="vLLM version for --verify")
    p.add_argument("--sglang", default=ENGINE_VERSIONS["sglang"], help="SGLang version for --verify")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_device_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.verify:
        result = verify(args.vllm, args.sglang)
        print(json.dumps(result, indent=2) if args.json else verify_markdown(result))
        return 0
    from mlaquant.calib.sweep import parse_list
    from mlaquant.device import from_args as device_from_args
    from mlaquant.evaluation.samples import token_samples
    from mlaquant.modeling.loader import load_model
    from mlaquant.runtime.plan import Plan

    contexts = parse_list(args.contexts, "--contexts", int)
    device, dtype = device_from_args(args)
    model = load_model(args.model, device, dtype)
    source = text_source(args.data)
    tokens = {t: token_samples(model.tokenizer, source, max(1, args.tokens // t), t, args.seed, model.cfg.eos_id)
              for t in contexts}
    n = len(model.layers)
    rows = [(f.name, Plan.uniform(f.codec, n).bind(model.cfg)) for f in FORMATS if _fits(f, model)]
    skipped = [f.name for f in FORMATS if not _fits(f, model)]
    rows += [(f"mlaquant {c}", Plan.uniform(c, n).bind(model.cfg)) for c in parse_list(args.codecs, "--codecs") or []]
    if args.plan:
        plan = Plan.load(args.plan)
        plan.check_model(model)
        rows.append((f"mlaquant plan {args.plan}", plan.bind(model.cfg)))
    priced, ref = price(model, tokens, rows, 8, progress=not args.quiet)
    ours = {} if args.no_llama_cpp else llama_cpp_losses(model, tokens, ref)
    report = {"model": model.source, "data": str(args.data), "contexts": contexts, "rows": priced,
              "llama_cpp": ours, "skipped": skipped, "cpu": torch.backends.cpu.get_cpu_capability()}
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0


def _fits(f: CacheFormat, model) -> bool:
    """Whether the format's codecs divide the model's latent widths (a q4_0 k_pe needs d_r % 32 == 0)."""
    from mlaquant.quant.codecs import CodecError, LayerCodec, split_pair

    try:
        LayerCodec.from_names(*split_pair(f.codec), *model.cfg.latent_widths)
    except CodecError:
        return False
    return True


def table(report: dict) -> str:
    """The priced rows as Markdown: format, setting, bytes, bits, loss per context (and llama.cpp's own)."""
    contexts = report["contexts"]
    settings = {f.name: f for f in FORMATS}
    head = ["format", "engine setting", "B/token/layer", "bits/value"] + [f"loss @{t}" for t in contexts]
    head += [f"@{contexts[-1]} by position"] + [f"llama.cpp measured @{t}" for t in contexts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        f = settings.get(r["label"])
        losses = [f"{r['contexts'][t]['loss']:+.3%}" for t in contexts]
        buckets = " / ".join(f"{b['loss']:+.2%}" for b in r["contexts"][contexts[-1]]["by_position"])
        measured = report["llama_cpp"].get(r["label"], {})
        own = [measured["skipped"][:40] if "skipped" in measured else f"{measured[t]:+.3%}" for t in contexts] \
            if measured else [""] * len(contexts)
        lines.append(f"| {r['label']} | {f.setting if f else 'mlaquant DecodeSession'} | "
                     f"{r['bytes_per_token_per_layer']:.1f} | {r['bits_per_value']:.2f} | " + " | ".join(losses)
                     + f" | {buckets} | " + " | ".join(own) + " |")
    foot = f"\n{report['data']} text, CPU {report['cpu']}"
    if report["skipped"]:
        foot += f"; formats that do not fit this model's widths: {', '.join(report['skipped'])}"
    return "\n".join(lines) + foot
