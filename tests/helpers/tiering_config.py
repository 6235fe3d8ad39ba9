"""A TritonTieringOffloadingSpec config with vLLM's ``fs`` secondary tier, and the steps
that settle its transfers (``tests/vllm/test_tiers.py`` and the tests built on it).
Importing this module needs no vLLM: ``VLLM_ERROR`` says why it cannot be imported, or
is None."""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path
from typing import Any

try:
    from vllm.v1.kv_offload.base import ScheduleEndContext
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"


PAGE = 4096


BPC = 2
# Two 1 KiB-per-block planes: one chunk is 4 KiB, exactly one OS page.
PLANE_BYTES = 1024
NUM_CHUNKS = 2
TIMEOUT_S = 20


def make_config(
    root: Path,
    spec_name: str = "TritonTieringOffloadingSpec",
    tiers: list[dict[str, Any]] | None = None,
    **changes: Any,
) -> OffloadingConfig:
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("attn",), group_id=0),),
        worker_kv_bytes_per_block=2 * PLANE_BYTES,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": spec_name,
            "spec_module_path": "triton_offload.vllm",
            "cpu_bytes_to_use": NUM_CHUNKS * PAGE,
            "verify_chunks": False,  # copies judged in test_tiers.py; seals in test_integrity.py
            "backend": "torch",
            "secondary_tiers": tiers
            if tiers is not None
            else [{"type": "fs", "root_dir": str(root), "n_read_threads": 1, "n_write_threads": 1}],
        },
        engine_id=f"tiering-{uuid.uuid4()}",
        model=OffloadingModelConfig(name="test", dtype="bfloat16", max_model_len=1024),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BPC),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    return dataclasses.replace(config, **changes)


def _settle(manager: Any) -> None:
    """Run scheduler steps until the tiers have no transfer in flight."""
    context = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
    deadline = time.monotonic() + TIMEOUT_S
    manager.on_schedule_end(context)
    while manager.has_pending_work():
        assert time.monotonic() < deadline, "tier transfers did not finish"
        time.sleep(0.005)
        manager.on_schedule_end(context)


def _finish(worker: Any, job_id: int) -> None:
    worker.wait({job_id})
    results = worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(job_id, True)]


def _parallel(tp: int, agnostic: bool) -> OffloadingParallelConfig:
    return OffloadingParallelConfig(
        rank=0,
        world_size=tp,
        tp_size=tp,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=agnostic,
    )
