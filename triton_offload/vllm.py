"""vLLM integration: ``TritonOffloadingSpec`` and ``TritonTieringOffloadingSpec``.

Backends for vLLM's ``OffloadingConnector``. Select one with ``kv_connector_extra_config
= {"spec_name": "TritonOffloadingSpec" (or "TritonTieringOffloadingSpec"),
"spec_module_path": "triton_offload.vllm", "cpu_bytes_to_use": ...}`` (the module path
may be left out once this package is installed: its ``vllm.general_plugins`` entry
point, :func:`register`, registers both names with vLLM's spec factory).

Supported: vLLM ``>=0.33,<0.34`` (the ``OffloadingSpec`` API of vllm 0.33: an
``OffloadingConfig`` in the constructor, ``CanonicalKVCaches`` in ``get_worker``,
explicit ``submit_store`` / ``submit_load``). Another version, or a build whose
offloading module lacks one of the names used here, raises
:class:`UnsupportedVLLMError` naming the version found and the supported range.

Scheduler side: the spec *is* vLLM's ``CPUOffloadingSpec`` (or ``TieringOffloadingSpec``,
with its ``secondary_tiers``) for everything the scheduler sees: its manager, chunk
count, metrics and keys, so the host chunk ids handed out are vLLM's own. Worker side:
``get_worker`` maps vLLM's ``SharedOffloadRegion`` with the arguments vLLM's spec
passes (``triton_offload.vllm_region``), page-locks this worker's part on CUDA, turns
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
- ``canonical_layout`` is refused: its pages are vLLM's canonical fragments, not this
  project's rows.
- The tiering spec's fs, obj and p2p tiers file chunks under a name that carries this
  layout (:func:`storage_layout_tag`), so they never exchange chunks with stock vLLM
  or another geometry; the KVCR tier, which cannot be so named, is refused.

Only this module and ``triton_offload.vllm_region`` touch vllm. Importing this module
only checks that vllm is installed (ImportError naming the ``vllm`` extra otherwise);
vLLM's offloading modules are imported, and the classes built, on first access to a
class name. The plugin's :func:`register` stays cheap and never fails the host
process: it runs in every vLLM process at start-up.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import logging
import re
import time
from collections.abc import Iterable, Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from triton_offload.engine import Backend

if importlib.util.find_spec("vllm") is None:
    raise ImportError(
        "triton_offload.vllm needs vLLM, which is not installed: "
        "pip install 'triton-offload[vllm]' (supported: vllm>=0.33,<0.34)"
    )

#: The vLLM releases whose offloading API this module implements (inclusive, exclusive).
SUPPORTED_VLLM_MIN = (0, 33)
SUPPORTED_VLLM_MAX = (0, 34)
SUPPORTED_VLLM = ">=0.33,<0.34"

#: The names under which :func:`register` adds the specs to vLLM's factory.
SPEC_NAME = "TritonOffloadingSpec"
TIERING_SPEC_NAME = "TritonTieringOffloadingSpec"

#: Extra-config keys read by this spec on top of vLLM's CPU spec keys.
EXTRA_CONFIG_KEYS = ("backend", "num_programs", "crossover")
BACKENDS = ("auto", "triton", "dma", "torch")

# vLLM attaches its handler to the "vllm" logger only (and stops propagation there), so
# a message meant for vLLM's log must come from a logger below it.
logger = logging.getLogger("vllm.triton_offload")


class UnsupportedVLLMError(ImportError):
    """The installed vLLM's offloading API is not the one this module implements."""


def installed_vllm_version() -> str:
    """The installed vLLM distribution's version string (``"unknown"`` without metadata)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check_vllm_version(version: str | None = None) -> str:
    """Raise :class:`UnsupportedVLLMError` unless ``version`` is in ``SUPPORTED_VLLM``.

    ``version`` defaults to the installed one; local and dev suffixes are ignored
    (``0.33.1.dev4+gabc`` is a 0.33 release). Returns the version checked.
    """
    found = installed_vllm_version() if version is None else version
    match = re.match(r"\s*v?(\d+)\.(\d+)", found)
    if match is None:
        raise UnsupportedVLLMError(
            f"triton_offload.vllm supports vllm{SUPPORTED_VLLM}; cannot tell which release "
            f"vllm version {found!r} is"
        )
    release = (int(match.group(1)), int(match.group(2)))
    if not SUPPORTED_VLLM_MIN <= release < SUPPORTED_VLLM_MAX:
        raise UnsupportedVLLMError(
            f"triton_offload.vllm supports vllm{SUPPORTED_VLLM} (the OffloadingSpec API of "
            f"vllm 0.33), found vllm {found}; install a supported vllm or a triton-offload "
            "release made for this one"
        )
    return found


# Every vLLM name this module uses: (module, attribute).
_VLLM_NAMES: tuple[tuple[str, str], ...] = (
    ("vllm.v1.kv_offload.base", "CanonicalKVCaches"),
    ("vllm.v1.kv_offload.base", "CanonicalKVCacheRef"),
    ("vllm.v1.kv_offload.base", "CanonicalKVCacheTensor"),
    ("vllm.v1.kv_offload.base", "GPULoadStoreSpec"),
    ("vllm.v1.kv_offload.base", "LoadStoreSpec"),
    ("vllm.v1.kv_offload.base", "OffloadingManager"),
    ("vllm.v1.kv_offload.base", "OffloadingSpec"),
    ("vllm.v1.kv_offload.base", "OffloadingWorker"),
    ("vllm.v1.kv_offload.base", "TransferResult"),
    ("vllm.v1.kv_offload.config", "OffloadingConfig"),
    ("vllm.v1.kv_offload.cpu.common", "CPULoadStoreSpec"),
    ("vllm.v1.kv_offload.cpu.spec", "CPUOffloadingSpec"),
    ("vllm.v1.kv_offload.tiering.spec", "TieringOffloadingSpec"),
)


def import_vllm_api() -> SimpleNamespace:
    """Import the vLLM offloading names used here, after the version check.

    Raises :class:`UnsupportedVLLMError` naming the version found, the supported
    range and the first missing name, instead of an AttributeError later on.
    """
    version = check_vllm_version()
    names: dict[str, Any] = {}
    for module_name, attribute in _VLLM_NAMES:
        try:
            module = importlib.import_module(module_name)
            names[attribute] = getattr(module, attribute)
        except (ImportError, AttributeError) as error:
            raise UnsupportedVLLMError(
                f"triton_offload.vllm supports vllm{SUPPORTED_VLLM}, found vllm {version} "
                f"without {module_name}.{attribute} ({type(error).__name__}: {error}); its "
                "offloading API is not the supported one"
            ) from error
    return SimpleNamespace(version=version, **names)


def register() -> None:
    """``vllm.general_plugins`` entry point: register ``TritonOffloadingSpec`` by name.

    Runs in every vLLM process at start-up, so it only records a lazy loader with
    vLLM's ``OffloadingSpecFactory`` (the classes are built when a spec is created)
    and never raises: with an unsupported vLLM it logs why and still registers, so
    that selecting the spec fails with :class:`UnsupportedVLLMError`.
    """
    try:
        check_vllm_version()
    except UnsupportedVLLMError as error:
        logger.warning("%s", error)
    try:
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    except ImportError as error:
        logger.warning(
            "triton_offload: vLLM's OffloadingSpecFactory is unavailable (%s); %s is not "
            "registered",
            error,
            SPEC_NAME,
        )
        return
    for name in (SPEC_NAME, TIERING_SPEC_NAME):
        try:
            OffloadingSpecFactory.register_spec(name, __name__, name)
        except ValueError:
            # Already registered in this process (plugins may load more than once).
            logger.debug("%s is already registered with vLLM's OffloadingSpecFactory", name)


# ----------------------------------------------------------------------------- config


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"kv_connector_extra_config[{key!r}] must be a positive integer, got {value!r}"
        )
    return value


def _crossover_option(value: Any) -> int | dict[str, int] | None:
    """The ``crossover`` key, checked by the engine's own validator (``parse_crossover``).

    One rule for both entry points (page bytes >= 0, an int or exactly ``store`` and
    ``load``); its message is renamed to the extra-config key.
    """
    from triton_offload.jobs import FROM_POOL, TO_POOL
    from triton_offload.selection import parse_crossover

    try:
        parsed = parse_crossover(value)
    except (TypeError, ValueError) as error:
        message = str(error)
        if message.startswith("crossover"):
            message = message[len("crossover") :]
        if not isinstance(value, Mapping) and message.startswith("['store']"):
            message = message[len("['store']") :]  # one value was given, not a mapping
        raise ValueError(f"kv_connector_extra_config['crossover']{message}") from error
    if parsed is None:
        return None
    if isinstance(value, Mapping):
        return {"store": parsed.threshold[TO_POOL], "load": parsed.threshold[FROM_POOL]}
    return parsed.threshold[TO_POOL]


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """This spec's own extra-config keys, validated (see the README for each).

    ``backend``: "auto" (on CUDA the copy kernel for some planes and DMA for others,
    chosen per plane from the crossover, so one job may use both; the CPU path without
    CUDA), "triton", "dma" or "torch" (CPU caches only). ``num_programs``: Triton grid
    size (None = the launcher's default). ``crossover``: page bytes at or above which
    "auto" uses DMA for a plane, an int >= 0 or ``{"store": int, "load": int}``; None =
    measured when the worker starts.
    """

    backend: Backend = "auto"
    num_programs: int | None = None
    crossover: int | Mapping[str, int] | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> EngineOptions:
        backend = extra.get("backend", "auto")
        if backend not in BACKENDS:
            raise ValueError(
                f"kv_connector_extra_config['backend'] {backend!r} is not one of {BACKENDS}"
            )
        num_programs = extra.get("num_programs")
        if num_programs is not None:
            num_programs = _positive_int("num_programs", num_programs)
        crossover = _crossover_option(extra.get("crossover"))
        return cls(backend=backend, num_programs=num_programs, crossover=crossover)


def plan_from_offloading_config(config: Any) -> Any:
    """This project's ``OffloadPlan`` for vLLM's ``OffloadingConfig``.

    vLLM's ``tokens_per_block`` already spans the DCP ranks where the group is
    DCP-sharded (attention) and not where it is replicated (Mamba), so each group is
    given with that span as its block size and ``dcp_sharded=False``: scaling it
    again would repeat the Mamba span bug. ``OffloadingConfig`` carries no cache
    kind, only each group's window in chunks, so a group without a window plans as
    full attention and a windowed one (sliding window, chunked local, Mamba: one
    chunk) as a sliding window of exactly that many chunks. The worker only needs
    the groups, spans and ``blocks_per_chunk`` from the plan; lookups stay vLLM's.
    """
    from triton_offload.groups import GroupKind, GroupSpec, ParallelSpec
    from triton_offload.plan import plan_offload

    blocks_per_chunk = int(config.cache.blocks_per_chunk)
    specs = []
    for group in config.groups:
        tokens_per_block = int(group.tokens_per_block)
        name = f"vllm group {group.group_id}"
        window = group.sliding_window_size_in_chunks
        if window is None:
            specs.append(
                GroupSpec(GroupKind.FULL_ATTENTION, tokens_per_block, dcp_sharded=False, name=name)
            )
        else:
            specs.append(
                GroupSpec(
                    GroupKind.SLIDING_WINDOW,
                    tokens_per_block,
                    sliding_window=int(window) * tokens_per_block * blocks_per_chunk,
                    dcp_sharded=False,
                    name=name,
                )
            )
    parallel = ParallelSpec(
        tp_size=int(config.parallel.tp_size),
        dcp_size=int(config.parallel.dcp_size),
        pcp_size=int(config.parallel.pcp_size),
    )
    return plan_offload(specs, parallel, blocks_per_chunk=blocks_per_chunk)


def caches_from_canonical(kv_caches: Any) -> list[list[Any]]:
    """``TransferEngine`` caches (per group, one uint8 plane per ref) from vLLM's caches.

    Each ``CanonicalKVCacheRef`` of group ``g`` becomes a uint8 ``[num_blocks,
    ref.page_size_bytes]`` view of its tensor: block stride from the tensor, page =
    the ref's unpadded page (a Mamba page padded to the attention page copies only
    its real bytes). Refs of different groups may point at one tensor (vLLM's hybrid
    allocator overlays them); block ids keep them apart.
    """
    tensors = list(kv_caches.tensors)
    views: list[Any] = []
    for index, entry in enumerate(tensors):
        tensor = getattr(entry, "tensor", None)
        views.append(_row_bytes_view(tensor, f"kv_caches.tensors[{index}]"))
    caches: list[list[Any]] = []
    for group, refs in enumerate(kv_caches.group_data_refs):
        layers = []
        for position, ref in enumerate(refs):
            name = f"kv_caches.group_data_refs[{group}][{position}]"
            index = ref.tensor_idx
            if isinstance(index, bool) or not isinstance(index, int):
                raise TypeError(f"{name}.tensor_idx must be an int, got {index!r}")
            if not 0 <= index < len(views):
                raise ValueError(
                    f"{name}.tensor_idx {index} out of range [0, {len(views)}) tensors"
                )
            row = views[index]
            page = ref.page_size_bytes
            if isinstance(page, bool) or not isinstance(page, int) or page < 1:
                raise ValueError(f"{name}.page_size_bytes must be a positive int, got {page!r}")
            if page > row.size(1):
                raise ValueError(
                    f"{name}.page_size_bytes {page} exceeds the {row.size(1)} bytes per block "
                    f"of kv_caches.tensors[{index}]"
                )
            layers.append(row[:, :page])
        caches.append(layers)
    return caches


def _row_bytes_view(tensor: Any, name: str) -> Any:
    """uint8 ``[num_blocks, bytes_per_block]`` view of a ``(num_blocks, ...)`` tensor."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}.tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() < 2:
        raise ValueError(
            f"{name}.tensor has shape {tuple(tensor.shape)}; expected (num_blocks, ...)"
        )
    try:
        rows = tensor.view(tensor.size(0), -1)
        if rows.size(1) > 1 and rows.stride(1) != 1:
            raise RuntimeError("per-block elements are strided")
        return rows.view(torch.uint8)
    except RuntimeError as error:
        raise ValueError(
            f"{name}.tensor (shape {tuple(tensor.shape)}, strides {tensor.stride()}): the "
            "bytes of one block must be contiguous, only the block dimension may be strided"
        ) from error


def split_job(
    gpu_spec: Any, host_spec: Any, num_groups: int, blocks_per_chunk: int, what: str
) -> Any:
    """The ``JobSpec`` (per group: GPU block ids, host chunk ids, first index) of a vLLM job.

    vLLM orders both specs by group: group ``g`` has ``group_sizes[g]`` GPU blocks,
    the first at logical block ``block_indices[g]`` of its request, and, when
    non-empty, ``ceil((block_indices[g] % bpc + group_sizes[g]) / bpc)`` host chunks
    (the first chunk's leading ``block_indices[g] % bpc`` slots are skipped).
    """
    import numpy as np

    from triton_offload.jobs import JobSpec

    sizes = [int(size) for size in gpu_spec.group_sizes]
    starts = [int(index) for index in gpu_spec.block_indices]
    if len(sizes) != num_groups or len(starts) != num_groups:
        raise ValueError(
            f"{what}: GPULoadStoreSpec has {len(sizes)} group sizes and {len(starts)} block "
            f"indices, but the offloaded caches have {num_groups} groups"
        )
    gpu_ids = np.asarray(gpu_spec.block_ids, dtype=np.int64).reshape(-1)
    host_ids = np.asarray(host_spec.block_ids, dtype=np.int64).reshape(-1)
    if sum(sizes) != gpu_ids.size:
        raise ValueError(
            f"{what}: group sizes {sizes} add up to {sum(sizes)} but the GPU spec has "
            f"{gpu_ids.size} block ids"
        )
    chunks = [
        0 if size == 0 else -(-((start % blocks_per_chunk) + size) // blocks_per_chunk)
        for size, start in zip(sizes, starts, strict=True)
    ]
    if sum(chunks) != host_ids.size:
        raise ValueError(
            f"{what}: the GPU spec (group sizes {sizes}, block indices {starts}, "
            f"blocks_per_chunk {blocks_per_chunk}) needs {sum(chunks)} CPU chunk ids "
            f"({chunks} per group), the CPU spec has {host_ids.size}"
        )
    gpu_bounds = np.cumsum([0, *sizes])
    host_bounds = np.cumsum([0, *chunks])
    gpu_blocks = [gpu_ids[gpu_bounds[g] : gpu_bounds[g + 1]] for g in range(num_groups)]
    host_blocks = [host_ids[host_bounds[g] : host_bounds[g + 1]] for g in range(num_groups)]
    return JobSpec(gpu_blocks, host_blocks, starts)


# ------------------------------------------------------------------ the vLLM classes

_LAZY_NAMES = ("TritonOffloadingSpec", "TritonOffloadingWorker", "TritonTieringOffloadingSpec")
# Built by triton_offload.vllm_connector on first access.
_CONNECTOR_NAMES = ("TritonOffloadingConnector", "TritonOffloadingConnectorScheduler")
if TYPE_CHECKING:
    TritonOffloadingSpec: type
    TritonOffloadingWorker: type
    TritonTieringOffloadingSpec: type
    TritonOffloadingConnector: type
    TritonOffloadingConnectorScheduler: type

_classes: dict[str, type] | None = None


def _validate_cpu_bytes(extra: Mapping[str, Any]) -> None:
    cpu_bytes = extra.get("cpu_bytes_to_use")
    if isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, (int, float, str)):
        raise ValueError(
            "kv_connector_extra_config['cpu_bytes_to_use'] (host bytes for all "
            f"workers together) must be given as a positive integer, got {cpu_bytes!r}"
        )
    try:
        value = int(cpu_bytes)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            "kv_connector_extra_config['cpu_bytes_to_use'] must be a positive "
            f"integer, got {cpu_bytes!r}"
        )


#: Secondary tiers whose storage identity is vLLM's ``FileMapper`` fields (the fs folder,
#: the obj key prefix, the p2p peer fingerprint), which carry this spec's layout tag, or
#: that keep their chunks inside this process ("example").
TAGGED_TIERS = ("fs", "obj", "p2p", "example")
#: Secondary tiers refused: their chunks are shared under keys this spec cannot tag.
UNTAGGABLE_TIERS = ("kvcr",)


def storage_layout_tag(spec: Any) -> str:
    """The identity of the bytes this spec puts in a host chunk, for secondary tiers.

    vLLM's fs, obj and p2p tiers file a chunk under a digest of model, dtype, block and
    group fields, with no field for the byte layout inside the chunk; with their
    parallel-agnostic folders they also drop the parallel sizes when vLLM declares a
    block parallelism-invariant. This project's rows are neither vLLM's layout nor
    invariant across parallel layouts (each worker's page is plane-major over its own
    shard), so the tag names the row layout version, the per-worker page and chunk
    geometry, and the parallel sizes, except under ``replicated_layout`` where the one
    copy of a chunk is the same bytes whatever the TP size.
    """
    from triton_offload.layout import ROW_LAYOUT_VERSION

    config = spec.config
    parts = [
        f"triton_offload-rows-v{ROW_LAYOUT_VERSION}",
        f"page{int(spec.cpu_page_size_per_worker)}",
        f"bpc{int(spec.blocks_per_chunk)}",
    ]
    if not spec.replicated_layout:
        parallel = config.parallel
        parts.append(
            f"tp{parallel.tp_size}-pp{parallel.pp_size}-pcp{parallel.pcp_size}"
            f"-dcp{parallel.dcp_size}"
        )
    kv_cache_layout = getattr(config, "kv_cache_layout", None)
    if kv_cache_layout:
        parts.append(f"kv-{kv_cache_layout}")
    return ":".join(parts)


def check_secondary_tiers(tiers: Any, spec_name: str) -> None:
    """Refuse tiers whose chunks could be shared with another layout (ValueError).

    A tier outside :data:`TAGGED_TIERS` and :data:`UNTAGGABLE_TIERS` (an out-of-tree
    tier) is let through with a warning: it is kept apart only if it files chunks with
    vLLM's ``FileMapper.from_offloading_spec`` (which carries the layout tag).
    """
    if not isinstance(tiers, list):
        return  # vLLM's tiering spec raises its own error for this
    for index, tier in enumerate(tiers):
        tier_type = tier.get("type") if isinstance(tier, Mapping) else None
        key = f"kv_connector_extra_config['secondary_tiers'][{index}]['type']"
        if tier_type in UNTAGGABLE_TIERS:
            raise ValueError(
                f"{key} {tier_type!r} is not supported by {spec_name}: that tier shares "
                "chunks between instances keyed by block hash alone, with no field this "
                "spec can tag with its row layout, so it could hand back chunks written "
                "in vLLM's layout (or another geometry's) as this project's rows; use "
                f"one of {TAGGED_TIERS[:3]}"
            )
        if tier_type is not None and tier_type not in TAGGED_TIERS:
            logger.warning(
                "%s %r is an out-of-tree tier: %s keeps its chunks apart from other "
                "layouts only if the tier files them with vLLM's "
                "FileMapper.from_offloading_spec (its dtype field carries the layout "
                "tag); give it storage no other layout uses",
                key,
                tier_type,
                spec_name,
            )


def _release_region(region: Any, cuda_api: Any) -> None:
    """Unlock (with the binding that locked it), then vLLM's clean-up: unmap, unlink."""
    from triton_offload.vllm_region import unlock_worker_pages

    if cuda_api is not None:
        unlock_worker_pages(region, cuda_api)
    region.cleanup()


def _build_classes() -> dict[str, type]:
    api = import_vllm_api()

    class TritonOffloadingWorker(api.OffloadingWorker):  # type: ignore[name-defined]
        """vLLM ``OffloadingWorker`` backed by a ``TransferEngine`` on vLLM's shared region.

        ``submit_store(job_id, GPULoadStoreSpec, CPULoadStoreSpec)`` and
        ``submit_load(job_id, CPULoadStoreSpec, GPULoadStoreSpec)`` check the spec
        types (TypeError) and the block counts (ValueError) before any byte moves;
        ``get_finished`` returns each job once as vLLM's ``TransferResult``; ``wait``
        blocks on jobs still in flight (ids already reported are ignored, as vLLM's
        CPU worker does); ``shutdown`` waits for running jobs, then releases the
        region as vLLM's CPU worker does (unlock, unmap, unlink if still linked).
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
            self._replica_jobs: dict[Any, Any] = {}  # non-writer: job id -> chunks
            self._empty_jobs: list[Any] = []  # jobs that move nothing on this worker
            self._ready: list[Any] = []  # engine results drained by wait()

        # ------------------------------------------------------------ job input

        def _job(self, what: str, gpu: tuple[str, Any], host: tuple[str, Any]) -> Any:
            """The job's ``JobSpec`` (every group of the config)."""
            (gpu_name, gpu_spec), (host_name, host_spec) = gpu, host
            if not isinstance(gpu_spec, api.GPULoadStoreSpec):
                raise TypeError(
                    f"{what}: {gpu_name} must be vLLM's GPULoadStoreSpec, got "
                    f"{type(gpu_spec).__name__}"
                )
            if not isinstance(host_spec, api.CPULoadStoreSpec):
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
            )

        # --------------------------------------------------------------- submit

        def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            if self._closed:
                return False
            what = f"submit_store(job {job_id!r})"
            job = self._job(what, ("src_spec", src_spec), ("dst_spec", dst_spec))
            self._check_new(job_id, what)
            chunks = None
            if self.ledger is not None:
                import numpy as np

                from triton_offload.vllm_region import check_ledger_job_id

                check_ledger_job_id(job_id, what)
                chunks = np.unique(np.concatenate([np.zeros(0, np.int64), *job.host_blocks]))
            if self.engine is None:
                self._empty_jobs.append(api.TransferResult(job_id, True, 0, 0.0))
                return True
            if not self.writer:
                from triton_offload.jobs import TO_POOL

                # Same checks as a real store (the ids, the slots, aliasing), no copy.
                self.engine.build_job_table(job, TO_POOL)
                self._replica_jobs[job_id] = chunks
                return True
            accepted = bool(self.engine.submit_store(job_id, job))
            if accepted:
                self._engine_jobs.add(job_id)
                if chunks is not None:
                    self._published[job_id] = chunks
            return accepted

        def submit_load(
            self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
        ) -> bool:
            if self._closed:
                return False
            what = f"submit_load(job {job_id!r})"
            job = self._job(what, ("dst_spec", dst_spec), ("src_spec", src_spec))
            self._check_new(job_id, what)
            if self.engine is None:
                self._empty_jobs.append(api.TransferResult(job_id, True, 0, 0.0))
                return True
            accepted = bool(self.engine.submit_load(job_id, job, expedited=bool(expedited)))
            if accepted:
                self._engine_jobs.add(job_id)
            return accepted

        # --------------------------------------------------------------- finish

        def _drain_engine(self) -> None:
            if self.engine is None:
                return
            for result in self.engine.get_finished():
                self._engine_jobs.discard(result.job_id)
                chunks = self._published.pop(result.job_id, None)
                if chunks is not None:
                    # The copy is complete and visible to the host: tell the other ranks.
                    self.ledger.publish(chunks, int(result.job_id), bool(result.success))
                self._ready.append(
                    api.TransferResult(
                        job_id=result.job_id,
                        success=result.success,
                        transfer_size=result.transfer_size,
                        transfer_time=result.transfer_time,
                    )
                )

        def _replicas_done(self) -> list[Any]:
            done = []
            for job_id, chunks in list(self._replica_jobs.items()):
                status = self.ledger.status(chunks, int(job_id))
                if status is not None:
                    del self._replica_jobs[job_id]
                    # This rank moved no byte: size and time 0 keep vLLM's store
                    # throughput metrics to the writer's real copies.
                    done.append(api.TransferResult(job_id, status, 0, 0.0))
            return done

        def get_finished(self) -> list[Any]:
            self._drain_engine()
            results = self._empty_jobs + self._ready
            self._empty_jobs, self._ready = [], []
            if self._replica_jobs:
                results += self._replicas_done()
            return results

        def wait(self, job_ids: Iterable[int]) -> None:
            ids = list(job_ids)
            engine_ids = [job_id for job_id in ids if job_id in self._engine_jobs]
            if engine_ids:
                self.engine.wait(engine_ids)
                self._drain_engine()
            replica_ids = [job_id for job_id in ids if job_id in self._replica_jobs]
            if replica_ids:
                from triton_offload.vllm_region import wait_until

                def writer_done() -> bool:
                    return all(
                        self.ledger.status(self._replica_jobs[job_id], int(job_id)) is not None
                        for job_id in replica_ids
                    )

                wait_until(writer_done, f"rank 0's stores {replica_ids} (replicated layout)")

        def shutdown(self) -> None:
            if self._closed:
                return
            self._closed = True
            engine = self.engine
            try:
                if engine is not None:
                    if self._published:
                        # Ranks waiting for these stores learn of them before the
                        # ledger goes away.
                        engine.wait(list(self._published))
                        self._drain_engine()
                    engine.shutdown()
            finally:
                # The engine's pool is a view of the region: drop it before unmapping.
                self.engine = None
                del engine
                if self.ledger is not None:
                    self.ledger.close()
                    self.ledger = None
                if self.region is not None:
                    _release_region(self.region, self._cuda_api)
                    self.region = None

    class _TritonWorkerSide:
        """The worker side shared by both specs: vLLM's region, this project's engine."""

        #: Barrier the region's workers meet at (None: vLLM's all-workers barrier when
        #: its process groups exist, else none). Tests set a multiprocessing barrier.
        region_barrier: Any = None
        #: Create the region as vLLM's tiering spec does (shared with the scheduler).
        _tiering_region = False

        config: Any
        extra_config: Any
        num_chunks: int
        blocks_per_chunk: int
        replicated_layout: bool

        def __init__(self, config: Any) -> None:
            extra = config.extra_config
            _validate_cpu_bytes(extra)
            if config.canonical_layout or extra.get("canonical_layout"):
                raise ValueError(
                    "kv_connector_extra_config['canonical_layout'] is not supported by "
                    f"{type(self).__name__}: its host rows hold each worker's own pages "
                    "in this project's row layout, not vLLM's canonical pages"
                )
            self.engine_options = EngineOptions.from_extra_config(extra)
            super().__init__(config)  # type: ignore[call-arg]
            # An attention-free model has no group: nothing to plan or move.
            self.plan = plan_from_offloading_config(config) if config.groups else None
            self._triton_manager: Any = None
            self._triton_worker: Any = None

        def _uses_shared_region(self) -> bool:
            # Every platform uses vLLM's shared region, so the single-copy layout
            # for replicated (MLA) pages holds everywhere, as in vLLM's tiering spec.
            return True

        def get_manager(self) -> Any:
            first = self._triton_manager is None
            manager = self._triton_manager = super().get_manager()  # type: ignore[misc]
            if first:
                from triton_offload.vllm_connector import warn_stock_lookup_hazards

                warn_stock_lookup_hazards(self.config)
                logger.info(
                    "%s (triton_offload): scheduler uses vLLM's %s, %d host chunks "
                    "of %d blocks (%d bytes each, %s), eviction_policy=%s",
                    type(self).__name__,
                    type(manager).__name__,
                    self.num_chunks,
                    self.blocks_per_chunk,
                    getattr(self, "kv_bytes_per_chunk", 0),
                    "one copy per chunk" if self.replicated_layout else "one page per worker",
                    getattr(self, "eviction_policy", "lru"),
                )
            return manager

        def get_worker(self, kv_caches: Any) -> Any:
            if self._triton_worker is None:
                self._triton_worker = self.create_worker(kv_caches)
            return self._triton_worker

        def create_worker(self, kv_caches: Any) -> Any:
            from triton_offload import __version__
            from triton_offload.layout import build_layout
            from triton_offload.vllm_region import (
                RegionPlan,
                StoreLedger,
                create_worker_region,
                default_barrier,
                lock_worker_pages,
                worker_pool_view,
            )

            if not isinstance(kv_caches, api.CanonicalKVCaches):
                raise TypeError(
                    f"get_worker needs vLLM's CanonicalKVCaches, got {type(kv_caches).__name__}"
                )
            num_groups = len(self.config.groups)
            if len(kv_caches.group_data_refs) != num_groups:
                raise ValueError(
                    f"kv_caches has {len(kv_caches.group_data_refs)} groups of refs but the "
                    f"OffloadingConfig has {num_groups} groups"
                )
            name = type(self).__name__
            rank = int(self.config.parallel.rank)
            if num_groups == 0:
                logger.info(
                    "%s (triton_offload %s): worker rank %d has no KV cache group "
                    "(attention-free model): nothing to offload, no host memory mapped",
                    name,
                    __version__,
                    rank,
                )
                return TritonOffloadingWorker(
                    None,
                    num_groups=0,
                    stage_groups=(),
                    blocks_per_chunk=self.blocks_per_chunk,
                    num_chunks=self.num_chunks,
                )
            if self.num_chunks < 1:
                raise ValueError(
                    f"cpu_bytes_to_use {self.extra_config.get('cpu_bytes_to_use')} holds no "
                    f"chunk of {self.config.worker_kv_bytes_per_block} bytes per block x "
                    f"{1 if self.replicated_layout else self.config.parallel.world_size} "
                    f"copies x {self.blocks_per_chunk} blocks; raise it"
                )
            caches = caches_from_canonical(kv_caches)
            stage = tuple(g for g, layers in enumerate(caches) if layers)
            region_plan = RegionPlan.from_spec(self)
            layout = None
            if stage:
                # Every group, those without layers here included: the engine moves
                # nothing for an empty group and still checks its host chunk ids.
                layout = build_layout(
                    caches, num_groups=num_groups, blocks_per_chunk=self.blocks_per_chunk
                )
                if layout.row_bytes > region_plan.cpu_page_size:
                    raise ValueError(
                        f"a host chunk of this worker's caches needs {layout.row_bytes} bytes "
                        f"(largest group row, planes 16-byte aligned) but vLLM's chunk gives "
                        f"each worker {region_plan.cpu_page_size} bytes "
                        f"(worker_kv_bytes_per_block {self.config.worker_kv_bytes_per_block} "
                        f"x {self.blocks_per_chunk} blocks)"
                    )
            # Every worker reaches the same barriers in the same order (the region's,
            # then the ledger's), whatever its stage holds.
            barrier = None
            if not self._tiering_region:
                barrier = self.region_barrier or default_barrier()
            started = time.perf_counter()
            region = create_worker_region(
                region_plan, barrier=barrier, tiering=self._tiering_region
            )
            ledger = None
            engine = None
            locked = 0
            api_used = None
            try:
                if region_plan.replicated and region_plan.world_size > 1:
                    ledger = StoreLedger(region_plan.engine_id, region_plan.num_chunks, barrier)
                mapped = time.perf_counter()
                if layout is not None and layout.device.type == "cuda":
                    import torch

                    from triton_offload.pool import cuda_api

                    api_used = cuda_api()
                    with torch.cuda.device(layout.device):
                        locked = lock_worker_pages(region, region_plan, api_used)
                ready = time.perf_counter()
                if layout is not None:
                    from triton_offload.engine import TransferEngine

                    options = self.engine_options
                    pool = worker_pool_view(region, region_plan)[:, : layout.row_bytes]
                    engine = TransferEngine(
                        self.plan,
                        caches,
                        self.num_chunks,
                        pool=pool,
                        backend=options.backend,
                        num_programs=options.num_programs,
                        crossover=options.crossover,
                        # Under the single-copy layout every rank addresses the same
                        # rows: each calibrates on its own slice of them, so the
                        # ranks' start-up measurements neither collide nor disturb
                        # one another's timings.
                        calibration_rows=(
                            (region_plan.rank, region_plan.world_size)
                            if region_plan.replicated
                            and 1 < region_plan.world_size <= self.num_chunks
                            else (0, 1)
                        ),
                    )
                    del pool
            except BaseException:
                if ledger is not None:
                    ledger.close()
                _release_region(region, api_used)
                raise
            role = (
                "writes replicated chunks"
                if region_plan.replicated and region_plan.writer
                else "reads replicated chunks (rank 0 writes)"
                if region_plan.replicated
                else f"owns page {region_plan.slot} of each chunk"
            )
            logger.info(
                "%s (triton_offload %s): worker rank %d %s; shared region %s: %d host chunks, "
                "row stride %d bytes, %d-byte pages; %.2f GiB mapped in %.3f s, %.2f GiB "
                "page-locked in %.3f s; %s",
                name,
                __version__,
                rank,
                role,
                region.mmap_path,
                region_plan.num_chunks,
                region_plan.row_stride,
                region_plan.cpu_page_size,
                region_plan.total_bytes / (1 << 30),
                mapped - started,
                locked / (1 << 30),
                ready - mapped,
                "no layer of any group on this stage: nothing to move"
                if engine is None
                else f"offloads {len(engine.layout.planes)} planes of groups "
                f"{list(stage)} of {num_groups}, backend={engine.backend}, "
                f"{engine.row_bytes}-byte rows on {engine.device}",
            )
            return TritonOffloadingWorker(
                engine,
                num_groups=num_groups,
                stage_groups=stage,
                blocks_per_chunk=self.blocks_per_chunk,
                num_chunks=self.num_chunks,
                region=region,
                writer=region_plan.writer,
                ledger=ledger,
                cuda_api=api_used,
            )

    class TritonOffloadingSpec(_TritonWorkerSide, api.CPUOffloadingSpec):  # type: ignore[name-defined]
        """vLLM's CPU offloading with this project's data path.

        The constructor is cheap and has no side effects (vLLM builds the spec in the
        scheduler and in every worker): it validates the extra config, computes the
        chunk count as vLLM's CPU spec does on its shared region (one copy per chunk
        under ``replicated_layout``) and plans the groups; nothing is allocated before
        ``get_worker``. ``get_manager`` is vLLM's CPU manager.
        """

    class TritonTieringOffloadingSpec(_TritonWorkerSide, api.TieringOffloadingSpec):  # type: ignore[name-defined]
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
        """

        _tiering_region = True

        def __init__(self, config: Any) -> None:
            check_secondary_tiers(
                config.extra_config.get("secondary_tiers", []), type(self).__name__
            )
            super().__init__(config)
            # Every secondary tier that names its storage with vLLM's FileMapper (the
            # fs folder, the obj key prefix, the p2p peer fingerprint) hashes the
            # config's KV dtype: tagging it with this layout files these rows apart
            # from stock vLLM's chunks and from other geometries, in every such tier.
            self.storage_layout = storage_layout_tag(self)
            model = self.config.model
            self.config = dataclasses.replace(
                self.config,
                model=dataclasses.replace(model, dtype=f"{model.dtype}+{self.storage_layout}"),
            )

    for cls in (TritonOffloadingWorker, TritonOffloadingSpec, TritonTieringOffloadingSpec):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return {
        "TritonOffloadingSpec": TritonOffloadingSpec,
        "TritonOffloadingWorker": TritonOffloadingWorker,
        "TritonTieringOffloadingSpec": TritonTieringOffloadingSpec,
    }


def __getattr__(name: str) -> Any:
    global _classes
    if name in _LAZY_NAMES:
        if _classes is None:
            _classes = _build_classes()
            globals().update(_classes)
        return _classes[name]
    if name in _CONNECTOR_NAMES:
        from triton_offload.vllm_connector import build_connector_classes

        connector_classes = build_connector_classes()
        globals().update(connector_classes)
        return connector_classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES) | set(_CONNECTOR_NAMES))


__all__ = [
    "BACKENDS",
    "EXTRA_CONFIG_KEYS",
    "SPEC_NAME",
    "SUPPORTED_VLLM",
    "TAGGED_TIERS",
    "TIERING_SPEC_NAME",
    "UNTAGGABLE_TIERS",
    "EngineOptions",
    "TritonOffloadingConnector",
    "TritonOffloadingSpec",
    "TritonOffloadingWorker",
    "TritonTieringOffloadingSpec",
    "UnsupportedVLLMError",
    "caches_from_canonical",
    "check_secondary_tiers",
    "check_vllm_version",
    "import_vllm_api",
    "installed_vllm_version",
    "plan_from_offloading_config",
    "register",
    "split_job",
    "storage_layout_tag",
]
