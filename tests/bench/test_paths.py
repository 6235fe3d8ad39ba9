"""CUDA-only bench paths driven on the CPU through stand-ins (no GPU needed).

The batched-DMA baseline runs against a stand-in ``cuda.bindings.driver`` whose
``cuMemcpyBatchAsync`` really moves the bytes (host memory), so its descriptors and
its verification are checked byte-exactly; a bindings release whose call does not fit
makes the path unavailable instead of failing. The engine path's launch count for
DMA jobs comes from the copier, not from a profile.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import types
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from triton_offload.bench import harness, paths
from triton_offload.bench.paths import (
    BatchedDmaPath,
    EnginePath,
    PathUnavailable,
    Workspace,
    build_workspace,
)

from triton_offload.transfer.pool import allocate_pool


class _CudaWorkspace(Workspace):
    """A CPU workspace that the CUDA-only paths accept."""

    @property
    def cuda(self) -> bool:
        return True


class _Stream:
    cuda_stream = 0x1234

    def synchronize(self) -> None:
        pass


def _driver_module(copy: Any) -> types.ModuleType:
    driver = types.ModuleType("cuda.bindings.driver")

    class CUresult:
        CUDA_SUCCESS = 0

    class CUmemcpySrcAccessOrder:
        CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1

    driver.CUresult = CUresult  # type: ignore[attr-defined]
    driver.CUmemcpySrcAccessOrder = CUmemcpySrcAccessOrder  # type: ignore[attr-defined]
    driver.CUmemcpyAttributes = SimpleNamespace  # type: ignore[attr-defined]
    driver.CUdeviceptr = int  # type: ignore[attr-defined]
    driver.CUstream = int  # type: ignore[attr-defined]
    driver.cuMemcpyBatchAsync = copy  # type: ignore[attr-defined]
    return driver


def _host_batch(calls: list) -> Any:
    """cuMemcpyBatchAsync as CUDA 13's bindings take it, moving host bytes."""

    def batch(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream):
        calls.append((count, num_attrs, attrs_idxs, stream))
        assert count == len(dsts) == len(srcs) == len(sizes)
        assert attrs[0].srcAccessOrder == 1 and attrs_idxs == [0] and num_attrs == 1
        for dst, src, size in zip(dsts, srcs, sizes, strict=True):
            ctypes.memmove(dst, src, size)
        return (0,)

    return batch


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(copy: Any) -> None:
        cuda = types.ModuleType("cuda")
        bindings = types.ModuleType("cuda.bindings")
        driver = _driver_module(copy)
        bindings.driver = driver  # type: ignore[attr-defined]
        cuda.bindings = bindings  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "cuda", cuda)
        monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
        monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
        monkeypatch.setattr(
            paths, "allocate_pool", lambda rows, row, pinned: allocate_pool(rows, row, pinned=False)
        )
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    return install


def _workspace() -> Workspace:
    ws = build_workspace(harness.correctness_case(), torch.device("cpu"))
    ws.__class__ = _CudaWorkspace
    return ws


def test_batched_dma_moves_every_page_byte_exact(stand_ins: Any) -> None:
    calls: list = []
    stand_ins(_host_batch(calls))
    runner = BatchedDmaPath(_workspace())
    assert calls == [(1, 1, [0], _Stream.cuda_stream)]  # the probe
    assert runner.verify() is None
    pages = runner.ws.job_pages
    assert [c[0] for c in calls[1:]] == [pages, pages]  # one batch per job
    runner.close()


@pytest.mark.parametrize("failure", ["signature", "error code", "no bytes"])
def test_batched_dma_unusable_bindings_make_it_unavailable(stand_ins: Any, failure: str) -> None:
    def batch(*args: Any) -> Any:
        if failure == "signature":
            raise TypeError("cuMemcpyBatchAsync() takes exactly 9 positional arguments")
        return (1,) if failure == "error code" else (0,)

    stand_ins(batch)
    with pytest.raises(PathUnavailable, match="probe failed"):
        BatchedDmaPath(_workspace())


def test_engine_path_counts_dma_jobs_without_the_profiler() -> None:
    runner = object.__new__(EnginePath)
    copier = SimpleNamespace(last_call_count=100_000)
    runner.engine = SimpleNamespace(cuda=True, last_job_backend="dma", copiers={"dma": copier})
    assert runner.launches_per_job("store") == 100_000
    runner.engine.last_job_backend = "triton"
    assert runner.launches_per_job("store") is None  # profiled
    runner.engine.cuda = False
    runner.engine.last_job_backend = "torch"
    assert runner.launches_per_job("store") is None


def test_profiler_counts_preset_rows_not_sweep_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    profiled: list[tuple[str, str]] = []

    def count(runner: Any, direction: str, device: torch.device) -> int:
        profiled.append((runner.ws.case.name, direction))
        return 2

    monkeypatch.setattr(harness, "count_device_ops", count)
    config = harness.Config(
        presets=[],
        sweep=True,
        directions=["store", "load"],
        repeats=1,
        warmup=0,
        paths=["torch"],
        quick=True,
        device=torch.device("cpu"),
        target_bytes=None,
    )
    preset = harness.correctness_case()
    rows = harness.run_case(preset, config)
    assert {r.launches for r in rows if r.path == "torch"} == {2}
    rows = harness.run_case(replace(preset, name="sweep-like", sweep=True), config)
    assert {r.launches for r in rows if r.path == "torch"} == {None}
    assert profiled == [(preset.name, "store"), (preset.name, "load")]
