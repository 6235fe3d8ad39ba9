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

Only this module and :mod:`triton_offload.vllm` import vllm; the classes are built on
first access (``triton_offload.vllm.TritonOffloadingConnector``).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Sequence
from typing import Any

from triton_offload.groups import GroupKind, GroupSpec, ParallelSpec
from triton_offload.lookup import ComputedPresence, hit_end_problem
from triton_offload.plan import OffloadPlan, plan_offload

__all__ = [
    "CONNECTOR_NAME",
    "LazyPresence",
    "build_connector_classes",
    "check_spans",
    "group_specs_from_kv_cache_config",
    "plan_from_kv_cache_config",
    "stock_lookup_hazards",
    "warn_stock_lookup_hazards",
]

CONNECTOR_NAME = "TritonOffloadingConnector"

# A logger below "vllm": vLLM's handler sits there and stops propagation.
logger = logging.getLogger("vllm.triton_offload")

# Set while TritonOffloadingConnector builds vLLM's connector: the spec's warning about
# the stock lookup is moot there (this connector's lookups are the planner's).
_PLANNED_LOOKUPS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "triton_offload_planned_lookups", default=False
)


# ------------------------------------------------------------------ plan from specs


def _layer_spec(kv_cache_spec: Any) -> Any:
    """The per-layer spec of a group (a ``UniformTypeKVCacheSpecs`` holds one per layer,
    all of one type)."""
    from vllm.v1.kv_cache_interface import iter_layer_specs

    return next(iter(iter_layer_specs(kv_cache_spec)))


def group_specs_from_kv_cache_config(
    kv_cache_config: Any, group_ids: Sequence[int]
) -> list[GroupSpec]:
    """The planner's groups for vLLM's cache groups ``group_ids`` (offloading order).

    Mamba keeps its cache mode and is never DCP-scaled, whatever its spec says (scaling
    it was vLLM's Mamba span bug). Attention kinds are DCP-sharded unless vLLM marks the
    cache replicated (``dcp_sharded=False``). A sliding window's extra retained tokens
    count as window: vLLM keeps (and loads) their blocks. A ``FullAttentionSpec`` that
    records a window (the hybrid allocator off) allocates every block: full attention.
    """
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    specs = []
    for group_id in group_ids:
        group = kv_cache_config.kv_cache_groups[group_id]
        spec = _layer_spec(group.kv_cache_spec)
        block_size = int(group.kv_cache_spec.block_size)
        name = f"vllm group {group_id}"
        eagle = bool(getattr(group, "is_eagle_group", False))
        replicated = None if getattr(spec, "dcp_sharded", True) else False
        if isinstance(spec, MambaSpec):
            specs.append(
                GroupSpec(
                    GroupKind.MAMBA,
                    block_size,
                    mamba_cache_mode=spec.mamba_cache_mode,
                    is_eagle=eagle,
                    name=name,
                )
            )
        elif isinstance(spec, SlidingWindowSpec):
            window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0))
            specs.append(
                GroupSpec(
                    GroupKind.SLIDING_WINDOW,
                    block_size,
                    sliding_window=window,
                    is_eagle=eagle,
                    dcp_sharded=replicated,
                    name=name,
                )
            )
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            specs.append(
                GroupSpec(
                    GroupKind.CHUNKED_LOCAL,
                    block_size,
                    attention_chunk_size=int(spec.attention_chunk_size),
                    is_eagle=eagle,
                    dcp_sharded=replicated,
                    name=name,
                )
            )
        elif isinstance(spec, FullAttentionSpec):
            kind = GroupKind.MLA if isinstance(spec, MLAAttentionSpec) else GroupKind.FULL_ATTENTION
            specs.append(
                GroupSpec(kind, block_size, is_eagle=eagle, dcp_sharded=replicated, name=name)
            )
        else:
            raise ValueError(
                f"{CONNECTOR_NAME} cannot plan vLLM cache group {group_id}: "
                f"{type(spec).__name__} is not full attention, MLA, sliding window, chunked "
                "local attention or Mamba"
            )
    return specs


def plan_from_kv_cache_config(
    kv_cache_config: Any, group_ids: Sequence[int], parallel_config: Any, blocks_per_chunk: int
) -> OffloadPlan:
    """The plan of vLLM's offloaded groups, from their cache specs and the parallel sizes."""
    parallel = ParallelSpec(
        tp_size=int(parallel_config.tensor_parallel_size),
        dcp_size=int(parallel_config.decode_context_parallel_size),
        pcp_size=int(parallel_config.prefill_context_parallel_size),
    )
    specs = group_specs_from_kv_cache_config(kv_cache_config, group_ids)
    return plan_offload(specs, parallel, blocks_per_chunk=blocks_per_chunk)


def check_spans(plan: OffloadPlan, offloading_config: Any) -> None:
    """Raise ``ValueError`` unless every group's planner span equals vLLM's.

    The message names each disagreeing group, its kind and both numbers, so a vLLM
    release that scales a Mamba span by DCP again (or forgets to scale attention)
    fails at start-up instead of storing keys that name the wrong tokens.
    """
    vllm_groups = tuple(offloading_config.groups)
    if len(vllm_groups) != len(plan.groups):
        raise ValueError(
            f"{CONNECTOR_NAME}: vLLM's OffloadingConfig has {len(vllm_groups)} groups, the "
            f"planner {len(plan.groups)}"
        )
    if int(offloading_config.cache.blocks_per_chunk) != plan.blocks_per_chunk:
        raise ValueError(
            f"{CONNECTOR_NAME}: vLLM's blocks_per_chunk "
            f"{offloading_config.cache.blocks_per_chunk} != the planner's {plan.blocks_per_chunk}"
        )
    mismatches = []
    dcp = plan.parallel.dcp_size
    for group, theirs in zip(plan.groups, vllm_groups, strict=True):
        if group.tokens_per_block == int(theirs.tokens_per_block):
            continue
        scaled = f"x DCP {dcp}" if group.spec.is_dcp_sharded else "not DCP-scaled"
        mismatches.append(
            f"group {theirs.group_id} ({group.kind.value}, block {group.block_size}, "
            f"{scaled}): planner {group.tokens_per_block} tokens per block, vLLM "
            f"{theirs.tokens_per_block}"
        )
    if mismatches:
        raise ValueError(
            f"{CONNECTOR_NAME}: vLLM's OffloadingConfig spans disagree with the planner's "
            f"(attention x DCP, Mamba x1, PCP never): {'; '.join(mismatches)}"
        )


# ------------------------------------------------------------ the stock lookup's hazard


def stock_lookup_hazards(groups: Sequence[tuple[str, int, str | None]]) -> list[str]:
    """Where vLLM 0.33's stock lookup can end a hit inside a Mamba chunk.

    ``groups``: ``(label, tokens_per_chunk, mamba)`` per group, ``mamba`` being the
    Mamba cache mode, ``"?"`` for a group that may be Mamba, None for other groups.
    vLLM rounds the hit down to the Mamba grid once (``align`` mode only), before the
    groups cut it; a later cut by a group whose chunk is not a multiple of the Mamba
    chunk can land inside a Mamba chunk, and the Mamba group then accepts the chunk
    holding the hit: its state, taken after the chunk's last token, is restored at an
    earlier position. In ``none`` mode nothing is rounded at all.
    """
    hazards = []
    for label, chunk, mode in groups:
        if mode is None:
            continue
        if mode == "none":
            hazards.append(f"{label} (Mamba, mode none: no round-down at all)")
            continue
        cutters = [
            f"{other} ({other_chunk}-token chunks)"
            for other, other_chunk, _ in groups
            if other != label and other_chunk % chunk
        ]
        if cutters:
            maybe = " if it is Mamba state" if mode == "?" else ""
            hazards.append(f"{label} ({chunk}-token chunks{maybe}) cut by {', '.join(cutters)}")
    return hazards


def warn_stock_lookup_hazards(offloading_config: Any) -> list[str]:
    """Log a warning when vLLM's stock lookup (``OffloadingConnector`` with this
    project's spec) can end a hit off a Mamba grid; returns the hazards found.

    ``OffloadingConfig`` carries no cache kinds: a group whose window is one chunk is
    taken for possible Mamba state (Mamba's window is one chunk), in ``align`` mode
    (the mode with prefix states). Silent under ``TritonOffloadingConnector``, whose
    lookups follow the planner.
    """
    if _PLANNED_LOOKUPS.get():
        return []
    bpc = int(offloading_config.cache.blocks_per_chunk)
    groups = [
        (
            f"group {g.group_id}",
            int(g.tokens_per_block) * bpc,
            "?" if g.sliding_window_size_in_chunks == 1 else None,
        )
        for g in offloading_config.groups
    ]
    hazards = stock_lookup_hazards(groups)
    if hazards:
        logger.warning(
            "triton_offload: vLLM's stock OffloadingConnector lookup can end a hit inside "
            "a Mamba chunk here and restore a state at the wrong position: %s. Select "
            '"kv_connector": "%s", "kv_connector_module_path": "triton_offload.vllm" to '
            "plan lookups with the Mamba round-down",
            "; ".join(hazards),
            CONNECTOR_NAME,
        )
    return hazards


# ------------------------------------------------------------------ presence


class LazyPresence(ComputedPresence):
    """One group's chunk presence, asked of vLLM's manager only for the chunks a scan
    touches (memoised): a lookup costs manager calls in proportion to what it reads,
    as vLLM's own scans do. Only a ready hit (``LookupResult.HIT``) counts as present;
    a pending or uncertain chunk reads as absent (a smaller hit now, never a wrong one).
    """

    def __init__(self, manager: Any, keys: Sequence[Any], req_context: Any, hit: Any) -> None:
        self._manager = manager
        self._keys = keys
        self._context = req_context
        self._hit = hit
        self._known: dict[int, bool] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def chunk_present(self, index: int) -> bool:
        known = self._known.get(index)
        if known is None:
            result = self._manager.lookup(self._keys[index], self._context)
            known = self._known[index] = result is self._hit
        return known

    @property
    def lookups(self) -> int:
        """Manager lookups made so far."""
        return len(self._known)


# ------------------------------------------------------------------ the vLLM classes


def build_connector_classes() -> dict[str, type]:
    """Build ``TritonOffloadingConnector`` (and its scheduler) on vLLM's classes."""
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

    from triton_offload.vllm import SPEC_NAME, import_vllm_api

    import_vllm_api()  # the version and API check of the spec module

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

        def _triton_setup(self, plan: OffloadPlan) -> None:
            self.triton_plan = plan
            self.triton_invalid_stock_hits = 0

        def _lookup_complete_chunks(
            self, req_status: Any, max_num_new_tokens: int | None = None
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
            presence = [
                LazyPresence(
                    self.manager,
                    state.offload_keys[: num_tokens // group.tokens_per_chunk],
                    req_status.req_context,
                    LookupResult.HIT,
                )
                for state, group in zip(req_status.group_states, plan.groups, strict=True)
            ]
            hit = plan.lookup(num_tokens, computed, presence, max_hit_end=cap)
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
                extra.setdefault("spec_module_path", "triton_offload.vllm")
            offloading_config = build_offloading_config(vllm_config, kv_cache_config)
            self.triton_plan: OffloadPlan = plan_from_kv_cache_config(
                kv_cache_config,
                get_offloading_group_ids(kv_cache_config),
                vllm_config.parallel_config,
                int(offloading_config.cache.blocks_per_chunk),
            )
            check_spans(self.triton_plan, offloading_config)
            token = _PLANNED_LOOKUPS.set(True)
            try:
                super().__init__(vllm_config, role, kv_cache_config)
            finally:
                _PLANNED_LOOKUPS.reset(token)
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

    for cls in (TritonOffloadingConnectorScheduler, TritonOffloadingConnector):
        cls.__module__ = "triton_offload.vllm"
        cls.__qualname__ = cls.__name__
    return {
        CONNECTOR_NAME: TritonOffloadingConnector,
        "TritonOffloadingConnectorScheduler": TritonOffloadingConnectorScheduler,
    }
