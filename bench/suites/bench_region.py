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
  elsewhere);
- ``store_ledger``: the replicated layout's store ledger (a second, small region and
  its barrier), alone and with two workers meeting at a gloo barrier as vLLM's do.

Each row records ``bytes``, ``GBps`` (bytes / fastest round) and ``ratio`` (the
first-touch time over the row's, same run) in ``extra_info``.

Sizes: 64 MiB with ``--benchmark-enable``, 4 MiB as the default smoke run;
``TRITON_OFFLOAD_BENCH_REGION_GIB=4`` measures 4 GiB (mind ``/dev/shm``'s size).
Run: ``python -m pytest bench/suites/bench_region.py --benchmark-enable -s``.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import pytest
import torch

try:
    from triton_offload.vllm import region as vllm_region

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
            from triton_offload.transfer.pool import cuda_api

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


# ------------------------------------------------------------------ store ledger

#: Chunk counts of the replicated layout's store ledger: a 16 GiB region of 2 MiB
#: chunks, and a ~100 GiB region of 96 KiB chunks (the most chunks a region has).
LEDGER_CHUNKS = (8192, 1 << 20)
LEDGER_WORKERS = 2


def _ledger_rank(rank: int, init: str, num_chunks: int, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=LEDGER_WORKERS)
    try:
        barrier_alone, with_ledger = [], []
        for round_ in range(ROUNDS):
            dist.barrier()
            start = time.perf_counter()
            dist.barrier()
            barrier_alone.append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            # What get_worker adds under the replicated layout: a second region and
            # its barrier (the same gloo barrier vLLM's workers meet at).
            ledger = vllm_region.StoreLedger(f"{init[-12:]}-{round_}", num_chunks, dist.barrier)
            with_ledger.append(time.perf_counter() - start)
            ledger.close()
        out.put((rank, barrier_alone, with_ledger))
    finally:
        dist.destroy_process_group()


def _ledger_start_up(num_chunks: int, tmp: str) -> tuple[float, float]:
    """(barrier alone, ledger creation incl. its barrier): slowest rank, best round (s)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    out = context.Queue()
    init = f"file://{tmp}/gloo-{uuid.uuid4().hex[:12]}"
    workers = [
        context.Process(target=_ledger_rank, args=(rank, init, num_chunks, out))
        for rank in range(LEDGER_WORKERS)
    ]
    for worker in workers:
        worker.start()
    results = [out.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    rounds = range(ROUNDS)
    barrier = min(max(r[1][i] for r in results) for i in rounds)
    ledger = min(max(r[2][i] for r in results) for i in rounds)
    return barrier, ledger


@pytest.mark.parametrize("num_chunks", LEDGER_CHUNKS)
def test_store_ledger(benchmark: Any, num_chunks: int, tmp_path: Any) -> None:
    """Start-up cost of the replicated layout's store ledger, per worker.

    Timed row: creating the ledger in one process (no barrier). ``extra_info``: the
    same with vLLM's kind of barrier (gloo, two processes), the barrier alone, and the
    ``/dev/shm`` bytes the ledger maps.
    """
    benchmark.group = "vLLM store ledger start-up"
    if benchmark.disabled and num_chunks != LEDGER_CHUNKS[0]:
        pytest.skip("the largest ledger is measured with --benchmark-enable only")
    ledgers: list[Any] = []

    def create() -> None:
        while ledgers:
            ledgers.pop().close()
        ledgers.append(vllm_region.StoreLedger(f"bench-{uuid.uuid4()}", num_chunks, None))

    try:
        benchmark.pedantic(create, rounds=ROUNDS, iterations=1)
        mapped = int(ledgers[0].region.total_size_bytes)
    finally:
        while ledgers:
            ledgers.pop().close()
    barrier, ledger = _ledger_start_up(num_chunks, str(tmp_path))
    benchmark.extra_info.update(
        chunks=num_chunks,
        bytes=mapped,
        barrier_ms=round(barrier * 1e3, 3),
        ledger_with_barrier_ms=round(ledger * 1e3, 3),
    )
    print(
        f"\nstore ledger, {num_chunks} chunks: {mapped / 1024:.0f} KiB of /dev/shm; "
        f"{LEDGER_WORKERS} workers (gloo): {ledger * 1e3:.2f} ms with its barrier "
        f"(barrier alone {barrier * 1e3:.2f} ms)"
    )
