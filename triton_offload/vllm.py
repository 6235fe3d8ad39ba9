"""vLLM integration: ``TritonOffloadingSpec``, a backend for vLLM's ``OffloadingConnector``.

Select it with ``kv_connector_extra_config = {"spec_name": "TritonOffloadingSpec",
"spec_module_path": "triton_offload.vllm", "cpu_bytes_to_use": ...}`` (the module
path may be left out once this package is installed: its ``vllm.general_plugins``
entry point, :func:`register`, registers the name with vLLM's spec factory).

Supported: vLLM ``>=0.33,<0.34`` (the ``OffloadingSpec`` API of vllm 0.33: an
``OffloadingConfig`` in the constructor, ``CanonicalKVCaches`` in ``get_worker``,
explicit ``submit_store`` / ``submit_load``). Another version, or a build whose
offloading module lacks one of the names used here, raises
:class:`UnsupportedVLLMError` naming the version found and the supported range.

Scheduler side: the spec *is* vLLM's ``CPUOffloadingSpec`` for everything the
scheduler sees (its manager, chunk count, metrics, ``cpu_bytes_to_use``,
``eviction_policy``, ``store_threshold``, ``max_tracker_size`` ...), so the host
chunk ids handed out are vLLM's own. Worker side: ``get_worker`` turns vLLM's
``CanonicalKVCaches`` into this project's byte planes and returns a
:class:`TritonOffloadingWorker` that moves the blocks with a
:class:`~triton_offload.engine.TransferEngine`; the engine's host pool has one row
per CPU chunk id, sized exactly as vLLM's CPU spec counts its chunks.

Only this module of the package touches vllm. Importing it only checks that vllm is
installed (ImportError naming the ``vllm`` extra otherwise); vLLM's offloading modules
are imported, and the spec and worker classes built, on first access to
``TritonOffloadingSpec`` / ``TritonOffloadingWorker``. The plugin's :func:`register`
stays cheap and never fails the host process: it runs in every vLLM process at
start-up.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import logging
import re
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

#: The name under which :func:`register` adds the spec to vLLM's factory.
SPEC_NAME = "TritonOffloadingSpec"

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
    try:
        OffloadingSpecFactory.register_spec(SPEC_NAME, __name__, SPEC_NAME)
    except ValueError:
        # Already registered in this process (plugins may load more than once).
        logger.debug("%s is already registered with vLLM's OffloadingSpecFactory", SPEC_NAME)


# ----------------------------------------------------------------------------- config


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"kv_connector_extra_config[{key!r}] must be a positive integer, got {value!r}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """This spec's own extra-config keys, validated (see the README for each).

    ``backend``: "auto" (Triton or DMA per job on CUDA from the crossover, the CPU path
    without CUDA), "triton", "dma" or "torch" (CPU caches only). ``num_programs``:
    Triton grid size (None = the launcher's default). ``crossover``: page bytes at or
    above which "auto" uses DMA, an int or ``{"store": int, "load": int}``; None =
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
        crossover = extra.get("crossover")
        if isinstance(crossover, Mapping):
            if set(crossover) != {"store", "load"}:
                raise ValueError(
                    "kv_connector_extra_config['crossover'] needs exactly the keys 'store' "
                    f"and 'load', got {dict(crossover)!r}"
                )
            crossover = {
                key: _positive_int(f"crossover.{key}", crossover[key]) for key in ("store", "load")
            }
        elif crossover is not None:
            crossover = _positive_int("crossover", crossover)
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

_LAZY_NAMES = ("TritonOffloadingSpec", "TritonOffloadingWorker")
if TYPE_CHECKING:
    TritonOffloadingSpec: type
    TritonOffloadingWorker: type

_classes: dict[str, type] | None = None


def _build_classes() -> dict[str, type]:
    api = import_vllm_api()

    class TritonOffloadingWorker(api.OffloadingWorker):  # type: ignore[name-defined]
        """vLLM ``OffloadingWorker`` backed by a ``TransferEngine``.

        ``submit_store(job_id, GPULoadStoreSpec, CPULoadStoreSpec)`` and
        ``submit_load(job_id, CPULoadStoreSpec, GPULoadStoreSpec)`` check the spec
        types (TypeError) and the block counts (ValueError) before any byte moves;
        ``get_finished`` returns each job once as vLLM's ``TransferResult``; ``wait``
        blocks on jobs still in flight (ids already reported are ignored, as vLLM's
        CPU worker does); ``shutdown`` waits for running jobs and frees the pool.
        An expedited load runs on the engine's load stream like any other load.
        """

        def __init__(self, engine: Any) -> None:
            self.engine = engine
            self.blocks_per_chunk: int = engine.blocks_per_chunk
            self.num_groups: int = engine.num_groups
            self._in_flight: set[Any] = set()

        def _job(self, what: str, gpu: tuple[str, Any], host: tuple[str, Any]) -> Any:
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
            return split_job(gpu_spec, host_spec, self.num_groups, self.blocks_per_chunk, what)

        def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            what = f"submit_store(job {job_id!r})"
            job = self._job(what, ("src_spec", src_spec), ("dst_spec", dst_spec))
            accepted = bool(self.engine.submit_store(job_id, job))
            if accepted:
                self._in_flight.add(job_id)
            return accepted

        def submit_load(
            self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
        ) -> bool:
            what = f"submit_load(job {job_id!r})"
            job = self._job(what, ("dst_spec", dst_spec), ("src_spec", src_spec))
            accepted = bool(self.engine.submit_load(job_id, job))
            if accepted:
                self._in_flight.add(job_id)
            return accepted

        def get_finished(self) -> list[Any]:
            results = []
            for result in self.engine.get_finished():
                self._in_flight.discard(result.job_id)
                results.append(
                    api.TransferResult(
                        job_id=result.job_id,
                        success=result.success,
                        transfer_size=result.transfer_size,
                        transfer_time=result.transfer_time,
                    )
                )
            return results

        def wait(self, job_ids: Iterable[int]) -> None:
            pending = [job_id for job_id in job_ids if job_id in self._in_flight]
            if pending:
                self.engine.wait(pending)

        def shutdown(self) -> None:
            self.engine.shutdown()

    class TritonOffloadingSpec(api.CPUOffloadingSpec):  # type: ignore[name-defined]
        """vLLM's CPU offloading with this project's data path.

        The constructor is cheap and has no side effects (vLLM builds the spec in the
        scheduler and in every worker): it validates the extra config, computes the
        chunk count as vLLM's CPU spec does and plans the groups; nothing is
        allocated before ``get_worker``. ``get_manager`` is vLLM's CPU manager.
        """

        def __init__(self, config: Any) -> None:
            extra = config.extra_config
            cpu_bytes = extra.get("cpu_bytes_to_use")
            if isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, (int, float, str)):
                raise ValueError(
                    "kv_connector_extra_config['cpu_bytes_to_use'] (host bytes for all "
                    f"workers together) must be given as a positive integer, got {cpu_bytes!r}"
                )
            try:
                cpu_bytes = int(cpu_bytes)
            except ValueError:
                cpu_bytes = 0
            if cpu_bytes < 1:
                raise ValueError(
                    "kv_connector_extra_config['cpu_bytes_to_use'] must be a positive "
                    f"integer, got {extra.get('cpu_bytes_to_use')!r}"
                )
            if config.canonical_layout or extra.get("canonical_layout"):
                raise ValueError(
                    "kv_connector_extra_config['canonical_layout'] is not supported by "
                    f"{SPEC_NAME}: its host rows hold each worker's own pages"
                )
            self.engine_options = EngineOptions.from_extra_config(extra)
            # Each worker keeps a private pool with its own pages: vLLM's single-copy
            # (replicated) layout needs the shared region that only its CPU worker has,
            # and would leave the other ranks' pools empty.
            if config.replicated_layout:
                config = dataclasses.replace(config, replicated_layout=False)
            super().__init__(config)
            self.replicated_layout = False
            self.plan = plan_from_offloading_config(config)
            self._triton_manager: Any = None
            self._triton_worker: Any = None

        def get_manager(self) -> Any:
            first = self._triton_manager is None
            manager = self._triton_manager = super().get_manager()
            if first:
                logger.info(
                    "%s (triton_offload): scheduler uses vLLM's CPU manager, %d host chunks "
                    "of %d blocks, eviction_policy=%s",
                    SPEC_NAME,
                    self.num_chunks,
                    self.blocks_per_chunk,
                    self.eviction_policy,
                )
            return manager

        def get_worker(self, kv_caches: Any) -> Any:
            if self._triton_worker is None:
                self._triton_worker = self.create_worker(kv_caches)
            return self._triton_worker

        def create_worker(self, kv_caches: Any) -> Any:
            from triton_offload import __version__
            from triton_offload.engine import TransferEngine

            if not isinstance(kv_caches, api.CanonicalKVCaches):
                raise TypeError(
                    f"get_worker needs vLLM's CanonicalKVCaches, got {type(kv_caches).__name__}"
                )
            if len(kv_caches.group_data_refs) != len(self.plan.groups):
                raise ValueError(
                    f"kv_caches has {len(kv_caches.group_data_refs)} groups of refs but the "
                    f"OffloadingConfig has {len(self.plan.groups)} groups"
                )
            if self.num_chunks < 1:
                raise ValueError(
                    f"cpu_bytes_to_use {self.extra_config.get('cpu_bytes_to_use')} holds no "
                    f"chunk of {self.config.worker_kv_bytes_per_block} bytes per block x "
                    f"{self.config.parallel.world_size} workers x {self.blocks_per_chunk} "
                    "blocks; raise it"
                )
            caches = caches_from_canonical(kv_caches)
            options = self.engine_options
            engine = TransferEngine(
                self.plan,
                caches,
                self.num_chunks,
                backend=options.backend,
                num_programs=options.num_programs,
                crossover=options.crossover,
            )
            logger.info(
                "%s (triton_offload %s): worker rank %d offloads %d planes in %d groups, "
                "backend=%s, %d host chunks of %d bytes (%.2f GiB) on %s",
                SPEC_NAME,
                __version__,
                self.config.parallel.rank,
                len(engine.layout.planes),
                engine.num_groups,
                engine.backend,
                engine.num_host_blocks,
                engine.row_bytes,
                engine.num_host_blocks * engine.row_bytes / (1 << 30),
                engine.device,
            )
            return TritonOffloadingWorker(engine)

    for cls in (TritonOffloadingWorker, TritonOffloadingSpec):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return {
        "TritonOffloadingSpec": TritonOffloadingSpec,
        "TritonOffloadingWorker": TritonOffloadingWorker,
    }


def __getattr__(name: str) -> Any:
    global _classes
    if name in _LAZY_NAMES:
        if _classes is None:
            _classes = _build_classes()
            globals().update(_classes)
        return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES))


__all__ = [
    "BACKENDS",
    "EXTRA_CONFIG_KEYS",
    "SPEC_NAME",
    "SUPPORTED_VLLM",
    "EngineOptions",
    "TritonOffloadingSpec",
    "TritonOffloadingWorker",
    "UnsupportedVLLMError",
    "caches_from_canonical",
    "check_vllm_version",
    "import_vllm_api",
    "installed_vllm_version",
    "plan_from_offloading_config",
    "register",
    "split_job",
]
