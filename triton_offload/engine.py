"""TransferEngine: moves cache blocks between GPU cache planes and the host pool.

A job names, per cache group ``g``, GPU block ids ``B_g``, host chunk ids ``H_g`` and
the logical index ``s_g`` of ``B_g[0]`` in its request. The k-th GPU block sits at
position ``p = (s_g mod bpc) + k``: host row ``H_g[p // bpc]``, slot ``p mod bpc``
(``bpc`` = ``plan.blocks_per_chunk``). The engine turns this into an int64
``(gpu_block, pool_row, slot)`` pair table (one row per block pair, whatever the
number of layers), validates it completely before any byte moves, and hands it to
one of three backends:

- ``"triton"``: the copy kernel of ``triton_offload.kernels.copy_blocks``, one
  launch per job covering every group, plane and block (on CUDA, or on CPU tensors
  under ``TRITON_INTERPRET=1``);
- ``"dma"``: the CUDA copy engines, one ``cudaMemcpyAsync`` per merged contiguous
  run of each plane;
- ``"torch"``: the CPU path of ``triton_offload.cpu_copy`` (no CUDA, no Triton).

``"auto"`` picks the CPU path without CUDA; on CUDA it picks Triton or DMA per job
from a crossover measured at start-up (or configured with ``crossover=``).

On CUDA every job runs on a dedicated stream per direction, after an event recorded
on the caller's current stream at submit time: a store must not read KV before
compute wrote it, a load must not overwrite blocks that attention may still read.
Jobs complete in FIFO order per direction. Without CUDA jobs run synchronously at
submit and ``get_finished`` reports them once, in submit order.

Job ids: any hashable; an id is in flight from its submit until ``get_finished``
reported it, and may be reused after that. ``wait`` blocks until jobs finished and
leaves their results to ``get_finished``. ``submit_*`` returns True when the job was
accepted (its result will be reported, with ``success=False`` if it failed while
running) and False once ``shutdown()`` was called; bad input raises ValueError
before anything is enqueued. The Triton backend also needs the Triton interpreter
on CPU; the CPU path needs neither CUDA nor the interpreter, but imports the
launcher module to validate pair tables the same way on every backend.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
import weakref
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from triton_offload import cpu_copy
from triton_offload.layout import CacheLayout, Layer, build_layout, pool_plane_view
from triton_offload.pool import (
    DEFAULT_PIECE_BYTES,
    HostPool,
    allocate_pool,
    cuda_api,
    device_address_of_pinned,
    wrap_pool,
)

logger = logging.getLogger(__name__)

Backend = Literal["auto", "triton", "dma", "torch"]
_BACKENDS = ("auto", "triton", "dma", "torch")

TO_POOL = cpu_copy.TO_POOL
FROM_POOL = cpu_copy.FROM_POOL
_DIRECTION_NAMES = {TO_POOL: "store", FROM_POOL: "load"}

#: Pinned staging buffers kept for pair tables; more in-flight jobs than this wait
#: for the oldest buffer's job to finish before reusing it.
MAX_STAGING_BUFFERS = 64


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one job: bytes moved and the device time between its start and end.

    ``transfer_size`` counts every page of every plane the job addressed (bytes);
    ``transfer_time`` is in seconds (CUDA events on CUDA, wall clock on CPU).
    A job that failed while running has ``success=False``.
    """

    job_id: Hashable
    success: bool
    transfer_size: int
    transfer_time: float


@dataclass
class _Job:
    job_id: Hashable
    direction: int
    backend: str
    transfer_size: int
    success: bool = True
    transfer_time: float = 0.0
    start: Any = None  # torch.cuda.Event
    end: Any = None  # torch.cuda.Event
    keep_alive: list[Any] = field(default_factory=list)

    def done(self) -> bool:
        return self.end is None or bool(self.end.query())

    def result(self) -> TransferResult:
        seconds = self.transfer_time
        if self.success and self.start is not None and self.end is not None:
            seconds = self.start.elapsed_time(self.end) / 1e3
        return TransferResult(self.job_id, self.success, self.transfer_size, seconds)


class _StagingRing:
    """Pinned int64 buffers for pair tables; each is reused only after its job ended."""

    def __init__(self, limit: int = MAX_STAGING_BUFFERS) -> None:
        self.buffers: list[torch.Tensor] = []
        self.events: list[Any] = []
        # Submit order of each buffer's last job: the oldest finishes first (FIFO
        # streams), so that is the one to wait for when every buffer is busy.
        self.release_order: list[int] = []
        self.releases = 0
        self.limit = limit

    def acquire(self, numel: int) -> tuple[int, torch.Tensor]:
        for index, event in enumerate(self.events):
            if event is None or event.query():
                if self.buffers[index].numel() < numel:
                    self.buffers[index] = _pinned_int64(numel)
                self.events[index] = None
                return index, self.buffers[index][:numel]
        if len(self.buffers) < self.limit:
            self.buffers.append(_pinned_int64(numel))
            self.events.append(None)
            self.release_order.append(0)
            return len(self.buffers) - 1, self.buffers[-1][:numel]
        # All buffers belong to running jobs: wait for the oldest use to finish.
        index = min(range(len(self.events)), key=self.release_order.__getitem__)
        self.events[index].synchronize()
        return self.acquire(numel)

    def release_after(self, index: int, event: Any) -> None:
        self.events[index] = event
        self.releases += 1
        self.release_order[index] = self.releases


def _pinned_bytes(numel: int) -> torch.Tensor:
    return torch.zeros(numel, dtype=torch.uint8, pin_memory=True)


def _pinned_int64(numel: int) -> torch.Tensor:
    capacity = 1 << max(10, math.ceil(math.log2(max(numel, 1))))
    return torch.empty(capacity, dtype=torch.int64, pin_memory=True)


@dataclass(frozen=True)
class Crossover:
    """Per direction, the winner measured at grid points (page bytes, pages per job).

    ``threshold`` (configured) overrides the grid: DMA when a job's mean page size
    is at least that many bytes.
    """

    grid: Mapping[int, Mapping[tuple[int, int], str]] = field(default_factory=dict)
    threshold: Mapping[int, int] | None = None

    def choose(self, direction: int, page_bytes: float, pages: int) -> str:
        if self.threshold is not None:
            return "dma" if page_bytes >= self.threshold[direction] else "triton"
        points = self.grid.get(direction)
        if not points:
            return "triton"

        def distance(point: tuple[int, int]) -> tuple[float, float]:
            return (
                abs(math.log2(point[0]) - math.log2(max(page_bytes, 1.0))),
                abs(math.log2(point[1]) - math.log2(max(pages, 1))),
            )

        return points[min(points, key=distance)]


def _as_ids(values: Any, what: str) -> np.ndarray:
    """A 1-d int64 array from a sequence / array / tensor of integer ids."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"{what} must be a 1-d sequence of ids, got shape {array.shape}")
    if array.dtype.kind not in "iu" or array.dtype == np.bool_:
        raise ValueError(f"{what} must hold integer ids, got {array.dtype}: {array[:8]!r}")
    if array.dtype.kind == "u" and array.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{what}: id {array.max()} out of range")
    return array.astype(np.int64, copy=False)


def _first_bad(ids: np.ndarray, limit: int) -> int | None:
    bad = (ids < 0) | (ids >= limit)
    if bad.any():
        return int(ids[np.argmax(bad)])
    return None


class DmaCopier:
    """The copy-engine path: one async copy per merged contiguous run of each plane.

    Runs are pages adjacent on both sides (consecutive GPU blocks of a plane whose
    block stride equals its page size, consecutive slots of one pool row); a padded
    or K/V-interleaved plane is copied page by page.
    """

    def __init__(
        self, layout: CacheLayout, pool_address: int, row_bytes: int, api: Any = None
    ) -> None:
        self.layout = layout
        self.pool_address = pool_address
        self.row_bytes = row_bytes
        self.api = cuda_api() if api is None else api
        self.last_copy_count = 0

    def copy(self, pairs: np.ndarray, offsets: np.ndarray, direction: int, stream: Any) -> None:
        handle = int(stream.cuda_stream)
        count = 0
        # Same runs, same addresses as the CPU path: only the copy call differs.
        for runs in cpu_copy.plane_runs(
            self.layout, self.pool_address, self.row_bytes, pairs, offsets, direction
        ):
            for target, source, length in zip(
                runs.targets.tolist(), runs.sources.tolist(), runs.lengths.tolist(), strict=True
            ):
                self.api.memcpy_async(target, source, length, handle)
            count += runs.lengths.size
        self.last_copy_count = count


#: Calibration grid: pages per job (the page sizes are the layout's own).
CALIBRATION_PAGES = (16, 256)
#: Bytes per calibration measurement; keeps the whole start-up measurement to a few ms.
CALIBRATION_MAX_BYTES = 16 << 20


def _calibration_page_sizes(layout: CacheLayout, limit: int = 4) -> list[int]:
    sizes = sorted({plane.page_bytes for plane in layout.planes})
    if len(sizes) <= limit:
        return sizes
    picks = np.linspace(0, len(sizes) - 1, limit).round().astype(int)
    return sorted({sizes[i] for i in picks})


def _time_on(stream: Any, fn: Any, repeats: int = 3) -> float:
    """Median seconds of ``fn()`` enqueued on ``stream`` (after one warm-up call)."""
    with torch.cuda.stream(stream):
        fn()
        times = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def _dma_pages(api: Any, targets: list[int], sources: list[int], page: int, handle: int) -> None:
    for target, source in zip(targets, sources, strict=True):
        api.memcpy_async(target, source, page, handle)


def calibrate(engine: TransferEngine) -> Crossover:
    """Time the Triton kernel against DMA per direction on scratch buffers.

    The grid is (each distinct page size of the caches, up to 4) x
    ``CALIBRATION_PAGES`` pages, pages scattered by a random permutation so DMA
    cannot merge them, as in real jobs. Scratch device and pinned host buffers are
    used so that neither the caches nor the pool are touched.
    """
    kernels = engine._kernels
    device = engine.device
    api = cuda_api()
    grid: dict[int, dict[tuple[int, int], str]] = {TO_POOL: {}, FROM_POOL: {}}
    generator = torch.Generator().manual_seed(0)
    for page in _calibration_page_sizes(engine.layout):
        for wanted in CALIBRATION_PAGES:
            pages = max(1, min(wanted, CALIBRATION_MAX_BYTES // page))
            scratch = torch.zeros(pages * page, dtype=torch.uint8, device=device)
            host = _pinned_bytes(pages * page)
            host_address = device_address_of_pinned(host)
            geometry = kernels.PlaneGeometry(
                group=0,
                base_address=scratch.data_ptr(),
                block_stride=page,
                page_bytes=page,
                num_blocks=pages,
                pool_offset=0,
            )
            layout = kernels.CopyLayout.build(
                [geometry],
                num_groups=1,
                blocks_per_chunk=1,
                pool_row_bytes=page,
                pool_rows=pages,
                device=device,
            )
            rows = torch.randperm(pages, generator=generator)
            pairs = torch.stack(
                [torch.arange(pages), rows, torch.zeros(pages, dtype=torch.int64)], dim=1
            )
            pairs_device = pairs.to(device)
            offsets_device = torch.tensor([0, pages], dtype=torch.int64, device=device)
            # The scratch fill and the table upload ran on the current stream; the
            # measurements run on the transfer streams.
            torch.cuda.synchronize(device)
            device_pages = (scratch.data_ptr() + torch.arange(pages) * page).tolist()
            host_pages = (host_address + rows * page).tolist()
            for direction in (TO_POOL, FROM_POOL):
                stream = engine._streams[direction]
                handle = int(stream.cuda_stream)
                store = direction == TO_POOL
                targets, sources = (
                    (host_pages, device_pages) if store else (device_pages, host_pages)
                )

                run_triton = functools.partial(
                    kernels.launch_copy,
                    layout,
                    pairs_device,
                    offsets_device,
                    host_address,
                    kernels.Direction(direction),
                )
                run_dma = functools.partial(_dma_pages, api, targets, sources, page, handle)
                triton_seconds = _time_on(stream, run_triton)
                dma_seconds = _time_on(stream, run_dma)
                winner = "dma" if dma_seconds < triton_seconds else "triton"
                grid[direction][(page, wanted)] = winner
                logger.debug(
                    "calibration %s page %d x %d: triton %.1f us, dma %.1f us",
                    _DIRECTION_NAMES[direction],
                    page,
                    pages,
                    triton_seconds * 1e6,
                    dma_seconds * 1e6,
                )
    return Crossover(grid=grid)


def _release(streams: list[Any], pool: HostPool) -> None:
    for stream in streams:
        stream.synchronize()
    pool.close()


def parse_crossover(configured: int | Mapping[str, int] | None) -> Crossover | None:
    """A configured DMA/Triton threshold (page bytes), or None to measure it at start-up.

    Checked on every device, so a bad setting fails where it is written, not only on
    the CUDA machine that would use it.
    """
    if configured is None:
        return None
    if isinstance(configured, Mapping):
        if set(configured) != {"store", "load"}:
            raise ValueError(
                f"crossover {dict(configured)!r} needs exactly the keys 'store' and 'load'"
            )
        values = {TO_POOL: configured["store"], FROM_POOL: configured["load"]}
    else:
        values = {TO_POOL: configured, FROM_POOL: configured}
    for direction, value in values.items():
        name = f"crossover[{_DIRECTION_NAMES[direction]!r}]"
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int of page bytes, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} {value} must be >= 0 page bytes")
    return Crossover(threshold={direction: int(v) for direction, v in values.items()})


class TransferEngine:
    """Stores and loads cache blocks; see the module docstring for the job semantics.

    Args:
        plan: an ``OffloadPlan`` (uses ``plan.groups`` and ``plan.blocks_per_chunk``).
        caches: ``caches[g]`` lists group g's layers; a layer is a tensor whose dim 0
            is the block dimension or a tuple of such tensors.
        num_host_blocks: rows of the host pool (one chunk of one group per row).
        device: where the caches live; inferred from them when None.
        backend: "auto", "triton", "dma" or "torch".
        pool: optional caller-provided pool, contiguous uint8 ``[num_host_blocks,
            row_bytes]`` (pinned when CUDA is used); allocated when None.
        stream_priority: priority of the two transfer streams (CUDA).
        crossover: DMA/Triton switch for "auto" on CUDA: page bytes at or above
            which DMA is used, as an int or ``{"store": int, "load": int}``;
            measured at start-up when None.
        num_programs: grid size for the Triton kernel (default: the launcher's).
        pool_piece_bytes: size of each ``cudaHostRegister`` call for the pool.
    """

    def __init__(
        self,
        plan: Any,
        caches: Sequence[Sequence[Layer]],
        num_host_blocks: int,
        *,
        device: torch.device | str | None = None,
        backend: Backend = "auto",
        pool: torch.Tensor | None = None,
        stream_priority: int = 0,
        crossover: int | Mapping[str, int] | None = None,
        num_programs: int | None = None,
        pool_piece_bytes: int = DEFAULT_PIECE_BYTES,
    ) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {_BACKENDS}")
        if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int):
            raise TypeError(f"num_host_blocks must be an int, got {num_host_blocks!r}")
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks {num_host_blocks} must be >= 1")
        configured_crossover = parse_crossover(crossover)
        num_groups = len(plan.groups)
        self.plan = plan
        self.blocks_per_chunk: int = int(plan.blocks_per_chunk)
        self.layout: CacheLayout = build_layout(
            caches, num_groups=num_groups, blocks_per_chunk=self.blocks_per_chunk
        )
        cache_device = self.layout.device
        if device is None:
            device = cache_device
        device = torch.device(device)
        if device.type != cache_device.type or (
            device.index is not None
            and cache_device.index is not None
            and device.index != cache_device.index
        ):
            raise ValueError(
                f"caches are on {cache_device} but device is {device}; the caches must "
                "live on the engine's device"
            )
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {device} is not supported (cpu or cuda)")
        self.device = cache_device
        self.cuda = device.type == "cuda"
        self.num_host_blocks = num_host_blocks
        self.num_groups = num_groups
        self.row_bytes: int = self.layout.row_bytes
        self.num_programs = num_programs

        if not self.cuda and backend == "dma":
            raise ValueError("backend 'dma' needs CUDA caches; the caches are on the CPU")
        if self.cuda and backend == "torch":
            raise ValueError(
                "backend 'torch' is the CPU path; the caches are on CUDA (use 'auto', "
                "'triton' or 'dma')"
            )
        if backend == "auto":
            backend = "auto" if self.cuda else "torch"
        self.backend: str = backend
        # The launcher's CopyLayout validates the geometry and its validate_pairs the
        # pair tables of every backend, so all paths reject exactly the same jobs.
        self._kernels: Any = self._import_kernels(backend)

        self.copy_layout: Any = self._kernels.CopyLayout.build(
            self.layout.geometries(),
            num_groups=num_groups,
            blocks_per_chunk=self.blocks_per_chunk,
            pool_row_bytes=self.row_bytes,
            pool_rows=num_host_blocks,
            device=self.device,
        )

        # Registration and device pointers refer to the current device's context.
        with torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext():
            if pool is None:
                self._pool: HostPool = allocate_pool(
                    num_host_blocks, self.row_bytes, pinned=self.cuda, piece_bytes=pool_piece_bytes
                )
            else:
                self._pool = wrap_pool(
                    pool, rows=num_host_blocks, row_bytes=self.row_bytes, cuda=self.cuda
                )
        self.pool: torch.Tensor = self._pool.tensor
        self.pool_address: int = self._pool.device_address

        # Pages per block pair and bytes per block pair, per group: the job size is
        # O(pairs) to compute whatever the number of layers.
        self._planes_per_group = np.array(
            [len(p) for p in self.layout.group_planes], dtype=np.int64
        )
        self._bytes_per_block = np.array(self.layout.bytes_per_block, dtype=np.int64)

        self._active: dict[Hashable, _Job] = {}
        self._queues: dict[int, deque[_Job]] = {TO_POOL: deque(), FROM_POOL: deque()}
        self._finished: deque[_Job] = deque()  # CPU: completed in submit order
        self._closed = False
        self.last_job_table: tuple[np.ndarray, np.ndarray] | None = None
        self.last_job_backend: str | None = None

        self._streams: dict[int, Any] = {}
        self._staging = _StagingRing()
        self._dma: Any = None
        self.crossover: Crossover | None = None
        if self.cuda:
            self._streams = {
                direction: torch.cuda.Stream(device=self.device, priority=stream_priority)
                for direction in (TO_POOL, FROM_POOL)
            }
            if backend in ("dma", "auto"):
                self._dma = DmaCopier(self.layout, self._pool.device_address, self.row_bytes)
            if backend == "auto":
                self.crossover = configured_crossover
                if self.crossover is None:
                    with torch.cuda.device(self.device):
                        self.crossover = calibrate(self)
        if self.cuda:
            # The static tables were uploaded on the current stream; jobs run on the
            # transfer streams and may be submitted from any stream.
            torch.cuda.synchronize(self.device)
        # An engine dropped without shutdown() still drains its streams before the
        # pool's pages are unlocked.
        self._finalizer = weakref.finalize(self, _release, list(self._streams.values()), self._pool)

    # ------------------------------------------------------------------ set-up

    def _import_kernels(self, backend: str) -> Any:
        if backend == "triton" and not self.cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "backend 'triton' on CPU tensors needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 in the environment before triton_offload.kernels is "
                "imported (or use backend='torch')"
            )
        from triton_offload.kernels import copy_blocks

        if backend == "triton" and not self.cuda and not copy_blocks._INTERPRETED:
            raise ValueError(
                "backend 'triton' on CPU tensors needs the Triton interpreter, but "
                "triton_offload.kernels.copy_blocks was imported before "
                "TRITON_INTERPRET=1 was set; set it before the first import"
            )
        if backend in ("triton", "auto") and self.cuda and copy_blocks._INTERPRETED:
            # The interpreter runs the kernel on the host: the device addresses in the
            # tables would be dereferenced there.
            raise ValueError(
                f"backend {backend!r} on CUDA caches needs the compiled kernel, but "
                "TRITON_INTERPRET=1 was set when triton_offload.kernels was imported; "
                "unset it (or use backend='dma')"
            )
        return copy_blocks

    # --------------------------------------------------------------- job table

    def _per_group(self, values: Any, what: str) -> Any:
        if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
            raise ValueError(f"{what} must be a sequence with one entry per group, got {values!r}")
        if len(values) != self.num_groups:
            raise ValueError(
                f"{what} has {len(values)} groups but the engine has {self.num_groups}"
            )
        return values

    def build_job_table(
        self,
        gpu_blocks: Sequence[Any],
        host_blocks: Sequence[Any],
        first_block_index: Sequence[int] | None,
        direction: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Validate a job and return its ``(pairs [n, 3], group_offsets [G + 1])`` int64.

        Raises ValueError naming the bad value; nothing is copied.
        """
        gpu_blocks = self._per_group(gpu_blocks, "gpu_blocks")
        host_blocks = self._per_group(host_blocks, "host_blocks")
        if first_block_index is not None:
            first_block_index = self._per_group(first_block_index, "first_block_index")
        bpc = self.blocks_per_chunk
        tables: list[np.ndarray] = []
        offsets = np.zeros(self.num_groups + 1, dtype=np.int64)
        for group in range(self.num_groups):
            blocks = _as_ids(gpu_blocks[group], f"gpu_blocks[{group}]")
            hosts = _as_ids(host_blocks[group], f"host_blocks[{group}]")
            first = 0
            if first_block_index is not None:
                value = first_block_index[group]
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                    raise ValueError(f"first_block_index[{group}] {value!r} is not an int")
                first = int(value)
                if first < 0:
                    raise ValueError(f"first_block_index[{group}] {first} is negative")
            limit = self.layout.group_num_blocks[group]
            bad = _first_bad(blocks, limit)
            if bad is not None:
                raise ValueError(f"GPU block id {bad} of group {group} out of range [0, {limit})")
            bad = _first_bad(hosts, self.num_host_blocks)
            if bad is not None:
                raise ValueError(
                    f"host block id {bad} of group {group} out of range [0, {self.num_host_blocks})"
                )
            positions = (first % bpc) + np.arange(blocks.size, dtype=np.int64)
            if blocks.size and positions[-1] // bpc >= hosts.size:
                raise ValueError(
                    f"group {group}: {blocks.size} GPU blocks starting at slot {first % bpc} "
                    f"need {int(positions[-1] // bpc) + 1} host chunks of {bpc} blocks, but "
                    f"{hosts.size} host blocks were given"
                )
            table = np.empty((blocks.size, 3), dtype=np.int64)
            table[:, 0] = blocks
            table[:, 1] = hosts[positions // bpc]
            table[:, 2] = positions % bpc
            tables.append(table)
            offsets[group + 1] = offsets[group] + blocks.size
        pairs = np.concatenate(tables) if tables else np.zeros((0, 3), dtype=np.int64)
        # Two pairs writing one destination page (also across groups sharing a pool
        # row or aliasing cache memory) are rejected here.
        self._kernels.validate_pairs(
            self.copy_layout, pairs, offsets, self._kernels.Direction(direction)
        )
        return pairs, offsets

    def _job_size(self, offsets: np.ndarray) -> tuple[int, int]:
        """(bytes moved, pages moved) for a job with these group offsets."""
        counts = np.diff(offsets)
        return (
            int((counts * self._bytes_per_block).sum()),
            int((counts * self._planes_per_group).sum()),
        )

    # ------------------------------------------------------------------ submit

    def submit_store(
        self,
        job_id: Hashable,
        gpu_blocks: Sequence[Any],
        host_blocks: Sequence[Any],
        first_block_index: Sequence[int] | None = None,
    ) -> bool:
        """Copy GPU blocks into host chunks; returns False once the engine is shut down."""
        return self._submit(job_id, gpu_blocks, host_blocks, first_block_index, TO_POOL)

    def submit_load(
        self,
        job_id: Hashable,
        host_blocks: Sequence[Any],
        gpu_blocks: Sequence[Any],
        first_block_index: Sequence[int] | None = None,
    ) -> bool:
        """Copy host chunks into GPU blocks; returns False once the engine is shut down."""
        return self._submit(job_id, gpu_blocks, host_blocks, first_block_index, FROM_POOL)

    def _submit(
        self,
        job_id: Hashable,
        gpu_blocks: Sequence[Any],
        host_blocks: Sequence[Any],
        first_block_index: Sequence[int] | None,
        direction: int,
    ) -> bool:
        if self._closed:
            return False
        try:
            hash(job_id)
        except TypeError:
            raise ValueError(f"job id {job_id!r} is not hashable") from None
        if job_id in self._active:
            raise ValueError(f"job id {job_id!r} is already in flight")
        pairs, offsets = self.build_job_table(gpu_blocks, host_blocks, first_block_index, direction)
        size, pages = self._job_size(offsets)
        backend = self.backend
        if backend == "auto":
            assert self.crossover is not None
            backend = self.crossover.choose(direction, size / max(pages, 1), pages)
        self.last_job_table = (pairs, offsets)
        self.last_job_backend = backend
        job = _Job(job_id, direction, backend, size)
        self._active[job_id] = job
        if self.cuda:
            self._queues[direction].append(job)
            self._run_cuda(job, pairs, offsets)
        else:
            self._finished.append(job)
            self._run_cpu(job, pairs, offsets)
        return True

    def _run_cpu(self, job: _Job, pairs: np.ndarray, offsets: np.ndarray) -> None:
        start = time.perf_counter()
        try:
            if job.backend == "torch":
                cpu_copy.copy_pages(
                    self.layout, self.pool_address, self.row_bytes, pairs, offsets, job.direction
                )
            else:
                self._launch_triton(torch.from_numpy(pairs), torch.from_numpy(offsets), job)
        except Exception:
            logger.exception("%s job %r failed", _DIRECTION_NAMES[job.direction], job.job_id)
            job.success = False
        job.transfer_time = time.perf_counter() - start

    def _launch_triton(self, pairs: torch.Tensor, offsets: torch.Tensor, job: _Job) -> None:
        kwargs = {} if self.num_programs is None else {"num_programs": self.num_programs}
        self._kernels.launch_copy(
            self.copy_layout,
            pairs,
            offsets,
            self.pool_address,
            self._kernels.Direction(job.direction),
            **kwargs,
        )

    def _run_cuda(self, job: _Job, pairs: np.ndarray, offsets: np.ndarray) -> None:
        stream = self._streams[job.direction]
        # RAW for stores, WAR for loads: wait for everything the caller's stream
        # enqueued before this submit.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        job.start = torch.cuda.Event(enable_timing=True)
        job.end = torch.cuda.Event(enable_timing=True)
        staging_index: int | None = None
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                job.start.record(stream)
                if job.backend == "triton":
                    n = pairs.shape[0]
                    staging_index, staged = self._staging.acquire(3 * n + offsets.size)
                    staged[: 3 * n].numpy()[:] = pairs.reshape(-1)
                    staged[3 * n :].numpy()[:] = offsets
                    table = torch.empty(staged.numel(), dtype=torch.int64, device=self.device)
                    table.copy_(staged, non_blocking=True)
                    job.keep_alive.append(table)
                    self._launch_triton(table[: 3 * n].view(n, 3), table[3 * n :], job)
                else:
                    self._dma.copy(pairs, offsets, job.direction, stream)
                job.end.record(stream)
        except Exception:
            logger.exception("%s job %r failed", _DIRECTION_NAMES[job.direction], job.job_id)
            job.success = False
            # Whatever was enqueued still runs; the job counts as finished after it.
            job.end.record(stream)
        finally:
            if staging_index is not None:
                self._staging.release_after(staging_index, job.end)

    # ------------------------------------------------------------------ finish

    def get_finished(self) -> list[TransferResult]:
        """Results of jobs finished since the last call, FIFO per direction; never blocks."""
        done: list[_Job] = []
        if self.cuda:
            for queue in self._queues.values():
                while queue and queue[0].done():
                    done.append(queue.popleft())
        else:
            done.extend(self._finished)
            self._finished.clear()
        results = []
        for job in done:
            del self._active[job.job_id]
            job.keep_alive.clear()
            results.append(job.result())
        return results

    def wait(self, job_ids: Iterable[Hashable]) -> None:
        """Block until the given jobs finished (their results stay for get_finished)."""
        ids = list(job_ids)
        for job_id in ids:
            if job_id not in self._active:
                raise ValueError(f"job id {job_id!r} is unknown or already reported")
        for job_id in ids:
            job = self._active[job_id]
            if job.end is not None:
                job.end.synchronize()

    def shutdown(self) -> None:
        """Wait for running jobs, then release the pool's page locks; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------- views

    def pool_view(self, plane_index: int) -> torch.Tensor:
        """uint8 ``[num_host_blocks, blocks_per_chunk, page_bytes]`` view of one plane."""
        return pool_plane_view(self.pool, self.layout.planes[plane_index], self.blocks_per_chunk)

    @property
    def last_job_table_size(self) -> int:
        """Rows of the pair table of the last accepted job (one per block pair)."""
        return 0 if self.last_job_table is None else int(self.last_job_table[0].shape[0])


__all__ = [
    "Crossover",
    "DmaCopier",
    "TransferEngine",
    "TransferResult",
    "calibrate",
    "parse_crossover",
]
