"""The engines' own code, executed (`mlaquant.integrations.engine_check` on the released wheels of ENGINE_VERSIONS),
against the facts mlaquant acts on (`mlaquant.integrations.engines`) and what `mlaquant export` writes.

The wheels are fetched with pip into the mlaquant cache (.ci/run fetches them first); without a reachable
registry and an empty cache these tests skip, saying which wheel could not be fetched.
"""

from __future__ import annotations

import ast

import pytest
import torch

from mlaquant.calib.engines import verify, verify_markdown
from mlaquant.integrations import engine_check
from mlaquant.integrations.distributions import DistributionError
from mlaquant.integrations.engines import (
    ENGINE_VERSIONS,
    FORMATS,
    MLA_KV_METHOD,
    SCALE_NAMES,
    SCALE_TARGETS,
    sglang_serve_command,
    vllm_serve_command,
)
from mlaquant.quant.codecs import CodecSpec, LayerCodec, RowCodec

LAYER = 3


def _root(engine: str):
    try:
        return engine_check.engine_root(engine, ENGINE_VERSIONS[engine])
    except DistributionError as e:
        pytest.skip(f"{engine} {ENGINE_VERSIONS[engine]} wheel unavailable: {e}")


@pytest.fixture(scope="module")
def vllm_root():
    return _root("vllm")


@pytest.fixture(scope="module")
def sglang_root():
    return _root("sglang")


def _expected(engine: str) -> dict[str, str]:
    return {n.format(i=LAYER): t.format(i=LAYER) for n, t in SCALE_TARGETS[engine].items()}


def test_vllm_loads_no_checkpoint_scale_onto_mla_attention(vllm_root):
    """Every name a DeepSeek checkpoint can carry, through AutoWeightsLoader's quant-config mapper and
    DeepseekV2Model.load_weights' remap, under each quant config: SCALE_TARGETS['vllm'] (nothing lands)."""
    names = [n.format(i=LAYER) for n in SCALE_NAMES]
    loads = engine_check.vllm_scale_loads(vllm_root, names, LAYER)
    assert {r.config: r.mla_kv_method for r in loads} == MLA_KV_METHOD
    for r in loads:
        assert {n: t for n, t in r.targets.items() if t} == _expected("vllm"), r.config
    # the names the last release exported (the README said vLLM loads them) are dropped, with vLLM's warning
    modelopt = next(r for r in loads if r.config == "modelopt")
    assert modelopt.targets["model.layers.3.self_attn.k_proj.k_scale"] is None
    assert any("self_attn.attn.attn.k_scale" in w and "is not loaded" in w for w in modelopt.warnings)


def test_vllm_chain_loads_where_the_parameter_names_fit(vllm_root):
    """The same executed chain does load scales when names fit: a non-MLA layer's `self_attn.attn.k_scale`
    gets the ModelOpt name, and the remap alone (without the quant config's mapper) would place the ModelOpt
    name on MLAAttention — so the drops above come from the engine, not from the harness."""
    remap = engine_check._vllm_remap(vllm_root, engine_check.Logger())
    mapper = engine_check._vllm_mapper(vllm_root, "modelopt")
    mha = {f"layers.{LAYER}.self_attn.attn.k_scale": None}
    name = list(mapper.apply([(f"model.layers.{LAYER}.self_attn.k_proj.k_scale", None)]))[0][0]
    assert remap(name.removeprefix("model."), mha) == f"layers.{LAYER}.self_attn.attn.k_scale"
    mla = {engine_check.VLLM_MLA_PARAMS.format(i=LAYER, s=s): None for s in "qkv"}
    direct = remap(f"layers.{LAYER}.self_attn.k_proj.k_scale", mla)
    assert direct == f"layers.{LAYER}.self_attn.mla_attn.mla_attn.k_scale"


def test_vllm_skip_layers_keep_the_exported_layers_in_the_model_dtype(vllm_root):
    """The exporter's serving command, parsed as vLLM's nargs='+' list, through MLAAttention.__init__."""
    command = vllm_serve_command("/m", [0, 2])
    skip = command.split("--kv-cache-dtype-skip-layers ")[1].split()
    assert [engine_check.vllm_layer_cache_dtype(vllm_root, skip, i) for i in range(4)] == ["auto", "fp8", "auto", "fp8"]
    assert "--kv-cache-dtype-skip-layers" not in vllm_serve_command("/m", [])


def test_vllm_ds_mla_sizes_are_the_formats_bytes(vllm_root):
    """MLAAttention's state_content_bytes literal (the engine's per-token size of its opaque layouts) equals the
    row bytes of the codecs that price them, at DeepSeek's widths."""
    path = engine_check._find(vllm_root, "model_executor/layers/attention/mla_attention.py")
    sizes = _state_bytes(path)
    for fmt in FORMATS:
        kind = fmt.setting.split()[-1]
        if kind in sizes:
            assert LayerCodec.from_names(*fmt.codec.split("/"), 512, 64).row_bytes == sizes[kind], fmt.name


def _state_bytes(path) -> dict:
    """The dict literal passed as `state_content_bytes=` in MLAAttention (`{...}.get(...)`)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "state_content_bytes":
            return ast.literal_eval(node.value.func.value)
    raise AssertionError(f"{path}: no state_content_bytes")


def test_sglang_scale_names_and_the_export_writes_none(sglang_root):
    """SGLang's do_load_weights statements place the ModelOpt names on attn_mqa (SCALE_TARGETS['sglang']); its
    default backends then ignore or misapply them (read: engines.SGLANG_BACKENDS), so the export writes no
    scale and the serving command carries none."""
    names = [n.format(i=LAYER) for n in SCALE_NAMES]
    targets, warnings = engine_check.sglang_scale_loads(sglang_root, names, LAYER)
    assert {n: t for n, t in targets.items() if t} == _expected("sglang")
    assert f"model.layers.{LAYER}.self_attn.k_scale not found in params_dict." in warnings
    assert "scale" not in sglang_serve_command("/m").replace("--kv-cache-dtype", "")


def test_sglang_fp4_pool_codec_is_bit_exact(sglang_root):
    """mlaquant's `mxfp4` codec against SGLang's FP4MXBlock16KVQuantizeUtil.batched_quantize, executed: the
    same packed codes and UE8M0 scales, ties (x on a decision point) included."""
    quantize = engine_check.sglang_fp4_quantize(sglang_root)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 160, generator=g) * torch.logspace(-4, 3, 64).unsqueeze(1)
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * torch.tensor([1.0, -1.0]).repeat(8)
    x[1] = 0.0
    packed, scales = quantize(x.view(1, 64, 160))
    codes = RowCodec.build(CodecSpec.parse("mxfp4"), 160).encode(x)
    assert torch.equal(codes[:, :80], packed[0]) and torch.equal(codes[:, 80:], scales.view(64, 10))


def test_verify_reports_every_name_for_every_config(vllm_root, sglang_root):
    """`mlaquant engines --verify`: the table a user takes upstream — every name, every config, both engines."""
    v = verify(ENGINE_VERSIONS["vllm"], ENGINE_VERSIONS["sglang"], LAYER)
    assert set(v["vllm"]) == set(MLA_KV_METHOD)
    text = verify_markdown(v)
    for n in SCALE_NAMES:
        assert f"`{n.format(i=LAYER)}`" in text
    assert text.count("dropped") >= len(SCALE_NAMES) * len(MLA_KV_METHOD)


def test_unfetchable_engine_version_is_one_line(tmp_path, monkeypatch, capsys):
    from mlaquant.cli import main

    monkeypatch.setenv("MLAQUANT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert main(["engines", "--verify", "--vllm", "0.0.0-missing"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "vllm==0.0.0-missing" in err
    assert not any((tmp_path / "cache").glob("vllm-*"))
