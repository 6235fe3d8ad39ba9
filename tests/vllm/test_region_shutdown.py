"""Shutdown releases vLLM's shared host region in every variant, with no view left behind.

vLLM's ``SharedOffloadRegion.cleanup()`` keeps a region mapped, and logs "Keeping ...
mapped: buffers are still exported to native users", while any view of it (a numpy array,
a memoryview export, a tensor over ``torch.frombuffer``) is alive. Each variant below
(the plain spec and the tiering spec with an ``fs`` tier, seals off and on, and
``TritonOffloadingConnector`` in both roles) stores and loads chunks byte-exactly, then
shuts down in vLLM's order (workers, then the scheduler) while the
caller still holds the worker's engine and sealer, as the connector tests and any tool
that inspects a worker do. Then: no such warning, no mapping of the region left in this
process (``/proc/self/maps``), vLLM's region objects in their released state, no region
file in ``/dev/shm``, a second shutdown harmless, and new work refused as each object's
contract says (the worker and the engine return False; the released pool and sealer
raise RuntimeError naming why).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

try:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext, make_offload_key

    import triton_offload.vllm as tv
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    pytest.skip(f"vllm cannot be imported: {error}", allow_module_level=True)

from tests.helpers.connector_serving import Serving, attention, window
from tests.helpers.region_config import PAGE, Caches, make_config, region_files, region_mappings
from tests.helpers.tiering_config import _settle

KEEPING = "buffers are still exported"


@pytest.fixture
def vllm_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every record of vLLM's loggers, once (vLLM's own logging set-up stops them from
    propagating to the root logger, where the capture sits)."""
    top = logging.getLogger("vllm")
    level, attach = top.level, not top.propagate
    if attach:
        top.addHandler(caplog.handler)
    top.setLevel(logging.INFO)
    try:
        yield caplog
    finally:
        if attach:
            top.removeHandler(caplog.handler)
        top.setLevel(level)


def fs_tier(root: Path) -> list[dict[str, Any]]:
    return [{"type": "fs", "root_dir": str(root), "n_read_threads": 1, "n_write_threads": 1}]


@dataclasses.dataclass
class Running:
    """One variant after a store and a load: what shuts down, and the regions it holds."""

    engine_id: str
    worker: Any  # this project's TritonOffloadingWorker
    shut_down: list[Any]  # objects whose shutdown() vLLM calls, in its order
    regions: list[Any]  # vLLM SharedOffloadRegion objects mapped by this process


def spec_variant(spec_name: str, sealed: bool, root: Path) -> Running:
    """A spec as vLLM's connector builds it in the scheduler and a worker; one store of
    two chunks (one per group) from GPU blocks 0-3, one load of them into blocks 4-7."""
    extra: dict[str, Any] = {"verify_chunks": sealed}
    if spec_name == "TritonTieringOffloadingSpec":
        extra["secondary_tiers"] = fs_tier(root)
    config = make_config(spec_name=spec_name, extra=extra, cpu_bytes=8 * PAGE)
    spec = getattr(tv, spec_name)(config)
    manager = spec.get_manager()
    caches = Caches()
    worker = spec.get_worker(caches.canonical)
    context = ReqContext(req_id="request")
    manager.on_new_request(context) if hasattr(manager, "on_new_request") else None
    keys = [make_offload_key(b"chunk-of-group-0", 0), make_offload_key(b"chunk-of-group-1", 1)]
    store = manager.prepare_store(keys, context)
    assert store is not None and list(store.keys_to_store) == keys
    source = GPULoadStoreSpec([0, 1, 2, 3], group_sizes=[2, 2], block_indices=[0, 0])
    assert worker.submit_store(1, source, store.store_spec)
    worker.wait({1})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    manager.complete_store(keys, context)
    if sealed and hasattr(manager, "secondary_tiers"):
        # The scheduler's promotion check reads the stored rows through its own mapping.
        guard = manager.triton_guard
        for chunk, key in zip(store.store_spec.block_ids, keys, strict=True):
            assert guard.promotion_problem(int(chunk), bytes(key)) is None
    if hasattr(manager, "secondary_tiers"):
        _settle(manager)  # the fs tier writes the chunks from the scheduler's mapping
        assert any(path.is_file() for path in root.rglob("*")), "the fs tier wrote no file"
    load = manager.prepare_load(keys, context)
    destination = GPULoadStoreSpec([4, 5, 6, 7], group_sizes=[2, 2], block_indices=[0, 0])
    assert worker.submit_load(2, load, destination)
    worker.wait({2})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]
    manager.complete_load(keys, context)
    # Group g's two planes are tensors 2g and 2g+1; its blocks went 2g, 2g+1 -> 2g+4, 2g+5.
    for index, tensor in enumerate(caches.tensors):
        group = index // 2
        moved = [2 * group, 2 * group + 1]
        assert torch.equal(tensor[[b + 4 for b in moved]], tensor[moved])
    regions = [worker.region]
    scheduler_region = getattr(spec, "_scheduler_mmap", None)
    if scheduler_region is not None:
        regions.append(scheduler_region)
    return Running(str(config.engine_id), worker, [worker, manager], regions)


def connector_variant() -> Running:
    """``TritonOffloadingConnector`` in both roles (its spec, seals on: the defaults), a
    prompt stored and loaded through vLLM's connector (bytes checked in
    tests/vllm/test_connector.py)."""
    serving = Serving([attention(4), window(4, 8)])
    serving.store_prompt(41)
    hit, _ = serving.load_prompt(41)
    assert hit > 0
    worker = serving.worker_side.connector.connector_worker.worker.worker
    assert worker.sealer is not None
    engine_id = str(serving.worker_side.connector.connector_worker.spec.config.engine_id)
    # Closed here, not by test_connector.py's fixture (this test shuts it down itself).
    from tests.helpers.connector_serving import _OPEN_SERVINGS

    _OPEN_SERVINGS.remove(serving)
    owners = [serving.worker_side.connector, serving.connector]
    return Running(engine_id, worker, owners, [worker.region])


VARIANTS = {
    "spec": lambda root: spec_variant("TritonOffloadingSpec", False, root),
    "spec-sealed": lambda root: spec_variant("TritonOffloadingSpec", True, root),
    "tiering": lambda root: spec_variant("TritonTieringOffloadingSpec", False, root),
    "tiering-sealed": lambda root: spec_variant("TritonTieringOffloadingSpec", True, root),
    "connector": lambda root: connector_variant(),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_shutdown_releases_every_mapping_of_the_region(
    variant: str, tmp_path: Path, vllm_log: pytest.LogCaptureFixture
) -> None:
    running = VARIANTS[variant](tmp_path)
    worker = running.worker
    # What a caller may still hold when vLLM shuts the worker down.
    engine, sealer = worker.engine, worker.sealer
    assert engine is not None
    assert (sealer is not None) == ("sealed" in variant or "connector" in variant)
    assert region_mappings(running.engine_id), "the region is not mapped while running"
    # The capture is live: vLLM's own region records reached it.
    assert "Created mmap file" in vllm_log.text or "Opened existing mmap file" in vllm_log.text
    vllm_log.clear()
    for owner in running.shut_down:
        owner.shutdown()
    kept = [r.getMessage() for r in vllm_log.records if KEEPING in r.getMessage()]
    assert kept == [], f"{variant}: vLLM kept the region mapped: {kept}"
    assert region_mappings(running.engine_id) == [], f"{variant}: still mapped"
    for region in running.regions:
        assert region.mmap_obj is None and region.fd is None  # vLLM's released state
        with pytest.raises(RuntimeError, match="has been released"):
            region.base_tensor  # noqa: B018
    assert region_files(running.engine_id) == []
    problems = [r for r in vllm_log.records if r.levelno >= logging.WARNING]
    assert problems == [], [r.getMessage() for r in problems]

    for owner in running.shut_down:
        owner.shutdown()  # a second shutdown is harmless
    assert [r for r in vllm_log.records if r.levelno >= logging.WARNING] == []
    assert worker.engine is None and worker.region is None

    # New work is refused as each contract says: the worker and the engine return False.
    job = GPULoadStoreSpec([0, 1], group_sizes=[2, 0], block_indices=[0, 0])
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    assert worker.submit_store(3, job, CPULoadStoreSpec([0])) is False
    assert worker.submit_load(4, CPULoadStoreSpec([0]), job) is False
    assert worker.get_finished() == []
    empty = [[]] * (engine.layout.num_groups - 1)
    assert engine.submit_store(5, gpu_blocks=[[0], *empty], host_blocks=[[0], *empty]) is False
    with pytest.raises(RuntimeError, match="shut down"):
        engine.pool_view(0)
    if sealer is not None:
        with pytest.raises(RuntimeError, match="closed"):
            sealer.records(np.array([0]))
