"""``TritonOffloadingWorker``: vLLM's ``OffloadingWorker`` on this project's engine.

The worker side of both specs (:mod:`triton_offload.vllm.spec` builds it in
``get_worker``): vLLM's job specs become ``JobSpec``s, the engine moves the bytes, and
results go back as vLLM's ``TransferResult``s. Under the replicated layout a non-writer
rank learns of rank 0's stores from the region's store ledger
(:mod:`triton_offload.vllm.region`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from triton_offload.transfer.jobs import TO_POOL, JobSpec
from triton_offload.transfer.pointers import GroupPlanes, blocks_from_pointers
from triton_offload.transfer.seal import PageSealer, key_digests
from triton_offload.transfer.seal_key import SealKey
from triton_offload.vllm.compat import logger, supported_vllm_api
from triton_offload.vllm.convert import split_job
from triton_offload.vllm.counters import (
    BYTES,
    CHUNKS_REFUSED,
    HOST_TIER,
    JOBS,
    VERIFY_SECONDS,
    CountBatch,
    Counters,
    refusal_reason,
)
from triton_offload.vllm.integrity import spec_keys
from triton_offload.vllm.region import check_ledger_job_id, release_region, wait_until
from triton_offload.vllm.releases import RELEASE
from triton_offload.vllm.tiers import withdraw_planes

with supported_vllm_api():
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingWorker, TransferResult
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

#: vLLM's per-job pointer class where the release has one (its connector worker may
#: resolve every job's GPU blocks to pointers first), else None.
DevicePointers: Any = RELEASE.DevicePointers


@dataclasses.dataclass
class TritonTransferResult(TransferResult):  # type: ignore[misc]
    """vLLM's ``TransferResult`` plus, for a failed load, what did not load.

    ``failed_blocks[g]``: group ``g``'s GPU block ids whose bytes must not count as
    loaded; ``bad_keys``: keys whose host chunk failed verification (dropped by the
    scheduler); ``problem``: why, for the log.
    """

    failed_blocks: tuple[tuple[int, ...], ...] = ()
    bad_keys: tuple[bytes, ...] = ()
    problem: str = ""


@dataclasses.dataclass(frozen=True)
class Report:
    """A finished job's vLLM report, queued for ``get_finished``, with the counts judging
    the job gathered (added to the worker's counters once, before the job leaves the
    books; a replicated store's rank copied nothing and counts nothing)."""

    result: Any
    counts: CountBatch = dataclasses.field(default_factory=CountBatch)


def chunk_gpu_blocks(job: JobSpec, group: int, index: int, blocks_per_chunk: int) -> np.ndarray:
    """GPU block ids of group ``group`` that chunk ``index`` of the job covers (the
    first chunk's leading ``first_block_index % bpc`` slots are not the job's)."""
    first = job.first_block_index
    skip = (int(first[group]) if first is not None else 0) % blocks_per_chunk
    lo = max(0, index * blocks_per_chunk - skip)
    hi = (index + 1) * blocks_per_chunk - skip
    return np.asarray(job.gpu_blocks[group][lo:hi])


@dataclasses.dataclass(frozen=True)
class JobChunks:
    """Every host chunk of a job in the host spec's order (keys, when the spec carries
    them, are in that order): its group, index in the group, chunk id (this worker's
    page) and key (None without keys), with the keys' seal digests ``[n, 8]``."""

    groups: np.ndarray
    indices: np.ndarray
    chunks: np.ndarray
    keys: tuple[bytes, ...] | None
    digests: np.ndarray | None

    @classmethod
    def of(
        cls, job: JobSpec, keys: tuple[bytes, ...] | None, seal_key: SealKey | None = None
    ) -> JobChunks:
        digests = None if keys is None else key_digests(keys, seal_key)
        if len(job.host_blocks) == 1:
            # One group (most models): no numpy call per group.
            chunks = np.asarray(job.host_blocks[0], dtype=np.int64)
            indices = np.arange(chunks.size, dtype=np.int64)
            return cls(np.zeros(chunks.size, np.int64), indices, chunks, keys, digests)
        sizes = [int(chunks.size) for chunks in job.host_blocks]
        groups = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        starts = np.repeat(np.cumsum([0, *sizes[:-1]]), sizes) if sizes else np.zeros(0)
        indices = np.arange(groups.size, dtype=np.int64) - starts.astype(np.int64)
        chunks = np.concatenate([np.zeros(0, np.int64), *job.host_blocks]).astype(np.int64)
        return cls(groups, indices, chunks, keys, digests)

    def checksums_of(self, checksums: Any) -> np.ndarray:
        """The engine's per-row checksums in this job's chunk order."""
        return checksums.values[np.searchsorted(checksums.rows, self.chunks)]


class TritonOffloadingWorker(RELEASE.SubmitSignatures, OffloadingWorker):  # type: ignore[misc]
    """vLLM ``OffloadingWorker`` backed by a ``TransferEngine`` on vLLM's shared region.

    ``submit_store(job_id, GPU side, CPULoadStoreSpec)`` and
    ``submit_load(job_id, CPULoadStoreSpec, GPU side)`` take the GPU side as vLLM's
    ``GPULoadStoreSpec`` (block ids: vLLM 0.33, and ``TritonOffloadingConnector`` on
    0.34, which skips vLLM's pointer resolution) or vLLM 0.34's ``DevicePointers`` (what
    vLLM's own connector worker passes): the block ids behind the pointers are derived
    and every pointer checked against ``device_planes`` (see
    :func:`~triton_offload.transfer.pointers.blocks_from_pointers`). They check the spec
    types (TypeError) and the block counts (ValueError) before any byte moves;
    ``get_finished`` returns each job once as vLLM's ``TransferResult``; ``wait``
    blocks on jobs still in flight (ids already reported are ignored, as vLLM's
    CPU worker does); ``shutdown`` waits for running jobs, then releases the
    region as vLLM's CPU worker does (unlock, unmap, unlink if still linked); the
    reports of jobs not yet handed over stay for a ``get_finished`` after it.
    ``submit_load(..., expedited=True)`` (vLLM's loads for requests that run in the
    same step, which vLLM's connector waits for at once) goes to the engine's
    expedited lane: on CUDA its own queue on a stream of the highest priority, so it
    never waits behind the regular loads already queued.

    ``stage_groups``: the config's groups that have layers on this worker (a
    pipeline stage may hold none of a group); the engine covers every group and
    moves nothing for the empty ones. Without any such group there is no engine and
    every job moves nothing. Under the replicated layout a rank
    other than 0 copies no store: it reports the job when the store ledger says
    rank 0's bytes are in the region (see ``triton_offload.vllm_region``).
    """

    def __init__(
        self,
        engine: Any,
        *,
        num_groups: int,
        stage_groups: tuple[int, ...],
        blocks_per_chunk: int,
        num_chunks: int,
        region: Any = None,
        writer: bool = True,
        ledger: Any = None,
        cuda_api: Any = None,
        replicated_store_timeout_s: float = 60.0,
        sealer: PageSealer | None = None,
        planes_note: str | None = None,
        device_planes: tuple[GroupPlanes, ...] = (),
    ) -> None:
        self.engine = engine
        self.num_groups = num_groups
        self.stage_groups = stage_groups
        self.blocks_per_chunk = blocks_per_chunk
        self.num_chunks = num_chunks
        self.region = region
        self.writer = writer
        self.ledger = ledger
        self._cuda_api = cuda_api  # what locked the region's pages (CUDA only)
        self._closed = False
        # Jobs accepted and not yet reported, by kind.
        self._engine_jobs: set[Any] = set()
        self._published: dict[Any, Any] = {}  # writer: job id -> chunks to publish
        # Non-writer: job id -> (chunks, time.monotonic() after which rank 0 is given up).
        self._replica_jobs: dict[Any, tuple[Any, float]] = {}
        self.replicated_store_timeout_s = replicated_store_timeout_s
        self._empty_jobs: list[Any] = []  # jobs that move nothing on this worker
        # Reports not yet returned by get_finished, by job id: judged engine results
        # (sealed stores, verified loads) and replicated stores. A job leaves the books
        # above only after its report is here and its counts were added, and
        # get_finished empties it in one line.
        self._ready: dict[Any, Report] = {}
        # Engine results taken from the engine and not yet judged (an interrupt while
        # judging them leaves them here for the next drain).
        self._pending: list[Any] = []
        #: Seals this worker's pages (None: verification off, or nothing to seal).
        self.sealer = sealer
        self._planes_note = planes_note  # this worker's published planes (tiering spec)
        #: Per group and ref, where vLLM 0.34's DevicePointers point (transfer.pointers).
        self.device_planes = device_planes
        self._to_seal: dict[Any, JobChunks] = {}  # store job -> its chunks
        # Load job -> its JobSpec and chunks (checked once the copy ended).
        self._loads: dict[Any, tuple[JobSpec, JobChunks | None]] = {}
        #: This worker's counts since vLLM last asked for them (chunks it refused, jobs
        #: and bytes per copy path, seconds sealing and verifying): see
        #: triton_offload.vllm.counters.
        self.counters = Counters()

    # ------------------------------------------------------------ job input

    def _job(self, what: str, gpu: tuple[str, Any], host: tuple[str, Any]) -> Any:
        """The job's ``JobSpec`` (every group of the config)."""
        (gpu_name, gpu_spec), (host_name, host_spec) = gpu, host
        if DevicePointers is not None and isinstance(gpu_spec, DevicePointers):
            if len(self.device_planes) != self.num_groups:
                raise ValueError(
                    f"{what}: {gpu_name} is DevicePointers but this worker was built "
                    "without the caches' device planes"
                )
            gpu_spec = blocks_from_pointers(gpu_spec, self.device_planes, f"{what}: {gpu_name}")
        elif not isinstance(gpu_spec, GPULoadStoreSpec):
            accepted = "GPULoadStoreSpec" + (
                " or DevicePointers" if DevicePointers is not None else ""
            )
            raise TypeError(
                f"{what}: {gpu_name} must be vLLM's {accepted}, got {type(gpu_spec).__name__}"
            )
        if not isinstance(host_spec, CPULoadStoreSpec):
            raise TypeError(
                f"{what}: {host_name} must be vLLM's CPULoadStoreSpec (from this spec's "
                f"manager), got {type(host_spec).__name__}"
            )
        job = split_job(gpu_spec, host_spec, self.num_groups, self.blocks_per_chunk, what)
        if self.engine is None:
            # No layer of any group here: nothing moves, but the chunk ids must still
            # be ones the manager can hand out (the engine checks them otherwise).
            for group in range(self.num_groups):
                ids = job.host_blocks[group]
                bad = ids[(ids < 0) | (ids >= self.num_chunks)]
                if bad.size:
                    raise ValueError(
                        f"{what}: host block id {int(bad[0])} of group {group} out of "
                        f"range [0, {self.num_chunks})"
                    )
        return job

    def _check_new(self, job_id: Any, what: str) -> None:
        try:
            hash(job_id)
        except TypeError:
            raise ValueError(f"{what}: job id {job_id!r} is not hashable") from None
        if job_id in self._in_flight():
            raise ValueError(f"{what}: job id {job_id!r} is already in flight")

    def _in_flight(self) -> set[Any]:
        return (
            self._engine_jobs
            | set(self._replica_jobs)
            | {result.job_id for result in self._empty_jobs}
            | set(self._ready)
        )

    # --------------------------------------------------------------- submit

    def _chunks(self, what: str, job: JobSpec, host_spec: Any) -> JobChunks | None:
        """The chunks a verified job seals or checks (None: unverified). Under a seal key
        a host spec without the chunks' keys is refused before any byte moves: its seals
        would name no chunk, so any page sealed in this configuration would pass for
        another chunk's."""
        if self.sealer is None:
            return None
        keys = spec_keys(host_spec)
        seal_key = self.sealer.seal_key
        if keys is None and seal_key is not None:
            raise ValueError(
                f"{what}: {type(host_spec).__name__} carries no chunk keys, and keyed seals "
                "bind every page to its chunk's key (the host specs get their keys from "
                "this backend's spec; a spec built without them cannot use seal_key_file)"
            )
        return JobChunks.of(job, keys, seal_key)

    def _store(self, job_id: Any, gpu: tuple[str, Any], dst_spec: Any) -> bool:
        if self._closed:
            return False
        what = f"submit_store(job {job_id!r})"
        job = self._job(what, gpu, ("dst_spec", dst_spec))
        self._check_new(job_id, what)
        sealed = self._chunks(what, job, dst_spec)
        chunks = None
        if self.ledger is not None:
            check_ledger_job_id(job_id, what)
            chunks = np.unique(np.concatenate([np.zeros(0, np.int64), *job.host_blocks]))
        if self.engine is None:
            self._empty_jobs.append(TransferResult(job_id, True, 0, 0.0))
            return True
        if not self.writer:
            # Same checks as a real store (the ids, the slots, aliasing), no copy.
            self.engine.build_job_table(job, TO_POOL)
            deadline = time.monotonic() + self.replicated_store_timeout_s
            self._replica_jobs[job_id] = (chunks, deadline)
            return True

        def register() -> None:
            self._engine_jobs.add(job_id)
            if chunks is not None:
                self._published[job_id] = chunks
            if sealed is not None:
                self._to_seal[job_id] = sealed

        def unregister() -> None:
            self._engine_jobs.discard(job_id)
            self._published.pop(job_id, None)
            self._to_seal.pop(job_id, None)

        checksum = self.sealer is not None
        return self._engine_submit(
            job_id,
            lambda: self.engine.submit_store(job_id, job, checksum=checksum),
            register,
            unregister,
        )

    def _engine_submit(self, job_id: Any, submit: Any, register: Any, unregister: Any) -> bool:
        """Submit with the job's books opened first: a job the engine took and then lost
        to an interrupt is still reported (failed) and still counts as in flight, so a
        caller that re-submits it after the interrupt is told so instead of starting it
        twice. A refused or invalid job leaves no books.

        Every line is inside the try: an interrupt while the books are opened (in
        ``register``), before the engine took the job, or after it refused it, used to
        leave books for a job the engine never reports (never reported, its id refused
        as in flight forever, ``wait`` on it an error). Whether the books stay is the
        engine's answer to ``in_flight``: it reports exactly the jobs in its books."""
        try:
            register()
            if submit():
                return True
            unregister()
            return False
        except BaseException:
            # Refused before the engine's books (bad input) or lost to an interrupt
            # before them: no report will come, so no books.
            if not self.engine.in_flight(job_id):
                unregister()
            raise

    def _load(self, job_id: Any, src_spec: Any, gpu: tuple[str, Any], expedited: Any) -> bool:
        if self._closed:
            return False
        what = f"submit_load(job {job_id!r})"
        job = self._job(what, gpu, ("src_spec", src_spec))
        self._check_new(job_id, what)
        if self.engine is None:
            self._empty_jobs.append(TransferResult(job_id, True, 0, 0.0))
            return True
        # Nothing is checked here: the copy starts at once, its pages' checksums are
        # computed where the bytes move, and the verdict joins the job's completion.
        chunks = self._chunks(what, job, src_spec)
        checksum = chunks is not None

        def register() -> None:
            self._engine_jobs.add(job_id)
            self._loads[job_id] = (job, chunks)

        def unregister() -> None:
            self._engine_jobs.discard(job_id)
            self._loads.pop(job_id, None)

        return self._engine_submit(
            job_id,
            lambda: self.engine.submit_load(
                job_id, job, expedited=bool(expedited), checksum=checksum
            ),
            register,
            unregister,
        )

    def submit_layered_loads(
        self, jobs: list[tuple[Any, Any, Any]], stages: list[tuple[int, ...]]
    ) -> Any:
        """A step's sync loads ``(job_id, src_spec, GPU side)``, copied stage by stage
        (``stages``: plane indices of the engine's layout; see
        ``triton_offload.vllm.layerwise``); returns the engine's handle, or None when
        nothing can be staged here (no engine, or shut down): the caller then submits
        the jobs as usual. Each job is checked as ``submit_load`` checks it, before any
        byte moves, and reported once by ``get_finished`` with its seal verdict."""
        if self._closed or self.engine is None:
            return None
        specs = []
        books: list[tuple[Any, JobSpec, JobChunks | None]] = []
        for job_id, src_spec, gpu_spec in jobs:
            what = f"submit_layered_loads(job {job_id!r})"
            job = self._job(what, ("dst_spec", gpu_spec), ("src_spec", src_spec))
            self._check_new(job_id, what)
            chunks = self._chunks(what, job, src_spec)
            specs.append((job_id, job))
            books.append((job_id, job, chunks))
        # Books opened first and closed only for jobs the engine does not hold, as in
        # _engine_submit: an interrupt after the engine took the jobs leaves their books,
        # so their (failed) reports reach vLLM as loads.
        try:
            for job_id, job, chunks in books:
                self._engine_jobs.add(job_id)
                self._loads[job_id] = (job, chunks)
            handle = self.engine.submit_layered_loads(
                specs, stages, checksum=self.sealer is not None
            )
            if handle is not None:
                return handle
        except BaseException:
            held = [job_id for job_id, _, _ in books if self.engine.in_flight(job_id)]
            self._close_books(job_id for job_id, _, _ in books if job_id not in held)
            raise
        self._close_books(job_id for job_id, _, _ in books)
        return None

    def _close_books(self, job_ids: Iterable[Any]) -> None:
        """Forget load jobs the engine never took (refused, or shut down)."""
        for job_id in job_ids:
            self._engine_jobs.discard(job_id)
            self._loads.pop(job_id, None)

    def _verify_load(
        self, chunks: JobChunks, checksums: Any, counts: CountBatch
    ) -> list[tuple[int, int, Any, str]]:
        """The chunks of a finished load whose page on this worker fails its seal:
        headers checked here (batched, 64 bytes a page), payloads by the checksums the
        copy computed: (group, index in group, key, problem); each refusal goes to
        ``counts``."""
        sealer = self.sealer
        assert sealer is not None
        values = None if checksums is None else chunks.checksums_of(checksums)
        algorithm = None if checksums is None else checksums.algorithm
        # Every page exactly as its store sealed it: one comparison, no reasons built.
        if (
            values is not None
            and algorithm is not None
            and sealer.all_accepted(chunks.chunks, chunks.groups, chunks.digests, values, algorithm)
        ):
            return []
        problems, records = sealer.header_problems(chunks.chunks, chunks.groups, chunks.digests)
        problems = sealer.payload_problems(chunks.chunks, records, problems, values, algorithm)
        bad = []
        for position in (i for i, problem in enumerate(problems) if problem is not None):
            key = None if chunks.keys is None else chunks.keys[position]
            group, problem = int(chunks.groups[position]), problems[position]
            bad.append((group, int(chunks.indices[position]), key, str(problem)))
            counts.add(CHUNKS_REFUSED, reason=refusal_reason(str(problem)), tier=HOST_TIER)
            logger.warning(
                "triton_offload: host chunk %d (key %s, group %d) failed verification: %s",
                int(chunks.chunks[position]),
                "unknown" if key is None else bytes(key).hex(),
                group,
                problem,
            )
        return bad

    def _load_result(self, result: Any, counts: CountBatch) -> Any:
        """The vLLM result of a finished load: failed unless every chunk verified and
        the copy succeeded; what failed is named per group. Changes no books (the
        verdict may be computed again after an interrupt); counts go to ``counts``."""
        job, chunks = self._loads[result.job_id]
        bad: list[tuple[int, int, Any, str]] = []
        if result.success and chunks is not None:
            started = time.perf_counter()
            bad = self._verify_load(chunks, result.checksums, counts)
            seconds = time.perf_counter() - started
            if result.checksums is not None:
                seconds += result.checksums.seconds  # the host's hash (the CPU path)
            counts.add(VERIFY_SECONDS, seconds, direction="load")
        if result.success and not bad:
            return TritonTransferResult(
                result.job_id, True, result.transfer_size, result.transfer_time
            )
        if not result.success:
            # The copy failed: none of the job's blocks is known to hold its bytes.
            failed = tuple(tuple(int(b) for b in blocks) for blocks in job.gpu_blocks)
            problem = "the copy failed"
        else:
            per_group: list[set[int]] = [set() for _ in job.gpu_blocks]
            for group, index, _, _ in bad:
                blocks = chunk_gpu_blocks(job, group, index, self.blocks_per_chunk)
                per_group[group].update(int(b) for b in blocks)
            failed = tuple(tuple(sorted(blocks)) for blocks in per_group)
            problem = "; ".join(sorted({p for _, _, _, p in bad}))
        return TritonTransferResult(
            result.job_id,
            False,
            result.transfer_size,
            result.transfer_time,
            failed_blocks=failed,
            bad_keys=tuple(bytes(key) for _, _, key, _ in bad if key is not None),
            problem=problem,
        )

    def _seal_store(self, result: Any, counts: CountBatch) -> bool:
        """Seal a finished store's chunks from the checksums its copy computed (only a
        successful copy is sealed); headers only, one batch. Changes no books: sealing
        again after an interrupt writes the same headers (counts go to ``counts``)."""
        chunks = self._to_seal.get(result.job_id)
        if chunks is None or not result.success:
            return bool(result.success)
        assert self.sealer is not None
        try:
            checksums = result.checksums
            if checksums is None:
                raise RuntimeError("the engine returned no checksums for a checksummed store")
            started = time.perf_counter()
            digests = chunks.digests
            if digests is None:
                digests = np.zeros((chunks.chunks.size, 8), dtype=np.uint8)
            self.sealer.seal_pages(
                chunks.chunks,
                chunks.groups,
                digests,
                chunks.checksums_of(checksums),
                checksums.algorithm,
            )
            # The seconds the host hashed the pages (the CPU path) count as verifying too.
            seconds = time.perf_counter() - started + checksums.seconds
            counts.add(VERIFY_SECONDS, seconds, direction="store")
        except Exception:  # an unsealed store is a failed store, never a crash
            logger.exception("triton_offload: sealing store job %r failed", result.job_id)
            return False
        return True

    # --------------------------------------------------------------- finish

    def _drain_engine(self) -> None:
        """Move the engine's finished jobs into ``_ready``, judged (stores sealed, loads
        verified).

        Restartable at any line: the engine's results enter the worker's books in one
        line (``_pending``), each is judged without changing the books, its report is
        queued by one assignment, its counts are added (once), and only then does the
        job leave the books. Invariants: a job the engine handed over stays in the books
        until its report is queued (an interrupt while sealing or verifying loses none),
        and its counts are added once, with its report, never while judging.
        """
        if self.engine is None:
            return
        self._pending += self.engine.get_finished()
        for result in self._pending:
            report = self._ready.get(result.job_id)
            if report is None:
                report = self._ready[result.job_id] = self._judged(result)
            # Again after an interrupt: a batch that was added adds nothing.
            self.counters.add_batch(report.counts)
            self._forget(result.job_id)  # again after an interrupt: idempotent
        self._pending = []

    def _judged(self, result: Any) -> Report:
        """The vLLM report of a finished engine job and its counts (not yet added);
        changes no books and no counter."""
        counts = CountBatch()
        self._count_copy(result, counts)
        if result.job_id in self._loads:
            return Report(self._load_result(result, counts), counts)
        success = self._seal_store(result, counts)
        chunks = self._published.get(result.job_id)
        if chunks is not None:
            # The copy is complete, sealed and visible to the host: tell the other
            # ranks (a failed store is published as failed; again after an interrupt).
            self.ledger.publish(chunks, int(result.job_id), success)
        report = TransferResult(
            job_id=result.job_id,
            success=success,
            transfer_size=result.transfer_size,
            transfer_time=result.transfer_time,
        )
        return Report(report, counts)

    def _count_copy(self, result: Any, counts: CountBatch) -> None:
        """A completed copy's job and bytes, per copy path and direction (counted whatever
        the verdict on its bytes: they moved)."""
        path = getattr(result, "path", "")
        if result.success and path:
            direction = "load" if result.job_id in self._loads else "store"
            counts.add(JOBS, path=path, direction=direction)
            counts.add(BYTES, result.transfer_size, path=path, direction=direction)

    def _forget(self, job_id: Any) -> None:
        """Take a reported engine job off the books (its report is queued)."""
        self._engine_jobs.discard(job_id)
        self._loads.pop(job_id, None)
        self._to_seal.pop(job_id, None)
        self._published.pop(job_id, None)

    def _collect_replicas(self) -> None:
        now = time.monotonic()
        for job_id, (chunks, deadline) in list(self._replica_jobs.items()):
            status = self.ledger.status(chunks, int(job_id))
            if status is None and now >= deadline:
                # Rank 0 never published this store (it died, or hangs): waiting on
                # would hang this rank too. Its chunks are not known to hold the bytes.
                logger.warning(
                    "replicated layout: rank 0 did not publish store job %r within %.1f s; "
                    "reporting it failed on this rank",
                    job_id,
                    self.replicated_store_timeout_s,
                )
                status = False
            if status is not None:
                self._report_replica(job_id, bool(status))

    def _report_replica(self, job_id: Any, success: bool) -> None:
        """Queue a replicated store's report on a rank that copied nothing, then take it
        off the books. Size and time 0 keep vLLM's store throughput metrics to the
        writer's real copies; queued by id, so again after an interrupt it is the same
        entry (a report queued before an interrupt stands)."""
        self._ready.setdefault(job_id, Report(TransferResult(job_id, success, 0, 0.0)))
        del self._replica_jobs[job_id]

    def report_refused(self, result: Any) -> None:
        """Queue the failed ``result`` of a job whose submit raised or was refused (vLLM's
        connector asserts every submit, so the caller reports it instead): it reaches
        ``get_finished`` with the other reports, once (queued by job id; while queued the
        id is in flight, so a submit of it again is refused as in flight)."""
        self._ready.setdefault(result.job_id, Report(result))

    def get_finished(self) -> list[Any]:
        self._drain_engine()
        if self._replica_jobs:
            self._collect_replicas()
        # The hand-over: an interrupt on either line (the second's lands before its
        # return) gave the caller nothing, so the books get every report back: the
        # reports leave the books only in the line that returns them.
        empty, ready = self._empty_jobs, self._ready
        try:
            self._empty_jobs, self._ready = [], {}
            return [*empty, *(report.result for report in ready.values())]
        except BaseException:
            self._empty_jobs, self._ready = empty, ready
            raise

    def wait(self, job_ids: Iterable[int]) -> None:
        ids = list(job_ids)
        # Jobs the engine handed over (and an interrupted drain left unjudged) are no
        # longer the engine's to wait for: it would refuse their ids.
        drained = {result.job_id for result in self._pending}
        engine_ids = [i for i in ids if i in self._engine_jobs and i not in drained]
        if engine_ids:
            self.engine.wait(engine_ids)
            self._drain_engine()
        replica_ids = [job_id for job_id in ids if job_id in self._replica_jobs]
        if replica_ids:
            jobs = [self._replica_jobs[job_id] for job_id in replica_ids]

            def writer_done() -> bool:
                return all(
                    self.ledger.status(chunks, int(job_id)) is not None
                    for job_id, (chunks, _) in zip(replica_ids, jobs, strict=True)
                )

            # Bounded: a job rank 0 never publishes is reported failed by get_finished.
            wait_until(
                writer_done,
                f"rank 0's stores {replica_ids} (replicated layout)",
                deadline=max(deadline for _, deadline in jobs),
            )

    def _settle_engine_jobs(self, engine: Any) -> None:
        """At shutdown: wait for the jobs the engine holds, then judge every finished
        one, those an interrupted drain took from the engine included. Stores are sealed
        and published, so ranks waiting for them learn of them before the ledger goes
        away; the reports stay for ``get_finished``.

        Only the engine's own jobs are waited for: ids an interrupted drain already took
        are no longer the engine's (``wait`` refuses them). Waiting for every id in
        ``_published`` raised ValueError after such an interrupt, and the engine was then
        never shut down: its pool kept the region mapped (vLLM's "Keeping ... mapped")
        and the stores left unjudged were never published (the other ranks waited for
        them until their timeout)."""
        engine.wait([job_id for job_id in self._engine_jobs if engine.in_flight(job_id)])
        self._drain_engine()

    def _settle_replicas(self) -> None:
        """At shutdown (non-writer): each store still waiting for rank 0 is reported with
        what the ledger says now, failed where rank 0 has not published it (this rank
        can no longer learn of it), so every job is reported once and nothing reads the
        ledger after it is closed."""
        for job_id, (chunks, _) in list(self._replica_jobs.items()):
            self._report_replica(job_id, bool(self.ledger.status(chunks, int(job_id))))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        engine = self.engine
        try:
            if engine is not None:
                try:
                    self._settle_engine_jobs(engine)
                finally:
                    engine.shutdown()  # whatever happened above: it holds views of the region
            if self._replica_jobs:
                self._settle_replicas()
        finally:
            # The engine's pool is a view of the region: drop it before unmapping.
            self.engine = None
            del engine
            if self.ledger is not None:
                self.ledger.close()
                self.ledger = None
            if self.sealer is not None:
                self.sealer.close()  # its view of the region would keep it mapped
            if self.region is not None:
                release_region(self.region, self._cuda_api)
                self.region = None
            withdraw_planes(self._planes_note)
            self._planes_note = None


__all__ = ["TritonOffloadingWorker"]
