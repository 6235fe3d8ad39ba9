"""Chunk verification inside vLLM: keys to the workers, seals checked on promotion,
bad chunks dropped and kept out of every tier, failures reported to the scheduler.

Where the check lives (one design for every mode that writes this project's rows): each
worker's page of a host chunk ends with a seal (:mod:`triton_offload.transfer.seal`):
the page's payload checksum, the chunk's offload key, and digests of the configuration
and of the worker's row layout. The seal is inside the chunk's bytes, so vLLM's fs, obj
and p2p tiers store and return it with the chunk without knowing it is there.

- A store is sealed by the worker that copied it, after the copy finished and before
  the job is reported; a failed store is never sealed and never published.
- A load is checked by each worker on its own page before the copy starts (payload,
  key, both digests); a page that fails makes the load fail for that chunk.
- A chunk promoted from a secondary tier into the host region is checked by the
  scheduler (which maps the same region) before vLLM's tiering manager makes it a hit:
  seal, key, configuration digest and payload checksum of every page of the row (the
  row layout digest is a worker fact; the worker checks it at the load).
- A chunk that failed is dropped from the host tier and its key is quarantined: the
  secondary tiers' lookups answer MISS for it, so vLLM's recompute never loops on a bad
  chunk. A later successful store of the key lifts the quarantine.
- A refused chunk's file in an fs tier is removed when its own bytes fail the check
  (:mod:`triton_offload.vllm.tier_repair`): vLLM's fs tier never overwrites a file, and
  the next store of the key must write a good one, or the chunk would be promoted and
  refused again each time it left host memory.

This module holds the vLLM glue: the key-carrying host spec, the manager hooks, the
tier hooks and the worker metadata that carries failures to the scheduler.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np

from triton_offload.transfer.seal import SEAL_BYTES, SealFormat, digest8, key_digest, seal_problem
from triton_offload.transfer.seal_key import SealKey
from triton_offload.vllm.compat import logger, supported_vllm_api
from triton_offload.vllm.counters import (
    CHUNKS_REFUSED,
    HOST_TIER,
    KEYS_QUARANTINED,
    Counters,
    refusal_reason,
)
from triton_offload.vllm.releases import RELEASE
from triton_offload.vllm.tier_repair import (
    RemovalOutcome,
    fs_chunk_file,
    fs_chunk_folder,
    remove_refused_file,
)

with supported_vllm_api():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.kv_offload.base import LookupResult, OffloadingEvent, OffloadKey
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

#: The extra-config key that turns chunk verification off (on by default).
VERIFY_KEY = "verify_chunks"


class KeyedCPULoadStoreSpec(CPULoadStoreSpec):  # type: ignore[misc]
    """vLLM's host spec plus the offload key of each chunk id (same order), so a worker
    can seal a stored chunk with its key and refuse another key's bytes on load."""

    def __init__(self, block_ids: Any, keys: Collection[Any]) -> None:
        super().__init__(block_ids)
        self.keys = tuple(bytes(key) for key in keys)
        if len(self.keys) != len(self.block_ids):
            raise ValueError(
                f"KeyedCPULoadStoreSpec: {len(self.keys)} keys for {len(self.block_ids)} chunk ids"
            )


def spec_keys(host_spec: Any) -> tuple[bytes, ...] | None:
    """The chunk keys a host spec carries (None for vLLM's plain spec)."""
    return getattr(host_spec, "keys", None)


def host_manager(manager: Any) -> Any:
    """The CPU manager holding the host chunks: the manager itself, or the tiering
    manager's primary tier (None when neither is vLLM's CPU manager)."""
    primary = getattr(manager, "primary_tier", manager)
    return primary if isinstance(primary, CPUOffloadingManager) else None


def give_keys_to_specs(manager: Any) -> None:
    """Make the manager's host specs carry their chunks' keys (stores and loads alike).

    vLLM's CPU manager builds every host spec in ``_get_load_store_spec(keys, chunks)``
    with the keys at hand and drops them; the instance's method is replaced by one that
    keeps them.
    """
    cpu = host_manager(manager)
    if cpu is None or getattr(cpu, "_triton_keyed_specs", False):
        return

    def keyed_spec(keys: Iterable[Any], chunks: Iterable[Any]) -> Any:
        keys = list(keys)
        return KeyedCPULoadStoreSpec([chunk.chunk_id for chunk in chunks], keys)

    cpu._get_load_store_spec = keyed_spec
    cpu._triton_keyed_specs = True


def config_description(spec: Any, storage_layout: str, checkpoint: str) -> str:
    """What the scheduler and every worker agree a chunk's bytes mean: the storage layout
    tag, the model and its checkpoint (:mod:`triton_offload.vllm.checkpoint`: one name
    may serve other weights), its KV dtype and block geometry (the seal's config
    digest)."""
    config = spec.config
    return ";".join(
        [
            storage_layout,
            f"model={config.model.name}",
            f"checkpoint={checkpoint}",
            f"dtype={config.model.dtype}",
            f"page={int(spec.cpu_page_size_per_worker)}",
            f"bpc={int(spec.blocks_per_chunk)}",
            "groups=" + ",".join(str(g.tokens_per_block) for g in config.groups),
        ]
    )


def config_digest(spec: Any, storage_layout: str, checkpoint: str) -> bytes:
    return digest8(config_description(spec, storage_layout, checkpoint))


@dataclasses.dataclass
class TritonWorkerMetadata(RELEASE.WorkerMetadataBase):  # type: ignore[misc]
    """vLLM's worker -> scheduler report (with ``failed_jobs``, on every release through
    its adapter) plus the keys whose chunks failed verification (merged over workers)."""

    bad_keys: set[bytes] = dataclasses.field(default_factory=set)

    def aggregate(self, other: Any) -> Any:
        merged = OffloadingWorkerMetadata.aggregate(self, other)
        return TritonWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            failed_jobs=self.failed_jobs | set(getattr(other, "failed_jobs", ())),
            bad_keys=self.bad_keys | set(getattr(other, "bad_keys", ())),
        )


class ChunkGuard:
    """The scheduler's side of verification: quarantined keys, dropped chunks, and the
    check of chunks promoted from secondary tiers.

    ``region``: the scheduler's memoryview of the host region, ``num_chunks`` rows of
    ``row_stride`` bytes (None: no promotion check, e.g. vLLM's CPU spec without tiers);
    ``page_bytes`` and ``page_count``: the pages of a row; ``digest``: the configuration
    digest.
    """

    def __init__(
        self,
        *,
        region: memoryview | None = None,
        num_chunks: int = 0,
        row_stride: int = 0,
        page_bytes: int = 0,
        page_count: int = 0,
        digest: bytes | None = None,
        seal_key: SealKey | None = None,
    ) -> None:
        self._region = region
        #: The engine's seal key: promotions and tier files must be sealed under it.
        self.seal_key = seal_key
        self._num_chunks = num_chunks
        self._row_stride = row_stride
        self.page_bytes = page_bytes
        self.page_count = page_count
        self.digest = digest
        self.quarantined: set[bytes] = set()
        self._pending_drops: set[bytes] = set()
        self._logged: set[bytes] = set()
        self._lock = threading.Lock()
        self.promotions_refused = 0
        #: Chunks refused (each logged once, until a fresh store of its key).
        self.chunks_refused = 0
        #: The scheduler's counts for vLLM's metrics (promotions refused, keys
        #: quarantined, failed jobs): see triton_offload.vllm.counters.
        self.counters = Counters()
        #: Refused chunks' files removed from fs tiers (so the next store rewrites them).
        self.tier_files_removed = 0
        #: The secondary tiers whose promotions this guard checks (:meth:`watch_tier`).
        self._tiers: list[Any] = []

    # ----------------------------------------------------------------- reporting

    def report(self, key: bytes, where: str, problem: str) -> None:
        """Log a bad chunk once (per key) with where it came from and why."""
        if key in self._logged:
            return
        self._logged.add(key)
        self.chunks_refused += 1
        logger.warning(
            "triton_offload: chunk %s from %s refused: %s; it is dropped and its tokens "
            "are recomputed",
            key.hex(),
            where,
            problem,
        )

    @property
    def region_rows(self) -> np.ndarray | None:
        """uint8 ``[num_chunks, row_stride]`` over the region, made on each use: a view
        kept here would hold an export of vLLM's memoryview, and vLLM's shutdown would
        then leave the region mapped ("buffers are still exported")."""
        if self._region is None:
            return None
        return region_rows(self._region, self._num_chunks, self._row_stride)

    # ---------------------------------------------------------------- quarantine

    def is_quarantined(self, key: Any) -> bool:
        return bool(self.quarantined) and bytes(key) in self.quarantined

    def release(self, keys: Iterable[Any]) -> None:
        """Keys stored again successfully: their host copy is fresh, lift the quarantine."""
        if self.quarantined:
            fresh = {bytes(key) for key in keys}
            with self._lock:
                self.quarantined.difference_update(fresh)
                # A fresh chunk that goes bad again is logged again.
                self._logged.difference_update(fresh)

    def quarantine(self, manager: Any, keys: Iterable[bytes]) -> None:
        """Keep ``keys`` out of every tier's lookups, drop their host chunks (now, or
        once the loads still reading them finished) and remove their tiers' bad files."""
        keys = [bytes(key) for key in keys]
        with self._lock:
            fresh = len(set(keys) - self.quarantined)
            self.quarantined.update(keys)
            self._pending_drops.update(keys)
        if fresh:
            self.counters.add(KEYS_QUARANTINED, fresh, tier=HOST_TIER)
        self.drop_pending(manager)
        self.repair_tiers(keys)

    def drop_pending(self, manager: Any) -> None:
        if self._pending_drops:
            with self._lock:
                self._pending_drops = drop_host_chunks(manager, self._pending_drops)

    # ---------------------------------------------------------------- promotions

    def promotion_problem(self, chunk: int, key: bytes) -> str | None:
        """Why host chunk ``chunk`` (just written by a secondary tier) is not ``key``'s."""
        rows = self.region_rows
        if rows is None or self.digest is None:
            return None
        # Headers only (64 bytes a page, no payload byte): the scheduler's thread is never
        # held by a checksum; the worker's load checks the payload where its bytes move,
        # and fails the chunk before any of it counts as loaded.
        return self.row_problem(rows[chunk], key, check_payload=False)

    def row_problem(self, row: np.ndarray, key: bytes, *, check_payload: bool) -> str | None:
        """Why the uint8 ``row`` is not ``key``'s chunk in this configuration: every
        page's seal (the row layout digest, a worker fact, is not checked)."""
        assert self.digest is not None
        chunk_digest = key_digest(key, self.seal_key)
        for page_index in range(self.page_count):
            start = page_index * self.page_bytes
            fmt = SealFormat(self.digest, bytes(8), page_index, self.page_count)
            problem = seal_problem(
                row[start : start + self.page_bytes],
                fmt,
                chunk_digest,
                check_layout=False,
                check_payload=check_payload,
                seal_key=self.seal_key,
            )
            if problem is not None:
                return f"page {page_index}: {problem}"
        return None

    def tier_file_problem(self, key: bytes) -> Any:
        """The verdict on a tier's file of ``key``'s chunk (its first row's bytes): short,
        or a page whose seal, key, configuration or payload checksum fails. A keyed file
        judged by an engine without a seal key is no verdict (None): the engines holding
        the key own it, and one misconfigured engine must not empty their tier."""

        def problem(data: bytes) -> str | None:
            if len(data) < self._row_stride:
                return f"{len(data)} of {self._row_stride} bytes"
            row = np.frombuffer(data, dtype=np.uint8, count=self._row_stride)
            found = self.row_problem(row, key, check_payload=True)
            if found is not None and refusal_reason(found) == "keyed":
                return None
            return found

        return problem

    def repair_tiers(self, keys: Iterable[bytes]) -> None:
        """Remove the refused ``keys``' files from the watched fs tiers where the file's
        own bytes fail the check, so the next store of a key writes a good one (vLLM's fs
        tier skips a key whose file exists). Without seals no file can be judged and none
        is removed; obj and p2p tiers keep theirs (see :mod:`tier_repair`)."""
        if self.digest is None or self._row_stride < 1:
            return
        for tier in self._tiers:
            folder = fs_chunk_folder(tier)
            if folder is None:
                continue
            for key in keys:
                path = fs_chunk_file(tier, key)
                try:
                    outcome = remove_refused_file(
                        path, folder, self._row_stride, self.tier_file_problem(key)
                    )
                except (OSError, ValueError) as error:
                    logger.warning(
                        "triton_offload: refused chunk %s's file %s in secondary tier %r "
                        "is kept: %s",
                        key.hex(),
                        path,
                        tier.tier_type,
                        error,
                    )
                    continue
                if outcome is RemovalOutcome.REMOVED:
                    with self._lock:
                        self.tier_files_removed += 1
                    logger.warning(
                        "triton_offload: removed refused chunk %s's file %s from secondary "
                        "tier %r: the next store of the key writes it again",
                        key.hex(),
                        path,
                        tier.tier_type,
                    )
                elif outcome in (RemovalOutcome.LINK_ON_THE_WAY, RemovalOutcome.NOT_A_FILE):
                    # Someone put a link or a folder where vLLM's fs tier keeps files: the
                    # operator must know (the chunk stays quarantined here all the same).
                    logger.warning(
                        "triton_offload: refused chunk %s's file %s in secondary tier %r is %s",
                        key.hex(),
                        path,
                        tier.tier_type,
                        outcome.value,
                    )

    def watch_tier(self, manager: Any, tier: Any) -> None:
        """Check every chunk ``tier`` promotes into the host region before it counts, and
        answer MISS for quarantined keys in ``tier``'s lookups."""
        if getattr(tier, "_triton_watched", False):
            return
        self._tiers.append(tier)
        lookup = tier.lookup
        get_finished_jobs = tier.get_finished_jobs
        guard = self
        miss = LookupResult.MISS

        def guarded_lookup(key: Any, req_context: Any) -> Any:
            if guard.is_quarantined(key):
                return miss
            return lookup(key, req_context)

        def checked_finished_jobs() -> Any:
            results = list(get_finished_jobs())
            return [guard._checked_promotion(manager, tier, result) for result in results]

        tier.lookup = guarded_lookup
        tier.get_finished_jobs = checked_finished_jobs
        tier._triton_watched = True

    def _checked_promotion(self, manager: Any, tier: Any, result: Any) -> Any:
        """The tier's result for a finished job, with every promoted chunk checked: a
        chunk whose seal fails is taken out of the job's successful keys (vLLM's tiering
        manager then frees it) and quarantined. With seals, a key of a job the tier
        reported failed as a whole (a short read of another file) whose row verifies is
        kept: its bytes are provably the chunk's."""
        job = manager._jobs.get(result.job_id)
        if job is None or not job.transfer_job.is_promotion:
            return result
        transfer = job.transfer_job
        keys = [bytes(key) for key in transfer.keys]
        chunk_of = dict(zip(keys, (int(c) for c in transfer.chunk_ids), strict=True))
        tier_name = str(tier.tier_type)
        where = f"secondary tier {tier_name!r}"
        reported = keys if result.success else [bytes(k) for k in result.successful_keys or ()]
        read = set(reported)
        unread = [key for key in keys if key not in read]
        candidates = list(reported)
        if self.digest is not None:
            # What the tier did write may still be whole: the seal says.
            candidates += unread
        good, bad, lost = [], [], []
        for key in candidates:
            problem = self.promotion_problem(chunk_of[key], key)
            if problem is None:
                good.append(key)
            elif key in unread:
                lost.append(key)
                self.report(key, where, f"the tier failed to read it ({problem})")
            else:
                bad.append(key)
                self.report(key, where, problem)
                self.counters.add(CHUNKS_REFUSED, reason=refusal_reason(problem), tier=tier_name)
        if self.digest is None:
            lost = unread
            for key in lost:
                self.report(key, where, "the tier failed to read it")
        if lost:
            self.counters.add(CHUNKS_REFUSED, len(lost), reason="read", tier=tier_name)
        if bad or lost:
            # Quarantined: the tier's lookup would offer them again at once, and a
            # request waiting on them would loop.
            with self._lock:
                fresh = len({*bad, *lost} - self.quarantined)
                self.quarantined.update(bad)
                self.quarantined.update(lost)
            if fresh:
                self.counters.add(KEYS_QUARANTINED, fresh, tier=tier_name)
            self.repair_tiers(bad + lost)
        self.promotions_refused += len(bad)
        if not bad and not lost:
            return dataclasses.replace(result, success=True, successful_keys=None)
        kept = set(good)
        return dataclasses.replace(
            result,
            success=False,
            successful_keys=[key for key in transfer.keys if bytes(key) in kept],
        )


def drop_host_chunks(manager: Any, keys: set[bytes]) -> set[bytes]:
    """Remove ``keys``' ready, unused chunks from the host tier (as an eviction would,
    with vLLM's removal event); returns the keys still being read (dropped later)."""
    cpu = host_manager(manager)
    if cpu is None:
        return set()
    waiting: set[bytes] = set()
    removed = []
    for key in keys:
        offload_key = OffloadKey(key)
        chunk = cpu._policy.get(offload_key)
        if chunk is None:
            continue
        if not chunk.is_ready or chunk.ref_cnt != 0:
            waiting.add(key)
            continue
        cpu._policy.remove(offload_key)
        cpu._free_chunk(chunk)
        cpu._num_evictable_cache_chunks -= 1
        removed.append(offload_key)
    if removed and cpu.events is not None:
        cpu.events.append(OffloadingEvent(keys=removed, medium=cpu.medium, removed=True))
    return waiting


def region_rows(memory: memoryview | None, num_chunks: int, row_stride: int) -> np.ndarray | None:
    """uint8 ``[num_chunks, row_stride]`` over the scheduler's view of the host region."""
    if memory is None or num_chunks < 1:
        return None
    rows = np.asarray(memory).view(np.uint8)
    return rows.reshape(-1)[: num_chunks * row_stride].reshape(num_chunks, row_stride)


__all__ = [
    "SEAL_BYTES",
    "VERIFY_KEY",
    "ChunkGuard",
    "KeyedCPULoadStoreSpec",
    "TritonWorkerMetadata",
    "config_description",
    "config_digest",
    "drop_host_chunks",
    "give_keys_to_specs",
    "host_manager",
    "region_rows",
    "spec_keys",
]
