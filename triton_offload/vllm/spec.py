"""``TritonOffloadingSpec`` and ``TritonTieringOffloadingSpec``: this backend as vLLM specs.

Backends for vLLM's ``OffloadingConnector``. Select one with ``kv_connector_extra_config
= {"spec_name": "TritonOffloadingSpec" (or "TritonTieringOffloadingSpec"),
"spec_module_path": "triton_offload.vllm", "cpu_bytes_to_use": ...}`` (the module path
may be left out once this package is installed: its ``vllm.general_plugins`` entry
point, :func:`register`, registers both names with vLLM's spec factory).

Supported: vLLM ``>=0.33,<0.35`` (the ``OffloadingSpec`` API of vllm 0.33 and 0.34: an
``OffloadingConfig`` in the constructor, ``CanonicalKVCaches`` in ``get_worker``,
explicit ``submit_store`` / ``submit_load``, which take GPU block ids on 0.33 and
``DevicePointers`` on 0.34 when vLLM's own connector worker calls them). Another version,
or a build whose offloading module lacks one of the names used here, raises
:class:`UnsupportedVLLMError` naming the version found and the supported range.

Scheduler side: the spec *is* vLLM's ``CPUOffloadingSpec`` (or ``TieringOffloadingSpec``,
with its ``secondary_tiers``) for everything the scheduler sees: its manager, chunk
count, metrics and keys, so the host chunk ids handed out are vLLM's own. Worker side:
``get_worker`` maps vLLM's ``SharedOffloadRegion`` with the arguments vLLM's spec
passes (:mod:`triton_offload.vllm.region`), page-locks this worker's part on CUDA, turns
vLLM's ``CanonicalKVCaches`` into this project's byte planes and returns a
:class:`TritonOffloadingWorker` whose :class:`~triton_offload.engine.TransferEngine`
uses the worker's pages of the region as its row-strided pool. Its log line says how
many bytes were mapped and locked and how long each took.

Decisions a user of vLLM's CPU spec would ask about:

- The region is used on every platform (vLLM's CPU spec uses it only on CUDA and XPU),
  so the single-copy ``replicated_layout`` holds everywhere and the chunk count is the
  one vLLM's CPU spec computes on its region: one copy per chunk for replicated (MLA)
  pages, else one per worker.
- Under ``replicated_layout`` only rank 0 copies stores (the rank vLLM's connector
  elects); another rank given a store reports it once the region's store ledger says
  rank 0's copy finished (protocol and ordering in ``triton_offload.vllm_region``).
  Every rank loads from the one copy.
- An attention-free config (no group) builds, counts capacity as vLLM's CPU spec does
  and gives a worker that maps and moves nothing. A group without layers on this
  worker's pipeline stage is an engine group without planes: its chunk ids are checked,
  nothing of it moves.
- ``canonical_layout``: ``TritonTieringOffloadingSpec`` honours it exactly where vLLM's
  tiering spec does. Host rows then hold stock vLLM's canonical bytes (every ref's
  ``CopyRun`` fragments become fragment planes, :mod:`triton_offload.vllm.canonical`),
  every rank writes the canonical pages it is the writer of (vLLM's rotation), loads
  read whole pages, ``spec.stock_rows`` is True and storage names are vLLM's own, so
  stock vLLM instances, other TP sizes (where vLLM certifies every layer) and KVCR
  peers share chunks with it. It fails closed where vLLM does: a ref without a mapping
  (pipeline parallelism, a packed cross-layer tensor) or, with a parallelism-agnostic
  namespace, a layer whose canonical bytes are not portable: ValueError naming the
  layer. ``TritonOffloadingSpec`` refuses the flag (vLLM's CPU spec silently ignores
  it; refusing keeps a user from believing rows are canonical when they are not).
- Without ``canonical_layout`` the tiering spec's fs, obj and p2p tiers file chunks
  under a name that carries this layout (:func:`storage_layout_tag` plus the plane
  arrangement every worker publishes when it registers its caches) and the checkpoint
  (:mod:`triton_offload.vllm.checkpoint`, also in the seals' configuration digest), so
  they never exchange chunks with stock vLLM, another geometry or another checkpoint
  served under the same model name; the KVCR tier, which cannot be so
  named, is refused. Where the rows provably are vLLM's CPU worker's bytes (verification
  off, one plane per cache tensor at vLLM's offsets: every worker says so), the names
  are vLLM's own and stock instances share the chunks.
- ``verify_chunks`` (default on): each worker page ends with a 64-byte seal (payload
  CRC-32, key, configuration and row-layout digests) written after a store's copy and
  checked before a load and before a promoted chunk counts; the page, and so the chunk
  count, is vLLM's plus the seal (:mod:`triton_offload.vllm.integrity`).

Importing this module imports vLLM's offloading modules, after the version check of
:mod:`triton_offload.vllm.compat`; ``triton_offload.vllm`` imports it on first use of a
class name, so the plugin stays cheap.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from triton_offload import __version__
from triton_offload.transfer.engine import TransferEngine
from triton_offload.transfer.layout import CacheLayout, build_layout
from triton_offload.transfer.pointers import device_planes
from triton_offload.transfer.pool import cuda_api
from triton_offload.transfer.seal import (
    SEAL_BYTES,
    PageSealer,
    SealFormat,
    digest8,
    layout_description,
)
from triton_offload.transfer.selection import describe_paths
from triton_offload.vllm.canonical import canonical_cache_layout
from triton_offload.vllm.capacity import ChunkRow, no_chunk_message
from triton_offload.vllm.checkpoint import SERVED_REVISION, checkpoint_identity
from triton_offload.vllm.compat import (
    SPEC_NAME,
    TIERING_SPEC_NAME,
    logger,
    supported_vllm_api,
)
from triton_offload.vllm.convert import caches_from_canonical, plan_from_offloading_config
from triton_offload.vllm.fs_writes import use_unique_temporary_names
from triton_offload.vllm.integrity import (
    ChunkGuard,
    config_digest,
    give_keys_to_specs,
    host_manager,
)
from triton_offload.vllm.internals import check_vllm_internals
from triton_offload.vllm.options import (
    EngineOptions,
    check_canonical_layout,
    check_extra_config,
)
from triton_offload.vllm.planning import warn_stock_lookup_hazards
from triton_offload.vllm.region import (
    RegionPlan,
    StoreLedger,
    canonical_pool_view,
    create_worker_region,
    default_barrier,
    lock_worker_pages,
    release_region,
    unlink_region_once_mapped,
    worker_pool_view,
)
from triton_offload.vllm.releases import RELEASE
from triton_offload.vllm.tiers import (
    OWN_ROWS,
    PLANES_UNPUBLISHED,
    STOCK_ROWS,
    layout_note_path,
    notes_are_stock,
    plane_notes,
    planes_tag,
    publish_planes,
    rows_are_stock,
    storage_layout_tag,
    withdraw_planes,
)
from triton_offload.vllm.worker import TritonOffloadingWorker

with supported_vllm_api():
    from vllm.platforms import current_platform
    from vllm.v1.kv_offload.base import CanonicalKVCaches
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

check_vllm_internals()


@dataclasses.dataclass(frozen=True)
class _MappedWorker:
    """What :meth:`TritonWorkerSide._map_worker` set up for one worker."""

    region: Any
    ledger: StoreLedger | None
    engine: Any
    sealer: PageSealer | None
    cuda_api: Any
    locked_bytes: int
    map_seconds: float
    lock_seconds: float


class TritonWorkerSide:
    """The worker side shared by both specs: vLLM's region, this project's engine."""

    #: Barrier the region's workers meet at (None: vLLM's all-workers barrier when
    #: its process groups exist, else none). Tests set a multiprocessing barrier.
    region_barrier: Any = None
    #: Create the region as vLLM's tiering spec does (shared with the scheduler).
    _tiering_region = False
    #: Whether this spec honours vLLM's ``canonical_layout`` (its tiering spec does).
    _honours_canonical_layout = False
    #: True when the host rows are stock vLLM's bytes (``canonical_layout``): no byte of
    #: this project's own (row layout, integrity records) may be added to them.
    stock_rows = False

    config: Any
    extra_config: Any
    num_chunks: int
    blocks_per_chunk: int
    replicated_layout: bool

    def __init__(self, config: Any) -> None:
        if current_platform.is_rocm():
            # vLLM's CPU spec keeps a private per-rank buffer on ROCm instead of the
            # shared region; this backend's pool is that region and its DMA path calls
            # the CUDA driver, so it does not run there.
            raise ValueError(
                f"{type(self).__name__} does not support ROCm: its host pool is vLLM's "
                "shared region, which vLLM does not use on ROCm, and its copy paths are "
                "CUDA's; use vLLM's CPUOffloadingSpec on ROCm"
            )
        extra = config.extra_config
        # The same checks TritonOffloadingConnector ran before the model loaded: here
        # for vLLM's plain OffloadingConnector, which calls in only now.
        spec_name = TIERING_SPEC_NAME if self._tiering_region else SPEC_NAME
        check_extra_config(extra, spec_name)
        check_canonical_layout({"canonical_layout": config.canonical_layout}, spec_name)
        # vLLM's tiering spec follows the config's flag (set from the extra config).
        self.stock_rows = bool(config.canonical_layout)
        #: Set by the canonical worker as vLLM's tiering spec sets it: whether every
        #: layer's canonical bytes are parallelism-agnostic.
        self.all_layers_portable: bool | None = None
        self.engine_options = EngineOptions.from_extra_config(extra)
        super().__init__(config)  # type: ignore[call-arg]
        #: Pages end with a seal (chunk verification on): see triton_offload.vllm.integrity.
        #: Stock vLLM's rows (canonical_layout) carry none: they are shared byte for byte
        #: with instances that write no seal, so no byte may be added to them.
        self.sealed_pages = self.engine_options.verify_chunks and not self.stock_rows
        #: The seal key (seal_key_file): seals carry its tags, only its seals load.
        self.seal_key = self.engine_options.seal_key() if self.sealed_pages else None
        #: (chunks, row bytes) vLLM's CPU spec would have without the seals (seal_note).
        self._unsealed: tuple[int, int] | None = None
        if self.sealed_pages:
            self._add_seal_room()
        # The chunk's bytes are known from here on (vLLM's cache geometry): the scheduler
        # and every worker refuse a capacity that holds none, before anything is mapped.
        self._check_capacity()
        #: The checkpoint served: one model name may serve other weights over time, and
        #: vLLM's names and keys carry only the name (triton_offload.vllm.checkpoint).
        self.model_revision = SERVED_REVISION.get()
        self.checkpoint = checkpoint_identity(
            config.model.name, self.engine_options.checkpoint_id, self.model_revision
        )
        self._log_checkpoint()
        # What the scheduler and every worker agree a chunk's bytes mean (the seals'
        # config digest): the config-level layout tag, the checkpoint and the model's own
        # dtype, fixed here, before the tiering spec tags the dtype with the planes.
        self._seal_config = config_digest(
            self, storage_layout_tag(self), self.checkpoint.description
        )
        self._planes_note: str | None = None
        # An attention-free model has no group: nothing to plan or move.
        self.plan = plan_from_offloading_config(config) if config.groups else None
        self._triton_manager: Any = None
        self._triton_worker: Any = None

    def _add_seal_room(self) -> None:
        """Grow each worker's page by the seal, and recount the chunks as vLLM's CPU
        spec counts them (row = pages rounded up to the region's alignment)."""
        config = self.config
        world = int(config.parallel.world_size)
        if config.worker_kv_bytes_per_block <= 0 or world <= 0:
            return
        copies = 1 if self.replicated_layout else world
        page = int(self.cpu_page_size_per_worker) + SEAL_BYTES
        alignment = int(self.BLOCK_SIZE_ALIGNMENT)
        # A row that already has 64 bytes of alignment slack per page keeps its size:
        # the seals then cost no byte of capacity.
        row = -(-page * copies // alignment) * alignment
        unsealed_row, unsealed_chunks = int(self.kv_bytes_per_chunk), int(self.num_chunks)
        self.cpu_page_size_per_worker = page
        self.kv_bytes_per_chunk = row
        self.num_chunks = int(self.extra_config["cpu_bytes_to_use"]) // row
        self.cpu_info = CPUOffloadingInfo.from_config(config, self.num_chunks, row)
        # Stated in the start-up lines (seal_note): small pages pay most (a 64-byte seal
        # per worker page, the row rounded up to the region's alignment).
        self._unsealed = (unsealed_chunks, unsealed_row)

    def seal_note(self) -> str:
        """Seals on or off and what they cost in chunks, for the start-up lines."""
        if not self.sealed_pages:
            why = "canonical_layout: stock rows" if self.stock_rows else "verify_chunks=false"
            return f"seals off ({why})"
        keyed = " keyed" if self.seal_key is not None else ""
        if self._unsealed is None:
            return f"seals on{keyed}"
        unsealed_chunks, unsealed_row = self._unsealed
        cost = 1 - self.num_chunks / unsealed_chunks if unsealed_chunks else 0.0
        return (
            f"seals on{keyed} ({SEAL_BYTES} B per worker page): {self.num_chunks} chunks fit "
            f"instead of {unsealed_chunks} ({100 * cost:.1f}% fewer, rows of "
            f"{int(self.kv_bytes_per_chunk)} B instead of {unsealed_row})"
            + ("; verify_chunks=false gives them back" if cost > 0 else "")
        )

    def _log_checkpoint(self) -> None:
        """The checkpoint's identity and where it came from, once per spec (scheduler and
        each worker: a node whose files differ shows here)."""
        checkpoint, name = self.checkpoint, type(self).__name__
        if checkpoint.value is None:
            logger.warning(
                "%s (triton_offload): no identity for the checkpoint of model %r (%s): its "
                "chunks are known by the model name only, as stock vLLM knows them, so "
                "another checkpoint served under this name could be handed them; set "
                "kv_connector_extra_config['checkpoint_id']",
                name,
                self.config.model.name,
                checkpoint.detail,
            )
            return
        if self.stock_rows:
            # Stock vLLM's names carry no checkpoint (that is what lets stock instances
            # share the rows), and stock rows carry no seal: nothing here can tell two
            # checkpoints served under one model name apart.
            logger.warning(
                "%s (triton_offload): checkpoint %s is not part of canonical_layout's "
                "chunk names (stock vLLM's, with no seal): another checkpoint served under "
                "model name %r and sharing these tiers is handed this checkpoint's chunks "
                "(wrong KV, wrong tokens); give each checkpoint its own model path or its "
                "own tier roots",
                name,
                checkpoint.value,
                self.config.model.name,
            )
            return
        if self.sealed_pages:
            where = "in every chunk seal's configuration digest" + (
                " and the tiers' storage names" if self._tiering_region else ""
            )
        else:
            where = (
                "chunk seals are off (verify_chunks=false): in the tiers' storage names "
                "only, and not where the rows prove stock vLLM's (vLLM's names)"
            )
        logger.info(
            "%s (triton_offload): checkpoint %s, from %s (%s); %s",
            name,
            checkpoint.value,
            checkpoint.source,
            checkpoint.detail,
            where,
        )

    def seal_config_digest(self) -> bytes:
        """The configuration digest every page seal of this spec carries."""
        return self._seal_config

    def _uses_shared_region(self) -> bool:
        # vLLM's shared region on every platform this backend runs on (CUDA, and the CPU
        # path), so the single-copy layout for replicated (MLA) pages holds everywhere,
        # as in vLLM's tiering spec. ROCm, where vLLM keeps a private buffer per rank,
        # is refused in __init__.
        return True

    def get_manager(self) -> Any:
        first = self._triton_manager is None
        layout_tag = getattr(self, "storage_layout", None)
        if first and layout_tag and layout_tag.endswith(PLANES_UNPUBLISHED):
            logger.warning(
                "%s: no worker of engine %s published its planes before the scheduler "
                "named the tiers' storage (%s): another plane arrangement of this config "
                "may share it (its chunks are refused at load by their seals)",
                type(self).__name__,
                self.config.engine_id,
                layout_tag,
            )
        manager = self._triton_manager = super().get_manager()  # type: ignore[misc]
        if first:
            self._guard_manager(manager)
        if first and self._tiering_region:
            # Mapped by every worker and now by the scheduler: unlinked, the region
            # cannot outlive a killed engine in /dev/shm (vLLM keeps it linked until its
            # creating worker shuts down).
            engine_id = str(self.config.engine_id)
            notes = [
                layout_note_path(engine_id, rank)
                for rank in range(max(1, int(self.config.parallel.world_size)))
            ]
            if unlink_region_once_mapped(engine_id, notes):
                logger.info(
                    "%s (triton_offload): region of engine %s unlinked from /dev/shm once "
                    "every worker and the scheduler mapped it",
                    type(self).__name__,
                    engine_id,
                )
        if first:
            warn_stock_lookup_hazards(self.config)
            logger.info(
                "%s (triton_offload): scheduler uses vLLM's %s, %d host chunks "
                "of %d blocks (%d bytes each, %s), eviction_policy=%s; %s",
                type(self).__name__,
                type(manager).__name__,
                self.num_chunks,
                self.blocks_per_chunk,
                getattr(self, "kv_bytes_per_chunk", 0),
                "one copy per chunk" if self.replicated_layout else "one page per worker",
                getattr(self, "eviction_policy", "lru"),
                self.seal_note(),
            )
        return manager

    def _guard_manager(self, manager: Any) -> None:
        """A ``ChunkGuard`` on the manager (``manager.triton_guard``) holds the quarantine
        the connector and the tier hooks share: a key a tier failed to read, or whose
        chunk failed verification, is a miss until it is stored again. With sealed
        pages the host specs carry their keys and promoted chunks are checked; without
        (verification off, or stock rows) only the tiers' own failures are caught."""
        if self.sealed_pages:
            give_keys_to_specs(manager)
        primary = host_manager(manager)
        memory = None
        if primary is not None and hasattr(primary, "get_kv_memoryview"):
            memory = primary.get_kv_memoryview()
        guard = ChunkGuard(
            region=memory,
            num_chunks=int(self.num_chunks),
            row_stride=int(self.kv_bytes_per_chunk),
            page_bytes=int(self.cpu_page_size_per_worker),
            page_count=1 if self.replicated_layout else int(self.config.parallel.world_size),
            digest=self.seal_config_digest() if self.sealed_pages else None,
            seal_key=self.seal_key,
        )
        for tier in getattr(manager, "secondary_tiers", ()):
            guard.watch_tier(manager, tier)
        manager.triton_guard = guard

    #: Set by ``TritonOffloadingConnectorWorker`` before it asks for the worker: the one
    #: connector that reports a failed load instead of asserting (layer-wise loads
    #: need it).
    reports_failed_loads: bool = False

    def get_worker(self, kv_caches: Any) -> TritonOffloadingWorker:
        if self.engine_options.layerwise_loads and not self.reports_failed_loads:
            raise ValueError(
                "kv_connector_extra_config['layerwise_loads'] is true, but the connector "
                "is not TritonOffloadingConnector: vLLM's plain OffloadingConnector cannot "
                "report a failed layer-wise load (set kv_connector to "
                "TritonOffloadingConnector, or layerwise_loads to false)"
            )
        if self._triton_worker is None:
            self._triton_worker = self.create_worker(kv_caches)
        return self._triton_worker

    def _stage_layout(
        self, caches: list[list[torch.Tensor]], region_plan: RegionPlan
    ) -> CacheLayout:
        """The row layout of every group (those without layers here included: the engine
        moves nothing for an empty group and still checks its host chunk ids), checked
        against the worker's share of vLLM's chunk."""
        layout = build_layout(
            caches, num_groups=len(caches), blocks_per_chunk=self.blocks_per_chunk
        )
        room = region_plan.cpu_page_size - (SEAL_BYTES if self.sealed_pages else 0)
        if layout.row_bytes > room:
            raise ValueError(
                f"a host chunk of this worker's caches needs {layout.row_bytes} bytes "
                f"(largest group row, planes 16-byte aligned) but vLLM's chunk gives "
                f"each worker {room} bytes "
                f"(worker_kv_bytes_per_block {self.config.worker_kv_bytes_per_block} "
                f"x {self.blocks_per_chunk} blocks)"
            )
        return layout

    def _new_engine(
        self,
        caches: list[list[torch.Tensor]] | CacheLayout,
        pool: torch.Tensor,
        region_plan: RegionPlan,
        *,
        shared_rows: bool,
    ) -> TransferEngine:
        """The engine on ``pool`` (this worker's row-strided part of the region), with the
        extra config's options. ``shared_rows``: every rank addresses the same rows (the
        single-copy layout, canonical pages), so each calibrates on its own slice of them
        and the ranks' start-up measurements neither collide nor disturb one another."""
        options = self.engine_options
        world = region_plan.world_size
        return TransferEngine(
            self.plan,
            caches,
            self.num_chunks,
            pool=pool,
            backend=options.backend,
            num_programs=options.num_programs,
            crossover=options.crossover,
            # Sealed pages: every job's page checksums are computed where it moves them.
            page_checksums=self.sealed_pages,
            seal_key=self.seal_key,
            calibration_rows=(
                (region_plan.rank, world)
                if shared_rows and 1 < world <= self.num_chunks
                else (0, 1)
            ),
        )

    def _check_tiers_on_one_node(self) -> None:
        """Where vLLM's tiering spec refuses secondary tiers on workers spanning nodes (the
        tiers run in the engine core and read only its node's region), so does this one,
        before any mapping (``RELEASE.check_workers_on_one_node``: a collective)."""
        if (
            self._tiering_region
            and self.extra_config.get("secondary_tiers")
            and int(self.config.parallel.world_size) > 1
        ):
            RELEASE.check_workers_on_one_node()

    def create_worker(self, kv_caches: Any) -> TritonOffloadingWorker:
        self._check_tiers_on_one_node()
        num_groups = self._checked_caches(kv_caches)
        if num_groups == 0 or self.config.worker_kv_bytes_per_block == 0:
            return self._worker_without_bytes(kv_caches, num_groups)
        self._check_capacity()
        if self.stock_rows:
            return self._canonical_worker(kv_caches)
        caches = caches_from_canonical(kv_caches)
        stage = tuple(g for g, layers in enumerate(caches) if layers)
        region_plan = RegionPlan.from_spec(self)
        layout = self._stage_layout(caches, region_plan) if stage else None
        # Every worker reaches the same barriers in the same order (the region's,
        # then the ledger's), whatever its stage holds.
        barrier = None
        if not self._tiering_region:
            barrier = self.region_barrier or default_barrier()
        planes_note = self._planes_note_for(kv_caches, layout)
        mapped = self._map_worker(caches, layout, region_plan, barrier, planes_note)
        self._log_worker_start(mapped, region_plan, stage, num_groups)
        return TritonOffloadingWorker(
            mapped.engine,
            num_groups=num_groups,
            stage_groups=stage,
            blocks_per_chunk=self.blocks_per_chunk,
            num_chunks=self.num_chunks,
            region=mapped.region,
            writer=region_plan.writer,
            ledger=mapped.ledger,
            cuda_api=mapped.cuda_api,
            replicated_store_timeout_s=self.engine_options.replicated_store_timeout_s,
            sealer=mapped.sealer,
            planes_note=self._planes_note,
            device_planes=device_planes(kv_caches),
        )

    def _checked_caches(self, kv_caches: Any) -> int:
        """The number of offloaded groups, once ``kv_caches`` is vLLM's canonical caches
        with one list of refs per group of the config."""
        if not isinstance(kv_caches, CanonicalKVCaches):
            raise TypeError(
                f"get_worker needs vLLM's CanonicalKVCaches, got {type(kv_caches).__name__}"
            )
        num_groups = len(self.config.groups)
        if len(kv_caches.group_data_refs) != num_groups:
            raise ValueError(
                f"kv_caches has {len(kv_caches.group_data_refs)} groups of refs but the "
                f"OffloadingConfig has {num_groups} groups"
            )
        return num_groups

    def _worker_without_bytes(self, kv_caches: Any, num_groups: int) -> TritonOffloadingWorker:
        """A worker with nothing to move (vLLM's CPU spec counts no chunk and still builds
        a worker here): no host memory mapped."""
        logger.info(
            "%s (triton_offload %s): worker rank %d has no KV cache bytes to offload "
            "(%s): no host memory mapped",
            type(self).__name__,
            __version__,
            int(self.config.parallel.rank),
            "attention-free model" if num_groups == 0 else "worker_kv_bytes_per_block 0",
        )
        return TritonOffloadingWorker(
            None,
            num_groups=num_groups,
            stage_groups=(),
            blocks_per_chunk=self.blocks_per_chunk,
            num_chunks=self.num_chunks,
            device_planes=device_planes(kv_caches),
        )

    def _check_capacity(self) -> None:
        """ValueError when ``cpu_bytes_to_use`` holds no chunk, naming the least that
        holds one: a chunk row as the region lays it out (every worker's page, seals
        included, rounded up to the region's alignment)."""
        if self.num_chunks >= 1 or self.config.worker_kv_bytes_per_block <= 0:
            return  # a worker without KV bytes maps nothing (vLLM counts no chunk there)
        row = ChunkRow(
            copies=1 if self.replicated_layout else int(self.config.parallel.world_size),
            blocks_per_chunk=int(self.blocks_per_chunk),
            block_bytes=int(self.config.worker_kv_bytes_per_block),
            sealed=self.sealed_pages,
            alignment=int(self.BLOCK_SIZE_ALIGNMENT),
        )
        assert row.row_bytes == self.kv_bytes_per_chunk, (row, self.kv_bytes_per_chunk)
        raise ValueError(no_chunk_message(self.extra_config.get("cpu_bytes_to_use"), row))

    def _planes_note_for(self, kv_caches: Any, layout: CacheLayout | None) -> str | None:
        """Under the tiering spec, this worker's planes as the scheduler names the tiers'
        storage after them (it starts after the workers in vLLM's engine): two plane
        arrangements of one config never share a folder, a key prefix or a peer."""
        if not self._tiering_region:
            return None
        planes = [] if layout is None else layout.planes
        stock = not self.sealed_pages and rows_are_stock(
            [int(t.page_size_bytes) for t in kv_caches.tensors],
            [
                (int(ref.tensor_idx), int(ref.page_size_bytes))
                for refs in kv_caches.group_data_refs
                for ref in refs
            ],
            [(p.pool_offset, p.page_bytes) for p in planes],
            self.blocks_per_chunk,
        )
        return (
            (STOCK_ROWS if stock else OWN_ROWS)
            + "\n"
            + layout_description(planes, self.blocks_per_chunk)
        )

    def _map_worker(
        self,
        caches: Any,
        layout: CacheLayout | None,
        region_plan: RegionPlan,
        barrier: Any,
        planes_note: str | None,
    ) -> _MappedWorker:
        """The region mapped (and its ledger, its page lock, the engine over it and the
        sealer): all of it, or nothing left behind when a step fails."""
        started = time.perf_counter()
        region = create_worker_region(region_plan, barrier=barrier, tiering=self._tiering_region)
        ledger = None
        engine = None
        locked = 0
        api_used = None
        try:
            if planes_note is not None:
                # Published once this worker holds the region (a start-up that fails
                # before leaves no note; the except below withdraws a later failure's).
                rank = int(self.config.parallel.rank)
                self._planes_note = publish_planes(str(self.config.engine_id), rank, planes_note)
            if region_plan.replicated and region_plan.world_size > 1:
                ledger = StoreLedger(region_plan.engine_id, region_plan.num_chunks, barrier)
            mapped = time.perf_counter()
            if layout is not None and layout.device.type == "cuda":
                api_used = cuda_api()
                with torch.cuda.device(layout.device):
                    locked = lock_worker_pages(region, region_plan, api_used)
            ready = time.perf_counter()
            if layout is not None:
                engine = self._new_engine(
                    caches,
                    worker_pool_view(region, region_plan)[:, : layout.row_bytes],
                    region_plan,
                    shared_rows=region_plan.replicated,
                )
            sealer = self._sealer(engine, region, region_plan)
        except BaseException:
            if ledger is not None:
                ledger.close()
            release_region(region, api_used)
            withdraw_planes(self._planes_note)
            raise
        return _MappedWorker(
            region, ledger, engine, sealer, api_used, locked, mapped - started, ready - mapped
        )

    def _log_worker_start(
        self,
        mapped: _MappedWorker,
        region_plan: RegionPlan,
        stage: tuple[int, ...],
        num_groups: int,
    ) -> None:
        role = (
            "writes replicated chunks"
            if region_plan.replicated and region_plan.writer
            else "reads replicated chunks (rank 0 writes)"
            if region_plan.replicated
            else f"owns page {region_plan.slot} of each chunk"
        )
        engine = mapped.engine
        logger.info(
            "%s (triton_offload %s): worker rank %d %s; shared region %s: %d host chunks, "
            "row stride %d bytes, %d-byte pages; %.2f GiB mapped in %.3f s, %.2f GiB "
            "page-locked in %.3f s; %s; %s",
            type(self).__name__,
            __version__,
            int(self.config.parallel.rank),
            role,
            mapped.region.mmap_path,
            region_plan.num_chunks,
            region_plan.row_stride,
            region_plan.cpu_page_size,
            region_plan.total_bytes / (1 << 30),
            mapped.map_seconds,
            mapped.locked_bytes / (1 << 30),
            mapped.lock_seconds,
            "no layer of any group on this stage: nothing to move"
            if engine is None
            else f"offloads {len(engine.layout.planes)} planes of groups "
            f"{list(stage)} of {num_groups}, backend={engine.backend} "
            f"({describe_paths(engine.policy, engine.layout)}), "
            f"{engine.row_bytes}-byte rows on {engine.device}",
            self.seal_note(),
        )

    def _sealer(self, engine: Any, region: Any, region_plan: RegionPlan) -> PageSealer | None:
        """This worker's page sealer (None: verification off, or no engine)."""
        if not self.sealed_pages or engine is None:
            return None
        layout = engine.layout
        description = layout_description(layout.planes, self.blocks_per_chunk)
        fmt = SealFormat(
            self.seal_config_digest(),
            digest8(description),
            region_plan.slot,
            1 if region_plan.replicated else region_plan.world_size,
        )
        pages = worker_pool_view(region, region_plan).numpy()
        return PageSealer(pages, fmt, layout.group_row_bytes, self.seal_key)

    def _canonical_layout(self, kv_caches: Any, region_plan: RegionPlan) -> CacheLayout:
        """The fragment planes of vLLM's canonical pages, checked as vLLM's tiering spec
        checks the refs (fail closed) and against vLLM's row stride."""
        names = [group.layer_names for group in self.config.groups]
        layout = canonical_cache_layout(kv_caches, self.blocks_per_chunk, layer_names=names)
        portable = [
            (group, position)
            for group, refs in enumerate(kv_caches.group_data_refs)
            for position, ref in enumerate(refs)
            if not ref.mapping.parallelism_agnostic
        ]
        self.all_layers_portable = not portable
        if self.config.parallel.is_parallelism_agnostic and portable:
            group, position = portable[0]
            name = (names[group][position:] or ("?",))[0]
            raise ValueError(
                f"canonical_layout could not certify layer {name!r} (group {group}) as "
                "parallelism-agnostic, but the storage namespace is shared across "
                "topologies; remove canonical_layout from kv_connector_extra_config or "
                "disable parallel-agnostic secondary tiers"
            )
        if layout.row_bytes > region_plan.row_stride:
            raise ValueError(
                f"the canonical pages of a chunk need {layout.row_bytes} bytes but vLLM's "
                f"row stride (kv_bytes_per_chunk) is {region_plan.row_stride}"
            )
        return layout

    def _canonical_worker(self, kv_caches: Any) -> TritonOffloadingWorker:
        """``canonical_layout``: every rank addresses the canonical area of every row."""
        region_plan = RegionPlan.from_spec(self)
        layout = self._canonical_layout(kv_caches, region_plan)
        stage = tuple(g for g, refs in enumerate(kv_caches.group_data_refs) if refs)
        started = time.perf_counter()
        region = create_worker_region(region_plan, barrier=None, tiering=self._tiering_region)
        api_used = None
        locked = 0
        try:
            if layout.device.type == "cuda":
                api_used = cuda_api()
                with torch.cuda.device(layout.device):
                    locked = lock_worker_pages(region, region_plan, api_used)
            engine = self._new_engine(
                layout,
                canonical_pool_view(region, region_plan, layout.row_bytes),
                region_plan,
                shared_rows=True,  # every rank writes its share of every canonical row
            )
        except BaseException:
            release_region(region, api_used)
            raise
        logger.info(
            "%s (triton_offload %s): worker rank %d writes its share of vLLM's canonical "
            "pages (canonical_layout, all layers portable: %s); shared region %s: %d host "
            "chunks, row stride %d bytes, %d canonical bytes per row; %.2f GiB page-locked "
            "in %.3f s; offloads %d fragment planes of groups %s, backend=%s (%s); %s",
            type(self).__name__,
            __version__,
            region_plan.rank,
            self.all_layers_portable,
            region.mmap_path,
            region_plan.num_chunks,
            region_plan.row_stride,
            layout.row_bytes,
            locked / (1 << 30),
            time.perf_counter() - started,
            len(layout.planes),
            list(stage),
            engine.backend,
            describe_paths(engine.policy, engine.layout),
            self.seal_note(),
        )
        return TritonOffloadingWorker(
            engine,
            num_groups=len(self.config.groups),
            stage_groups=stage,
            blocks_per_chunk=self.blocks_per_chunk,
            num_chunks=self.num_chunks,
            region=region,
            writer=True,
            cuda_api=api_used,
            device_planes=device_planes(kv_caches),
        )


class TritonOffloadingSpec(TritonWorkerSide, CPUOffloadingSpec):  # type: ignore[misc]
    """vLLM's CPU offloading with this project's data path.

    The constructor is cheap and has no side effects (vLLM builds the spec in the
    scheduler and in every worker): it validates the extra config, computes the
    chunk count as vLLM's CPU spec does on its shared region (one copy per chunk
    under ``replicated_layout``) and plans the groups; nothing is allocated before
    ``get_worker``. ``get_manager`` is vLLM's CPU manager. ``canonical_layout`` is
    refused with a ValueError (vLLM's CPU spec ignores it; its rows here are this
    project's own layout).
    """


class TritonTieringOffloadingSpec(TritonWorkerSide, TieringOffloadingSpec):  # type: ignore[misc]
    """vLLM's tiering offloading (CPU primary tier + ``secondary_tiers``) with this
    project's data path between the GPU and the CPU tier.

    The scheduler side is vLLM's ``TieringOffloadingManager`` unchanged (its
    region, promotions and cascades to the fs, obj and p2p tiers); the worker maps
    the same region as vLLM's tiering worker does. Those tiers keep this spec's
    chunks apart from any other layout's: the KV dtype they hash into their storage
    name carries :func:`storage_layout_tag` (``self.storage_layout``), so a shared
    ``root_dir``, bucket prefix or peer never hands stock vLLM's chunks (or those
    of another page geometry or parallel layout) to these rows, nor these rows to
    them. The KVCR tier, which has no such name, is refused (ValueError).

    Under ``canonical_layout`` (accepted exactly where vLLM's tiering spec accepts it)
    the rows are stock vLLM's canonical bytes: ``stock_rows`` is True, the dtype is
    not tagged (``storage_layout`` is None), so every tier files chunks under vLLM's own
    names (with vLLM's canonical format id), and the KVCR tier is accepted.
    """

    _tiering_region = True
    _honours_canonical_layout = True
    storage_layout: str | None = None
    #: The default layout's rows proved stock vLLM's bytes (verification off, every
    #: worker's planes where vLLM's CPU worker puts them): vLLM's own storage names.
    shares_stock_rows = False

    def __init__(self, config: Any) -> None:
        # The secondary tiers are checked with the rest of the extra config, first thing
        # in TritonWorkerSide.__init__ (options.START_UP_CHECKS).
        # vLLM's fs tier would name its temporary files from the seeded random module:
        # engines of one seed would collide on them (triton_offload.vllm.fs_writes).
        use_unique_temporary_names()
        super().__init__(config)
        if self.stock_rows:
            return  # vLLM's bytes under vLLM's names: shared with stock instances
        notes = plane_notes(str(self.config.engine_id), int(self.config.parallel.world_size))
        if not self.sealed_pages and notes is not None and notes_are_stock(notes):
            # Every worker published rows that are vLLM's CPU worker's bytes (one plane
            # per cache tensor at vLLM's offsets, no seal): vLLM's own names, so stock
            # instances of the same configuration share these chunks.
            self.shares_stock_rows = True
            return
        # Every secondary tier that names its storage with vLLM's FileMapper (the
        # fs folder, the obj key prefix, the p2p peer fingerprint) hashes the
        # config's KV dtype: tagging it with this layout files these rows apart
        # from stock vLLM's chunks and from other geometries, in every such tier.
        # The plane part names the workers' published plane arrangement.
        # The checkpoint part keeps another checkpoint of the same model name apart.
        self.storage_layout = (
            f"{storage_layout_tag(self)}:{self.checkpoint.tag}:{planes_tag(notes)}"
        )
        model = self.config.model
        self.config = dataclasses.replace(
            self.config,
            model=dataclasses.replace(model, dtype=f"{model.dtype}+{self.storage_layout}"),
        )


__all__ = ["TritonOffloadingSpec", "TritonTieringOffloadingSpec", "TritonWorkerSide"]
