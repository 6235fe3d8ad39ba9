"""Start-up cost of a vLLM worker's host memory: creating vLLM's shared region and locking it.

What :class:`~triton_offload.vllm.TritonOffloadingSpec` does in ``get_worker`` before
any job runs: create (or join) the ``SharedOffloadRegion`` with vLLM's own arguments
(segment files, every page of this worker pre-faulted) and, on CUDA, page-lock the
worker's pages with ``cudaHostRegister`` in pieces. Rows:

- ``first_touch``: the ceiling, measured in the same run: a private allocation of the
  same bytes with every page written once (what faulting them in costs anyway);
- ``create``: region creation alone (a worker of one, per-worker layout), then its
  clean-up outside the timing;
- ``create_and_lock``: the same plus locking (CUDA only; skipped with the reason
  elsewhere).

Each row records ``bytes``, ``GBps`` (bytes / fastest round) and ``ratio`` (the
first-touch time over the row's, same run) in ``extra_info``.

Sizes: 64 MiB with ``--benchmark-enable``, 4 MiB as the default smoke run;
``TRITON_OFFLOAD_BENCH_REGION_GIB=4`` measures 4 GiB (mind ``/dev/shm``'s size).
Run: ``python -m pytest bench/bench_region.py --benchmark-enable -s``.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import pytest
import torch

try:
    from triton_offload import vllm_region

    vllm_region.create_worker_region  # noqa: B018
    # Imported here as in a vLLM worker, where they are loaded long before the region.
    import vllm.v1.kv_offload.cpu.spec  # noqa: F401
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: F401

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")

SMOKE_BYTES = 4 << 20
DEFAULT_BYTES = 64 << 20
#: One chunk row: 2 MiB (e.g. Llama-3.1-8B, 16-token blocks, 2 blocks per chunk at TP=2).
ROW_BYTES = 2 << 20
ROUNDS = 3


def _region_bytes(benchmark: Any) -> int:
    gib = os.environ.get("TRITON_OFFLOAD_BENCH_REGION_GIB")
    if gib:
        return int(float(gib) * (1 << 30)) // ROW_BYTES * ROW_BYTES
    return SMOKE_BYTES if benchmark.disabled else DEFAULT_BYTES


def _plan(total: int) -> Any:
    return vllm_region.RegionPlan(
        engine_id=f"bench-{uuid.uuid4()}",
        num_chunks=total // ROW_BYTES,
        row_stride=ROW_BYTES,
        cpu_page_size=ROW_BYTES,
        rank=0,
        world_size=1,
        replicated=False,
    )


def _first_touch_seconds(total: int) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        buffer = torch.empty(total, dtype=torch.uint8)
        buffer[::4096].fill_(0)  # one write per page: the faults, not a memset
        best = min(best, time.perf_counter() - start)
        del buffer
    return best


def _report(benchmark: Any, total: int, seconds: float, ceiling: float, what: str) -> None:
    benchmark.extra_info.update(
        bytes=total,
        GBps=round(total / seconds / 1e9, 2),
        first_touch_GBps=round(total / ceiling / 1e9, 2),
        ratio=round(ceiling / seconds, 3),
    )
    print(
        f"\n{what} {total / (1 << 20):.0f} MiB: {seconds * 1e3:.1f} ms "
        f"({total / seconds / 1e9:.2f} GB/s; first touch {total / ceiling / 1e9:.2f} GB/s, "
        f"ratio {ceiling / seconds:.2f})"
    )


def _measure(benchmark: Any, lock: bool) -> tuple[int, float]:
    total = _region_bytes(benchmark)
    regions: list[Any] = []
    times: list[float] = []

    def create() -> None:
        release()  # the previous round's region, outside the timing
        plan = _plan(total)
        start = time.perf_counter()
        region = vllm_region.create_worker_region(plan, barrier=None)
        if lock:
            from triton_offload.pool import cuda_api

            vllm_region.lock_worker_pages(region, plan, cuda_api())
        times.append(time.perf_counter() - start)
        regions.append(region)

    def release() -> None:
        while regions:
            regions.pop().cleanup()

    try:
        benchmark.pedantic(create, rounds=ROUNDS, iterations=1)
    finally:
        release()
    return total, min(times)


def test_first_touch(benchmark: Any) -> None:
    total = _region_bytes(benchmark)
    benchmark.group = "vLLM region start-up"
    benchmark.pedantic(_first_touch_seconds, args=(total,), rounds=1, iterations=1)
    ceiling = _first_touch_seconds(total)
    _report(benchmark, total, ceiling, ceiling, "first touch")


def test_create(benchmark: Any) -> None:
    benchmark.group = "vLLM region start-up"
    total, seconds = _measure(benchmark, lock=False)
    _report(benchmark, total, seconds, _first_touch_seconds(total), "create")


@pytest.mark.cuda
def test_create_and_lock(benchmark: Any) -> None:
    benchmark.group = "vLLM region start-up"
    total, seconds = _measure(benchmark, lock=True)
    _report(benchmark, total, seconds, _first_touch_seconds(total), "create + lock")
