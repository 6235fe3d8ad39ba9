"""vLLM's shared host region as this project's host pool, and the replicated-store ledger.

The host memory of :class:`~triton_offload.vllm.TritonOffloadingSpec` is vLLM's own
``SharedOffloadRegion``: one mapping per engine (``/dev/shm/vllm_offload_{engine_id}.mmap``,
split into segment files that are pre-faulted in parallel), ``num_chunks`` rows of
``row_stride`` bytes (the chunk rounded up to the OS page), where worker ``r`` owns the
``cpu_page_size`` bytes at ``k * row_stride + r * cpu_page_size`` of row ``k``. Inside
that page the row layout is this project's (plane-major, see ``triton_offload.transfer.layout``).
:func:`create_worker_region` creates it with exactly the arguments vLLM's CPU spec
(or its tiering spec) passes, so capacity, sharing, pre-faulting and clean-up are the
ones a vLLM user already has; :func:`worker_pool_view` is the engine's pool.

Page-locking (:func:`lock_worker_pages`) happens on CUDA only: the pages a worker
touches are registered with ``cudaHostRegister`` in pieces (its own page of every row
when the other workers' pages leave at least ``MIN_SLOT_LOCK_SAVING`` bytes per row
unlocked, else the whole region in row-aligned pieces of at most
``DEFAULT_PIECE_BYTES``). The region records the pieces as vLLM's worker does; at
shutdown :func:`unlock_worker_pages` unlocks them with the binding that locked them,
then ``region.cleanup()`` unmaps and unlinks. On CPU the region is mapped, not locked.

**Replicated layout.** With ``replicated_layout`` (MLA: every worker's pages are
byte-identical) there is one copy per chunk, in worker slot 0, and only rank 0 (the
rank vLLM's connector also elects) copies a stored chunk. Another rank given the same
store job copies nothing; it reports the job once the writer's bytes are in the region.
That is known through a :class:`StoreLedger`, a second tiny shared region of one
int64 per chunk: after the writer's engine reports a store job finished (its copy is
complete and visible to the host), the writer writes ``(job_id + 1) << 1 | failed``
into the ledger entry of each chunk of the job, between two memory fences (a lock
acquire/release: the data stores are ordered before the entry, the entry is pushed out
before the writer goes on). A non-writer's job ``j`` over chunks ``H`` is finished
once every entry of ``H`` holds job ``j`` (read after a fence, so the bytes read next
are at least as new); it failed if any entry says failed. Equality, not ``>=``, is the
test: vLLM's scheduler gives a chunk to a new store only after every worker reported
the old one, so an entry cannot move past ``j`` before the non-writer saw it.
Job ids must therefore be ints in ``[0, 2**61)`` (vLLM's are a counter from 0).

Only this module and ``triton_offload.vllm`` import vllm; both import it lazily.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Whole-region locking uses the engine's own pool pieces: whole rows of about
# DEFAULT_PIECE_BYTES (each cudaHostRegister call short, ~100 calls for 100 GiB).
from triton_offload.transfer.pool import DEFAULT_PIECE_BYTES, piece_ranges

logger = logging.getLogger("vllm.triton_offload")

#: vLLM's CPU spec splits its region into this many files (pre-faulted in parallel);
#: used when vLLM's own constant cannot be imported.
REGION_SEGMENTS = 32

#: Lock only this worker's pages when the other workers' pages leave at least this many
#: bytes per row unlocked: below it the per-call cost of one registration per row
#: (tens of microseconds) outweighs the pages saved (vLLM's worker uses the same rule).
MIN_SLOT_LOCK_SAVING = 3 << 20

#: Largest job id the ledger can encode: ``(job_id + 1) << 1`` must fit an int64.
MAX_LEDGER_JOB_ID = (1 << 61) - 1

_fence_lock = threading.Lock()


def memory_fence() -> None:
    """A full memory barrier between this thread's shared-memory accesses.

    Acquiring and releasing a lock is an atomic read-modify-write with acquire and
    release ordering on every platform CPython runs on, which is what orders the
    ledger entry after the page bytes (and the reader's page reads after the entry).
    """
    with _fence_lock:
        pass


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class RegionPlan:
    """Arguments of one worker's ``SharedOffloadRegion``, as vLLM's CPU spec derives them.

    ``slot`` is the worker page this process addresses (0 for every rank under the
    replicated layout); ``writer`` says whether this rank copies stores. ``canonical``:
    vLLM's ``canonical_layout``, where every rank addresses the canonical area at the
    start of every row (its pages are locked whole) and writes its share of each page.
    """

    engine_id: str
    num_chunks: int
    row_stride: int
    cpu_page_size: int
    rank: int
    world_size: int
    replicated: bool
    canonical: bool = False

    @property
    def slot(self) -> int:
        return 0 if self.replicated else self.rank

    @property
    def writer(self) -> bool:
        # Canonical pages: every rank writes, page by page in turn (the mapping's writers).
        return self.canonical or not self.replicated or self.rank == 0

    @property
    def total_bytes(self) -> int:
        return self.num_chunks * self.row_stride

    @classmethod
    def from_spec(cls, spec: Any) -> RegionPlan:
        """From a built ``CPUOffloadingSpec`` (or subclass): its chunk geometry and rank."""
        parallel = spec.config.parallel
        return cls(
            engine_id=str(spec.config.engine_id),
            num_chunks=int(spec.num_chunks),
            row_stride=int(spec.kv_bytes_per_chunk),
            cpu_page_size=int(spec.cpu_page_size_per_worker),
            rank=int(parallel.rank),
            world_size=int(parallel.world_size),
            replicated=bool(spec.replicated_layout),
            canonical=bool(getattr(spec, "stock_rows", False)),
        )


def default_barrier() -> Callable[[], None] | None:
    """vLLM's all-workers barrier when its process groups exist, else None.

    Without a barrier the region is still shared (joiners wait for the creator's file
    size) but its file is unlinked only when the creating worker shuts down.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    try:
        from vllm.v1.kv_offload.cpu.spec import _all_workers_barrier
    except ImportError:  # pragma: no cover - vLLM 0.33 has it
        return None
    barrier: Callable[[], None] = _all_workers_barrier
    return barrier


def _vllm_segments() -> int:
    """vLLM's segment count: ``REGION_SEGMENTS`` of its region module (0.34), or the CPU
    spec's private ``_REGION_SEGMENTS`` (0.33); both are in ``internals.RELIANCES``."""
    try:
        from vllm.v1.kv_offload.cpu.shared_offload_region import (
            REGION_SEGMENTS as segments,  # vLLM 0.34
        )
    except ImportError:
        try:
            from vllm.v1.kv_offload.cpu.spec import _REGION_SEGMENTS as segments
        except ImportError:  # pragma: no cover - one of the two is in every release
            return REGION_SEGMENTS
    return int(segments)


def _unlink_region_files(engine_id: str) -> None:
    """Remove the engine's region files: vLLM's ``vllm_offload_{engine_id}.mmap`` and
    its numbered segment files beside it."""
    first = f"/dev/shm/vllm_offload_{engine_id}.mmap"
    for path in [first, *glob.glob(glob.escape(first) + ".*")]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


#: A worker's note written this soon after the scheduler's process started is not taken
#: as proof of a mapping (the process start is known to the second only).
_START_MARGIN_S = 1.0


def _process_start_time() -> float | None:
    """When this process started, in seconds since the epoch (None off Linux)."""
    try:
        with open("/proc/self/stat") as stat_file:
            # Field 22 is the start in clock ticks after boot; fields from the 3rd on
            # follow the command name's closing parenthesis.
            ticks = int(stat_file.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as boot_file:
            boot = next(int(line.split()[1]) for line in boot_file if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def unlink_region_once_mapped(engine_id: str, worker_notes: list[str]) -> bool:
    """Unlink the engine's region files (vLLM's tiering layout: the scheduler maps the
    region by name after the workers) when each worker's note in ``worker_notes``, which
    a worker writes once it holds its mapping, is newer than this (the scheduler's)
    process: then every party of this engine has mapped the region and none opens it by
    name again, so the memory goes when the last of them exits, however it exits. A
    missing or older note (a scheduler built before its workers, a note left by a killed
    engine of the same id) leaves the file for the workers to join and for its creator
    to remove at shutdown. Returns whether it unlinked."""
    started = _process_start_time()
    if started is None:
        return False
    for note in worker_notes:
        try:
            written = os.stat(note).st_mtime
        except OSError:
            return False
        if written < started + _START_MARGIN_S:
            return False
    _unlink_region_files(engine_id)
    return True


def create_worker_region(
    plan: RegionPlan, *, barrier: Callable[[], None] | None, tiering: bool = False
) -> Any:
    """This worker's mapping of the engine's ``SharedOffloadRegion``.

    ``tiering=False``: as vLLM's ``CPUOffloadingSpec.create_worker`` creates it (the
    barrier, ``_REGION_SEGMENTS`` segment files, and under the replicated layout every
    rank in slot 0 pre-faulting its shard). ``tiering=True``: as vLLM's
    ``TieringOffloadingSpec.create_worker`` does (one file shared with the scheduler's
    mapping, no barrier: the scheduler maps it too, outside the workers' group).
    """
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    if tiering:
        return SharedOffloadRegion(
            engine_id=plan.engine_id,
            num_chunks=plan.num_chunks,
            rank=plan.slot,
            kv_bytes_per_chunk=plan.row_stride,
            cpu_page_size=plan.cpu_page_size,
        )
    try:
        return SharedOffloadRegion(
            engine_id=plan.engine_id,
            num_chunks=plan.num_chunks,
            rank=plan.slot,
            kv_bytes_per_chunk=plan.row_stride,
            cpu_page_size=plan.cpu_page_size,
            barrier=barrier,
            num_segments=_vllm_segments(),
            populate_shard=(plan.rank, plan.world_size) if plan.replicated else None,
        )
    except BaseException:
        # Start-up failed on this rank, so the engine cannot start: its region files go,
        # whoever created them (ranks that mapped them keep their mappings). vLLM removes
        # them only from the creating rank and only for an Exception, so a KeyboardInterrupt
        # or SIGTERM's SystemExit at the barrier, or a creator that died before it (the
        # others then fail at the barrier), would leave them in /dev/shm.
        _unlink_region_files(plan.engine_id)
        raise


def worker_pool_view(region: Any, plan: RegionPlan) -> torch.Tensor:
    """uint8 ``[num_chunks, cpu_page_size]`` view of this worker's pages, row stride
    ``row_stride``: row ``k`` starts at ``k * row_stride + slot * cpu_page_size``."""
    base = region.base_tensor.view(torch.uint8)
    return base.as_strided(
        (plan.num_chunks, plan.cpu_page_size),
        (plan.row_stride, 1),
        plan.slot * plan.cpu_page_size,
    )


def canonical_pool_view(region: Any, plan: RegionPlan, row_bytes: int) -> torch.Tensor:
    """uint8 ``[num_chunks, row_bytes]`` view of the canonical area at the start of every
    row (``canonical_layout``: all ranks address the same bytes), row stride ``row_stride``."""
    base = region.base_tensor.view(torch.uint8)
    return base.as_strided((plan.num_chunks, row_bytes), (plan.row_stride, 1), 0)


def lock_ranges(plan: RegionPlan, piece_bytes: int = DEFAULT_PIECE_BYTES) -> list[tuple[int, int]]:
    """(offset, length) byte ranges of the region this worker page-locks.

    This worker's page of every row, rounded out to OS pages, when the rest of a row
    is at least ``MIN_SLOT_LOCK_SAVING`` bytes; otherwise the whole region in pieces
    that end on row boundaries (a page never straddles two registrations) of at most
    ``piece_bytes`` (at least one row). Canonical rows are shared by every rank: always
    the whole region (vLLM's worker pins it whole then too).
    """
    page = mmap.PAGESIZE
    saving = plan.row_stride - plan.cpu_page_size
    if saving >= max(page, MIN_SLOT_LOCK_SAVING) and not plan.canonical:
        ranges = []
        for row in range(plan.num_chunks):
            start = row * plan.row_stride + plan.slot * plan.cpu_page_size
            aligned = start - start % page
            end = _round_up(start + plan.cpu_page_size, page)
            ranges.append((aligned, end - aligned))
        return ranges
    # The engine's own pool is cut the same way (rows are OS-page multiples here).
    return piece_ranges(plan.num_chunks, plan.row_stride, piece_bytes)


def lock_worker_pages(
    region: Any,
    plan: RegionPlan,
    api: Any,
    *,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
) -> int:
    """Page-lock this worker's part of ``region`` with ``api`` (a ``CudaApi``); bytes locked.

    Every piece must map to the device at one fixed offset from its host address
    (kernels address the whole pool from one base); otherwise, or when a registration
    fails, every piece locked so far is unlocked again and RuntimeError says why. On
    success the region records the pieces, so that ``region.cleanup()`` unlocks them.
    """
    base = int(region.base_tensor.data_ptr())
    locked: list[int] = []
    total = 0
    offset_to_device: int | None = None
    try:
        for offset, length in lock_ranges(plan, piece_bytes):
            address = base + offset
            api.register(address, length)
            locked.append(address)
            total += length
            shift = int(api.device_pointer(address)) - address
            if offset_to_device is None:
                offset_to_device = shift
            elif shift != offset_to_device:
                raise RuntimeError(
                    f"locked region piece at offset {offset} maps to the device at host "
                    f"address {shift:+#x}, the first piece at {offset_to_device:+#x}; the "
                    "pool needs one linear device mapping (unified addressing)"
                )
    except BaseException:
        for address in reversed(locked):
            api.unregister(address)
        raise
    region.pinned_addresses.extend(locked)
    region.is_pinned = bool(locked)
    return total


def unlock_worker_pages(region: Any, api: Any) -> None:
    """Unlock what :func:`lock_worker_pages` locked, with the same binding (idempotent).

    Done before ``region.cleanup()`` (which then finds nothing to unlock), so the pages
    are unlocked even where vLLM's own helper would not find the CUDA runtime.
    """
    for address in reversed(region.pinned_addresses):
        api.unregister(address)
    region.pinned_addresses.clear()
    region.is_pinned = False


def release_region(region: Any, cuda_api: Any) -> None:
    """Unlock (with the binding that locked it), then vLLM's clean-up: unmap, unlink."""
    if cuda_api is not None:
        unlock_worker_pages(region, cuda_api)
    region.cleanup()


class StoreLedger:
    """Per-chunk record of the writer's finished store jobs, shared by an engine's workers.

    One int64 per chunk in its own small ``SharedOffloadRegion`` (``engine_id`` +
    ``"_triton_stores"``), created, shared and released like the data region. See the
    module docstring for the protocol and its ordering.

    Why every worker creates it at start-up, although vLLM's connector never gives a
    non-writer a store job (it acknowledges them itself): it cannot be created lazily on
    a non-writer's first ``submit_store``. The writer has to publish every store it
    finishes from its first one, since it cannot know whether another rank was given the
    same job (a caller other than vLLM's connector gives it to every rank, in the same
    step); a ledger that appeared later would miss publishes already made, and the rank
    waiting for one would wait forever. Creating it later with the region's barrier is
    a collective only the non-writers would reach: a deadlock. Creating it without a
    barrier would leave its file in ``/dev/shm`` whenever a worker dies before shutdown
    (only the barrier lets it be unlinked at once). The cost, measured by
    ``bench/suites/bench_region.py::test_store_ledger`` (two workers at a gloo barrier, CPU):
    8 bytes of ``/dev/shm`` per chunk (64 KiB for 8192 chunks, 8 MiB for 2**20) and
    0.6 ms (8192 chunks) to 7 ms (2**20) of start-up per worker, of which the
    barrier is 0.2-0.4 ms; the rest is mapping and pre-faulting the entries. Under the
    per-worker layout, or with one worker, there is no ledger.
    """

    SUFFIX = "_triton_stores"

    def __init__(self, engine_id: str, num_chunks: int, barrier: Callable[[], None] | None) -> None:
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

        page = mmap.PAGESIZE
        rows = max(1, _round_up(num_chunks * 8, page) // page)
        self.num_chunks = num_chunks
        self.region: Any = SharedOffloadRegion(
            engine_id=engine_id + self.SUFFIX,
            num_chunks=rows,
            rank=None,
            kv_bytes_per_chunk=page,
            cpu_page_size=page,
            barrier=barrier,
        )
        raw = self.region.base_tensor.view(torch.int64)
        self.entries: np.ndarray = raw.numpy()[:num_chunks]

    @staticmethod
    def encode(job_id: int, success: bool) -> int:
        return ((job_id + 1) << 1) | (0 if success else 1)

    def publish(self, chunks: np.ndarray, job_id: int, success: bool) -> None:
        """Record that the writer's store ``job_id`` over ``chunks`` finished."""
        memory_fence()
        self.entries[chunks] = self.encode(job_id, success)
        memory_fence()

    def status(self, chunks: np.ndarray, job_id: int) -> bool | None:
        """None while some chunk does not hold ``job_id`` yet, else whether it succeeded."""
        memory_fence()
        values = self.entries[chunks]
        memory_fence()
        if values.size == 0:
            return True
        if not np.all((values >> 1) == job_id + 1):
            return None
        return not bool(np.any(values & 1))

    def close(self) -> None:
        self.entries = np.zeros(0, dtype=np.int64)
        self.region.cleanup()


def check_ledger_job_id(job_id: Any, what: str) -> int:
    """The job id as an int the ledger can encode; TypeError/ValueError otherwise."""
    if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)):
        raise TypeError(
            f"{what}: under the replicated layout store job ids must be ints (the "
            f"writer publishes them for the other ranks), got {job_id!r}"
        )
    if not 0 <= int(job_id) <= MAX_LEDGER_JOB_ID:
        raise ValueError(
            f"{what}: job id {job_id} out of range [0, {MAX_LEDGER_JOB_ID}] for the "
            "replicated layout's store ledger"
        )
    return int(job_id)


def wait_until(
    check: Callable[[], bool], what: str, warn_after: float = 30.0, deadline: float | None = None
) -> bool:
    """Poll ``check`` with a short backoff until it is true (True) or ``time.monotonic()``
    passes ``deadline`` (False); warn once if it takes long."""
    start = time.monotonic()
    delay = 20e-6
    warned = False
    while not check():
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False
        time.sleep(delay if deadline is None else min(delay, max(deadline - now, 0.0)))
        delay = min(delay * 2, 1e-3)
        if not warned and time.monotonic() - start > warn_after:
            warned = True
            logger.warning("still waiting after %.0f s for %s", warn_after, what)
    return True


__all__ = [
    "DEFAULT_PIECE_BYTES",
    "MAX_LEDGER_JOB_ID",
    "MIN_SLOT_LOCK_SAVING",
    "REGION_SEGMENTS",
    "RegionPlan",
    "StoreLedger",
    "canonical_pool_view",
    "check_ledger_job_id",
    "create_worker_region",
    "default_barrier",
    "lock_ranges",
    "lock_worker_pages",
    "memory_fence",
    "release_region",
    "unlink_region_once_mapped",
    "unlock_worker_pages",
    "wait_until",
    "worker_pool_view",
]
