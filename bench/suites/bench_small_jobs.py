"""CPU path, small jobs: one engine job against a per-page ``copy_`` loop, same run.

The engine's per-job cost (job spec, pair table and its checks, the copy) must not make
a small job slower than the plain loop a caller would write instead: one
``pool_page.copy_(cache_page)`` per page over the same pages. A job here is 8 blocks
of a K/V layer (16 pages) at 1, 4, 16 and 64 KiB per page, or 1 block (2 pages) at
4 KiB, random blocks and rows;
the engine is given the lists as a caller would (``gpu_blocks=``/``host_blocks=``), so
building the ``JobSpec`` is inside the timed call.

Each row records, over ``ROUNDS`` alternated runs of the two (so that load from other
processes on a shared machine hits both alike), ``ratio`` = loop time / job time of the
fastest runs and ``ratio_median`` of the medians in ``extra_info``, and prints them
(``-s``). Goals: ratio >= 1 for 16-page jobs, >= 0.35 for 2-page jobs (where the
loop's two calls leave the job's fixed cost nothing to hide behind).

Run: ``python -m pytest bench/suites/bench_small_jobs.py --benchmark-enable -s``; without
``--benchmark-enable`` each case runs a few rounds as a smoke test (and checks bytes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from triton_offload import GroupSpec, plan_offload
from triton_offload.transfer.engine import TransferEngine

PAGE_SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10]
#: (page bytes, blocks) of each case; a block is 2 pages (K, V).
CASES = [(1 << 10, 8), (4 << 10, 8), (16 << 10, 8), (64 << 10, 8), (4 << 10, 1)]
NUM_BLOCKS = 64
ROUNDS = 200
SMOKE_ROUNDS = 3


def _setup(
    page: int, blocks_per_job: int, direction: str
) -> tuple[Callable[[], None], Callable[[], None], Any]:
    generator = torch.Generator().manual_seed(page)
    kv = torch.randint(0, 256, (2, NUM_BLOCKS, page), dtype=torch.uint8, generator=generator)
    plan = plan_offload([GroupSpec("full_attention", 16)])
    engine = TransferEngine(plan, [[(kv[0], kv[1])]], NUM_BLOCKS, backend="torch")
    blocks = torch.randperm(NUM_BLOCKS, generator=generator)[:blocks_per_job].tolist()
    rows = torch.randperm(NUM_BLOCKS, generator=generator)[:blocks_per_job].tolist()
    sides = [(kv[0], engine.pool_view(0)[:, 0]), (kv[1], engine.pool_view(1)[:, 0])]
    state = {"job": 0}
    submit = engine.submit_store if direction == "store" else engine.submit_load

    def job() -> None:
        state["job"] += 1
        submit(state["job"], gpu_blocks=[blocks], host_blocks=[rows])
        (result,) = engine.get_finished()
        assert result.success

    def loop() -> None:
        for cache, pool in sides:
            for block, row in zip(blocks, rows, strict=True):
                if direction == "store":
                    pool[row].copy_(cache[block])
                else:
                    cache[block].copy_(pool[row])

    check = SimpleNamespace(kv=kv, pool=engine.pool, sides=sides, blocks=blocks, rows=rows)
    return job, loop, check


def _alternate(job: Callable[[], None], loop: Callable[[], None], rounds: int) -> tuple:
    jobs, loops = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        job()
        jobs.append(time.perf_counter() - start)
        start = time.perf_counter()
        loop()
        loops.append(time.perf_counter() - start)
    return jobs, loops


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize(
    ("page", "blocks"), CASES, ids=[f"{blocks * 2}x{page >> 10}KiB" for page, blocks in CASES]
)
def test_small_job_vs_per_page_loop(benchmark: Any, page: int, blocks: int, direction: str) -> None:
    job, loop, check = _setup(page, blocks, direction)
    pages = 2 * blocks
    benchmark.group = f"{pages}-page job, {page >> 10} KiB pages"
    benchmark(job)
    for cache, pool in check.sides:  # the job moved the bytes the loop would
        assert torch.equal(pool[check.rows], cache[check.blocks])
    jobs, loops = _alternate(job, loop, SMOKE_ROUNDS if benchmark.disabled else ROUNDS)
    ratio = min(loops) / min(jobs)
    ratio_median = statistics.median(loops) / statistics.median(jobs)
    benchmark.extra_info.update(
        pages=pages,
        job_us=round(min(jobs) * 1e6, 1),
        loop_us=round(min(loops) * 1e6, 1),
        ratio=round(ratio, 3),
        ratio_median=round(ratio_median, 3),
    )
    print(
        f"\n{direction} {pages} x {page >> 10} KiB: job {min(jobs) * 1e6:.1f} us, per-page loop "
        f"{min(loops) * 1e6:.1f} us, loop/job {ratio:.2f} (medians {ratio_median:.2f})"
    )
