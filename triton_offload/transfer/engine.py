"""TransferEngine: moves cache blocks between GPU cache planes and the host pool.

A job is a :class:`~triton_offload.transfer.jobs.JobSpec`: per cache group, GPU block ids, host
rows and the logical index of the first block (see ``triton_offload.transfer.jobs``). The engine
turns it into an int64 pair table (one row per block pair, whatever the number of
layers), validates it completely before any byte moves, and hands it to copiers
(``triton_offload.transfer.copiers``) as its path policy
(``triton_offload.transfer.selection``) assigns the job's planes:

- ``"triton"``: every plane by the copy kernel, one launch per job (on CUDA, or on CPU
  tensors under ``TRITON_INTERPRET=1``);
- ``"dma"``: every plane by the CUDA copy engines;
- ``"torch"``: the CPU path (no CUDA, no Triton import);
- ``"auto"``: the CPU path without CUDA; on CUDA the kernel for some planes and DMA for
  others, per plane from a crossover measured at start-up (or configured).

The engine itself keeps streams, events, FIFO completion and the lifecycle. On CUDA
every job runs on a dedicated stream per lane, after an event recorded on the caller's
current stream at submit time: a store must not read KV before compute wrote it, a load
must not overwrite blocks that attention may still read. The lanes are stores, loads
and expedited loads (``submit_load(..., expedited=True)``: a load the caller waits on
within its step, e.g. vLLM's synchronous loads, which must not queue behind regular
loads; it runs on a third stream of the device's highest priority). A job's copiers
run one after another on its lane's stream between one start and one end event; the
start is recorded after the host work (address arithmetic, table staging and upload),
so ``transfer_time`` is the copy. Jobs complete in FIFO order per lane. Without CUDA
jobs run synchronously at submit (``expedited`` is accepted and changes nothing but
the lane's copy lock: an expedited copy never waits for another thread's regular
load) and ``get_finished`` reports them once, in the order they finished (submit order
for one thread).

Job ids: any hashable; an id is in flight from its submit until ``get_finished``
reported it, and may be reused after that. ``wait`` blocks until jobs finished and
leaves their results to ``get_finished``. ``submit_*`` returns True when the job was
accepted (its result will be reported, with ``success=False`` if it failed while
running) and False once ``shutdown()`` was called; bad input raises ValueError or
TypeError before anything is enqueued.

Threads: ``submit_store``, ``submit_load``, ``get_finished``, ``wait`` and
``shutdown`` may be called from different threads (a lock guards the job books).
Every accepted job is reported exactly once, and only after its bytes landed (CUDA:
its end event completed; CPU: its copy returned, helper threads included). On CPU one
job per lane copies at a time, outside the lock, so ``get_finished`` does not
wait for a copy. ``wait`` on an id another thread already reported raises ValueError.

Failures: a job interrupted by any exception, ``KeyboardInterrupt`` included, is
reported ``success=False``; an ``Exception`` is logged, anything else propagates from
the submit after the job was marked failed. A failed job has stopped writing when it
is reported. A CPU job accepted before ``shutdown`` whose copy had not begun when the
pool was released moves no byte and is reported failed.

Caches: the engine keeps raw addresses. Each registered tensor's data pointer and
storage size are compared with their values at construction on every submit; after a
``resize_``, ``set_`` or a freed storage the job is refused naming the plane. Groups
may alias memory; a load whose destination pages share bytes is refused. A group with
no layers (a pipeline stage holding none of its layers) is valid: its pairs move
nothing and count no bytes.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from triton_offload.planner.plan import OffloadPlan
from triton_offload.transfer import cpu_copy
from triton_offload.transfer.batch_copy import find_batch_copy
from triton_offload.transfer.checksums import JobPages, host_checksums, job_pages
from triton_offload.transfer.copiers import (
    Copier,
    DmaCopier,
    HostCopier,
    PageSums,
    TritonCopier,
    check_num_programs,
    load_kernels,
)
from triton_offload.transfer.job_state import (
    EXPEDITED_LOAD,
    LANES,
    RunningJob,
    TransferResult,
)
from triton_offload.transfer.jobs import (
    DIRECTION_NAMES,
    FROM_POOL,
    TO_POOL,
    JobSpec,
    PairTable,
    PlainJob,
    pair_table,
    plain_job,
    plain_pair_table,
)
from triton_offload.transfer.layered import LayeredLoad, check_stages, stage_assignment
from triton_offload.transfer.layout import (
    CacheLayout,
    Layer,
    build_layout,
    check_int,
    check_pool_placement,
    pool_plane_view,
)
from triton_offload.transfer.pool import (
    DEFAULT_PIECE_BYTES,
    HostPool,
    allocate_pool,
    cuda_api,
    wrap_pool,
)
from triton_offload.transfer.seal import checksum_algorithm
from triton_offload.transfer.seal_key import SealKey
from triton_offload.transfer.selection import (
    PATH_CHOICES,
    Assignment,
    Crossover,
    CrossoverPath,
    FixedPath,
    PathChoice,
    PathPolicy,
    calibrate,
    calibration_slice,
    parse_crossover,
    path_name,
)

logger = logging.getLogger(__name__)

Backend = Literal["auto", "triton", "dma", "torch"]
_BACKENDS = ("auto", "triton", "dma", "torch")
#: The copiers each backend builds (``"auto"`` picks among them per plane).
_BACKEND_COPIERS = {
    "auto": ("triton", "dma"),
    "triton": ("triton",),
    "dma": ("dma",),
    "torch": ("torch",),
}


def _release(streams: list[Any], pool: HostPool) -> None:
    for stream in streams:
        stream.synchronize()
    pool.close()


def _refuse_positional_lists(method: str, extra: tuple[Any, ...]) -> None:
    """Two block lists given by position are refused in this project's words (one list
    is refused by ``JobSpec.of``): a store's and a load's lists swapped by position would
    copy silently in the wrong direction."""
    if extra:
        given = 1 + len(extra)
        raise TypeError(
            f"{method} takes the job as a JobSpec or as keywords gpu_blocks=, host_blocks= "
            f"(and first_block_index=), not as {given} positional block list(s)"
        )


def _job_of(
    spec: JobSpec | None, gpu_blocks: Any, host_blocks: Any, first_block_index: Any
) -> JobSpec | PlainJob:
    """A submit's job: keyword lists of a small job as a :class:`PlainJob` (lists of
    non-negative Python ints, no first index), anything else through ``JobSpec.of``."""
    if spec is None and first_block_index is None:
        plain = plain_job(gpu_blocks, host_blocks)
        if plain is not None:
            return plain
    return JobSpec.of(
        spec, gpu_blocks=gpu_blocks, host_blocks=host_blocks, first_block_index=first_block_index
    )


def _checked_device(cache_device: torch.device, device: torch.device | str | None) -> torch.device:
    """The engine's device: the caches' own; a ``device`` given must name the same one."""
    wanted = cache_device if device is None else torch.device(device)
    if wanted.type != cache_device.type or (
        wanted.index is not None
        and cache_device.index is not None
        and wanted.index != cache_device.index
    ):
        raise ValueError(
            f"caches are on {cache_device} but device is {wanted}; the caches must "
            "live on the engine's device"
        )
    if wanted.type not in ("cpu", "cuda"):
        raise ValueError(f"device {wanted} is not supported (cpu or cuda)")
    return cache_device


def _checked_arguments(
    backend: object,
    path_choice: object,
    num_host_blocks: object,
    pool_piece_bytes: object,
    num_programs: object,
    page_checksums: object,
) -> int | None:
    """The engine's scalar arguments checked before anything is built (each refusal
    names the argument and its value); returns ``num_programs`` normalised."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {_BACKENDS}")
    if path_choice not in PATH_CHOICES:
        raise ValueError(f"path_choice {path_choice!r} is not one of {PATH_CHOICES}")
    if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int):
        raise TypeError(f"num_host_blocks must be an int, got {num_host_blocks!r}")
    if num_host_blocks < 1:
        raise ValueError(f"num_host_blocks {num_host_blocks} must be >= 1")
    check_int("pool_piece_bytes", pool_piece_bytes, 1)
    if num_programs is not None:
        # Checked on every backend: a grid of no program would report jobs that moved
        # nothing, and a non-int would fail every job at launch instead of here.
        num_programs = check_num_programs(num_programs)
    if not isinstance(page_checksums, bool):
        raise TypeError(f"page_checksums must be a bool, got {page_checksums!r}")
    return num_programs


def _layout_of(
    caches: Sequence[Sequence[Layer]] | CacheLayout, num_groups: int, blocks_per_chunk: int
) -> CacheLayout:
    """The engine's layout: built from the caches, or the caller's, checked against the plan."""
    if not isinstance(caches, CacheLayout):
        return build_layout(caches, num_groups=num_groups, blocks_per_chunk=blocks_per_chunk)
    if (caches.num_groups, caches.blocks_per_chunk) != (num_groups, blocks_per_chunk):
        raise ValueError(
            f"the given CacheLayout has {caches.num_groups} groups of {caches.blocks_per_chunk} "
            f"blocks per chunk but the plan has {num_groups} of {blocks_per_chunk}"
        )
    if not caches.planes:
        raise ValueError("the given CacheLayout has no plane: nothing to offload")
    return caches


class TransferEngine:
    """Stores and loads cache blocks; see the module docstring for the job semantics.

    Every argument is checked here, with an error naming it; see the module docstring
    for the thread-safety contract and failure semantics.

    Args:
        plan: an ``OffloadPlan`` (uses ``plan.groups`` and ``plan.blocks_per_chunk``).
        caches: ``caches[g]`` lists group g's layers; a layer is a tensor whose dim 0
            is the block dimension or a tuple of such tensors. A group may list no
            layer; two planes of one group may not share bytes. Or a ``CacheLayout``
            the caller built (fragment planes, e.g. vLLM's canonical pages) for the
            plan's groups and ``blocks_per_chunk``.
        num_host_blocks: rows of the host pool (one chunk of one group per row); an
            allocated pool must fit in the host's memory.
        device: where the caches live; inferred from them when None.
        backend: "auto", "triton", "dma" or "torch".
        pool: optional caller-provided pool, uint8 ``[num_host_blocks, row_bytes]``
            with contiguous rows (``stride(1) == 1``) spaced ``stride(0) >= row_bytes``
            bytes apart (pinned when CUDA is used), on the host or the caches' GPU and
            sharing no byte with a cache; allocated when None.
        stream_priority: priority of the store and load streams (CUDA); the
            expedited-load stream has the device's highest priority.
        crossover: DMA/Triton switch for "auto" on CUDA: page bytes at or above
            which DMA is used, as an int or ``{"store": int, "load": int}``;
            measured at start-up when None.
        num_programs: grid size for the Triton kernel, an int >= 1 (default: the
            launcher's).
        pool_piece_bytes: size of each ``cudaHostRegister`` call for the pool.
        path_choice: for "auto": ``"plane"`` (each plane by its own best copier) or
            ``"job"`` (one copier per job, from the job's mean page size).
        calibration_rows: ``(k, n)``: the start-up calibration stores into and loads
            from only the k-th of n equal, disjoint slices of the pool's rows. Engines
            whose pools share rows (one region, replicated chunks) and calibrate at the
            same time pass distinct k and the same n; default ``(0, 1)``: every row.
        page_checksums: jobs may ask for the checksum of every page (pool row) they
            name (``submit_*(..., checksum=True)``): ``wsum64`` computed by the copy
            kernel or a device pass on CUDA and under the Triton interpreter (its
            variants compiled now), ``xxh3_64`` by the host on the CPU path
            (:attr:`checksum_algorithm`; see ``transfer.checksums``).
        seal_key: with ``page_checksums``, the pages' sums are keyed universal hashes
            (``keyed_wsum64`` by the kernel, ``keyed_ghash64`` by the host on the CPU
            path; see ``transfer.seal_key``) instead of checksums anyone can compute.
    """

    def __init__(
        self,
        plan: Any,
        caches: Sequence[Sequence[Layer]] | CacheLayout,
        num_host_blocks: int,
        *,
        device: torch.device | str | None = None,
        backend: Backend = "auto",
        pool: torch.Tensor | None = None,
        stream_priority: int = 0,
        crossover: int | Mapping[str, int] | None = None,
        num_programs: int | None = None,
        pool_piece_bytes: int = DEFAULT_PIECE_BYTES,
        path_choice: PathChoice = "plane",
        calibration_rows: tuple[int, int] = (0, 1),
        page_checksums: bool = False,
        seal_key: SealKey | None = None,
    ) -> None:
        num_programs = _checked_arguments(
            backend, path_choice, num_host_blocks, pool_piece_bytes, num_programs, page_checksums
        )
        #: Pool rows the calibration may overwrite (see ``calibration_rows``).
        self.calibration_rows: range = calibration_slice(calibration_rows, num_host_blocks)
        if not isinstance(plan, OffloadPlan):
            raise TypeError(
                f"plan must be an OffloadPlan (from plan_offload), got {type(plan).__name__} "
                f"{plan!r:.60}"
            )
        configured_crossover = parse_crossover(crossover)
        num_groups = len(plan.groups)
        self.plan = plan
        self.blocks_per_chunk: int = int(plan.blocks_per_chunk)
        self.layout: CacheLayout = _layout_of(caches, num_groups, self.blocks_per_chunk)
        self.device = _checked_device(self.layout.device, device)
        self.cuda = self.device.type == "cuda"
        self.num_host_blocks = num_host_blocks
        self.num_groups = num_groups
        self.row_bytes: int = self.layout.row_bytes
        self.num_programs = num_programs

        if page_checksums and self.layout.writer_classes not in ((), ((1, 0),)):
            # A page whose slots several ranks take turns writing is not one engine's to
            # checksum (vLLM's stock rows, which carry no seal).
            raise ValueError(
                "page_checksums needs pages this engine writes whole; the layout's planes "
                f"take turns writing them (writer classes {self.layout.writer_classes})"
            )
        self.page_checksums = page_checksums
        if seal_key is not None and not isinstance(seal_key, SealKey):
            raise TypeError(f"seal_key must be a SealKey or None, got {type(seal_key).__name__}")
        if seal_key is not None and not page_checksums:
            raise ValueError("seal_key is given but page_checksums is off: nothing would be keyed")
        self.seal_key = seal_key
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
        if "triton" in _BACKEND_COPIERS[backend]:
            # Checked before the pool is allocated: a refused backend costs nothing.
            load_kernels(backend, self.cuda)

        self._build_pool(pool, num_host_blocks, pool_piece_bytes)
        self._build_books()
        self._build_streams(stream_priority)
        self._build_copiers(backend)
        self._build_policy(backend, configured_crossover, path_choice)
        # An engine dropped without shutdown() still drains its streams before the
        # pool's pages are unlocked.
        self._finalizer = weakref.finalize(self, _release, list(self._streams.values()), self._pool)

    # ------------------------------------------------------------------ builders

    def _build_pool(
        self, pool: torch.Tensor | None, num_host_blocks: int, pool_piece_bytes: int
    ) -> None:
        """The host pool (allocated pinned on CUDA, or the caller's wrapped), its address
        as the device sees it and its row stride."""
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
                check_pool_placement(self._pool.tensor, self.layout)
        self.pool: torch.Tensor = self._pool.tensor
        self.pool_address: int = self._pool.device_address
        #: Bytes between pool rows: the pool tensor's stride(0), >= row_bytes.
        self.row_stride: int = self._pool.row_stride

        # Bytes per block pair, per group: the job size is O(groups) to compute
        # whatever the number of layers.
        self._bytes_per_block = self.layout.bytes_per_block

    def _build_books(self) -> None:
        """The job books and their locks: this engine keeps the only ledger of its jobs."""
        self._active: dict[Hashable, RunningJob] = {}
        # path_name per assignment: the policy hands out a few assignments, over and over.
        self._path_names: dict[Assignment, str] = {}
        self._last_path: tuple[Assignment | None, str] = (None, "")
        self._queues: dict[int, deque[RunningJob]] = {lane: deque() for lane in LANES}
        self._finished: deque[RunningJob] = deque()  # CPU: completed, in completion order
        # Finished jobs a get_finished call took but could not return (interrupted).
        self._undelivered: list[RunningJob] = []
        self._closed = False
        # Guards the job books (_active, _queues, _finished, _undelivered, _closed) and,
        # on CUDA, the enqueue of a job together with its place in the FIFO queue.
        # Reentrant: the calibration submits jobs through _submit.
        self._lock = threading.RLock()
        # CPU: one job per lane copies at a time (the CUDA streams' FIFO order);
        # copies run outside _lock so that get_finished never waits for a copy.
        self._copy_locks = {lane: threading.Lock() for lane in LANES}
        self.last_job_table: PairTable | None = None
        self.last_job_backend: str | None = None
        self.last_job_assignment: Assignment | None = None

    def _build_streams(self, stream_priority: int) -> None:
        """CUDA: one stream per lane (stores, loads, and the expedited loads at the
        device's highest priority); none on the CPU path."""
        self._streams: dict[int, Any] = {}
        if self.cuda:
            self._streams = {
                direction: torch.cuda.Stream(device=self.device, priority=stream_priority)
                for direction in (TO_POOL, FROM_POOL)
            }
            # A lower number is a higher priority; (lowest, highest) of this device.
            _, highest = torch.cuda.Stream.priority_range()
            self._streams[EXPEDITED_LOAD] = torch.cuda.Stream(device=self.device, priority=highest)

    def _build_copiers(self, backend: str) -> None:
        """The backend's copiers, compiled and warmed up now (never mid-serving), and
        what checksum jobs compute."""
        self.copiers: dict[str, Copier] = {
            name: self._make_copier(name) for name in _BACKEND_COPIERS[backend]
        }
        triton = self.copiers.get("triton")
        if self.cuda and isinstance(triton, TritonCopier):
            # Compile now: the first job would otherwise wait ~1 s for it mid-serving.
            # On the current stream, after the table uploads it reads.
            with torch.cuda.device(self.device):
                triton.warm_up()
        self._set_up_checksums(triton)

    def _build_policy(
        self, backend: str, configured_crossover: Crossover | None, path_choice: PathChoice
    ) -> None:
        """Which copier moves each plane: a fixed backend, or the crossover (configured,
        or calibrated now through this engine's own path)."""
        self.crossover: Crossover | None = None
        self.policy: PathPolicy
        if backend == "auto":
            self.crossover = configured_crossover
            if self.crossover is None:
                # Calibration runs real jobs; until it has a result every job takes
                # the path its forced assignment names.
                self.policy = FixedPath("triton")
                with torch.cuda.device(self.device):
                    self.crossover = calibrate(self)
            self.policy = CrossoverPath(self.layout, self.crossover, path_choice)
        else:
            self.policy = FixedPath(backend)
        if self.cuda:
            # The static tables were uploaded on the current stream; jobs run on the
            # transfer streams and may be submitted from any stream.
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ set-up

    def _set_up_checksums(self, triton: Copier | None) -> None:
        """What ``checksum=True`` jobs compute (:attr:`checksum_algorithm`): device-side
        sums wherever a kernel can run (the bytes are summed where they move), the
        host's hash on the CPU path; with ``page_checksums`` the summing launches'
        tables are uploaded and their kernels compiled now, not mid-serving."""
        on_device = self.cuda or self.backend == "triton"
        self.checksum_algorithm: str = checksum_algorithm(on_device, self.seal_key is not None)
        # The launches that sum pages (fused into the copy, or read-only passes).
        self._summer: TritonCopier | None = None
        # The CPU path's: the pool's bytes as the host hashes them (made at the first
        # checksummed job).
        self._host_pool_bytes: memoryview | None = None
        if not self.page_checksums or not on_device:
            return
        summer = triton if isinstance(triton, TritonCopier) else self._make_copier("triton")
        assert isinstance(summer, TritonCopier)
        self._summer = summer
        with torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext():
            summer.gap_tables()  # uploaded now, before any job's stream reads it
            if self.seal_key is not None:
                # One weights table for every page: the longest payload's words.
                words = -(-max(self.layout.group_row_bytes, default=0) // 4)
                weights = self.seal_key.weights(words).view(np.int64)
                summer.set_page_weights(torch.from_numpy(weights.copy()).to(self.device))
            if self.cuda:
                summer.warm_up(checksum=True)

    def _make_copier(self, name: str) -> Copier:
        layout, address, stride = self.layout, self.pool_address, self.row_stride
        if name == "torch":
            return HostCopier(layout, address, stride)
        if name == "dma":
            batch, why = find_batch_copy()
            return DmaCopier(layout, address, stride, cuda_api(), batch, fallback_reason=why)
        with torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext():
            return TritonCopier(
                layout,
                address,
                stride,
                device=self.device,
                cuda=self.cuda,
                num_programs=self.num_programs,
            )

    # --------------------------------------------------------------- job table

    def build_job_table(self, spec: JobSpec, direction: int) -> PairTable:
        """Validate a job and return its ``(pairs [n, 3], group_offsets [G + 1])`` int64.

        Raises ValueError/TypeError naming the bad value; nothing is copied.
        """
        return pair_table(self.layout, self.num_host_blocks, spec, direction)

    # ------------------------------------------------------------------ submit

    def submit_store(
        self,
        job_id: Hashable,
        spec: JobSpec | None = None,
        *positional_lists: Any,
        gpu_blocks: Sequence[Any] | None = None,
        host_blocks: Sequence[Any] | None = None,
        first_block_index: Sequence[int] | None = None,
        checksum: bool = False,
    ) -> bool:
        """Copy GPU blocks into host rows; returns False once the engine is shut down.

        The job is a ``JobSpec`` or the keyword lists ``gpu_blocks=``, ``host_blocks=``
        (and optionally ``first_block_index=``), one entry per group. ``checksum=True``
        (an engine made with ``page_checksums``): its result carries the checksum of
        every pool row it names, whole payload, computed where the bytes moved.
        """
        if positional_lists:
            _refuse_positional_lists("submit_store", positional_lists)
        job = _job_of(spec, gpu_blocks, host_blocks, first_block_index)
        return self._submit(job_id, job, TO_POOL, checksum=checksum)

    def submit_load(
        self,
        job_id: Hashable,
        spec: JobSpec | None = None,
        *positional_lists: Any,
        gpu_blocks: Sequence[Any] | None = None,
        host_blocks: Sequence[Any] | None = None,
        first_block_index: Sequence[int] | None = None,
        expedited: bool = False,
        checksum: bool = False,
    ) -> bool:
        """Copy host rows into GPU blocks; returns False once the engine is shut down.

        The job as for :meth:`submit_store`. ``expedited=True``: a load the caller will
        wait on soon; it runs in its own lane (CUDA: its own FIFO queue on a stream of
        the highest priority), so it never queues behind regular loads. Like every job
        it still waits for what the caller's stream enqueued before the submit, and it
        is reported once by ``get_finished``. Lanes are not ordered with each other: a
        regular load and an expedited one must not write the same GPU blocks unless
        the caller waits for the first (as for a store and a load of one host row).
        ``checksum=True``: as for :meth:`submit_store`, of the pool bytes the job read
        (and of the slots of its rows it did not move).
        """
        if positional_lists:
            _refuse_positional_lists("submit_load", positional_lists)
        if not isinstance(expedited, bool):
            raise TypeError(f"expedited must be a bool, got {expedited!r}")
        job = _job_of(spec, gpu_blocks, host_blocks, first_block_index)
        return self._submit(
            job_id,
            job,
            FROM_POOL,
            lane=EXPEDITED_LOAD if expedited else None,
            checksum=checksum,
        )

    def submit_layered_loads(
        self,
        jobs: Sequence[tuple[Hashable, JobSpec]],
        stages: Sequence[Sequence[int]],
        *,
        checksum: bool = False,
    ) -> LayeredLoad | None:
        """Load ``jobs`` (``(job_id, JobSpec)`` pairs) stage by stage in the expedited
        lane: ``stages`` are disjoint lists of plane indices covering every plane; stage
        ``k`` of every job is copied before stage ``k + 1`` of any, an event after each
        (see ``transfer.layered``). Returns the handle whose ``wait(k)`` orders the
        caller after stage ``k``, or None once the engine is shut down. Every job is
        validated before any byte moves and reported once by :meth:`get_finished`.
        """
        if self._closed:
            return None
        if not isinstance(checksum, bool):
            raise TypeError(f"checksum must be a bool, got {checksum!r}")
        if checksum and not self.page_checksums:
            raise ValueError("checksum=True needs an engine made with page_checksums=True")
        ids = [job_id for job_id, _ in jobs]
        for job_id in ids:
            try:
                hash(job_id)
            except TypeError:
                raise ValueError(f"job id {job_id!r} is not hashable") from None
        if len(set(ids)) != len(ids):
            raise ValueError(f"job ids {ids} repeat an id")
        if not ids:
            raise ValueError("submit_layered_loads needs at least one job")
        self.layout.check_sources()
        specs = [(job_id, JobSpec.of(spec)) for job_id, spec in jobs]
        with self._lock:
            if self._closed:
                return None
            busy = [job_id for job_id in ids if job_id in self._active]
            if busy:
                raise ValueError(f"job ids {busy} are already in flight")
            return self._submit_layered(specs, stages, checksum=checksum)

    # ------------------------------------------------------- layer-staged loads

    def _layered_job_runs(
        self,
        job: RunningJob,
        table: PairTable,
        stages: list[tuple[int, ...]],
        stream: Any,
    ) -> tuple[list[list[Callable[[], None]]], list[Callable[[], None]]]:
        """(runs of each stage, runs after the last stage) of one job."""
        num_planes = len(self.layout.planes)
        holds = job.holds
        summer = self._summer if job.checksum else None
        page_sums = None
        pages = None
        if summer is not None:
            pages = job_pages(self.layout, table)
            page_sums = torch.zeros(pages.rows.size, dtype=torch.int64, device=self.device)
            holds.keep_alive.append(page_sums)
        per_stage: list[list[Callable[[], None]]] = []
        for stage in stages:
            parts = stage_assignment(job.assignment, stage, num_planes)
            subset = None if len(stage) == num_planes else stage
            if summer is not None and pages is not None and page_sums is not None:
                if parts == (("triton", subset),):
                    sums = PageSums(page_sums, pages.pair_pages)
                    runs = [summer.prepare(table, FROM_POOL, subset, holds, stream, sums=sums)]
                else:
                    runs = [
                        self.copiers[name].prepare(table, FROM_POOL, planes, holds, stream)
                        for name, planes in parts
                    ]
                    landed = PageSums(page_sums, pages.pair_pages, write=False)
                    runs.append(summer.prepare(table, TO_POOL, subset, holds, stream, sums=landed))
            else:
                runs = [
                    self.copiers[name].prepare(table, FROM_POOL, planes, holds, stream)
                    for name, planes in parts
                ]
            per_stage.append(runs)
        tail: list[Callable[[], None]] = []
        if summer is not None and pages is not None and page_sums is not None:
            tail = self._summed_tail(job, pages, page_sums, stream)
        elif job.checksum:
            # The CPU path: the host hashes each page once the last stage landed.
            def hash_pages() -> None:
                sums = host_checksums(
                    self.pool.numpy(), self.layout, table, self.checksum_algorithm, self.seal_key
                )
                job.checksum_rows, job.checksum_values = sums.rows, sums.values
                job.checksum_seconds = sums.seconds

            tail.append(hash_pages)
        return per_stage, tail

    def _submit_layered(
        self,
        jobs: Sequence[tuple[Hashable, JobSpec]],
        stages: Sequence[Sequence[int]],
        *,
        checksum: bool,
    ) -> LayeredLoad:
        """Validate every job, then enqueue (CUDA) or start (CPU, on a thread) them stage by
        stage (``transfer.layered``). The engine's lock is held by the caller."""
        checked = check_stages(stages, len(self.layout.planes))
        made: list[tuple[RunningJob, PairTable]] = []
        for job_id, spec in jobs:
            table = self.build_job_table(spec, FROM_POOL)
            counts = [blocks.size for blocks in spec.gpu_blocks]
            size = sum(c * b for c, b in zip(counts, self._bytes_per_block, strict=True))
            job = RunningJob(
                job_id, FROM_POOL, self.policy.assign(FROM_POOL, counts), size, EXPEDITED_LOAD
            )
            job.checksum = checksum
            job.checksum_algorithm = self.checksum_algorithm
            made.append((job, table))
        handle = LayeredLoad(
            tuple(job.job_id for job, _ in made), len(checked), self.cuda, self.device
        )
        handle._jobs = [job for job, _ in made]
        if not self.cuda:
            handle.events = [threading.Event() for _ in checked]
        # From the first job entering the books, an interrupt (KeyboardInterrupt, SystemExit)
        # at any line must still leave every job reported once: the jobs not yet marked
        # finished are failed, queued and marked here, and every wait is released. On CPU
        # the copy thread marks them itself under the same lock and skips jobs settled
        # first, so a thread that did start never reports one twice.
        try:
            for job, _ in made:
                self._active[job.job_id] = job
            if self.cuda:
                self._enqueue_layered_cuda(made, checked, handle)
            else:
                thread = threading.Thread(
                    target=self._run_layered_cpu,
                    args=(made, checked, handle),
                    name="triton-offload-layered-load",
                    daemon=True,
                )
                thread.start()
        except BaseException:
            handle.fail_all()
            for job, _ in made:
                self._settle_interrupted(job)
            if not self.cuda:
                for event in handle.events:
                    event.set()
                handle._ended.set()
            raise
        return handle

    def _enqueue_layered_cuda(
        self, made: list[Any], stages: list[tuple[int, ...]], handle: LayeredLoad
    ) -> None:
        stream = self._streams[made[0][0].lane] if made else None
        # Timed events: a stage's bandwidth is the time between two (bench_layerwise.py).
        handle.events = [torch.cuda.Event(enable_timing=True) for _ in stages]
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        for job, _ in made:
            job.start = torch.cuda.Event(enable_timing=True)
            job.end = torch.cuda.Event(enable_timing=True)
            self._queues[job.lane].append(job)
        recorded = 0
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                prepared = [
                    self._layered_job_runs(job, table, stages, stream) for job, table in made
                ]
                stream.wait_event(ready)
                for job, _ in made:
                    job.start.record(stream)
                for number in range(len(stages)):
                    for per_stage, _ in prepared:
                        for run in per_stage[number]:
                            run()
                    handle.events[number].record(stream)
                    recorded += 1
                for (job, _), (_, tail) in zip(made, prepared, strict=True):
                    for run in tail:
                        run()
                    job.end.record(stream)
        except BaseException as error:
            handle.fail_all()
            # Whatever was enqueued still runs; every wait and job end follows it.
            for event in handle.events[recorded:]:
                event.record(stream)
            for job, _ in made:
                job.end.record(stream)
            if isinstance(error, Exception):
                logger.exception("layer-staged load jobs %s failed", list(handle.job_ids))
            else:
                raise
        finally:
            for job, _ in made:
                job.holds.release_after(job.end)
                job.finished.set()

    def _run_layered_cpu(
        self, made: list[Any], stages: list[tuple[int, ...]], handle: LayeredLoad
    ) -> None:
        start = time.perf_counter()
        try:
            with self._lock:
                settled = any(job.finished.is_set() for job, _ in made)
            if settled:
                return  # the submit was interrupted and failed the jobs: copy nothing
            with self._copy_locks[EXPEDITED_LOAD]:
                if self._closed:
                    # shutdown released the pool while this thread was on its way to the lock
                    # (shutdown takes every copy lock first, so a copy holding it is safe):
                    # the runs would move bytes by raw address from released memory.
                    logger.error(
                        "layer-staged load jobs %s failed: the engine was shut down before "
                        "they copied",
                        list(handle.job_ids),
                    )
                    handle.fail_all()
                    return
                prepared = [self._layered_job_runs(job, table, stages, None) for job, table in made]
                for number in range(len(stages)):
                    for per_stage, _ in prepared:
                        for run in per_stage[number]:
                            run()
                    handle.events[number].set()
                for _, tail in prepared:
                    for run in tail:
                        run()
        except Exception:
            logger.exception("layer-staged load jobs %s failed", list(handle.job_ids))
            handle.fail_all()
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                for job, _ in made:
                    if job.finished.is_set():
                        continue  # settled by an interrupted submit, reported from there
                    job.transfer_time = elapsed
                    job.holds.release_after(None)
                    self._finished.append(job)
                    job.finished.set()
            for event in handle.events:
                event.set()  # released in any case (a failed stage fails the jobs above)
            handle._ended.set()

    def _submit(
        self,
        job_id: Hashable,
        spec: JobSpec | PlainJob,
        direction: int,
        assignment: Assignment | None = None,
        *,
        lane: int | None = None,
        checksum: bool = False,
    ) -> bool:
        if self._closed:
            return False
        if checksum is not False:
            if checksum is not True:
                raise TypeError(f"checksum must be a bool, got {checksum!r}")
            if not self.page_checksums:
                raise ValueError("checksum=True needs an engine made with page_checksums=True")
        try:
            hash(job_id)
        except TypeError:
            raise ValueError(f"job id {job_id!r} is not hashable") from None
        # A reallocated cache would be read or written through stale addresses.
        self.layout.check_sources()
        if type(spec) is PlainJob:
            table = plain_pair_table(self.layout, self.num_host_blocks, spec, direction)
            counts = [len(blocks) for blocks in spec.gpu_blocks]
        else:
            table = pair_table(self.layout, self.num_host_blocks, spec, direction)
            counts = [blocks.size for blocks in spec.gpu_blocks]
        # One count per group of the engine: pair_table checked the number of groups.
        size = sum(map(operator.mul, counts, self._bytes_per_block))
        if assignment is None:
            assignment = self.policy.assign(direction, counts)
        last = self._last_path  # (assignment, its path name), read once: threads replace it
        if last[0] is assignment:
            path = last[1]
        else:
            path = self._path_names.get(assignment) or path_name(assignment)
            self._path_names[assignment] = path
            self._last_path = (assignment, path)
        job = RunningJob(
            job_id,
            direction,
            assignment,
            size,
            direction if lane is None else lane,
            path,
            checksum=checksum,
            checksum_algorithm=self.checksum_algorithm,
        )
        # The job enters the books with ``self._active[job_id] = job``; from that line on an
        # interrupt (KeyboardInterrupt, SystemExit) at any later line, this method's or its
        # callees', must still leave it reported once. Before this try, an interrupt after
        # that line and before _run_cpu's (the last_job_* lines, path_name) left it in
        # _active, never queued nor marked finished: never reported, and wait() on it hung.
        try:
            with self._lock:
                if self._closed:
                    return False
                if job_id in self._active:
                    raise ValueError(f"job id {job_id!r} is already in flight")
                self._active[job_id] = job
                self.last_job_table = table
                self.last_job_assignment = assignment
                self.last_job_backend = path
                if self.cuda:
                    self._queues[job.lane].append(job)
                    self._run_cuda(job, table)
                    return True
            self._run_cpu(job, table)
            return True
        except BaseException:
            self._settle_interrupted(job)
            raise

    def _settle_interrupted(self, job: RunningJob) -> None:
        """After anything escaped ``_submit``: a job that entered the books but was not
        marked finished (the interrupt landed before that) is failed, queued once and
        marked finished. Jobs are marked finished only under the lock and get_finished
        takes only marked ones, so the queue is searched here with no one else taking."""
        with self._lock:
            if self._active.get(job.job_id) is not job or job.finished.is_set():
                return  # never entered the books, or finished (perhaps reported) already
            job.success = False
            queue = self._queues[job.lane] if self.cuda else self._finished
            if not any(queued is job for queued in queue):
                queue.append(job)
            job.finished.set()
        job.holds.release_after(job.end)

    def in_flight(self, job_id: Hashable) -> bool:
        """Whether ``job_id`` entered the books and was not reported yet (the caller of a
        submit that raised KeyboardInterrupt or SystemExit learns whether it will be)."""
        with self._lock:
            return job_id in self._active

    def jobs_in_flight(self) -> int:
        """How many jobs entered the books and were not reported yet."""
        with self._lock:
            return len(self._active)

    def _prepare(self, job: RunningJob, table: PairTable, stream: Any) -> list[Callable[[], None]]:
        if job.checksum and self._summer is not None:
            return self._prepare_summed(job, table, stream)
        return [
            self.copiers[name].prepare(table, job.direction, planes, job.holds, stream)
            for name, planes in job.assignment
        ]

    def _prepare_summed(
        self, job: RunningJob, table: PairTable, stream: Any
    ) -> list[Callable[[], None]]:
        """A checksummed job's launches: the copy with the sums fused in when the kernel
        copies the whole job, else the copiers' runs and a read-only device pass over
        the GPU blocks (before a store's copy, after a load's landed); then a read-only
        pass over the pool slots of its rows the job does not move; then, on CUDA, the
        sums' copy to the host. The host reads no payload byte."""
        summer = self._summer
        assert summer is not None
        pages = job_pages(self.layout, table)
        page_sums = torch.zeros(pages.rows.size, dtype=torch.int64, device=self.device)
        job.holds.keep_alive.append(page_sums)
        holds = job.holds
        if job.assignment == (("triton", None),):
            sums = PageSums(page_sums, pages.pair_pages)
            runs = [summer.prepare(table, job.direction, None, holds, stream, sums=sums)]
        else:
            copies = [
                self.copiers[name].prepare(table, job.direction, planes, holds, stream)
                for name, planes in job.assignment
            ]
            cache_side = PageSums(page_sums, pages.pair_pages, write=False)
            gpu_pass = summer.prepare(table, TO_POOL, None, holds, stream, sums=cache_side)
            runs = [gpu_pass, *copies] if job.direction == TO_POOL else [*copies, gpu_pass]
        return runs + self._summed_tail(job, pages, page_sums, stream)

    def _summed_tail(
        self, job: RunningJob, pages: JobPages, page_sums: torch.Tensor, stream: Any
    ) -> list[Callable[[], None]]:
        """A checksummed job's launches after its copy: the read-only passes over the
        slots of its rows it does not move and the bytes between the planes' slots,
        then (CUDA) the sums' copy to the host, read once the job ended."""
        summer = self._summer
        assert summer is not None
        holds = job.holds
        runs: list[Callable[[], None]] = []
        if pages.rest.pairs.shape[0]:
            rest = PageSums(page_sums, pages.rest_pages, write=False)
            runs.append(summer.prepare(pages.rest, FROM_POOL, None, holds, stream, sums=rest))
        between = PageSums(page_sums, pages.whole_pages, write=False)
        gaps = summer.prepare_gaps(pages.whole, holds, stream, between)
        if gaps is not None:
            runs.append(gaps)
        job.checksum_rows = pages.rows
        if self.cuda:
            host = torch.empty(pages.rows.size, dtype=torch.int64, pin_memory=True)
            holds.keep_alive.append(host)
            job.checksum_values = host
            runs.append(lambda: host.copy_(page_sums, non_blocking=True))
        else:
            job.checksum_values = page_sums
        return runs

    def _run_cpu(self, job: RunningJob, table: PairTable) -> None:
        """Copy now; the job is reported (queued for get_finished) only after its copy
        returned or failed, and a copy interrupted by any exception, KeyboardInterrupt
        included, is reported ``success=False`` before the exception propagates.

        An interrupt that lands in the ``finally`` below, before the job was queued and
        marked finished, reaches ``_submit``'s handler, which does both (once)."""
        # Failed until its copy returned: an interrupt at any line before ``success`` is
        # set again, a line of the except clause included, reports it failed.
        job.success = False
        try:
            with self._copy_locks[job.lane]:
                if self._closed:
                    # shutdown released the pool between this submit's check of the books
                    # and here (it takes every copy lock first, so a copy holding one is
                    # safe): the runs would move bytes by raw address to or from released
                    # memory. Reported failed below, like any copy that failed.
                    logger.error(
                        "%s job %r failed: the engine was shut down before it copied",
                        DIRECTION_NAMES[job.direction],
                        job.job_id,
                    )
                    return
                if job.checksum and self._summer is None:
                    self._copy_and_hash(job, table)
                else:
                    runs = self._prepare(job, table, None)
                    start = time.perf_counter()
                    for run in runs:
                        run()
                    job.transfer_time = time.perf_counter() - start
                job.success = True
        except BaseException as error:
            job.success = False
            if isinstance(error, Exception):
                logger.exception("%s job %r failed", DIRECTION_NAMES[job.direction], job.job_id)
            else:
                raise
        finally:
            # The copy returned: nothing reads the job's staging any more.
            if job.holds.releases:
                job.holds.release_after(None)
            # Queued and marked finished under one hold of the lock: get_finished takes
            # only marked jobs, so one interrupted between the two lines is not taken
            # before _submit's handler marks it.
            with self._lock:
                self._finished.append(job)
                job.finished.set()

    def _copy_and_hash(self, job: RunningJob, table: PairTable) -> None:
        """The CPU path's checksummed job: each pool row hashed (XXH3-64, or the seal
        key's GHASH) right after
        its copy, while its bytes are in cache. ``transfer_time`` is the whole pass, as
        a fused kernel's is on CUDA; the hashing's share goes with the checksums."""
        assert job.assignment == (("torch", None),), job.assignment
        if self._host_pool_bytes is None:
            self._host_pool_bytes = cpu_copy.pool_bytes(
                self.pool_address, self.row_stride, self.pool.shape[0], self.pool.shape[1]
            )
        # Through the copier, as every CPU copy: one place runs (and may fail) them.
        digest = None if self.seal_key is None else self.seal_key.keyed_ghash64
        copy = self.copiers["torch"].prepare(
            table, job.direction, None, job.holds, None, hashed=self._host_pool_bytes, digest=digest
        )
        start = time.perf_counter()
        hashed = copy()
        job.transfer_time = time.perf_counter() - start
        job.checksum_rows, job.checksum_values = hashed.rows, hashed.values
        job.checksum_seconds = hashed.hash_seconds

    def _run_cuda(self, job: RunningJob, table: PairTable) -> None:
        stream = self._streams[job.lane]
        # RAW for stores, WAR for loads: wait for everything the caller's stream
        # enqueued before this submit.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        job.start = torch.cuda.Event(enable_timing=True)
        job.end = torch.cuda.Event(enable_timing=True)
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                # Table uploads read no cache byte: enqueued before the wait, they
                # overlap compute instead of following it.
                runs = self._prepare(job, table, stream)
                stream.wait_event(ready)
                # After the host work, the table upload and the wait: the timed span is
                # the copy.
                job.start.record(stream)
                for run in runs:
                    run()
                job.end.record(stream)
        except BaseException as error:
            job.success = False
            # Whatever was enqueued still runs; the job counts as finished after it.
            job.end.record(stream)
            if isinstance(error, Exception):
                logger.exception("%s job %r failed", DIRECTION_NAMES[job.direction], job.job_id)
            else:
                raise
        finally:
            job.holds.release_after(job.end)
            job.finished.set()

    # ------------------------------------------------- unreported jobs (calibration)

    def run_unreported(
        self, spec: JobSpec, direction: int, assignment: Assignment
    ) -> TransferResult:
        """Run one job with a forced assignment and wait for it (calibration, the bench's
        checks); ``get_finished`` never reports it."""
        return self.finish_unreported(self.start_unreported(spec, direction, assignment))

    def lane_stream(self, direction: int) -> Any:
        """The CUDA stream of ``direction``'s lane (None without CUDA): a calibration
        timer holds it before a timed job."""
        return self._streams[direction] if self.cuda else None

    def start_unreported(self, spec: JobSpec, direction: int, assignment: Assignment) -> RunningJob:
        """Enqueue (CUDA) or run (CPU) a job that ``get_finished`` will not report."""
        job_id = ("calibration", object())
        self._submit(job_id, spec, direction, assignment)
        with self._lock:
            job = self._active.pop(job_id)
            if self.cuda:
                self._queues[job.lane].remove(job)
            else:
                self._finished.remove(job)
        return job

    def finish_unreported(self, job: RunningJob) -> TransferResult:
        """Wait for a job of :meth:`start_unreported`; RuntimeError when it failed."""
        if self.cuda:
            job.end.synchronize()
        job.holds.keep_alive.clear()
        result = job.result()
        if not result.success:
            raise RuntimeError(f"calibration {DIRECTION_NAMES[job.direction]} job failed")
        return result

    # ------------------------------------------------------------------ finish

    def get_finished(self) -> list[TransferResult]:
        """Results of jobs finished since the last call, FIFO per lane; never blocks.

        Each accepted job is reported exactly once, and only after its bytes landed
        (CUDA: its end event completed; CPU: its copy returned). An interrupt at any line
        of this call reports nothing and loses nothing: the next call reports them.
        """
        # Every line that takes jobs off the books runs inside the try, and each takes
        # them in one assignment (an interrupt lands before it or after it): the handler
        # puts back exactly what ``done`` holds, so no job taken off the books is lost.
        done: list[RunningJob] = []
        try:
            with self._lock:
                # Jobs an interrupted call took off the queues come first, in their order.
                done, self._undelivered = self._undelivered, []
                # Only jobs marked finished (under this lock): one whose submit was
                # interrupted before it was marked is settled by that submit first.
                if self.cuda:
                    for queue in self._queues.values():
                        while queue and queue[0].finished.is_set() and queue[0].done():
                            done.append(queue.popleft())
                elif self._finished:
                    ready = [job for job in self._finished if job.finished.is_set()]
                    if len(ready) == len(self._finished):
                        done, self._finished = done + ready, deque()
                    elif ready:
                        rest = deque(job for job in self._finished if not job.finished.is_set())
                        done, self._finished = done + ready, rest
            results = []
            for job in done:
                job.holds.keep_alive.clear()
                results.append(job.result())
            with self._lock:
                for job in done:
                    self._active.pop(job.job_id, None)
            return results
        except BaseException:
            # None of their results reached the caller: the next call reports them.
            with self._lock:
                self._undelivered = done + self._undelivered
                self._active.update((job.job_id, job) for job in done)
            raise

    def wait(self, job_ids: Iterable[Hashable]) -> None:
        """Block until the given jobs finished (their results stay for get_finished).

        ValueError for an id that is not in flight (unknown, or already reported: with
        another thread polling ``get_finished`` that can happen at any time).
        """
        ids = list(job_ids)
        with self._lock:
            jobs = []
            for job_id in ids:
                job = self._active.get(job_id)
                if job is None:
                    raise ValueError(f"job id {job_id!r} is unknown or already reported")
                jobs.append(job)
        for job in jobs:
            job.finished.wait()
            if job.end is not None:
                job.end.synchronize()

    def shutdown(self) -> None:
        """Wait for running jobs, then release the pool: its page locks, and every view
        of it the engine holds (``pool`` becomes an empty tensor, ``pool_view`` raises
        RuntimeError); idempotent. A caller that still holds the engine then keeps no
        view of a pool that is a caller's memory: vLLM's shared region is unmapped at
        its shutdown only once no view of it is left."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # No copy may still run when the pool is released (CPU copies hold these).
        with contextlib.ExitStack() as held:
            for lock in self._copy_locks.values():
                held.enter_context(lock)
            self._finalizer()
            self.pool = self._pool.tensor  # released by the finalizer's pool.close()
            self._host_pool_bytes = None  # addressed the released pool

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------- views

    def pool_view(self, plane_index: int) -> torch.Tensor:
        """uint8 ``[num_host_blocks, blocks_per_chunk, page_bytes]`` view of one plane."""
        if self._closed:
            raise RuntimeError("the engine was shut down: its host pool is released")
        planes = self.layout.planes
        index = check_int("plane_index", plane_index, 0)
        if index >= len(planes):
            raise ValueError(f"plane index {index} out of range [0, {len(planes)})")
        return pool_plane_view(self.pool, planes[index], self.blocks_per_chunk)

    @property
    def last_job_table_size(self) -> int:
        """Rows of the pair table of the last accepted job (one per block pair)."""
        return 0 if self.last_job_table is None else int(self.last_job_table.pairs.shape[0])


__all__ = [
    "EXPEDITED_LOAD",
    "Crossover",
    "DmaCopier",
    "JobSpec",
    "TransferEngine",
    "TransferResult",
    "calibrate",
    "parse_crossover",
]
