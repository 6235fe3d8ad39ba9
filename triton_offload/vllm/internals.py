"""Every vLLM name this package relies on beyond vLLM's public classes, in one place.

vLLM's offloading API is its public classes (``OffloadingSpec``, ``OffloadingWorker``,
``OffloadingManager``, the specs and results they exchange). To plan lookups, route
failures and verify chunks this package also overrides private methods, reads or
replaces private attributes, swaps two classes and calls internal functions. Each such
name is a :class:`Reliance` below, with the releases it was checked against (the
source of each release read, and the project's and vLLM's own tests run on it), the
parameters an override or call depends on, and why it is needed. Where a release
offers a public hook for what a private name did, the entry is limited to the releases
before it (``releases``) and the code uses the hook on the others.

:func:`check_vllm_internals` resolves every entry of the installed release and raises
:class:`UnsupportedVLLMError` with one line per missing or changed name and the
supported range; the modules that subclass vLLM's classes call it at import, so a
release that moved a name fails at start-up with the name, never later in a request.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from triton_offload.vllm.compat import (
    SUPPORTED_VLLM,
    UnsupportedVLLMError,
    installed_vllm_version,
    vllm_release,
)

BOTH = ((0, 33), (0, 34))
ONLY_0_33 = ((0, 33),)
ONLY_0_34 = ((0, 34),)

_SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
_CONNECTOR_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"
_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"
_METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics"
_COMMON = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"
_CPU_MANAGER = "vllm.v1.kv_offload.cpu.manager"
_CPU_SPEC = "vllm.v1.kv_offload.cpu.spec"
_REGION = "vllm.v1.kv_offload.cpu.shared_offload_region"
_TIERING_MANAGER = "vllm.v1.kv_offload.tiering.manager"
_TIERING_SPEC = "vllm.v1.kv_offload.tiering.spec"
_TIER_BASE = "vllm.v1.kv_offload.tiering.base"


@dataclass(frozen=True)
class Reliance:
    """One vLLM name this package depends on.

    ``module`` and ``name`` (a dotted path inside the module: a function, a class
    attribute, or ``Class.attribute`` set in the class's ``__init__``), ``use`` (what
    this package does with it: ``overrides``, ``calls``, ``reads``, ``replaces``,
    ``replaces on instances``, ``swaps the class of``, ``reads field`` (a field of vLLM's
    per-request state or job records), or ``adds``: a marker attribute set
    on vLLM's objects, checked to be unused by vLLM), ``params`` (the leading parameter
    names an override or a call depends on, ``self`` left out), ``returns`` (the return
    annotation as vLLM writes it, where the override must return the same), ``releases``
    (where it is relied on) and ``why``.
    """

    module: str
    name: str
    use: str
    why: str
    params: tuple[str, ...] | None = None
    returns: str | None = None
    releases: tuple[tuple[int, int], ...] = BOTH
    instance: bool = False  # set on instances in __init__ (checked in the class source)


RELIANCES: tuple[Reliance, ...] = (
    # ---- the connector's scheduler: planned lookups and failure routing
    Reliance(
        _CONNECTOR,
        "OffloadingConnector.connector_scheduler",
        "swaps the class of",
        "vLLM builds its scheduler inside OffloadingConnector.__init__ with no hook; "
        "TritonOffloadingConnector gives that instance its subclass",
        instance=True,
    ),
    Reliance(
        _CONNECTOR,
        "OffloadingConnector.connector_worker",
        "swaps the class of",
        "the same for the connector worker (failure reporting)",
        instance=True,
    ),
    Reliance(
        _SCHEDULER,
        "OffloadingConnectorScheduler._lookup_complete_chunks",
        "overrides",
        "the planner answers the complete-chunk lookup (hits on every group's grid)",
        params=("req_status", "max_num_new_tokens"),
        returns="int | None",
        releases=ONLY_0_33,
    ),
    Reliance(
        _SCHEDULER,
        "OffloadingConnectorScheduler._lookup_complete_chunks",
        "overrides",
        "the planner answers the complete-chunk lookup; the full-attention boundary is "
        "vLLM's, passed through",
        params=("req_status", "max_num_new_tokens"),
        returns="tuple[int | None, int | None]",
        releases=ONLY_0_34,
    ),
    Reliance(
        _SCHEDULER,
        "OffloadingConnectorScheduler._update_connector_output",
        "overrides",
        "bad keys from the workers are quarantined; on 0.33 failed jobs are completed "
        "as failed (0.34 does it itself)",
        params=("connector_output",),
    ),
    Reliance(
        _SCHEDULER,
        "OffloadingConnectorScheduler._reserve_sync_load",
        "overrides",
        "no sync loads for models with several groups (a failed one cannot be reported)",
        params=("req_status", "num_computed_tokens", "num_hit_tokens"),
    ),
    Reliance(
        _SCHEDULER,
        "OffloadingConnectorScheduler._jobs",
        "reads",
        "a failed job's key list, by identity, to know which completion failed",
        instance=True,
    ),
    Reliance(
        _SCHEDULER,
        "OffloadingConnectorScheduler._stale_job_threshold",
        "reads",
        "failures of jobs from before a cache reset are ignored as vLLM ignores them",
        instance=True,
    ),
    Reliance(
        _SCHEDULER,
        "OffloadingConnectorScheduler._current_batch_sync_loads",
        "reads",
        "a refused sync load is taken out of the step's sync set",
        instance=True,
    ),
    Reliance(
        _SCHEDULER,
        "OffloadingConnectorScheduler._chunks_being_loaded",
        "reads",
        "a planned hit that reads a chunk still being loaded is deferred, as vLLM's is",
        instance=True,
    ),
    # ---- the connector's worker: fail-soft submits and failure reports
    Reliance(
        _CONNECTOR_WORKER,
        "OffloadingConnectorWorker._init_worker",
        "overrides",
        "the offloading worker is wrapped so a refused submit becomes a failed job",
        params=("kv_caches",),
    ),
    Reliance(
        _CONNECTOR_WORKER,
        "OffloadingConnectorWorker.get_finished",
        "overrides",
        "0.33 asserts every job succeeded; its loop runs here without the assert",
        params=("finished_req_ids",),
        releases=ONLY_0_33,
    ),
    Reliance(
        _CONNECTOR_WORKER,
        "OffloadingConnectorWorker.start_kv_transfers",
        "overrides",
        "jobs go to this project's worker with GPU block ids: vLLM's per-job pointer "
        "resolution is host work the worker does not need",
        params=("metadata",),
        releases=ONLY_0_34,
    ),
    Reliance(
        _CONNECTOR_WORKER,
        "OffloadingConnectorWorker.handle_preemptions",
        "overrides",
        "the deferred stores go with block ids before vLLM flushes preempted requests",
        params=("kv_connector_metadata",),
        releases=ONLY_0_34,
    ),
    Reliance(
        _CONNECTOR_WORKER,
        "OffloadingConnectorWorker._load_jobs",
        "reads",
        "which finished job is a load, and of which request (None: a sync load)",
        instance=True,
    ),
    Reliance(
        _CONNECTOR_WORKER,
        "OffloadingConnectorWorker._unsubmitted_store_jobs",
        "reads",
        "the stores vLLM deferred to the next step, submitted with block ids (0.34)",
        instance=True,
        releases=ONLY_0_34,
    ),
    Reliance(
        _CONNECTOR_WORKER,
        "OffloadingConnectorWorker._connector_worker_meta",
        "replaces",
        "the worker metadata carries bad keys (and on 0.33 failed jobs) to the scheduler",
        instance=True,
    ),
    # ---- vLLM's offloading stats: this backend's counters ride the same payload
    Reliance(
        _METRICS,
        "OffloadingConnectorStats.increase_counter",
        "calls",
        "this backend's counters (triton_offload.vllm.counters) are added to vLLM's "
        "offloading stats payload, which vLLM sums over workers and logs",
        params=("counter_name", "counter_increase_value", "labelvalues"),
    ),
    Reliance(
        _METRICS,
        "OffloadingConnectorStats.metric_sections",
        "calls",
        "the connector's Prometheus metrics take this backend's counters out of a payload "
        "copy and hand vLLM's offloading metrics the rest",
        params=(),
    ),
    # ---- vLLM's CPU manager: keyed host specs and dropped chunks
    Reliance(
        _CPU_MANAGER,
        "CPUOffloadingManager._get_load_store_spec",
        "replaces",
        "host specs carry their chunks' keys so workers seal and check them",
        params=("keys", "chunks"),
    ),
    Reliance(
        _CPU_MANAGER,
        "CPUOffloadingManager._free_chunk",
        "calls",
        "a chunk that failed verification is freed as an eviction frees it",
        params=("chunk",),
    ),
    Reliance(
        _CPU_MANAGER,
        "CPUOffloadingManager._policy",
        "reads",
        "a bad chunk is found and removed from the eviction policy",
        instance=True,
    ),
    Reliance(
        _CPU_MANAGER,
        "CPUOffloadingManager._num_evictable_cache_chunks",
        "replaces",
        "the evictable count drops with a removed bad chunk",
        instance=True,
    ),
    # ---- fields read from vLLM's per-request state and job records
    *(
        Reliance(
            _SCHEDULER,
            f"RequestOffloadState.{field}",
            "reads field",
            "the planned lookup reads the request's state as vLLM's lookup does",
        )
        for field in (
            "req",
            "req_context",
            "group_states",
            "max_load_tokens",
            "num_locally_computed_tokens",
        )
    ),
    Reliance(
        _SCHEDULER,
        "RequestGroupState.offload_keys",
        "reads field",
        "the planned lookup reads each group's chunk keys",
    ),
    *(
        Reliance(
            _SCHEDULER,
            f"TransferJobStatus.{field}",
            "reads field",
            "a failed job's keys and request are completed and excluded by them",
        )
        for field in ("keys", "req_id")
    ),
    *(
        Reliance(
            _COMMON,
            f"TransferJob.{field}",
            "reads field",
            "the connector worker submits jobs (and layer-wise loads) from vLLM's records",
        )
        for field in ("req_id", "src_spec", "dst_spec", "sync")
    ),
    Reliance(
        _COMMON,
        "OffloadingConnectorMetadata.load_jobs",
        "reads field",
        "the connector worker's start of this step's loads",
    ),
    # ---- vLLM's fs tier: temporary names no seed decides
    Reliance(
        "vllm.v1.kv_offload.tiering.fs.io",
        "_get_tmp_suffix",
        "replaces",
        "vLLM draws the fs tier's temporary file names from the random module it seeds "
        "with the engine's seed: engines of one seed collide on them, and a killed "
        "writer's file stops the chunk being stored again (triton_offload.vllm.fs_writes)",
        params=(),
    ),
    # ---- vLLM's connector factory: the configuration checked before the model loads
    Reliance(
        "vllm.distributed.kv_transfer.kv_connector.factory",
        "KVConnectorFactory.get_connector_class",
        "reads the argument of",
        "0.33 hands the connector class no config before the model loads (0.34 calls "
        "kv_cache_access with it); its front-end looks the class up while it builds "
        "VllmConfig, and the lookup's kv_transfer_config is read from that call's frame "
        "(releases/v0_33.config_of_class_lookup)",
        params=("kv_transfer_config",),
        releases=ONLY_0_33,
    ),
    # ---- vLLM's tiering manager: promoted chunks checked before they count
    Reliance(
        _TIERING_MANAGER,
        "TieringOffloadingManager._jobs",
        "reads",
        "a finished promotion's keys and host chunk ids, to check their seals",
        instance=True,
    ),
    Reliance(
        _TIER_BASE,
        "SecondaryTierManager.lookup",
        "replaces on instances",
        "a tier answers MISS for a quarantined key (no tier factory hook to subclass it)",
        params=("key", "req_context"),
    ),
    Reliance(
        _TIER_BASE,
        "SecondaryTierManager.get_finished_jobs",
        "replaces on instances",
        "every chunk a tier promotes is checked before it counts",
        params=(),
    ),
    Reliance(
        _TIER_BASE,
        "SecondaryTierManager._triton_watched",
        "adds",
        "marks a tier whose lookup and finished jobs are already replaced",
    ),
    Reliance(
        _CPU_MANAGER,
        "CPUOffloadingManager._triton_keyed_specs",
        "adds",
        "marks a manager whose _get_load_store_spec already keeps the keys",
    ),
    # ---- vLLM's specs and region
    Reliance(
        _CPU_SPEC,
        "CPUOffloadingSpec._uses_shared_region",
        "overrides",
        "the shared region is used on every platform (vLLM: CUDA and XPU only)",
        params=(),
    ),
    Reliance(
        _CPU_SPEC,
        "_all_workers_barrier",
        "calls",
        "the region is created behind the same barrier vLLM's CPU spec uses",
        params=(),
    ),
    Reliance(
        _CPU_SPEC,
        "_REGION_SEGMENTS",
        "reads",
        "the region is split into as many segment files as vLLM's",
        releases=ONLY_0_33,
    ),
    Reliance(
        _REGION,
        "REGION_SEGMENTS",
        "reads",
        "the region is split into as many segment files as vLLM's",
        releases=ONLY_0_34,
    ),
    Reliance(
        _REGION,
        "SharedOffloadRegion.__init__",
        "calls",
        "the worker maps vLLM's region with the arguments vLLM's specs pass",
        params=("engine_id", "num_chunks", "rank", "kv_bytes_per_chunk", "cpu_page_size"),
    ),
    Reliance(
        _TIERING_SPEC,
        "_reject_workers_across_nodes",
        "calls",
        "secondary tiers are refused on engines whose workers span nodes, as vLLM's "
        "tiering spec does",
        params=(),
        releases=ONLY_0_34,
    ),
)


def _resolve(module: Any, dotted: str) -> Any:
    target = module
    for part in dotted.split("."):
        target = getattr(target, part)
    return target


def _problem(reliance: Reliance) -> str | None:
    """Why ``reliance`` does not hold on the installed vLLM (None: it holds)."""
    try:
        module = importlib.import_module(reliance.module)
    except ImportError as error:
        return f"module {reliance.module} does not import ({error})"
    owner_path, _, attribute = reliance.name.rpartition(".")
    if reliance.use == "reads field":
        # A field of vLLM's dataclass (or slots, or annotated attribute) it reads.
        try:
            owner = _resolve(module, owner_path)
        except AttributeError:
            return f"{owner_path} is missing"
        names: set[str] = set(getattr(owner, "__dataclass_fields__", {}))
        for klass in getattr(owner, "__mro__", ()):
            names.update(getattr(klass, "__annotations__", {}))
            names.update(getattr(klass, "__slots__", ()))
        if attribute not in names:
            return f"{owner_path} has no field {attribute}"
        return None
    if reliance.use == "adds":
        # A marker this package sets on vLLM's objects: vLLM must not use the name.
        try:
            owner = _resolve(module, owner_path)
            source = inspect.getsource(owner)
        except (AttributeError, OSError, TypeError) as error:
            return f"{owner_path} is not readable ({error})"
        if hasattr(owner, attribute) or attribute in source:
            return f"{owner_path} now uses {attribute}: this package's marker would collide"
        return None
    if reliance.instance:
        try:
            owner = _resolve(module, owner_path)
            source = inspect.getsource(owner)
        except (AttributeError, OSError, TypeError) as error:
            return f"{owner_path} is not readable ({error})"
        if f"self.{attribute}" not in source:
            return f"{owner_path} no longer sets self.{attribute}"
        return None
    try:
        target = _resolve(module, reliance.name)
    except AttributeError:
        return "missing"
    if reliance.params is not None:
        try:
            parameters = list(inspect.signature(target).parameters)
        except (TypeError, ValueError):
            return "not a callable with a signature"
        if parameters and parameters[0] == "self":
            parameters = parameters[1:]
        found = tuple(parameters[: len(reliance.params)])
        if found != reliance.params:
            return f"parameters changed: expected {reliance.params}, found {tuple(parameters)}"
    if reliance.returns is not None:
        annotation = inspect.signature(target).return_annotation
        text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
        if text != reliance.returns:
            return f"return type changed: expected {reliance.returns}, found {text}"
    return None


def internals_problems(release: tuple[int, int] | None = None) -> list[str]:
    """One line per name of :data:`RELIANCES` (of ``release``, default: the installed one)
    that does not hold on the installed vLLM."""
    release = vllm_release() if release is None else release
    lines = []
    for reliance in RELIANCES:
        if release not in reliance.releases:
            continue
        problem = _problem(reliance)
        if problem is not None:
            lines.append(
                f"{reliance.module}.{reliance.name} ({reliance.use} it: {reliance.why}): {problem}"
            )
    return lines


@functools.cache
def check_vllm_internals() -> None:
    """Raise :class:`UnsupportedVLLMError` listing every relied-on name that the installed
    vLLM lacks or changed (once per process; the check reads a few class sources)."""
    problems = internals_problems()
    if problems:
        raise UnsupportedVLLMError(
            f"triton_offload.vllm supports vllm{SUPPORTED_VLLM}; the installed vllm "
            f"{installed_vllm_version()} differs from the releases it was checked against "
            f"in {len(problems)} name(s) it relies on:\n" + "\n".join(problems)
        )


__all__ = ["RELIANCES", "Reliance", "check_vllm_internals", "internals_problems"]
