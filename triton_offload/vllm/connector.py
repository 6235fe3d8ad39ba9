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

The plan, the span check and the manager-backed presence rows live in
:mod:`triton_offload.vllm.planning`; this module holds only vLLM's two subclasses.
"""

from __future__ import annotations

from typing import Any

from triton_offload.planner.groups import GroupKind
from triton_offload.planner.lookup import hit_end_problem
from triton_offload.planner.plan import OffloadPlan
from triton_offload.vllm.compat import (
    CONNECTOR_NAME,
    MODULE_PATH,
    SPEC_NAME,
    logger,
    supported_vllm_api,
)
from triton_offload.vllm.planning import (
    PLANNED_LOOKUPS,
    LazyPresence,
    check_spans,
    plan_from_kv_cache_config,
    stock_lookup_hazards,
)

with supported_vllm_api():
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
        get_offloading_group_ids,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.kv_offload.base import LookupResult


class _LookupMemo:
    """vLLM's offloading manager for the span of one lookup: each key is asked once and
    its answer kept, so vLLM's scan and the planner after it share them. Everything but
    ``lookup`` goes to the manager itself."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self._answers: dict[Any, Any] = {}

    def lookup(self, key: Any, req_context: Any) -> Any:
        answer = self._answers.get(key)
        if answer is None:
            answer = self._answers[key] = self.manager.lookup(key, req_context)
        return answer

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

    def _lookup_complete_chunks(
        self, req_status: Any, max_num_new_tokens: int | None = None
    ) -> int | None:
        # One lookup asks the manager once per key: vLLM's scan (which may revisit a
        # key while groups cut the hit) and the planner after it share the answers. With
        # the tiering manager a lookup can start a promotion, so a second ask is not free.
        memo = _LookupMemo(self.manager)
        self.manager = memo
        try:
            return self._planned_lookup(req_status, max_num_new_tokens, memo)
        finally:
            self.manager = memo.manager

    def _planned_lookup(
        self, req_status: Any, max_num_new_tokens: int | None, memo: _LookupMemo
    ) -> int | None:
        stock = super()._lookup_complete_chunks(req_status, max_num_new_tokens)
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


class TritonOffloadingConnector(OffloadingConnector):  # type: ignore[misc]
    """vLLM's ``OffloadingConnector`` with spans cross-checked and planned lookups.

    Uses ``TritonOffloadingSpec`` unless ``kv_connector_extra_config`` names a
    ``spec_name``. At start-up (scheduler and every worker) the planner's spans from
    the cache specs must equal vLLM's ``OffloadingConfig`` (ValueError naming each
    group otherwise). The scheduler role answers complete-chunk lookups with the
    planner (see ``TritonOffloadingConnectorScheduler``); vLLM builds its scheduler
    inside ``OffloadingConnector.__init__`` with no hook, so the instance is given
    the subclass afterwards (it adds methods, no state vLLM reads).
    """

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
        )
        check_spans(
            self.triton_plan,
            [(group.group_id, group.tokens_per_block) for group in offloading_config.groups],
            offloading_config.cache.blocks_per_chunk,
        )
        token = PLANNED_LOOKUPS.set(True)
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
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
                "OffloadingConfig; lookups planned (%s, mamba_align_tokens=%s)%s",
                CONNECTOR_NAME,
                [g.tokens_per_block for g in plan.groups],
                ", ".join(f"{g.spec.label}: {g.kind.value}" for g in plan.groups),
                plan.mamba_align_tokens,
                "; vLLM's stock lookup could end off the Mamba grid here: " + "; ".join(hazards)
                if hazards
                else "",
            )
        else:
            logger.info(
                "%s (triton_offload): worker spans %s tokens per block match vLLM's "
                "OffloadingConfig",
                CONNECTOR_NAME,
                [g.tokens_per_block for g in plan.groups],
            )


__all__ = ["TritonOffloadingConnector", "TritonOffloadingConnectorScheduler"]
