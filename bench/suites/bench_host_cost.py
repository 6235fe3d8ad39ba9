"""Host microseconds per job of every copier at the preset shapes (full size), no GPU.

What a job costs the host before the device does anything: the job spec, its pair
table and checks, the path choice, and each copier's preparation and enqueue. The
device side is replaced by recording stand-ins (a ``cuMemcpyBatchAsync`` that only
counts, a ``cudaMemcpyAsync`` that only counts, a kernel launcher that does nothing),
so the numbers are the Python and numpy work alone, measured on the CPU:

- ``triton``: pair table staged in a (here unpinned) buffer, its "upload" and the launch;
- ``dma``: one batched driver call, descriptors built with numpy;
- ``dma-loop``: the fallback for drivers before 12.8, one call per merged run;
- ``auto``: per-plane choice (pages of 64 KiB and more by DMA, the rest by the kernel).

Caches and pool are ``torch.empty`` (never touched): only addresses are computed, so
full-size models cost no memory. Each row records ``us_per_job``, ``driver_calls`` and
``descriptors`` per job in ``extra_info`` and prints them (``-s``). Goal: the DMA path's
host work is O(1) driver calls per job (one), the Triton path unchanged.

``test_path_choice_per_job`` times the per-plane path choice alone (``auto``'s
``CrossoverPath.assign``) on a 160-plane hybrid layout with a calibration-shaped grid.

Run: ``python -m pytest bench/suites/bench_host_cost.py --benchmark-enable -s``; without it
each case runs once as a smoke test.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from triton_offload.bench.cases import CASES
from triton_offload.bench.paths import build_workspace, plan_for

from triton_offload.transfer import batch_copy
from triton_offload.transfer.copiers import DmaCopier, TritonCopier
from triton_offload.transfer.engine import TransferEngine
from triton_offload.transfer.selection import Crossover, CrossoverPath, FixedPath

COPIERS = ("triton", "dma", "dma-loop", "auto")
#: The per-plane split used for "auto" here (a measured crossover needs a GPU).
AUTO_DMA_FROM_BYTES = 64 << 10


class _CountingApi:
    def __init__(self) -> None:
        self.calls = 0

    def memcpy_async(self, dst: int, src: int, size: int, stream: int) -> None:
        self.calls += 1


class _CountingBatch:
    def __init__(self) -> None:
        self.calls = 0
        self.descriptors = 0

    def __call__(self, *args: Any) -> int:
        self.calls += 1
        self.descriptors += args[3]
        return 0


class _Stream:
    cuda_stream = 0

    def wait_event(self, event: Any) -> None:
        pass


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


def _kernels() -> SimpleNamespace:
    launches: list[int] = []
    return SimpleNamespace(
        TILE_BYTES=8192,
        launch_copy=lambda *args, **kwargs: launches.append(1),
        default_num_programs=lambda device, tile: 32,
        launches=launches,
    )


def _engine(case_name: str, copier: str) -> tuple[TransferEngine, Any, dict[str, Any]]:
    case = CASES[case_name]
    ws = build_workspace(case, torch.device("cpu"), seed=5)
    pool = torch.empty((ws.num_host_blocks, ws.layout.row_bytes), dtype=torch.uint8)
    engine = TransferEngine(
        plan_for(case), ws.caches, ws.num_host_blocks, backend="torch", pool=pool
    )
    # A CUDA-shaped triton copier (staging ring, packed table) on CPU buffers.
    kernels = _kernels()
    triton = TritonCopier(
        engine.layout,
        engine.pool_address,
        engine.row_stride,
        device=engine.device,
        cuda=True,
        kernels=kernels,  # type: ignore[arg-type]
    )
    counters: dict[str, Any] = {
        "batch": _CountingBatch(),
        "api": _CountingApi(),
        "kernels": kernels,
    }
    batched = DmaCopier(
        engine.layout,
        engine.pool_address,
        engine.row_stride,
        counters["api"],
        batch_copy.stand_in(counters["batch"]),
    )
    loop = DmaCopier(engine.layout, engine.pool_address, engine.row_stride, counters["api"])
    engine.copiers = {"triton": triton, "dma": loop if copier == "dma-loop" else batched}
    if copier == "auto":
        crossover = Crossover(threshold={0: AUTO_DMA_FROM_BYTES, 1: AUTO_DMA_FROM_BYTES})
        engine.policy = CrossoverPath(engine.layout, crossover, "plane")
    else:
        engine.policy = FixedPath("dma" if copier.startswith("dma") else "triton")
    return engine, ws, counters


@pytest.mark.parametrize("copier", COPIERS)
@pytest.mark.parametrize("case_name", sorted(CASES))
def test_host_cost_per_job(
    benchmark: Any, case_name: str, copier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from triton_offload.transfer import copiers

    # Pinned staging needs CUDA; the fill and upload cost the same on a plain buffer.
    monkeypatch.setattr(copiers, "_pinned_int64", lambda n: torch.empty(n, dtype=torch.int64))
    # The kernel tables of a plane subset are uploaded on the job's stream, ordered by an
    # event: stand-ins for both (the engine runs the CUDA-shaped copier on the CPU).
    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    engine, ws, counters = _engine(case_name, copier)
    lists = {"gpu_blocks": ws.gpu_blocks, "host_blocks": ws.host_rows}
    job = iter(range(1 << 30))

    failed: list[Any] = []

    def one_job() -> list[Any]:
        engine.submit_store(next(job), **lists)
        results = engine.get_finished()
        failed.extend(r for r in results if not r.success)
        return results

    # Tables of plane subsets are built once, not per job: not timed.
    assert [r.success for r in one_job()] == [True]
    counters["batch"].calls = counters["batch"].descriptors = counters["api"].calls = 0
    counters["kernels"].launches.clear()
    assert [r.success for r in one_job()] == [True]  # one counted job
    launches = len(counters["kernels"].launches)
    calls = counters["batch"].calls + counters["api"].calls
    descriptors = counters["batch"].descriptors + counters["api"].calls
    if copier == "dma":
        assert calls == 1  # one batched call per job, whatever its size
    if copier == "dma-loop":
        assert calls == descriptors  # the fallback: one call per merged run
    benchmark.group = f"host cost per job: {case_name}"
    benchmark(one_job)
    assert engine.get_finished() == [] and not failed  # a failed job would time an error path
    us = benchmark.stats.stats.median * 1e6 if benchmark.stats is not None else float("nan")
    benchmark.extra_info.update(
        us_per_job=round(us, 1),
        driver_calls=calls,
        kernel_launches=launches,
        descriptors=descriptors,
        pages=ws.job_pages,
        path=engine.last_job_backend,
    )
    print(
        f"\n{case_name:<16} {copier:<9} {us:9.1f} us/job, {calls:5d} DMA calls, "
        f"{launches} launch, {descriptors:5d} descriptors, {ws.job_pages} pages "
        f"({engine.last_job_backend})"
    )
    engine.shutdown()


#: Page bytes of the 160-plane hybrid below: 40 attention layers with K/V pages of
#: 8 KiB, 40 Mamba layers with a 24 KiB conv and a 1 MiB SSM state.
CHOICE_ATTENTION_BYTES, CHOICE_CONV_BYTES, CHOICE_SSM_BYTES = 8 << 10, 24 << 10, 1 << 20


def _choice_layout() -> Any:
    from triton_offload.transfer.layout import build_layout

    # One block per plane: only the page sizes matter to the path choice.
    attention = [
        (
            torch.empty(1, CHOICE_ATTENTION_BYTES, dtype=torch.uint8),
            torch.empty(1, CHOICE_ATTENTION_BYTES, dtype=torch.uint8),
        )
        for _ in range(40)
    ]
    mamba = [
        (
            torch.empty(1, CHOICE_CONV_BYTES, dtype=torch.uint8),
            torch.empty(1, CHOICE_SSM_BYTES, dtype=torch.uint8),
        )
        for _ in range(40)
    ]
    return build_layout([attention, mamba], num_groups=2, blocks_per_chunk=1)


def _choice_grid() -> Crossover:
    """A calibration-shaped grid (page sizes x 16 / 256 pages, both directions)."""
    winners = {
        (CHOICE_ATTENTION_BYTES, 16): "triton",
        (CHOICE_ATTENTION_BYTES, 256): "triton",
        (CHOICE_CONV_BYTES, 16): "dma",
        (CHOICE_CONV_BYTES, 256): "triton",
        (CHOICE_SSM_BYTES, 16): "dma",
        (CHOICE_SSM_BYTES, 256): "dma",
    }
    return Crossover(grid={0: dict(winners), 1: dict(winners)})


def test_path_choice_per_job(benchmark: Any) -> None:
    """Host microseconds of the per-plane path choice of one job, 160 planes.

    Jobs as serving produces them: 1-512 attention blocks, and the Mamba state at the
    hit end (0 or 1 block), stores and loads alternating; 512 distinct jobs cycled.
    """
    import itertools

    import numpy as np

    layout = _choice_layout()
    assert len(layout.planes) == 160
    policy = CrossoverPath(layout, _choice_grid(), "plane")
    rng = np.random.default_rng(3)
    jobs = [(i % 2, (int(rng.integers(1, 513)), int(rng.integers(0, 2)))) for i in range(512)]
    cycle = itertools.cycle(jobs)

    def one_job() -> None:
        direction, counts = next(cycle)
        policy.assign(direction, counts)

    benchmark.group = "path choice per job: 160 planes"
    benchmark(one_job)
    us = benchmark.stats.stats.median * 1e6 if benchmark.stats is not None else float("nan")
    benchmark.extra_info.update(us_per_job=round(us, 2), planes=len(layout.planes))
    print(f"\npath choice, 160 planes: {us:9.2f} us/job")
