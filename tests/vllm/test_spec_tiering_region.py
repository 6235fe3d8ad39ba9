"""TritonTieringOffloadingSpec's host region leaves /dev/shm once every party mapped it.

vLLM's tiering spec maps its region twice: each worker by name (no barrier), and the
scheduler by name after them (vLLM's engine registers the caches before it builds the
scheduler). Linked until shutdown, the region's file would outlive an engine that is
killed (SIGKILL, the OOM killer): its whole size stays in /dev/shm, and an engine
restarted under the same engine id maps the dead one's file and never removes it. The
scheduler unlinks it once this engine's every worker has mapped it (each worker's plane
note, written after its mapping, is newer than the scheduler's process); a scheduler
built before its workers (outside vLLM's engine) leaves it linked for them to join.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.tiering_config import NUM_CHUNKS, PAGE, PLANE_BYTES, make_config

try:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from triton_offload.vllm.tiers import layout_note_path

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")

NUM_BLOCKS = 16


def caches() -> Any:
    planes = [torch.zeros(NUM_BLOCKS, PLANE_BYTES, dtype=torch.int8) for _ in range(2)]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(p, PLANE_BYTES) for p in planes],
        group_data_refs=[
            [CanonicalKVCacheRef(0, PLANE_BYTES), CanonicalKVCacheRef(1, PLANE_BYTES)]
        ],
    )


def rows_of(manager: Any) -> torch.Tensor:
    """The scheduler's mapping of the region, row by row."""
    view = manager.primary_tier.get_kv_memoryview()
    return torch.frombuffer(view, dtype=torch.uint8).view(NUM_CHUNKS, PAGE)


def assert_one_memory(worker: Any, manager: Any) -> None:
    """Bytes written through the worker's mapping are the scheduler's (one region)."""
    pattern = torch.arange(PAGE, dtype=torch.int32).remainder(251).to(torch.uint8)
    worker_rows = worker.region.base_tensor.view(torch.uint8).view(NUM_CHUNKS, PAGE)
    worker_rows[NUM_CHUNKS - 1] = pattern
    rows = rows_of(manager)
    try:
        assert torch.equal(rows[NUM_CHUNKS - 1], pattern)
    finally:
        del rows


def test_the_scheduler_unlinks_the_region_once_every_worker_mapped_it(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    worker = OffloadingSpecFactory.create_spec(config).get_worker(caches())
    path = worker.region.mmap_path
    manager = None
    try:
        assert os.path.exists(path)  # the worker alone: linked for the scheduler to join
        manager = OffloadingSpecFactory.create_spec(config).get_manager()
        assert not os.path.exists(path)
        assert_one_memory(worker, manager)
    finally:
        worker.shutdown()
        if manager is not None:
            manager.shutdown()
    assert not os.path.exists(path)


def test_a_scheduler_built_before_its_workers_leaves_the_region_for_them(
    tmp_path: Path,
) -> None:
    spec = OffloadingSpecFactory.create_spec(make_config(tmp_path))
    manager = spec.get_manager()
    path = manager.primary_tier._mmap_region.mmap_path
    worker = None
    try:
        assert os.path.exists(path)
        worker = spec.get_worker(caches())
        assert_one_memory(worker, manager)
    finally:
        if worker is not None:
            worker.shutdown()
        manager.shutdown()
    assert not os.path.exists(path)


def test_a_note_older_than_the_scheduler_proves_no_mapping(tmp_path: Path) -> None:
    """A worker's note from before the scheduler's process started (a killed earlier
    engine of this id left it) is no proof that this engine's worker mapped the region:
    the scheduler leaves it linked."""
    config = make_config(tmp_path)
    worker = OffloadingSpecFactory.create_spec(config).get_worker(caches())
    path = worker.region.mmap_path
    note = layout_note_path(str(config.engine_id), 0)
    os.utime(note, (1.0, 1.0))
    manager = None
    try:
        manager = OffloadingSpecFactory.create_spec(config).get_manager()
        assert os.path.exists(path)
    finally:
        worker.shutdown()
        if manager is not None:
            manager.shutdown()
    assert not os.path.exists(path)
