"""The transfer paths a benchmark case is measured on, and the workspace they share.

A :class:`Workspace` holds one case's cache tensors (on the device), the job (per group:
GPU block ids and host pool rows) and the pool row layout of
:func:`triton_offload.transfer.layout.build_layout`, so every path that owns a pool fills it the
same way and can be checked against one expected pool image.

A path is a :class:`PathRunner`: ``submit(direction)`` enqueues one job,
``finish()`` waits for it. Paths:

==================  ========  ================================================================
name                role      what one job does
==================  ========  ================================================================
triton/dma/auto/    project   ``TransferEngine`` with that backend: ``submit_store`` /
torch                         ``submit_load``, then ``wait``
per-page-copy       baseline  one ``copy_`` per page (one ``cudaMemcpyAsync`` each on CUDA):
                              vLLM's old ``swap_blocks`` strategy
index-copy          baseline  CPU only: ``index_select`` + ``index_copy_`` per plane
flat-triton         baseline  one descriptor per page built on the host, one launch of a flat
                              kernel with a 12-program grid (vLLM's load-kernel strategy)
batched-dma         baseline  CUDA only: one ``cuMemcpyBatchAsync`` per job via cuda-python
vllm-swap-blocks    baseline  CUDA only, vllm importable: vLLM's own ``swap_blocks_batch``
ceiling             ceiling   one contiguous copy of the job's bytes (device <-> pinned host)
==================  ========  ================================================================
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from triton_offload.bench.cases import Case

from triton_offload.transfer.copiers import load_kernels
from triton_offload.transfer.jobs import JobSpec
from triton_offload.transfer.layout import CacheLayout, Layer, build_layout, pool_plane_view
from triton_offload.transfer.pool import HostPool, allocate_pool

STORE = "store"
LOAD = "load"
DIRECTIONS = (STORE, LOAD)

ENGINE_BACKENDS = ("triton", "dma", "auto", "torch")
BASELINES = ("per-page-copy", "index-copy", "flat-triton", "batched-dma", "vllm-swap-blocks")
CEILING = "ceiling"
ALL_PATHS = (*ENGINE_BACKENDS, *BASELINES, CEILING)

POISON = 0xA5  # fill of destination bytes before a verified copy
CACHE_POISON = 0x5A


class PathUnavailable(Exception):
    """The path cannot run here (missing dependency, no CUDA); the message says why."""


# --------------------------------------------------------------------------- workspace


@dataclass
class Workspace:
    """One case's caches, job and pool layout on ``device``."""

    case: Case
    device: torch.device
    caches: list[list[Layer]]
    backing: list[torch.Tensor]  # every allocated cache tensor (for fills and checks)
    layout: CacheLayout
    gpu_blocks: list[list[int]]
    host_rows: list[list[int]]
    num_host_blocks: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def spec(self) -> JobSpec:
        """The job as the engine takes it (first block index 0, one row per block)."""
        return JobSpec(self.gpu_blocks, self.host_rows)

    @property
    def job_bytes(self) -> int:
        return sum(
            self.layout.bytes_per_block[g] * len(self.gpu_blocks[g])
            for g in range(self.layout.num_groups)
        )

    @property
    def job_pages(self) -> int:
        return sum(
            len(self.layout.group_planes[g]) * len(self.gpu_blocks[g])
            for g in range(self.layout.num_groups)
        )

    def fill_random(self, seed: int) -> None:
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for tensor in self.backing:
            tensor.copy_(
                torch.randint(
                    0, 256, tensor.shape, dtype=torch.uint8, device=self.device, generator=generator
                )
            )

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.backing]

    def caches_equal(self, snapshot: Sequence[torch.Tensor]) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.backing, snapshot, strict=True))

    def poison_addressed_blocks(self) -> None:
        for plane in self.layout.planes:
            ids = self.block_index(plane.group)
            plane.view[ids] = CACHE_POISON

    def block_index(self, group: int) -> torch.Tensor:
        return torch.tensor(self.gpu_blocks[group], dtype=torch.long, device=self.device)

    def row_index(self, group: int) -> torch.Tensor:
        return torch.tensor(self.host_rows[group], dtype=torch.long)

    def expected_pool(self, row_bytes: int) -> torch.Tensor:
        """The pool image after a store into a pool poisoned with ``POISON`` (CPU tensor)."""
        pool = torch.full((self.num_host_blocks, row_bytes), POISON, dtype=torch.uint8)
        for plane in self.layout.planes:
            view = pool_plane_view(pool, plane, 1)
            view[self.row_index(plane.group), 0] = plane.view[self.block_index(plane.group)].cpu()
        return pool

    def descriptors(self, pool_address: int, direction: str) -> tuple[np.ndarray, ...]:
        """One (source, destination, size) descriptor per (block x plane) of the job.

        Built per job with numpy, as a per-descriptor path must: O(blocks x planes).
        """
        cache_parts: list[np.ndarray] = []
        pool_parts: list[np.ndarray] = []
        size_parts: list[np.ndarray] = []
        row_bytes = self.layout.row_bytes
        for group in range(self.layout.num_groups):
            blocks = np.asarray(self.gpu_blocks[group], dtype=np.int64)
            rows = pool_address + np.asarray(self.host_rows[group], dtype=np.int64) * row_bytes
            for index in self.layout.group_planes[group]:
                plane = self.layout.planes[index]
                cache_parts.append(plane.base_address + blocks * plane.block_stride)
                pool_parts.append(rows + plane.pool_offset)
                size_parts.append(np.full(blocks.size, plane.page_bytes, dtype=np.int64))
        cache = np.concatenate(cache_parts)
        pool = np.concatenate(pool_parts)
        sizes = np.concatenate(size_parts)
        return (cache, pool, sizes) if direction == STORE else (pool, cache, sizes)


def plan_for(case: Case) -> Any:
    """The planner's ``OffloadPlan`` for ``case`` (one block per chunk)."""
    from triton_offload.planner.groups import GroupSpec
    from triton_offload.planner.plan import plan_offload

    specs = [
        GroupSpec(
            g.kind,
            g.block_size,
            sliding_window=g.sliding_window,
            mamba_cache_mode=g.mamba_cache_mode,
            name=g.name,
        )
        for g in case.groups
    ]
    return plan_offload(specs)


def _allocate_layer(
    plane_bytes: Sequence[int], num_blocks: int, device: torch.device
) -> tuple[Layer, list[torch.Tensor]]:
    """A layer in the layout a real cache uses: K and V of equal size as the two halves
    of one ``(2, num_blocks, page)`` tensor (FlashAttention), else one tensor per plane."""
    if len(plane_bytes) == 2 and plane_bytes[0] == plane_bytes[1]:
        kv = torch.empty((2, num_blocks, plane_bytes[0]), dtype=torch.uint8, device=device)
        return (kv[0], kv[1]), [kv]
    tensors = [torch.empty((num_blocks, b), dtype=torch.uint8, device=device) for b in plane_bytes]
    if len(tensors) == 1:
        return tensors[0], tensors
    return tuple(tensors), tensors


def spare_blocks(blocks_per_job: int) -> int:
    """Blocks of a cache beyond those a job addresses: unaddressed pages must stay intact."""
    return max(2, blocks_per_job // 4)


def build_workspace(case: Case, device: torch.device, *, seed: int = 0) -> Workspace:
    rng = np.random.default_rng(seed)
    caches: list[list[Layer]] = []
    backing: list[torch.Tensor] = []
    gpu_blocks: list[list[int]] = []
    host_rows: list[list[int]] = []
    next_row = 0
    for group in case.groups:
        num_blocks = group.blocks_per_job + spare_blocks(group.blocks_per_job)
        layers: list[Layer] = []
        for _ in range(group.layers):
            layer, tensors = _allocate_layer(group.plane_bytes, num_blocks, device)
            layers.append(layer)
            backing.extend(tensors)
        caches.append(layers)
        gpu_blocks.append(rng.permutation(num_blocks)[: group.blocks_per_job].tolist())
        rows = np.arange(next_row, next_row + group.blocks_per_job)
        host_rows.append(rng.permutation(rows).tolist())
        next_row += group.blocks_per_job
    # a few rows no job addresses: they must stay untouched
    num_host_blocks = next_row + 2
    layout = build_layout(caches, num_groups=len(caches), blocks_per_chunk=1)
    return Workspace(
        case=case,
        device=device,
        caches=caches,
        backing=backing,
        layout=layout,
        gpu_blocks=gpu_blocks,
        host_rows=host_rows,
        num_host_blocks=num_host_blocks,
    )


# --------------------------------------------------------------------------- runners


class PathRunner(Protocol):
    name: str
    role: str
    #: stream the path enqueues on (CUDA), for device events; None for self-timed paths
    stream: Any
    #: True when ``finish()`` returns the job's device seconds measured by the path
    #: itself (the engine's own CUDA events); the harness then records no events
    self_timed: bool

    def submit(self, direction: str) -> None: ...

    def finish(self) -> float | None: ...

    def launches_per_job(self, direction: str) -> int | None: ...

    def verify(self) -> str | None:
        """Run one store and one load with full checks; None if byte-exact, else why not."""
        ...

    def close(self) -> None: ...


class _PoolPath:
    """Shared verification of a path that moves pages between the caches and a pool."""

    name = ""
    role = "baseline"
    stream: Any = None
    self_timed = False

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws

    @property
    def pool_tensor(self) -> torch.Tensor:
        raise NotImplementedError

    def submit(self, direction: str) -> None:
        raise NotImplementedError

    def finish(self) -> float | None:
        if self.stream is not None:
            self.stream.synchronize()
        return None

    def launches_per_job(self, direction: str) -> int | None:
        return None

    def close(self) -> None:
        pass

    def _enqueue(self, direction: str) -> None:
        if self.ws.cuda:
            # The fills and poisons ran on the default stream; this path's stream does
            # not wait for it by itself.
            torch.cuda.synchronize(self.ws.device)
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.submit(direction)
        else:
            self.submit(direction)
        self.finish()

    def verify(self) -> str | None:
        ws = self.ws
        ws.fill_random(seed=1)
        original = ws.snapshot()
        pool = self.pool_tensor
        pool.fill_(POISON)
        expected = ws.expected_pool(pool.size(1))
        self._enqueue(STORE)
        if not ws.caches_equal(original):
            return "store changed the source cache"
        if not torch.equal(pool.cpu(), expected):
            return _pool_mismatch(pool.cpu(), expected)
        ws.poison_addressed_blocks()
        self._enqueue(LOAD)
        if not torch.equal(pool.cpu(), expected):
            return "load changed the pool"
        if not ws.caches_equal(original):
            return "load did not restore the addressed blocks (or touched others)"
        return None


def _pool_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str:
    if actual.shape != expected.shape:
        return f"pool shape {tuple(actual.shape)} differs from the layout's {tuple(expected.shape)}"
    bad = (actual != expected).nonzero()
    row, col = (int(x) for x in bad[0])
    return f"store wrote pool row {row} byte {col} wrong ({bad.size(0)} bytes differ)"


def engine_backend_unavailable(backend: str, cuda: bool) -> str | None:
    """Why engine ``backend`` cannot run on this machine, or None when it can.

    Decided before an engine is built, from the device and the interpreter setting
    alone: a backend that could run here but raises while being built or run is a
    failure, and must not be reported as an absence.
    """
    if backend == "dma" and not cuda:
        return "needs CUDA caches (the copy engines); the caches are on the CPU"
    if backend == "torch" and cuda:
        return "the CPU path; the caches are on CUDA"
    if backend == "triton" or (backend == "auto" and cuda):  # auto on CUDA has the kernel
        try:
            load_kernels(backend, cuda)
        except (ValueError, RuntimeError) as error:  # the interpreter setting is wrong here
            return str(error)
    return None


class EnginePath(_PoolPath):
    """This project's ``TransferEngine`` with one backend."""

    role = "project"
    self_timed = True

    def __init__(self, ws: Workspace, backend: str) -> None:
        super().__init__(ws)
        self.name = backend
        why = engine_backend_unavailable(backend, ws.cuda)
        if why is not None:
            raise PathUnavailable(f"backend {backend!r}: {why}")
        from triton_offload.transfer.engine import TransferEngine

        # Anything raised from here on is the project failing (a failed calibration job,
        # a refused layout), reported FAILED by the harness, never "unavailable".
        self.engine = TransferEngine(
            plan_for(ws.case), ws.caches, ws.num_host_blocks, device=ws.device, backend=backend
        )
        self._job_ids = itertools.count(1)
        self._spec = ws.spec
        self._pending: int | None = None
        self._started = 0.0

    @property
    def pool_tensor(self) -> torch.Tensor:
        return self.engine.pool

    def submit(self, direction: str) -> None:
        job = next(self._job_ids)
        if direction == STORE:
            accepted = self.engine.submit_store(job, self._spec)
        else:
            accepted = self.engine.submit_load(job, self._spec)
        if not accepted:
            raise RuntimeError(f"engine {self.name} refused job {job}")
        self._pending = job

    def finish(self) -> float | None:
        assert self._pending is not None
        job, self._pending = self._pending, None
        self.engine.wait({job})
        seconds: float | None = None
        for result in self.engine.get_finished():
            if result.job_id == job:
                if not result.success:
                    raise RuntimeError(f"engine {self.name} reported job {job} failed")
                seconds = float(result.transfer_time)
        return seconds if self.ws.cuda else None

    def launches_per_job(self, direction: str) -> int | None:
        # A DMA job is one cuMemcpyBatchAsync (or, on the fallback, one cudaMemcpyAsync
        # per merged run), and the copier counts its driver calls: exact, and no profiler
        # session (each costs a CUPTI start and teardown, and a trace of 100k copies
        # takes seconds to collect). A Triton job (table upload and kernel) is counted on
        # CUDA by the profiler (harness.count_device_ops).
        engine = self.engine
        if engine.cuda and engine.last_job_backend == "dma":
            return int(engine.copiers["dma"].last_call_count)
        return None

    def close(self) -> None:
        self.engine.shutdown()


class _OwnPoolPath(_PoolPath):
    """A baseline with its own pool (pinned on CUDA) in the layout's row format."""

    def __init__(self, ws: Workspace) -> None:
        super().__init__(ws)
        self.pool: HostPool = allocate_pool(ws.num_host_blocks, ws.layout.row_bytes, pinned=ws.cuda)
        if ws.cuda:
            self.stream = torch.cuda.Stream(device=ws.device)

    @property
    def pool_tensor(self) -> torch.Tensor:
        return self.pool.tensor

    def close(self) -> None:
        self.pool.close()


class PerPageCopyPath(_OwnPoolPath):
    """One ``copy_`` per (block x plane): a ``cudaMemcpyAsync`` each on CUDA.

    Pages are addressed per job from the block ids, as a per-page path must.
    """

    name = "per-page-copy"

    def __init__(self, ws: Workspace) -> None:
        super().__init__(ws)
        self._planes = [
            (plane.view, pool_plane_view(self.pool.tensor, plane, 1)[:, 0], plane.group)
            for plane in ws.layout.planes
        ]

    def submit(self, direction: str) -> None:
        ws = self.ws
        for cache, pool, group in self._planes:
            pairs = zip(ws.gpu_blocks[group], ws.host_rows[group], strict=True)
            if direction == STORE:
                for block, row in pairs:
                    pool[row].copy_(cache[block], non_blocking=True)
            else:
                for block, row in pairs:
                    cache[block].copy_(pool[row], non_blocking=True)

    def launches_per_job(self, direction: str) -> int | None:
        return self.ws.job_pages


class IndexCopyPath(_OwnPoolPath):
    """CPU: ``index_select`` + ``index_copy_`` per plane (torch gather/scatter)."""

    name = "index-copy"

    def __init__(self, ws: Workspace) -> None:
        if ws.cuda:
            raise PathUnavailable("CPU-only baseline (a CUDA cache needs a copy per page)")
        super().__init__(ws)
        self._planes = [
            (
                plane.view,
                pool_plane_view(self.pool.tensor, plane, 1)[:, 0],
                ws.block_index(plane.group),
                ws.row_index(plane.group),
            )
            for plane in ws.layout.planes
        ]

    def submit(self, direction: str) -> None:
        for cache, pool, blocks, rows in self._planes:
            if direction == STORE:
                pool.index_copy_(0, rows, cache.index_select(0, blocks))
            else:
                cache.index_copy_(0, blocks, pool.index_select(0, rows))

    def launches_per_job(self, direction: str) -> int | None:
        return 2 * len(self._planes)


class FlatTritonPath(_OwnPoolPath):
    """Host-built descriptors, one flat kernel launch (bench/baseline_kernels.py)."""

    name = "flat-triton"

    def __init__(self, ws: Workspace) -> None:
        super().__init__(ws)
        from triton_offload.bench import baseline_kernels

        self._kernels = baseline_kernels
        n = ws.job_pages
        # Descriptor tables staged in pinned memory, as a real per-descriptor path does.
        self._host = torch.empty((3, n), dtype=torch.int64, pin_memory=ws.cuda)
        self._max_page = max(p.page_bytes for p in ws.layout.planes)

    def submit(self, direction: str) -> None:
        src, dst, sizes = self.ws.descriptors(self.pool.device_address, direction)
        host = self._host.numpy()
        host[0], host[1], host[2] = src, dst, sizes
        word = self._kernels.word_bytes_for(np.concatenate((src, dst)), sizes)
        tables = self._host.to(self.ws.device, non_blocking=True)
        self._kernels.flat_copy(
            tables[0], tables[1], tables[2], word_bytes=word, max_page_bytes=self._max_page
        )

    def launches_per_job(self, direction: str) -> int | None:
        return 2 if self.ws.cuda else 1  # table upload + kernel


class BatchedDmaPath(_OwnPoolPath):
    """One ``cuMemcpyBatchAsync`` per job through cuda-python (CUDA 12.8+ driver)."""

    name = "batched-dma"

    def __init__(self, ws: Workspace) -> None:
        if not ws.cuda:
            raise PathUnavailable("needs CUDA")
        try:
            from cuda.bindings import driver
        except ImportError:
            try:
                from cuda import cuda as driver  # cuda-python < 12.6 layout
            except ImportError:
                raise PathUnavailable("cuda-python is not installed") from None
        if not hasattr(driver, "cuMemcpyBatchAsync"):
            raise PathUnavailable("cuda-python has no cuMemcpyBatchAsync (needs 12.8+)")
        super().__init__(ws)
        self._driver = driver
        try:
            attributes = driver.CUmemcpyAttributes()
            order = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
            attributes.srcAccessOrder = order
            self._attributes = [attributes]
            self._probe()
        except Exception as error:  # the bindings' signature differs between releases
            self.close()
            raise PathUnavailable(
                f"cuMemcpyBatchAsync probe failed: {type(error).__name__}: {error}"
            ) from None

    def _probe(self) -> None:
        """One 16-byte device copy: an API this path cannot call is unavailable, not wrong."""
        probe = torch.arange(32, dtype=torch.uint8, device=self.ws.device)
        torch.cuda.synchronize(self.ws.device)
        self._batch([probe.data_ptr() + 16], [probe.data_ptr()], [16])
        self.stream.synchronize()
        if not torch.equal(probe[16:], probe[:16]):
            raise RuntimeError("the probe copy did not move its 16 bytes")

    def _batch(self, dst: list[int], src: list[int], sizes: list[int]) -> None:
        driver = self._driver
        srcs = [driver.CUdeviceptr(int(a)) for a in src]
        dsts = [driver.CUdeviceptr(int(a)) for a in dst]
        stream = driver.CUstream(self.stream.cuda_stream)
        # failIdx is an output of the C call (CUDA 12.8-12.9; gone in 13): the bindings
        # return it, they do not take it.
        result = driver.cuMemcpyBatchAsync(
            dsts, srcs, sizes, len(srcs), self._attributes, [0], 1, stream
        )
        error = result[0] if isinstance(result, tuple) else result
        if error != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: {error}")

    def submit(self, direction: str) -> None:
        src, dst, sizes = self.ws.descriptors(self.pool.device_address, direction)
        self._batch(dst.tolist(), src.tolist(), sizes.tolist())

    def launches_per_job(self, direction: str) -> int | None:
        return 1


class VllmSwapBlocksPath(_OwnPoolPath):
    """vLLM's own ``swap_blocks_batch`` (one batched driver call, or its Triton kernel)."""

    name = "vllm-swap-blocks"

    def __init__(self, ws: Workspace) -> None:
        if not ws.cuda:
            raise PathUnavailable("needs CUDA")
        try:
            from vllm import _custom_ops as ops

            swap = ops.swap_blocks_batch
        except Exception as error:  # vllm's import can fail in many ways without its deps
            raise PathUnavailable(f"vllm not importable: {error}") from None
        super().__init__(ws)
        self._swap: Callable[..., None] = swap
        self._host = torch.empty((3, ws.job_pages), dtype=torch.int64, pin_memory=True)

    def submit(self, direction: str) -> None:
        src, dst, sizes = self.ws.descriptors(self.pool.device_address, direction)
        host = self._host.numpy()
        host[0], host[1], host[2] = src, dst, sizes
        self._swap(self._host[0], self._host[1], self._host[2])

    def launches_per_job(self, direction: str) -> int | None:
        return 1


class CeilingPath:
    """One contiguous copy of the job's bytes: device -> pinned host (store) and back."""

    name = CEILING
    role = "ceiling"
    self_timed = False

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws
        n = ws.job_bytes
        self.device_buffer = torch.empty(n, dtype=torch.uint8, device=ws.device)
        self.host_buffer = torch.empty(n, dtype=torch.uint8, pin_memory=ws.cuda)
        self.stream = torch.cuda.Stream(device=ws.device) if ws.cuda else None

    def submit(self, direction: str) -> None:
        if direction == STORE:
            self.host_buffer.copy_(self.device_buffer, non_blocking=True)
        else:
            self.device_buffer.copy_(self.host_buffer, non_blocking=True)

    def finish(self) -> float | None:
        if self.stream is not None:
            self.stream.synchronize()
        return None

    def launches_per_job(self, direction: str) -> int | None:
        return 1

    def verify(self) -> str | None:
        generator = torch.Generator(device=self.ws.device).manual_seed(2)
        self.device_buffer.copy_(
            torch.randint(
                0,
                256,
                self.device_buffer.shape,
                dtype=torch.uint8,
                device=self.ws.device,
                generator=generator,
            )
        )
        if self.ws.cuda:
            torch.cuda.synchronize(self.ws.device)  # the fill ran on the default stream
        for direction in DIRECTIONS:
            if direction == LOAD:
                self.device_buffer.fill_(CACHE_POISON)
                if self.ws.cuda:
                    # The poison ran on the default stream; the copy runs on this path's
                    # own stream, which does not wait for it by itself.
                    torch.cuda.synchronize(self.ws.device)
            else:
                self.host_buffer.fill_(POISON)
                expected = self.device_buffer.cpu()
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    self.submit(direction)
            else:
                self.submit(direction)
            self.finish()
            if not torch.equal(self.host_buffer, expected) or not torch.equal(
                self.device_buffer.cpu(), expected
            ):
                return f"{direction} copy differs"
        return None

    def close(self) -> None:
        pass


def make_path(name: str, ws: Workspace) -> PathRunner:
    """Build path ``name`` for ``ws``; PathUnavailable says why it cannot run here."""
    if name in ENGINE_BACKENDS:
        return EnginePath(ws, name)
    factories: dict[str, Callable[[Workspace], Any]] = {
        "per-page-copy": PerPageCopyPath,
        "index-copy": IndexCopyPath,
        "flat-triton": FlatTritonPath,
        "batched-dma": BatchedDmaPath,
        "vllm-swap-blocks": VllmSwapBlocksPath,
        CEILING: CeilingPath,
    }
    if name not in factories:
        raise ValueError(f"unknown path {name!r}; choose from {', '.join(ALL_PATHS)}")
    return factories[name](ws)


def role_of(name: str) -> str:
    if name in ENGINE_BACKENDS:
        return "project"
    return "ceiling" if name == CEILING else "baseline"


__all__ = [
    "ALL_PATHS",
    "BASELINES",
    "CEILING",
    "DIRECTIONS",
    "ENGINE_BACKENDS",
    "LOAD",
    "STORE",
    "PathRunner",
    "PathUnavailable",
    "Workspace",
    "build_workspace",
    "engine_backend_unavailable",
    "make_path",
    "plan_for",
    "role_of",
]
