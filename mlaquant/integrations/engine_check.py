"""The engines' own code, executed: where a checkpoint's KV-cache scale names land in vLLM's and SGLang's
DeepSeek loaders, which quantization configs give the MLA attention layer a KV-cache method, how vLLM's
`--kv-cache-dtype-skip-layers` treats an MLA layer, and SGLang's FP4 MLA quantizer. The facts mlaquant
acts on (`mlaquant.integrations.engines`) are checked against these results in tests/test_engines.py, and
`mlaquant engines --verify` reruns the checks for other engine versions.

How: the released wheel's Python files (`mlaquant.integrations.distributions.fetch`, `.py` members only) are parsed with
`ast`; the functions, classes and statements named below are taken out verbatim and executed as plain
Python, with the names they use but do not define replaced by stubs (empty classes, a logger that keeps its
messages, a private `__import__` answering the engine's own lazy imports). Only the glue between two
executed pieces (which loader hands a name to which function) is written here, each step citing its source.

    vLLM      vllm/model_executor/models/utils.py            WeightsMapper (class), AutoWeightsLoader.load_weights
              vllm/model_executor/layers/quantization/...    QuantizationConfig / Fp8Config.get_cache_scale_mapper,
                                                             CompressedTensorsConfig / Fp8Config /
                                                             ModelOptQuantConfigBase.get_quant_method
              vllm/model_executor/model_loader/weight_utils.py  maybe_remap_kv_scale_name
              vllm/models/.../deepseek_v2.py                 DeepseekV2Model.load_weights (the remap statements)
              vllm/model_executor/layers/attention/mla_attention.py  MLAAttention.__init__ (the skip-layers statement)
    SGLang    sglang/srt/models/deepseek_common/deepseek_weight_loader.py  do_load_weights (the KV-scale statements)
              sglang/srt/layers/quantization/kvfp4_tensor.py FP4MXBlock16KVQuantizeUtil
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import textwrap
import types
from collections.abc import Callable
from pathlib import Path

from mlaquant.errors import MLAQuantError
from mlaquant.integrations.distributions import fetch

# the MLA attention's KV-scale parameters, per engine (relative to the loader that sees them)
VLLM_MLA_PARAMS = "layers.{i}.self_attn.mla_attn.mla_attn.{s}_scale"  # DeepseekV2Model.named_parameters()
SGLANG_MLA_PARAMS = "model.layers.{i}.self_attn.{a}.{s}_scale"  # a: attn_mqa, attn_mha (RadixAttention)


class EngineCodeError(MLAQuantError):
    """The engine's code no longer has what a check executes (the message names file and definition)."""


def engine_root(engine: str, version: str) -> Path:
    """The unpacked Python files of the engine's wheel (`vllm` or `sglang`), fetched on first use."""
    return fetch(engine, version, suffixes=(".py",))


@functools.cache
def _find(root: Path, suffix: str) -> Path:
    """The one file under `root` whose path ends with `suffix` (files move between releases)."""
    hits = sorted(p for p in root.rglob(Path(suffix).name) if p.as_posix().endswith(suffix))
    if not hits:
        raise EngineCodeError(f"{root.name}: no file …/{suffix}")
    return hits[0]


@functools.cache
def _module(path: Path) -> tuple[str, ast.Module]:
    text = path.read_text()
    return text, ast.parse(text)


def _definition(path: Path, qualname: str) -> ast.AST:
    """The `def` / `class` node `qualname` ('name' or 'Class.method') at the top of `path`."""
    nodes = _module(path)[1].body
    node = None
    for part in qualname.split("."):
        node = next((n for n in nodes if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == part), None)
        if node is None:
            raise EngineCodeError(f"{path}: no definition {qualname}")
        nodes = node.body
    return node


def _source(path: Path, node: ast.AST) -> str:
    """The node's source, decorators included, dedented."""
    lines = _module(path)[0].splitlines()
    start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
    return textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno]))


def _statements(path: Path, qualname: str, first: Callable[[str], bool], count: int) -> str:
    """`count` consecutive statements of function `qualname`, the first one the statement whose source
    satisfies `first` (searched at any depth), dedented."""
    text = _module(path)[0]
    for node in ast.walk(_definition(path, qualname)):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for k, stmt in enumerate(block):
                if isinstance(stmt, ast.stmt) and first(ast.get_source_segment(text, stmt) or ""):
                    return "\n".join(_source(path, s) for s in block[k : k + count])
    raise EngineCodeError(f"{path}: {qualname} no longer holds the statement this check runs")


class Logger:
    """Stands in for the engines' loggers (`warning_once`, `debug`, ...); keeps (level, message)."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, str]] = []

    def __getattr__(self, level: str):
        def log(msg, *args, **kwargs):
            self.messages.append((level, str(msg) % args if args else str(msg)))

        return log


def _stub_class(name: str, bases: tuple = ()) -> type:
    """An empty class named `name` whose constructor takes any arguments."""
    return type(name, bases or (object,), {"__init__": lambda self, *args, **kwargs: None})


class _Anything:
    """An object whose every attribute is a stub class (`self.KVCacheMethodCls(self)` works)."""

    def __getattr__(self, name: str):
        return _stub_class(name)


ENGINES = ("vllm", "sglang", "transformers")  # imports of these are answered by stubs, never imported


def _namespace(modules: dict[str, dict] | None = None) -> dict:
    """Globals for executed code: a `Logger` as `logger`, and an `__import__` that answers the engines' own
    modules from `modules` (name → attributes; a module not listed is empty) and imports everything else."""
    modules = modules or {}
    real = builtins.__import__

    def importer(name, globals=None, locals=None, fromlist=(), level=0):
        if name in modules or level or name.split(".")[0] in ENGINES:
            return types.SimpleNamespace(**modules.get(name, {}))
        return real(name, globals, locals, fromlist, level)

    return {"__builtins__": {**vars(builtins), "__import__": importer}, "logger": Logger(), "__name__": __name__}


def _defines(stmt: ast.stmt) -> set[str]:
    """The top-level names a module statement binds."""
    if isinstance(stmt, ast.FunctionDef | ast.ClassDef):
        return {stmt.name}
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names}
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _engine_import(stmt: ast.stmt) -> bool:
    """An import of an engine's own modules (or a relative one): its names become stubs, it is not run."""
    if isinstance(stmt, ast.ImportFrom):
        return bool(stmt.level) or (stmt.module or "").split(".")[0] in ENGINES
    return isinstance(stmt, ast.Import) and any(a.name.split(".")[0] in ENGINES for a in stmt.names)


def load(path: Path, qualname: str, space: dict, stubs: dict | None = None, depth: int = 0) -> object:
    """Execute definition `qualname` of `path` ('f', 'Class' or 'Class.method', the latter inside a bare class
    of that name) in `space`, after the module's top-level statements that bind the names it uses (imports of
    other libraries, constants, helper definitions, one level deep); a name bound by an engine import, or not
    at all, becomes a stub class (`stubs` gives some their value). Returns the executed object."""
    stubs = stubs or {}
    node = _definition(path, qualname)
    names = lambda n: {x.id for x in ast.walk(n) if isinstance(x, ast.Name)} - set(dir(builtins)) - set(space)
    used = names(node) - {qualname.split(".")[0]}
    text, tree = _module(path)
    runnable = [st for st in tree.body if not isinstance(st, ast.If) and not _engine_import(st) and st is not node]
    grown = True
    while grown:  # constants and aliases the used names are built from, transitively
        extra = set().union(*[names(st) for st in runnable if _defines(st) & used
                              and not isinstance(st, ast.FunctionDef | ast.ClassDef)]) - used
        grown, used = bool(extra), used | extra
    for stmt in runnable:
        wanted = _defines(stmt) & used
        if not wanted or wanted <= set(stubs):
            continue
        if not isinstance(stmt, ast.FunctionDef | ast.ClassDef):
            _run(ast.get_source_segment(text, stmt), space, str(path))
        elif not depth:
            load(path, stmt.name, space, stubs, depth + 1)
    for name in used - set(space) - {n.name for n in ast.walk(node) if isinstance(n, ast.FunctionDef)}:
        space[name] = stubs.get(name) or _stub_class(name)
    source = _source(path, node)
    if "." in qualname:
        source = f"class {qualname.split('.')[0]}:\n" + textwrap.indent(source, "    ")
    _run(source, space, str(path))
    obj = space[qualname.split(".")[0]]
    return getattr(obj, qualname.split(".")[1]) if "." in qualname else obj


def _run(source: str, space: dict, where: str) -> dict:
    exec(compile(source, where, "exec"), space)  # the engine's own code, verbatim
    return space


@dataclasses.dataclass(frozen=True)
class VllmLoads:
    """Per checkpoint name: the MLA parameter it loads into, or None (dropped), under one quant config."""

    config: str
    mla_kv_method: bool  # the config's get_quant_method gives MLAAttention a KV-cache method
    targets: dict[str, str | None]
    mapped: dict[str, str | None]  # each name after AutoWeightsLoader's mapper (what load_weights receives)
    warnings: list[str]


# quant config → (file of its class, the class); `get_quant_method` and the cache-scale mapper come from it
VLLM_CONFIGS = {
    "compressed-tensors": ("model_executor/layers/quantization/compressed_tensors/compressed_tensors.py",
                           "CompressedTensorsConfig"),
    "fp8": ("model_executor/layers/quantization/fp8.py", "Fp8Config"),
    "modelopt": ("model_executor/layers/quantization/modelopt.py", "ModelOptQuantConfigBase"),
}
VLLM_BASE_CONFIG = ("model_executor/layers/quantization/base_config.py", "QuantizationConfig")


def _vllm_layer_classes(root: Path) -> dict[str, type]:
    """Stub `Attention` and `MLAAttention` with the wheel's own base classes (by name)."""
    bases = {}
    for rel, name in (("model_executor/layers/attention/attention.py", "Attention"),
                      ("model_executor/layers/attention/mla_attention.py", "MLAAttention")):
        bases[name] = [ast.unparse(b).split(".")[-1] for b in _definition(_find(root, rel), name).bases]
    shared = {b: _stub_class(b) for names in bases.values() for b in names}
    return {n: _stub_class(n, tuple(shared[b] for b in names)) for n, names in bases.items()}


def vllm_mla_kv_method(root: Path) -> dict[str, bool]:
    """Quant config → whether its `get_quant_method` gives an `MLAAttention` a KV-cache method, executed with
    stub layer classes whose bases are the wheel's own (`_vllm_layer_classes`)."""
    classes = _vllm_layer_classes(root)
    out = {}
    for config, (rel, cls) in VLLM_CONFIGS.items():
        method = load(_find(root, rel), f"{cls}.get_quant_method", _namespace(), classes)
        out[config] = method(_Anything(), classes["MLAAttention"](), "model.layers.0.self_attn.attn") is not None
    return out


def _vllm_mapper(root: Path, config: str):
    """The WeightsMapper `AutoWeightsLoader.load_weights` builds for `config` (models/utils.py: `mapper |=
    quant_config.get_cache_scale_mapper()`, `mapper |= quant_config.get_checkpoint_weight_mapper()`), executed:
    each getter of the config's class where it overrides the base class's, else the base's."""
    mapper_cls = load(_find(root, "model_executor/models/utils.py"), "WeightsMapper", _namespace())
    modules = {"vllm.model_executor.models.utils": {"WeightsMapper": mapper_cls}}
    base_path, base_cls = _find(root, VLLM_BASE_CONFIG[0]), VLLM_BASE_CONFIG[1]
    getters = ("get_cache_scale_mapper", "get_checkpoint_weight_mapper")
    base = type(base_cls, (), {g: staticmethod(load(base_path, f"{base_cls}.{g}", _namespace(modules)))
                               for g in getters})
    path, cls = _find(root, VLLM_CONFIGS[config][0]), VLLM_CONFIGS[config][1]
    mapper = mapper_cls()
    for g in getters:
        own = _has(path, f"{cls}.{g}")
        getter = load(path, f"{cls}.{g}", _namespace(modules), {base_cls: base}) if own else getattr(base, g)
        mapper = mapper | getter()
    return mapper


def _has(path: Path, qualname: str) -> bool:
    try:
        _definition(path, qualname)
    except EngineCodeError:
        return False
    return True


def _vllm_remap(root: Path, logger: Logger) -> Callable[[str, dict], str | None]:
    """DeepseekV2Model.load_weights' kv-scale statements (`remapped_name = maybe_remap_kv_scale_name(name,
    params_dict)`, `continue` when None, `name = remapped_name`) around the wheel's `maybe_remap_kv_scale_name`,
    executed: (name, params) → the name it loads, or None."""
    space = _namespace()
    space["logger"] = logger
    load(_find(root, "model_executor/model_loader/weight_utils.py"), "maybe_remap_kv_scale_name", space)
    model = _find(root, "deepseek_v2.py")
    body = _statements(model, "DeepseekV2Model.load_weights",
                       lambda s: s.startswith("remapped_name = maybe_remap_kv_scale_name"), 3)
    return _run(_once(body), space, str(model))["_load"]


def _once(body: str) -> str:
    """A function `_load(name, params_dict)` running `body` (engine statements that may `continue`) once:
    `name` after it, or None where it continued."""
    return ("def _load(name, params_dict):\n    for _once in (None,):\n" + textwrap.indent(body, "        ")
            + "\n        return name\n    return None\n")


def vllm_scale_loads(root: Path, names: list[str], layer: int) -> list[VllmLoads]:
    """For every quant config of `VLLM_CONFIGS`: where each checkpoint name of layer `layer` lands. The chain:
    AutoWeightsLoader.load_weights applies the config's mapper to full names, `_load_module` hands
    DeepseekV2Model.load_weights the names without `model.`, which runs its remap statements against the
    model's parameters: the MLA layer's `mla_attn.mla_attn.{q,k,v}_scale` where the config gives MLAAttention a
    KV method (`vllm_mla_kv_method`), none otherwise (there are only the `_k_scale` buffers then)."""
    methods = vllm_mla_kv_method(root)
    out = []
    for config in VLLM_CONFIGS:
        params = {VLLM_MLA_PARAMS.format(i=layer, s=s): None for s in "qkv"} if methods[config] else {}
        logger = Logger()
        remap, mapper = _vllm_remap(root, logger), _vllm_mapper(root, config)
        targets, renamed = {}, {}
        for original in names:
            mapped = list(mapper.apply([(original, None)]))
            renamed[original] = mapped[0][0] if mapped else None
            hit = remap(mapped[0][0].removeprefix("model."), params) if mapped else None
            targets[original] = hit if hit in params else None  # a name no rule renamed is no parameter
        out.append(VllmLoads(config, methods[config], targets, renamed, [m for _, m in logger.messages]))
    return out


def vllm_layer_cache_dtype(root: Path, skip_layers: list[str], layer: int, cache_dtype: str = "fp8") -> str:
    """The kv_cache_dtype `MLAAttention.__init__` gives layer `layer` under `--kv-cache-dtype cache_dtype
    --kv-cache-dtype-skip-layers skip_layers`: its skip-layers statement executed, with the wheel's
    `extract_layer_index`."""
    mla = _find(root, "model_executor/layers/attention/mla_attention.py")
    index = load(_find(root, "model_executor/models/utils.py"), "extract_layer_index", _namespace())
    space = _namespace({"vllm.model_executor.models.utils": {"extract_layer_index": index}})
    body = _statements(mla, "MLAAttention.__init__", lambda s: "kv_cache_dtype_skip_layers" in s.split("\n")[0], 1)
    source = "def _dtype(cache_config, prefix, kv_cache_dtype):\n" + textwrap.indent(body, "    ")
    fn = _run(source + "\n    return kv_cache_dtype\n", space, str(mla))["_dtype"]
    cache_config = types.SimpleNamespace(kv_cache_dtype_skip_layers=list(skip_layers), cache_dtype=cache_dtype)
    return fn(cache_config, f"model.layers.{layer}.self_attn.attn", cache_dtype)


def sglang_scale_loads(root: Path, names: list[str], layer: int) -> tuple[dict[str, str | None], list[str]]:
    """Where each checkpoint name lands in SGLang's DeepSeek loader: `do_load_weights`' plain-weight
    statements (the k/v-scale rename, the Quark scale-name resolution, the not-in-params check) executed
    against the MLA layer's RadixAttention scales (`attn_mqa`, `attn_mha`); and the warnings logged."""
    loader = _find(root, "srt/models/deepseek_common/deepseek_weight_loader.py")
    space = _namespace()
    load(loader, "_resolve_quark_fp8_block_scale_name", space)
    body = _statements(loader, "DeepseekV2WeightLoaderMixin.do_load_weights",
                       lambda s: s.startswith("if (") and '"k_scale" in name' in s, 3)
    fn = _run(_once(body), space, str(loader))["_load"]
    params = {SGLANG_MLA_PARAMS.format(i=layer, a=a, s=s): None for a in ("attn_mqa", "attn_mha") for s in "kv"}
    return {n: fn(n, params) for n in names}, [m for _, m in space["logger"].messages]


def sglang_fp4_quantize(root: Path) -> Callable:
    """SGLang's `FP4MXBlock16KVQuantizeUtil.batched_quantize` (tensor [B, M, N] → packed uint8 [B, M, N/2],
    UE8M0 scales uint8 [B, M·N/16]), executed eagerly: its `@torch.compile` decorator applied as the identity,
    the body unchanged."""
    import torch

    eager = types.SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch) if not n.startswith("__")})
    eager.compile = lambda fn: fn
    path = _find(root, "srt/layers/quantization/kvfp4_tensor.py")
    return load(path, "FP4MXBlock16KVQuantizeUtil.batched_quantize", _namespace(), {"torch": eager})
