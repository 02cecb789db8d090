"""The fast CPU decode path (`backend="cpu"`, what "auto" takes on CPU) against the FP32 reference on the
same quantized cache: within tests/reference.py's `cpu_error_bound` (ragged batch, NaN-filled free slots and
blocks, permuted block tables, several blocks per sequence); exact arithmetic once the query quantization is
taken out; W8A8 projections through INT32 GEMMs bit-identical to the FP64 emulation."""

from __future__ import annotations

import time

import pytest
import torch

from mlaquant import DecodeSession
from mlaquant.attention import backends, native, ops
from mlaquant.attention.backends import CpuBackend, resolve_backend
from mlaquant.attention.cpu_decode import mla_decode_cpu, pv_kind
from mlaquant.attention.decode_inputs import DecodeInputs
from mlaquant.attention.ops import mla_decode
from mlaquant.attention.reference import mla_decode_reference
from mlaquant.errors import BackendError
from mlaquant.modeling.int8_proj import grouped_int8_matmul, quantize_grouped
from mlaquant.quant.codecs import LayerCodec, packed_as
from mlaquant.runtime.session import generate
from tests.reference import cpu_error_bound, cpu_quantized_slices, quantized_query

D_C, D_R, H, PAGE = 64, 16, 4, 16
SCALE = 0.17
CODECS = [
    ("fp16", "fp16"),
    ("fp32", "bf16"),
    ("int8-g32", "fp16"),
    ("int8-row", "int8-row"),
    ("int4-g32", "int8-row"),
    ("int4-g16-asym", "int4-row-asym"),
    ("int8-g16-asym", "int8-g16"),
    ("fp8", "fp8-g16"),
    ("int4-row", "int4-row"),
    ("int8-row-asym", "int4-g16"),
    ("int4-row-asym", "fp16"),
    ("band-8x16-4x16-3x16-2x8-0x8", "int8-row"),  # every band width, k_pe integer: in place
    ("band-4x24-3x24-2x16", "int4-row"),  # odd bytes before k_pe, 3-bit tail chunks
    ("band-0x16-3x32-2x16", "fp16"),  # a float k_pe: the blocks' path
]
LENS = [37, 1, 0, 70, 16]


def _cache(codec: LayerCodec, lens: list[int], seed: int = 0):
    """Rows per sequence, and a pool holding them on permuted pages among NaN-filled spare pages (0xFF bytes
    decode to NaN in every codec), free slots NaN, unused table entries pointing at a NaN page or −1."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(n, D_C + D_R, generator=g) * (1 + 3 * torch.rand(D_C + D_R, generator=g)) for n in lens]
    need = [-(-n // PAGE) for n in lens]
    n_pages = sum(need) + 4
    pool = torch.full((n_pages, PAGE, codec.row_bytes), 0xFF, dtype=torch.uint8)
    ids = torch.randperm(n_pages, generator=g).tolist()
    spare = ids[sum(need)]
    table = torch.full((len(lens), max(need) + 2), spare, dtype=torch.int32)
    for b, r in enumerate(rows):
        mine, ids = ids[: need[b]], ids[need[b] :]
        flat = pool[mine].view(-1, codec.row_bytes)
        if len(r):  # (codecs.py cannot encode zero rows)
            flat[: len(r)] = codec.encode(r)
        pool[mine] = flat.view(-1, PAGE, codec.row_bytes)
        table[b, : need[b]] = torch.tensor(mine, dtype=torch.int32)
        if b % 2:
            table[b, need[b] :] = -1
    q = torch.randn(len(lens), H, D_C + D_R, generator=g)
    decoded = [codec.decode(codec.encode(r)) if len(r) else r for r in rows]
    return q, pool, table, torch.tensor(lens, dtype=torch.int32), decoded, [_row_scales(codec, r) for r in rows]


def _row_scales(codec: LayerCodec, rows: torch.Tensor) -> torch.Tensor | None:
    """The stored FP16 scales of each row's c_kv part, fp32 [T, n_groups] (None unless the part is integer)."""
    lay = codec.ckv.layout
    if codec.ckv.spec.kind not in ("int8", "int4", "band"):
        return None
    if not len(rows):
        return torch.zeros(0, lay.n_groups)
    return packed_as(codec.ckv.encode(rows[:, :D_C])[:, lay.scale_offset : lay.scale_offset + 2 * lay.n_groups],
                     torch.float16).float()


@pytest.mark.parametrize("names", CODECS, ids=lambda n: "/".join(n))
@pytest.mark.parametrize("block_tokens, group", [(16, 1), (16, 8), (1024, 2)])
@pytest.mark.parametrize("c_kernels", [True, False], ids=["c-kernels", "torch-ops"])
def test_fast_path_within_stated_bound_of_reference(names, block_tokens, group, c_kernels):
    """Groups of one sequence, of all five (ragged: padded pages, zeroed and masked rows), of two; integer parts
    by the C kernels (every part integer: rows read in place from the permuted pages) and by torch ops."""
    codec = LayerCodec.from_names(*names, D_C, D_R)
    q, pool, table, lens, decoded, scales = _cache(codec, LENS)
    inputs = DecodeInputs(q, pool, table, lens, codec, D_C)
    out, lse = mla_decode_cpu(inputs, SCALE, block_tokens=block_tokens, group=group,
                              c_kernels=c_kernels)
    ref_out, ref_lse = mla_decode_reference(inputs, SCALE)
    d_lse, d_out = cpu_error_bound(q, decoded, codec, D_C, SCALE, scales, c_kernels=c_kernels)
    assert torch.isfinite(out).all()
    empty = lens == 0
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    assert ((lse - ref_lse)[~empty].abs() <= d_lse[~empty]).all()
    assert ((out - ref_out).abs() <= d_out).all()
    if cpu_quantized_slices(codec, c_kernels):  # the bound is not vacuous: the query quantization is its main term
        assert (out - ref_out).abs().max() > 1e-6
    # without the query quantization, the scores are exact up to FP32 rounding (the INT32 dots are exact)
    # and the output moves only by FP32 rounding and, for row-wise integer c_kv, the P·V digit term
    q_eff = quantized_query(q, cpu_quantized_slices(codec, c_kernels))
    ref_out, ref_lse = mla_decode_reference(DecodeInputs(q_eff, pool, table, lens, codec, D_C), SCALE)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-5)
    _, d_exact = cpu_error_bound(q_eff, decoded, codec, D_C, SCALE, scales, quantized_query=False,
                                 c_kernels=c_kernels)
    assert ((out - ref_out).abs() <= d_exact + 2e-5).all()
    if pv_kind(codec, c_kernels) != "fp32":  # the P·V term is not vacuous: a coarser P would break it
        assert (out - ref_out).abs().max() > 1e-6


NATIVE = backends.CpuRouting("AVX2", "avx2", torch_vnni=False)  # the C kernels built: avx2 ...
NATIVE_VNNI = backends.CpuRouting("AVX512", "avx512vnni", torch_vnni=True)  # ... or avx512vnni
INT_MM = backends.CpuRouting("AVX512", None, torch_vnni=True)  # no C kernels; torch._int_mm on VNNI
NEITHER = backends.CpuRouting("AVX2", None, torch_vnni=False)  # no C kernels, no VNNI (issue 29's machine)


def test_dispatch_auto_takes_cpu_path_from_its_crossover_and_torch_stays_reference(monkeypatch):
    assert resolve_backend("auto", "cpu") == "cpu"
    assert resolve_backend("cpu", "cpu") == "cpu"
    with pytest.raises(BackendError, match="CPU tensors only"):
        resolve_backend("cpu", "cuda")
    codec = LayerCodec.from_names("int8", "fp16", D_C, D_R)
    q, pool, table, lens, _, _ = _cache(codec, [20, 33])
    fast = mla_decode_cpu(DecodeInputs(q, pool, table, lens, codec, D_C), SCALE)
    ref = mla_decode_reference(DecodeInputs(q, pool, table, lens, codec, D_C), SCALE)
    assert not torch.equal(fast[0], ref[0])
    for backend, want in (("cpu", fast), ("torch", ref), ("auto", ref)):  # 53 tokens < any threshold
        for a, b in zip(mla_decode(q, pool, table, lens, codec, D_C, SCALE, backend=backend), want):
            assert torch.equal(a, b), backend
    if native.chosen_isa() in native.VECTOR_ISAS:
        monkeypatch.setitem(backends.CPU_NATIVE_MIN_MEAN, native.chosen_isa(), 26)  # 26.5 per sequence: auto goes fast
        monkeypatch.setattr(backends, "native_faster", lambda *key: True)  # ... where the codec's probe says so
        for a, b in zip(mla_decode(q, pool, table, lens, codec, D_C, SCALE), fast):
            assert torch.equal(a, b)


@pytest.mark.parametrize("routing, names, lens, fast", [
    (NATIVE, ("int8-row", "int8-row"), [2048], True),  # the avx2 C kernels: 2048 per live sequence ...
    (NATIVE, ("int4-g32", "int4-g32"), [512] * 64, False),  # (however many sequences)
    (NATIVE, ("int4-g32", "int4-g32"), [2048, 0, 2048, 0], True),
    (NATIVE, ("int8-g64", "int8-g64"), [1024] * 4, False),
    (NATIVE_VNNI, ("int8-g64", "int8-g64"), [1024] * 4, True),  # ... the avx512vnni ones 1024
    (NATIVE_VNNI, ("int4-row", "int4-row"), [1000, 20], False),
    (NATIVE, ("fp16", "fp16"), [4096], False),  # a float codec: FP32 GEMMs, 8192 tokens in all
    (NATIVE, ("fp16", "fp16"), [512] * 16, True),
    (INT_MM, ("int8-row", "int8-row"), [512] * 16, True),  # torch._int_mm: row-wise 8192 in all ...
    (INT_MM, ("int8-row", "int8-row"), [1024] * 4, False),
    (INT_MM, ("int8-row", "int8-row"), [2048, 0], True),  # ... or 2048 per live sequence
    (INT_MM, ("int8-g64", "fp16"), [8192], False),  # grouped: 16384 in all and 1024 per sequence
    (INT_MM, ("int8-g64", "fp16"), [1024] * 16, True),
    (INT_MM, ("int8-g64", "fp16"), [512] * 32, False),
    (INT_MM, ("int4-g32", "int4-row"), [8192] * 4, False),  # 16 groups: never (`backends.CPU_INT_MM_MAX_GROUPS`)
    (NEITHER, ("int8-row", "int8-row"), [16384] * 16, False),  # integer parts: never
    (NEITHER, ("fp16", "int4-row"), [16384] * 16, False),
    (NEITHER, ("fp16", "fp16"), [512] * 16, True),  # float ones: FP32 GEMMs as anywhere
])
def test_cpu_backend_takes_calls_by_the_rule_of_the_machine(monkeypatch, routing, names, lens, fast):
    monkeypatch.setattr(backends, "native_faster", lambda *key: True)  # the probe near the threshold: next test
    codec = LayerCodec.from_names(*names, 512, 64)
    reason = CpuBackend(routing).supports(codec, torch.device("cpu"), torch.tensor(lens, dtype=torch.int32))
    assert (reason is None) is fast, reason


def test_near_the_threshold_the_c_kernels_run_where_the_codecs_probe_measured_them_faster(monkeypatch):
    """From CPU_NATIVE_MIN_MEAN to CPU_NATIVE_PROBE_BELOW tokens per sequence, auto asks `native_faster` for the
    codec at min(sequences, threads) sequences of the mean rounded down to a power of two; elsewhere it asks
    nothing."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    codec = LayerCodec.from_names("int8-g64", "int8-g64", 512, 64)
    asked = []
    for faster in (True, False):
        monkeypatch.setattr(backends, "native_faster", lambda *key, faster=faster: asked.append(key) or faster)
        for lens, key in (([4096], (1, 4096)), ([3000, 0, 3000, 3000], (2, 2048)), ([9000, 7000], (2, 4096))):
            reason = NATIVE.takes(codec, torch.tensor(lens, dtype=torch.int32))
            assert (reason is None) is faster and asked.pop() == ("int8-g64/int8-row", 512, 64, *key)
            assert faster or "the reference measured faster here for int8-g64/int8-row" in reason
        assert NATIVE.takes(codec, torch.tensor([8192], dtype=torch.int32)) is None  # past the band: fast, unasked
        assert NATIVE.takes(codec, torch.tensor([2000], dtype=torch.int32)) is not None  # below it: the reference
        assert not asked


def test_the_codecs_probe_picks_the_faster_path_once_per_class(monkeypatch):
    """`native_faster` times both paths (here: sleeps) on a synthetic cache of the class and caches the answer."""
    calls = []

    def timed(path, slow):
        return lambda inputs, scale: calls.append((path, tuple(inputs.seq_lens.tolist()))) or time.sleep(
            0.004 if path == slow else 0.0)

    for slow, want in (("fast", False), ("reference", True)):
        monkeypatch.setattr(backends.cpu_decode, "mla_decode_cpu", timed("fast", slow))
        monkeypatch.setattr(backends, "mla_decode_reference", timed("reference", slow))
        backends.native_faster.cache_clear()
        calls.clear()
        assert backends.native_faster("int4-row/int8-row", 512, 64, 2, 128) is want
        assert backends.native_faster("int4-row/int8-row", 512, 64, 2, 128) is want  # cached: no new calls
        assert calls == [("fast", (128, 128)), ("reference", (128, 128))] * 4  # one untimed, three timed each
    monkeypatch.undo()
    backends.native_faster.cache_clear()
    if native.vector_kernels() is not None:  # the real paths run on the probe's synthetic cache
        assert backends.native_faster("int8-g64/int4-row", 512, 64, 1, 64) in (True, False)
        backends.native_faster.cache_clear()


def test_routing_follows_the_capability(monkeypatch, fresh_native_build):
    """The rule is read from this machine: torch's capability and VNNI, whether the C kernels build."""
    monkeypatch.setattr(backends, "torch_int8_vnni", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    routing = backends.cpu_routing()
    assert routing.capability == "AVX2"
    assert routing.integer == ("native" if native.runnable("avx2") else "reference")
    assert routing.native_isa in (None, "scalar", "avx2", "avxvnni")  # never AVX-512 under an AVX2 capability
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert backends.cpu_routing() is routing  # read once per process
    backends.cpu_routing.cache_clear()
    assert backends.cpu_routing().native_isa in (None, "scalar") and backends.cpu_routing().integer == "reference"
    assert "integer caches on the reference" in ops.describe_backend("auto", "cpu")


def test_without_c_kernels_or_vnni_auto_keeps_integer_codecs_on_the_reference(monkeypatch, fresh_native_build):
    """Issue 29's machine: no compiler and torch's int8 GEMM without VNNI; even a long batch stays on torch."""
    fresh_native_build.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(backends, "torch_int8_vnni", lambda: False)
    with pytest.warns(UserWarning, match="no C compiler"):
        assert backends.cpu_routing().integer == "reference"
    codec = LayerCodec.from_names("int8-row", "int4-row", D_C, D_R)
    q, pool, table, lens, _, _ = _cache(codec, [9000, 8000])
    assert CpuBackend().supports(codec, torch.device("cpu"), lens) is not None
    ref = mla_decode_reference(DecodeInputs(q, pool, table, lens, codec, D_C), SCALE)
    for a, b in zip(mla_decode(q, pool, table, lens, codec, D_C, SCALE), ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(1, 16, 128, 512), (5, 1, 2048, 64), (3, 4, 7, 3)])
def test_int8_projections_int32_gemm_bit_identical_to_fp64_emulation(shape):
    m, g, k, n = shape
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, g, k, generator=gen) * torch.logspace(-2, 1, k)
    w8, ws = quantize_grouped(torch.randn(g, n, k, generator=gen))
    emulated = grouped_int8_matmul(x, w8, ws, backend="torch")
    assert torch.equal(grouped_int8_matmul(x, w8, ws, backend="cpu"), emulated)
    assert torch.equal(grouped_int8_matmul(x, w8, ws), emulated)  # auto on CPU


@pytest.mark.parametrize("plan", ["int8", "int4-g32-asym/int8-row+i8mm"])
def test_session_on_fast_path_close_to_reference_and_greedy_equal(tiny_model, plan):
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    fast, ref = DecodeSession(tiny_model, plan=plan), DecodeSession(tiny_model, plan=plan, backend="torch")
    assert resolve_backend(fast.backend, "cpu") == "cpu" and ref.backend == "torch"
    fast.prefill(ids[:, :4])
    ref.prefill(ids[:, :4])
    for t in range(4, ids.shape[1]):
        a, b = fast.decode(ids[:, t]), ref.decode(ids[:, t])
        assert (a - b).abs().max() < 0.05 * b.abs().max()
    prompt = ids[0, :5].tolist()
    greedy = generate(tiny_model, prompt, 6, plan=plan)[0]
    assert greedy == generate(tiny_model, prompt, 6, plan=plan, backend="torch")[0]


def test_auto_keeps_many_group_codecs_on_the_reference_without_c_kernels(monkeypatch):
    long = torch.tensor([8192] * 4, dtype=torch.int32)
    assert NATIVE_VNNI.takes(LayerCodec.from_names("int4-g32", "int4-row", 512, 64), long) is None  # C: any grouping
    assert INT_MM.takes(LayerCodec.from_names("int4-row", "int8-row", 512, 64), long) is None
    assert INT_MM.takes(LayerCodec.from_names("int8-g64", "fp16", 512, 64), long) is None  # 8 groups
    assert "groups" in INT_MM.takes(LayerCodec.from_names("int4-g32", "int4-row", 512, 64), long)  # 16: a GEMM each
    codec = LayerCodec.from_names("int4-g16", "fp16", D_C, D_R)  # 4 groups at this width
    monkeypatch.setattr(backends, "cpu_routing", lambda: INT_MM)
    monkeypatch.setattr(backends, "CPU_INT_MM_MAX_GROUPS", 2)
    monkeypatch.setattr(backends, "CPU_FAST_GROUPED_TOKENS", 1)
    monkeypatch.setattr(backends, "CPU_FAST_MIN_MEAN", 1)
    q, pool, table, lens, _, _ = _cache(codec, [20, 33])
    ref = mla_decode_reference(DecodeInputs(q, pool, table, lens, codec, D_C), SCALE)
    for a, b in zip(mla_decode(q, pool, table, lens, codec, D_C, SCALE), ref):
        assert torch.equal(a, b)
    # now auto takes the torch ops (no C kernels)
    monkeypatch.setattr(backends, "CPU_INT_MM_MAX_GROUPS", 8)
    want = mla_decode_cpu(DecodeInputs(q, pool, table, lens, codec, D_C), SCALE, c_kernels=False)
    for a, b in zip(mla_decode(q, pool, table, lens, codec, D_C, SCALE), want):
        assert torch.equal(a, b)


def test_reused_buffers_give_the_same_result_across_shapes_and_threads():
    """The per-thread buffers: a call after calls of other shapes, and two threads at once, return
    exactly what a first call does."""
    import threading

    codec = LayerCodec.from_names("int4-row", "int4-row", D_C, D_R)
    big, small = _cache(codec, LENS, seed=1), _cache(codec, [5, 90], seed=2)
    run = lambda c: mla_decode_cpu(DecodeInputs(*c[:4], codec, D_C), SCALE, block_tokens=32)  # noqa: E731
    first = run(big)
    run(small)
    assert all(torch.equal(a, b) for a, b in zip(run(big), first))
    got = {}
    cases = (("b", big), ("s", small))
    threads = [threading.Thread(target=lambda k=k, c=c: got.__setitem__(k, run(c))) for k, c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(a, b) for a, b in zip(got["b"], first))
    assert all(torch.equal(a, b) for a, b in zip(got["s"], run(small)))


def test_the_first_call_that_probes_the_threads_keeps_its_own_buffers(monkeypatch):
    """The split-threads probe runs a decode of its own inside the first call with fewer sequences than threads. At
    the probe's shapes (16 heads, d_c 512) its accumulator is that call's buffer, so the probe must run before the
    call takes any: run after, it left its sums in the first call's output."""
    from mlaquant.attention import cpu_decode

    if native.vector_kernels() is None:
        pytest.skip(f"needs a vector ISA variant of the C kernels (an x86 CPU with AVX2); here: {native.describe()}")
    codec = LayerCodec.from_names("int8-row", "int8-row", 512, 64)
    g = torch.Generator().manual_seed(3)
    pool = codec.encode(torch.randn(5 * 64, codec.width, generator=g)).view(5, 64, codec.row_bytes)
    table, lens = torch.arange(5, dtype=torch.int32)[None], torch.tensor([300], dtype=torch.int32)
    inputs = DecodeInputs(torch.randn(1, 16, codec.width, generator=g), pool, table, lens, codec, 512)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # one sequence, two threads: the probe's case
    cpu_decode.split_threads.cache_clear()
    first = mla_decode_cpu(inputs, SCALE)  # probes
    cpu_decode.split_threads.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(first, mla_decode_cpu(inputs, SCALE, threads=1)))


def test_split_threads_follows_the_probe_and_never_changes_the_outputs(monkeypatch):
    """Fewer live sequences than threads: the C decode splits them across torch's threads only where the one-time
    probe measured that faster; either way the outputs are the same bits."""
    from mlaquant.attention import cpu_decode

    if native.vector_kernels() is None:
        pytest.skip(f"needs a vector ISA variant of the C kernels (an x86 CPU with AVX2); here: {native.describe()}")
    codec = LayerCodec.from_names("int8-row", "int4-row", D_C, D_R)
    q, pool, table, lens, _, _ = _cache(codec, [300])
    inputs = DecodeInputs(q, pool, table, lens, codec, D_C)
    one, two = mla_decode_cpu(inputs, SCALE, threads=1), mla_decode_cpu(inputs, SCALE, threads=2)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    for slow, want in ((2, 1), (1, 2)):  # the team that sleeps longer loses
        monkeypatch.setattr(cpu_decode, "mla_decode_cpu",
                            lambda inputs, scale, threads, slow=slow: time.sleep(0.004 if threads == slow else 0.0))
        cpu_decode.split_threads.cache_clear()
        assert cpu_decode.split_threads(2) == want
    cpu_decode.split_threads.cache_clear()
    assert cpu_decode.split_threads(1) == 1
