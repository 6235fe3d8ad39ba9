"""``TritonOffloadingConnector``: vLLM's ``OffloadingConnector`` with the planner's hits.

Select it with ``"kv_connector": "TritonOffloadingConnector", "kv_connector_module_path":
"triton_offload.vllm"``; it uses ``TritonOffloadingSpec`` unless the extra config names
another ``spec_name`` (vLLM's CPU or tiering spec, for instance). Everything else is
vLLM's connector: its scheduler (stores, loads, events, metrics, partial tails), its
worker and its manager. It adds two things:

- A span cross-check at start-up, in the scheduler and in every worker: the planner's
  per-group span (attention ``block_size * dcp_size``, Mamba ``block_size``, PCP never)
  from the real cache specs must equal vLLM's ``OffloadingConfig.tokens_per_block``; a
  mismatch (a vLLM release multiplying a Mamba span by the DCP size again) is an error naming
  each group, its kind and both numbers.
- Complete-chunk lookups that obey the planner's rules: the plan is built from the cache
  specs in vLLM's ``KVCacheConfig`` (full attention, MLA, sliding window with its extra
  retained tokens, chunked local, Mamba with its cache mode, EAGLE groups), so a hit
  never ends off a Mamba group's grid and never misses a chunk a window reads, while a
  valid hit of vLLM's own rule is always kept (the planner returns the largest valid
  hit, and vLLM's answer is re-checked against the same rules).

It also reports failed jobs instead of asserting (see the worker class), and publishes
this backend's counters beside vLLM's offloading metrics through vLLM's KV-connector
stats (:mod:`triton_offload.vllm.counters`).

The plan, the span check and the manager-backed presence rows live in
:mod:`triton_offload.vllm.planning`; this module holds only vLLM's two subclasses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from triton_offload.planner.groups import GroupKind
from triton_offload.planner.lookup import hit_end_problem
from triton_offload.planner.plan import OffloadPlan
from triton_offload.vllm.capacity import building_vllm_config, check_capacity_before_load
from triton_offload.vllm.checkpoint import SERVED_REVISION, ModelRevision
from triton_offload.vllm.compat import (
    CONNECTOR_NAME,
    MODULE_PATH,
    SPEC_NAME,
    logger,
    supported_vllm_api,
)
from triton_offload.vllm.counters import (
    LOADS_FAILED,
    STORES_FAILED,
    TritonPromMetrics,
    stats_of,
)
from triton_offload.vllm.integrity import ChunkGuard, TritonWorkerMetadata
from triton_offload.vllm.internals import check_vllm_internals
from triton_offload.vllm.layerwise import (
    LayerwiseLoads,
    attention_runs_outside_graphs,
    layer_stages,
)
from triton_offload.vllm.options import OWN_SPECS, check_extra_config
from triton_offload.vllm.planning import (
    PLANNED_LOOKUPS,
    LazyPresence,
    check_spans,
    eagle_drop,
    plan_from_kv_cache_config,
    stock_lookup_hazards,
)
from triton_offload.vllm.releases import RELEASE
from triton_offload.vllm.worker import TritonTransferResult

with supported_vllm_api():
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
        get_offloading_group_ids,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.kv_offload.base import LookupResult, TransferResult

check_vllm_internals()


class _LookupMemo:
    """vLLM's offloading manager for the span of one lookup: each key is asked once and
    its answer kept, so vLLM's scan and the planner after it share them. Everything but
    ``lookup`` goes to the manager itself."""

    def __init__(
        self, manager: Any, guard: ChunkGuard | None = None, excluded: Any = frozenset()
    ) -> None:
        self.manager = manager
        self._answers: dict[Any, Any] = {}
        self._guard = guard
        self._excluded = excluded

    def lookup(self, key: Any, req_context: Any) -> Any:
        answer = self._answers.get(key)
        if answer is None:
            if key in self._excluded or (
                self._guard is not None and self._guard.is_quarantined(key)
            ):
                # A chunk that failed to load (for this request) or to verify (for
                # everyone) is a miss: recomputing must not load it again.
                answer = LookupResult.MISS
            else:
                answer = self.manager.lookup(key, req_context)
            self._answers[key] = answer
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)


class _CompletionHook:
    """The manager as vLLM's completion code sees it for one worker report: a good
    store lifts a quarantine, failed jobs are counted, a failed store completes with
    ``success=False`` (its keys released, never published) and the release adds what it
    does not do itself (``RELEASE.on_failed_store`` / ``on_failed_load``). Everything
    else goes to the manager."""

    def __init__(self, manager: Any, scheduler: Any, failing: dict[int, Any]) -> None:
        self.manager = manager
        self._scheduler = scheduler
        self._failing = failing

    def complete_store(self, keys: Any, req_context: Any, success: bool = True) -> None:
        job = self._failing.get(id(keys))
        if job is not None:
            success = False
            self._scheduler.triton_failed_stores += 1
            self._scheduler.triton_guard.counters.add(STORES_FAILED)
            RELEASE.on_failed_store(len(keys), job.req_id)
        self.manager.complete_store(keys, req_context, success=success)  # as vLLM calls it
        if success:
            self._scheduler.triton_guard.release(keys)

    def complete_load(self, keys: Any, req_context: Any) -> None:
        self.manager.complete_load(keys, req_context)
        job = self._failing.get(id(keys))
        if job is not None:
            self._scheduler.triton_failed_loads += 1
            self._scheduler.triton_guard.counters.add(LOADS_FAILED)
            RELEASE.on_failed_load(self._scheduler._triton_excluded, job.req_id, keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)


class TritonOffloadingConnectorScheduler(OffloadingConnectorScheduler):  # type: ignore[misc]
    """vLLM's connector scheduler whose complete-chunk lookup is the planner's.

    Why an override: vLLM's ``_lookup_complete_chunks`` rounds the hit down to the
    Mamba grid once, before the groups cut it, so a group with a finer chunk grid
    can leave the hit inside a Mamba chunk (the state restored there is the one
    after the chunk's last token). This override keeps vLLM's lookup for what it
    does besides the answer (deferring on pending or uncertain chunks and on chunks
    still being loaded, event records, the partial-tail state), then answers with
    the planner's hit on the same keys: the largest hit every group can serve, under
    the same caps (``max_num_new_tokens``, ``max_load_tokens``). vLLM's hit is kept
    whenever it is valid by the same rules, so this never loads less than vLLM.
    Sub-chunk partial tails (vLLM's Mamba checkpoints) stay vLLM's.
    """

    triton_plan: OffloadPlan
    triton_invalid_stock_hits: int
    _triton_min_load: int

    def __init__(self, spec: Any, vllm_config: Any, kv_cache_config: Any) -> None:
        """Built directly (as vLLM's own tests build its scheduler), the plan comes from
        the same cache specs and is span-checked against the spec's ``OffloadingConfig``;
        ``TritonOffloadingConnector`` plans once and gives vLLM's scheduler this class."""
        super().__init__(spec, vllm_config, kv_cache_config)
        groups = self.config.kv_group_configs
        plan = plan_from_kv_cache_config(
            kv_cache_config,
            [group.group_idx for group in groups],
            vllm_config.parallel_config,
            int(self.config.blocks_per_chunk),
            eagle_drop=eagle_drop(vllm_config),
        )
        check_spans(
            plan,
            [(group.group_idx, group.tokens_per_block) for group in groups],
            self.config.blocks_per_chunk,
        )
        self._triton_setup(plan)

    def _triton_setup(self, plan: OffloadPlan) -> None:
        self.triton_plan = plan
        self.triton_invalid_stock_hits = 0
        # vLLM returns 0 when a hit adds fewer tokens than some group's chunk: every
        # group is visited, so the smallest hit it loads is the largest chunk.
        self._triton_min_load = max((g.tokens_per_chunk for g in plan.groups), default=0)
        # This backend's specs put a ChunkGuard on their manager (quarantine shared with
        # the tier hooks); another spec's manager gets one here (quarantine and drops).
        guard = getattr(self.manager, "triton_guard", None)
        self.triton_guard: ChunkGuard = guard if guard is not None else ChunkGuard()
        self._triton_failed_jobs: set[int] = set()
        # Request id -> keys whose load failed for it: misses when it looks up again.
        self._triton_excluded: dict[str, set[Any]] = {}
        self.triton_failed_loads = 0
        self.triton_failed_stores = 0

    # ---------------------------------------------------------------- failures

    def _reserve_sync_load(
        self, req_status: Any, num_computed_tokens: int, num_hit_tokens: Any
    ) -> bool:
        if len(self.config.kv_group_configs) > 1:
            # A sync load's failure can only be reported by block id, which vLLM's
            # scheduler refuses with several groups (ids are unique per group only): a
            # hybrid model's loads are asynchronous, their failures reported per request.
            self._current_batch_sync_loads.discard(req_status.req.request_id)
            return False
        return bool(super()._reserve_sync_load(req_status, num_computed_tokens, num_hit_tokens))

    def _update_connector_output(self, connector_output: Any) -> None:
        if not hasattr(self, "triton_guard"):  # built without __init__, as vLLM's tests do
            return super()._update_connector_output(connector_output)
        meta = connector_output.kv_connector_worker_meta
        failed = getattr(meta, "failed_jobs", None) or ()
        bad_keys = getattr(meta, "bad_keys", None) or set()
        self._triton_failed_jobs.update(
            job_id for job_id in failed if job_id >= self._stale_job_threshold
        )
        # The failed jobs vLLM may complete in this call, by the identity of their key
        # lists (vLLM passes job_status.keys itself to complete_store / complete_load).
        failing = {
            id(self._jobs[job_id].keys): self._jobs[job_id]
            for job_id in self._triton_failed_jobs
            if job_id in self._jobs
        }
        proxy = _CompletionHook(self.manager, self, failing)
        self.manager = proxy
        try:
            super()._update_connector_output(connector_output)
        finally:
            self.manager = proxy.manager
        self._triton_failed_jobs.intersection_update(self._jobs)
        guard = self.triton_guard
        if bad_keys:
            for key in bad_keys:
                guard.report(bytes(key), "the host region", "its seal did not verify on a worker")
            guard.quarantine(self.manager, bad_keys)
        else:
            guard.drop_pending(self.manager)

    def request_finished(self, request: Any) -> Any:
        # A scheduler built without __init__ (vLLM 0.34's tests) has no books of its own.
        excluded = getattr(self, "_triton_excluded", None)
        if excluded is not None:
            excluded.pop(request.request_id, None)
        return super().request_finished(request)

    def _lookup_complete_chunks(
        self, req_status: Any, max_num_new_tokens: int | None = None
    ) -> Any:
        """The planner's hit in the release's shape (``RELEASE.lookup_answer``), with vLLM's
        full-attention boundary passed through where it has one (the keys behind it are
        the same)."""
        if not hasattr(self, "triton_plan"):
            # Built without __init__ (vLLM 0.34's tests): no plan, vLLM's own lookup.
            return super()._lookup_complete_chunks(req_status, max_num_new_tokens)
        # One lookup asks the manager once per key: vLLM's scan (which may revisit a
        # key while groups cut the hit) and the planner after it share the answers. With
        # the tiering manager a lookup can start a promotion, so a second ask is not free.
        memo = _LookupMemo(
            self.manager,
            self.triton_guard,
            self._triton_excluded.get(req_status.req.request_id, frozenset()),
        )
        self.manager = memo
        try:
            hit, boundary = self._planned_lookup(req_status, max_num_new_tokens, memo)
        finally:
            self.manager = memo.manager
        return RELEASE.lookup_answer(hit, boundary)

    def _planned_lookup(
        self, req_status: Any, max_num_new_tokens: int | None, memo: _LookupMemo
    ) -> tuple[int | None, int | None]:
        answer = super()._lookup_complete_chunks(req_status, max_num_new_tokens)
        stock, boundary = RELEASE.split_lookup(answer)
        hit = self._planned_hit(req_status, max_num_new_tokens, memo, stock)
        return hit, boundary

    def _planned_hit(
        self, req_status: Any, max_num_new_tokens: int | None, memo: _LookupMemo, stock: Any
    ) -> int | None:
        if stock is None:
            return None  # the backend asked for time, or chunks are being loaded
        plan = self.triton_plan
        request = req_status.req
        computed = req_status.num_locally_computed_tokens
        num_tokens = request.num_tokens
        cap: int | None = None
        if max_num_new_tokens is not None:
            cap = computed + max_num_new_tokens
        if req_status.max_load_tokens is not None:
            limit = computed + req_status.max_load_tokens
            cap = limit if cap is None else min(cap, limit)
        # The hit bound vLLM checks before asking the manager: the windowed groups' last
        # token recomputed, the caps, every group's whole chunks, the Mamba grid.
        bound = num_tokens - (1 if plan.windowed_group_order else 0)
        if cap is not None:
            bound = min(bound, cap)
        for group in plan.groups:
            bound = min(bound, num_tokens // group.tokens_per_chunk * group.tokens_per_chunk)
        if plan.mamba_align_tokens is not None:
            bound -= bound % plan.mamba_align_tokens
        if bound - computed < self._triton_min_load:
            return 0  # vLLM's minimum load, decided before any lookup as vLLM does
        presence = [
            LazyPresence(
                memo,
                state.offload_keys[: num_tokens // group.tokens_per_chunk],
                req_status.req_context,
                LookupResult.HIT,
            )
            for state, group in zip(req_status.group_states, plan.groups, strict=True)
        ]
        hit = plan.lookup(num_tokens, computed, presence, max_hit_end=cap)
        if hit < self._triton_min_load:
            # vLLM's minimum load: a hit adding less than a chunk of any group is
            # skipped (a small load costs a job and lookups for a few tokens).
            hit = 0
        if stock > hit:
            problem = hit_end_problem(plan, num_tokens, computed, presence, computed + stock)
            if problem is None:
                hit = stock  # cannot happen (the planner's hit is the largest valid)
            else:
                self.triton_invalid_stock_hits += 1
                log = logger.warning if self.triton_invalid_stock_hits == 1 else logger.debug
                log(
                    "%s: request %s: vLLM's stock lookup would load %d tokens after %d, "
                    "an invalid hit (%s); loading the planner's %d%s",
                    CONNECTOR_NAME,
                    request.request_id,
                    stock,
                    computed,
                    problem,
                    hit,
                    " (further cases at debug level)"
                    if self.triton_invalid_stock_hits == 1
                    else "",
                )
        if hit != stock and self._hit_chunks_being_loaded(req_status, computed + hit):
            return None
        return hit

    def _hit_chunks_being_loaded(self, req_status: Any, hit_end: int) -> bool:
        """Whether a load ending at ``hit_end`` reads a chunk another request is still
        loading (vLLM delays the request then, as it does for its own hits)."""
        loading = self._chunks_being_loaded
        if not loading or hit_end <= req_status.num_locally_computed_tokens:
            return False
        for group, state in zip(self.triton_plan.groups, req_status.group_states, strict=True):
            lo, top = group.needed_chunks(hit_end)
            lo = max(lo, req_status.num_locally_computed_tokens // group.tokens_per_chunk)
            if any(key in loading for key in state.offload_keys[lo:top]):
                return True
        return False


def _blocks_by_group(gpu_spec: Any) -> tuple[tuple[int, ...], ...]:
    """A GPU spec's block ids per group (vLLM orders them by group)."""
    ids = [int(b) for b in gpu_spec.block_ids]
    sizes = list(getattr(gpu_spec, "group_sizes", None) or [len(ids)])
    groups, start = [], 0
    for size in sizes:
        groups.append(tuple(ids[start : start + int(size)]))
        start += int(size)
    return tuple(groups)


def _refused_result(job_id: int, gpu_spec: Any) -> Any:
    """The result of a job whose submit raised or was refused: failed, and for a load
    every GPU block it was to fill (none of them holds its bytes)."""
    if gpu_spec is None or not hasattr(gpu_spec, "block_ids"):
        return TransferResult(job_id, False, 0, 0.0)
    return TritonTransferResult(
        job_id,
        False,
        0,
        0.0,
        failed_blocks=_blocks_by_group(gpu_spec),
        problem="the job could not be submitted",
    )


class _FailSoftWorker:
    """The offloading worker as vLLM's connector worker calls it: a submit that raises
    or is refused becomes a failed job reported by ``get_finished`` (vLLM asserts every
    submit), its result naming the GPU blocks a load was to fill; each failed load's
    result passes through ``on_failed_load(result)`` (the connector worker's, which may
    report it by block ids and hand vLLM another result). It keeps no per-job state:
    every failed result names its own blocks (``TritonTransferResult.failed_blocks``), and
    this project's worker queues a refused job's report with its own
    (``report_refused``); only another worker (vLLM's, under a spec of vLLM's) has its
    refused reports kept here until ``get_finished``."""

    def __init__(self, worker: Any, on_failed_load: Any) -> None:
        self.worker = worker
        self._refused: list[Any] = []
        self._report_refused = getattr(worker, "report_refused", self._refused.append)
        self._on_failed_load = on_failed_load

    def _submit(self, what: str, job_id: int, call: Any, gpu_spec: Any = None) -> bool:
        in_flight = getattr(self.worker, "_in_flight", None)
        if in_flight is not None and job_id in in_flight():
            # vLLM submits its deferred jobs in a loop it clears afterwards: after an
            # interrupt cut the loop it submits them again. A job already running (or
            # lost to the interrupt and reported failed) is not started twice.
            logger.debug("%s: %s job %r is already in flight", CONNECTOR_NAME, what, job_id)
            return True
        try:
            accepted = bool(call())
        except Exception:  # a job that cannot run fails; the engine keeps serving
            logger.exception("%s: %s job %r could not be submitted", CONNECTOR_NAME, what, job_id)
            accepted = False
        if not accepted:
            self._report_refused(_refused_result(job_id, gpu_spec))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._submit(
            "store", job_id, lambda: self.worker.submit_store(job_id, src_spec, dst_spec)
        )

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        return self._submit(
            "load",
            job_id,
            lambda: self.worker.submit_load(job_id, src_spec, dst_spec, expedited=expedited),
            dst_spec,
        )

    def get_finished(self) -> list[Any]:
        results = list(self.worker.get_finished())
        if self._refused:
            results = [*self._refused, *results]
            self._refused.clear()
        return [result if result.success else self._on_failed_load(result) for result in results]

    def wait(self, job_ids: Any) -> None:
        refused = {result.job_id for result in self._refused}
        self.worker.wait({job_id for job_id in job_ids if job_id not in refused})

    def shutdown(self) -> None:
        self.worker.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


class TritonOffloadingConnectorWorker(OffloadingConnectorWorker):  # type: ignore[misc]
    """vLLM's connector worker that reports failed transfers instead of asserting.

    A failed load names its GPU blocks, and the keys whose chunks failed verification go
    to the scheduler (quarantined there). Who tells vLLM's core scheduler of a failed
    load, and in what shape, is the release's (:mod:`triton_offload.vllm.releases`): a
    single-group load by its GPU block ids (vLLM's ``kv_load_failure_policy`` recomputes
    from the first of them, or fails the request), a hybrid model's per request (vLLM
    refuses block ids that are unique per group only; hybrid models get no sync loads).
    A failed store is a failed job in the metadata and completes unpublished. Jobs are
    submitted with GPU block ids (this project's worker builds its own tables from them).
    """

    def _triton_setup(self, num_groups: int) -> None:
        self.triton_num_groups = num_groups
        self._connector_worker_meta = TritonWorkerMetadata()
        self._triton_load_errors: set[int] = set()
        #: Requests whose load failed, where the release reports them per request.
        self._triton_failed_requests: set[str] = set()
        #: Layer-wise sync loads (None: off, see triton_offload.vllm.layerwise).
        self._triton_layerwise: LayerwiseLoads | None = None
        self._triton_layer_order: list[str] = []
        #: This step's forward replays a full CUDA graph (set by start_load_kv).
        self._triton_full_graph_step = False

    def register_kv_caches(self, kv_caches: Any) -> None:
        # The order vLLM registered the layers in: the forward's, the stages' order.
        self._triton_layer_order = [str(name) for name in kv_caches]
        super().register_kv_caches(kv_caches)

    def _init_worker(self, kv_caches: Any) -> None:
        self.spec.reports_failed_loads = True  # layer-wise loads may be set up
        super()._init_worker(kv_caches)
        self.worker = _FailSoftWorker(self.worker, self._triton_failed_load)
        self._triton_layerwise = self._triton_layerwise_setup()

    def _triton_layerwise_setup(self) -> LayerwiseLoads | None:
        """The layer map of this worker's planes, when ``layerwise_loads`` is on."""
        options = getattr(self.spec, "engine_options", None)
        if options is None or not options.layerwise_loads:
            return None
        engine = getattr(self.worker.worker, "engine", None)
        if engine is None:
            return None  # no layer of any offloaded group on this worker
        groups = list(self.spec.config.groups)
        cache_groups = self.kv_cache_config.kv_cache_groups
        hooked = {
            index
            for index, group in enumerate(groups)
            if isinstance(cache_groups[int(group.group_id)].kv_cache_spec, AttentionSpec)
        }
        context = getattr(
            getattr(self.vllm_config, "compilation_config", None), "static_forward_context", {}
        )
        sharing = {
            str(name): str(layer.kv_sharing_target_layer_name)
            for name, layer in (context or {}).items()
            if getattr(layer, "kv_sharing_target_layer_name", None)
        }
        stages = layer_stages(
            engine.layout,
            [list(group.layer_names) for group in groups],
            hooked,
            self._triton_layer_order,
            sharing,
        )
        state = LayerwiseLoads(stages)
        usable, why = attention_runs_outside_graphs(self.vllm_config)
        if not usable:
            state.turn_off(why)
        logger.info(
            "%s: layer-wise sync loads %s: %d layer stages, %d planes loaded whole first",
            CONNECTOR_NAME,
            "on" if state.active else f"off ({state.off_reason})",
            len(stages.stages) - 1,
            len(stages.stages[0]),
        )
        return state

    def triton_wait_layer(self, layer_name: str) -> None:
        """vLLM's ``wait_for_layer_load``: wait for that layer's stage only."""
        if self._triton_layerwise is not None:
            self._triton_layerwise.wait(layer_name)

    def _triton_start_layered(self, metadata: Any) -> bool:
        """This step's loads with the sync ones layer by layer; False: not this step
        (the caller runs the whole-job path)."""
        layered = self._triton_layerwise
        full_graph, self._triton_full_graph_step = self._triton_full_graph_step, False
        if layered is None or not layered.active:
            return False
        if not any(entry.sync for entry in metadata.load_jobs.values()):
            return False
        if full_graph:
            layered.turn_off("a step replayed a full CUDA graph (no per-layer hooks)")
            return False
        self._submit_deferred_stores()
        staged: list[tuple[int, Any, Any]] = []
        for job_id, entry in metadata.load_jobs.items():
            if entry.sync:
                self._load_jobs[job_id] = None
                staged.append((job_id, entry.src_spec, entry.dst_spec))
            else:
                self._load_jobs[job_id] = entry.req_id
                self.worker.submit_load(job_id, entry.src_spec, entry.dst_spec)
        try:
            started = layered.start(self.worker.worker, staged)
        except Exception:
            logger.exception("%s: layer-wise load of jobs %s failed", CONNECTOR_NAME, staged)
            started = False
        if not started:
            # Whole jobs instead (a job that cannot run is reported failed there).
            for job_id, src_spec, dst_spec in staged:
                self.worker.submit_load(job_id, src_spec, dst_spec, expedited=True)
            self.worker.wait({job_id for job_id, _, _ in staged})
        return True

    def _triton_join_layered(self) -> None:
        """Before the step's report: the layer-wise jobs ended (their verdicts join
        their results); a stage the forward skipped fails its jobs."""
        if self._triton_layerwise is not None:
            self._triton_layerwise.finish()

    def take_load_errors(self) -> set[int]:
        errors, self._triton_load_errors = self._triton_load_errors, set()
        return errors

    def take_failed_requests(self) -> set[str]:
        """The requests whose async load failed, where the release routes them per request
        through the connector (``RELEASE.route_failed_load``)."""
        failed, self._triton_failed_requests = self._triton_failed_requests, set()
        return failed

    # --------------------------------------------------- submit and finish, per release

    def _submit_deferred_stores(self) -> None:
        for job_id, src_spec, dst_spec in self._unsubmitted_store_jobs:
            self.worker.submit_store(job_id, src_spec, dst_spec)
        self._unsubmitted_store_jobs.clear()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        RELEASE.handle_preemptions(self, kv_connector_metadata, super().handle_preemptions)

    def start_kv_transfers(self, metadata: Any) -> None:
        if self._triton_start_layered(metadata):
            return None
        RELEASE.start_kv_transfers(self, metadata, super().start_kv_transfers)
        return None

    def _triton_failed_load(self, result: Any) -> Any:
        """A failed job's result on its way to vLLM: a load's bad keys go to the
        scheduler, the release routes it (``RELEASE.route_failed_load``: by block id or
        per request) and returns the result vLLM's books should see."""
        job_id = result.job_id
        if job_id not in self._load_jobs:
            return result  # a store: the metadata's failed_jobs reports it
        req_id = self._load_jobs[job_id]
        failed = getattr(result, "failed_blocks", ())
        self._connector_worker_meta.bad_keys.update(getattr(result, "bad_keys", ()))
        logger.warning(
            "%s: load job %r%s failed (%s): %d GPU blocks not loaded, vLLM's "
            "kv_load_failure_policy decides (recompute or fail)",
            CONNECTOR_NAME,
            job_id,
            "" if req_id is None else f" of request {req_id}",
            getattr(result, "problem", "") or "the copy failed",
            sum(len(group) for group in failed),
        )
        return RELEASE.route_failed_load(self, result, failed, req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self._triton_join_layered()
        assert self.worker is not None
        return RELEASE.get_finished(self, finished_req_ids, super().get_finished)

    def build_connector_worker_meta(self) -> Any:
        if not self._connector_worker_meta.completed_jobs:
            return None
        meta, self._connector_worker_meta = self._connector_worker_meta, TritonWorkerMetadata()
        return meta


def _region_alignment() -> int:
    """The alignment of a chunk row in vLLM's shared region (vLLM's CPU spec's)."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    return int(CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)


class TritonOffloadingConnector(RELEASE.ConnectorClassHooks, OffloadingConnector):  # type: ignore[misc,name-defined]
    """vLLM's ``OffloadingConnector`` with spans cross-checked and planned lookups.

    Uses ``TritonOffloadingSpec`` unless ``kv_connector_extra_config`` names a
    ``spec_name``. Its configuration is checked (:meth:`check_transfer_config`) at the
    first call vLLM makes into the class with it, in the front-end process while vLLM
    builds its config, before the model loads (the release adapter says which call).
    At start-up (scheduler and every worker) the planner's spans from
    the cache specs must equal vLLM's ``OffloadingConfig`` (ValueError naming each
    group otherwise). The scheduler role answers complete-chunk lookups with the
    planner (see ``TritonOffloadingConnectorScheduler``); vLLM builds its scheduler
    inside ``OffloadingConnector.__init__`` with no hook, so the instance is given
    the subclass afterwards (it adds methods, no state vLLM reads).
    """

    @classmethod
    def check_transfer_config(cls, kv_transfer_config: Any) -> None:
        """ValueError (or TypeError) naming the first mistake in the extra config of the
        spec this connector would build (:func:`check_extra_config`); vLLM's own specs,
        named by ``spec_name``, are left to vLLM."""
        extra = kv_transfer_config.kv_connector_extra_config
        spec_name = extra.get("spec_name", SPEC_NAME) if isinstance(extra, Mapping) else SPEC_NAME
        if spec_name in OWN_SPECS:
            check_extra_config(extra, spec_name)
            # The model is described by now (its layers, heads, dtype): a capacity below
            # the least a chunk of a plain attention model takes is refused before it
            # loads.
            vllm_config = building_vllm_config()
            if vllm_config is not None:
                check_capacity_before_load(extra, vllm_config, _region_alignment())

    @classmethod
    def on_class_lookup(cls) -> None:
        """Called by this package's lazy loader whenever the class is looked up: where the
        release hands the class no config, the one vLLM's connector factory is looking it
        up for is checked now."""
        config = RELEASE.config_of_class_lookup()
        if config is not None and getattr(config, "kv_connector", None) == CONNECTOR_NAME:
            cls.check_transfer_config(config)

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        transfer = vllm_config.kv_transfer_config
        if transfer is None:
            raise ValueError(f"{CONNECTOR_NAME} needs vllm_config.kv_transfer_config")
        extra = transfer.kv_connector_extra_config
        if "spec_name" not in extra:
            extra["spec_name"] = SPEC_NAME
            extra.setdefault("spec_module_path", MODULE_PATH)
        offloading_config = build_offloading_config(vllm_config, kv_cache_config)
        self.triton_plan: OffloadPlan = plan_from_kv_cache_config(
            kv_cache_config,
            get_offloading_group_ids(kv_cache_config),
            vllm_config.parallel_config,
            int(offloading_config.cache.blocks_per_chunk),
            eagle_drop=eagle_drop(vllm_config),
        )
        check_spans(
            self.triton_plan,
            [(group.group_id, group.tokens_per_block) for group in offloading_config.groups],
            offloading_config.cache.blocks_per_chunk,
        )
        token = PLANNED_LOOKUPS.set(True)
        # The spec sees vLLM's OffloadingConfig, which names the model but not the
        # revision it resolved: handed over here, in the scheduler and every worker alike.
        revision = SERVED_REVISION.set(ModelRevision.from_model_config(vllm_config.model_config))
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            SERVED_REVISION.reset(revision)
            PLANNED_LOOKUPS.reset(token)
        plan = self.triton_plan
        if role == KVConnectorRole.SCHEDULER:
            scheduler = self.connector_scheduler
            assert scheduler is not None
            scheduler.__class__ = TritonOffloadingConnectorScheduler
            scheduler._triton_setup(plan)
            hazards = stock_lookup_hazards(
                [
                    (
                        g.spec.label,
                        g.tokens_per_chunk,
                        g.spec.mamba_cache_mode if g.kind is GroupKind.MAMBA else None,
                    )
                    for g in plan.groups
                ]
            )
            logger.info(
                "%s (triton_offload): spans %s tokens per block match vLLM's "
                "OffloadingConfig; lookups planned (%s%s)%s",
                CONNECTOR_NAME,
                [g.tokens_per_block for g in plan.groups],
                ", ".join(f"{g.spec.label}: {g.kind.value}" for g in plan.groups),
                # Only where a Mamba group sets one: "None" on a Llama reads as a lost group.
                ""
                if plan.mamba_align_tokens is None
                else f", mamba_align_tokens={plan.mamba_align_tokens}",
                "; vLLM's stock lookup could end off the Mamba grid here: " + "; ".join(hazards)
                if hazards
                else "",
            )
        else:
            worker = self.connector_worker
            if worker is not None:
                worker.__class__ = TritonOffloadingConnectorWorker
                worker._triton_setup(len(plan.groups))
            logger.info(
                "%s (triton_offload): worker spans %s tokens per block match vLLM's "
                "OffloadingConfig",
                CONNECTOR_NAME,
                [g.tokens_per_block for g in plan.groups],
            )

    # ------------------------------------------------------------ layer-wise loads

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self.connector_worker
        if isinstance(worker, TritonOffloadingConnectorWorker):
            mode = getattr(forward_context, "cudagraph_runtime_mode", None)
            worker._triton_full_graph_step = "FULL" in str(getattr(mode, "name", mode) or "")
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        worker = self.connector_worker
        if isinstance(worker, TritonOffloadingConnectorWorker):
            worker.triton_wait_layer(layer_name)

    # ------------------------------------------------------------------ metrics

    def get_kv_connector_stats(self) -> Any:
        """vLLM's offloading stats (the scheduler's) with this backend's counts since the
        last call (the scheduler's or this worker's, see triton_offload.vllm.counters);
        None when there is nothing, as vLLM wants an idle worker's answer."""
        stats = super().get_kv_connector_stats()
        scheduler, worker = self.connector_scheduler, self.connector_worker
        counters = None
        if scheduler is not None:
            guard = getattr(scheduler, "triton_guard", None)
            counters = None if guard is None else guard.counters
        elif worker is not None:
            # The offloading worker (this project's; another spec's has no counters),
            # there once vLLM registered the caches.
            counters = getattr(getattr(worker, "worker", None), "counters", None)
        return stats if counters is None else stats_of(counters.drain(), stats)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """vLLM's offloading metrics and, beside them, this backend's counters."""
        inner = super().build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
        return TritonPromMetrics(
            inner, vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # ------------------------------------------------------------ load failures

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks whose load failed (one cache group; vLLM's policy recomputes them
        or fails their requests)."""
        worker = self.connector_worker
        if isinstance(worker, TritonOffloadingConnectorWorker):
            return worker.take_load_errors()
        return set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        worker = self.connector_worker
        if isinstance(worker, TritonOffloadingConnectorWorker):
            return RELEASE.transfer_results(worker, results)
        return results


__all__ = [
    "TritonOffloadingConnector",
    "TritonOffloadingConnectorScheduler",
    "TritonOffloadingConnectorWorker",
]
