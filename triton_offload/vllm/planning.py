"""The planner inside vLLM's scheduler: plans from vLLM's cache specs, span checks, presence.

Used by :mod:`triton_offload.vllm.connector` (planned lookups) and
:mod:`triton_offload.vllm.spec` (the warning about vLLM's stock lookup under the plain
connector). The plan is built from the cache specs in vLLM's ``KVCacheConfig``, so each
group keeps its real kind (full attention, MLA, sliding window, chunked local, Mamba
with its cache mode, EAGLE); :func:`check_spans` cross-checks its spans against vLLM's
``OffloadingConfig``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

from triton_offload.planner.groups import GroupKind, GroupSpec, ParallelSpec
from triton_offload.planner.lookup import ComputedPresence
from triton_offload.planner.plan import OffloadPlan, plan_offload
from triton_offload.vllm.compat import (
    CONNECTOR_NAME,
    MODULE_PATH,
    logger,
    supported_vllm_api,
)
from triton_offload.vllm.releases import RELEASE

with supported_vllm_api():
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        iter_layer_specs,
    )

# Set while TritonOffloadingConnector builds vLLM's connector: the spec's warning about
# the stock lookup is moot there (this connector's lookups are the planner's).
PLANNED_LOOKUPS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "triton_offload_planned_lookups", default=False
)


def _layer_spec(kv_cache_spec: Any) -> Any:
    """The per-layer spec of a group (a ``UniformTypeKVCacheSpecs`` holds one per layer,
    all of one type)."""
    return next(iter(iter_layer_specs(kv_cache_spec)))


def group_specs_from_kv_cache_config(
    kv_cache_config: Any, group_ids: Sequence[int], *, eagle_drop: bool = True
) -> list[GroupSpec]:
    """The planner's groups for vLLM's cache groups ``group_ids`` (offloading order).

    Mamba keeps its cache mode and is never DCP-scaled, whatever its spec says (scaling
    it was vLLM's Mamba span bug). Attention kinds are DCP-sharded unless vLLM marks the
    cache replicated (``dcp_sharded=False``). A sliding window's extra retained tokens
    count as window: vLLM keeps (and loads) their blocks. A ``FullAttentionSpec`` that
    records a window (the hybrid allocator off) allocates every block: full attention.
    ``eagle_drop=False`` (vLLM 0.34 with lookahead block hashes, where a draft group's
    newest chunk has a stable hash and vLLM stores and loads it) plans EAGLE groups as
    ordinary ones.
    """
    specs = []
    for group_id in group_ids:
        group = kv_cache_config.kv_cache_groups[group_id]
        spec = _layer_spec(group.kv_cache_spec)
        block_size = int(group.kv_cache_spec.block_size)
        name = f"vllm group {group_id}"
        eagle = eagle_drop and bool(getattr(group, "is_eagle_group", False))
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
    kv_cache_config: Any,
    group_ids: Sequence[int],
    parallel_config: Any,
    blocks_per_chunk: int,
    *,
    eagle_drop: bool = True,
) -> OffloadPlan:
    """The plan of vLLM's offloaded groups, from their cache specs and the parallel sizes
    (``eagle_drop``: see :func:`group_specs_from_kv_cache_config`)."""
    # vLLM's scheduler reads only the DCP size of its parallel config; TP and PCP never
    # scale a span, so a config without them (one rank each) plans the same.
    dcp = int(parallel_config.decode_context_parallel_size)
    parallel = ParallelSpec(
        tp_size=int(getattr(parallel_config, "tensor_parallel_size", dcp)),
        dcp_size=dcp,
        pcp_size=int(getattr(parallel_config, "prefill_context_parallel_size", 1)),
    )
    specs = group_specs_from_kv_cache_config(kv_cache_config, group_ids, eagle_drop=eagle_drop)
    return plan_offload(specs, parallel, blocks_per_chunk=blocks_per_chunk)


def eagle_drop(vllm_config: Any) -> bool:
    """Whether vLLM drops an EAGLE group's newest chunk (the release's rule)."""
    return bool(RELEASE.eagle_drop(vllm_config))


def check_spans(plan: OffloadPlan, spans: Sequence[tuple[int, int]], blocks_per_chunk: int) -> None:
    """Raise ``ValueError`` unless every group's planner span equals vLLM's.

    ``spans``: vLLM's ``(group id, tokens_per_block)`` per offloaded group, in order.
    The message names each disagreeing group, its kind and both numbers, so a vLLM
    release that scales a Mamba span by DCP again (or forgets to scale attention)
    fails at start-up instead of storing keys that name the wrong tokens.
    """
    if len(spans) != len(plan.groups):
        raise ValueError(
            f"{CONNECTOR_NAME}: vLLM offloads {len(spans)} groups, the planner {len(plan.groups)}"
        )
    if int(blocks_per_chunk) != plan.blocks_per_chunk:
        raise ValueError(
            f"{CONNECTOR_NAME}: vLLM's blocks_per_chunk {blocks_per_chunk} != the "
            f"planner's {plan.blocks_per_chunk}"
        )
    mismatches = []
    dcp = plan.parallel.dcp_size
    for group, (group_id, theirs) in zip(plan.groups, spans, strict=True):
        if group.tokens_per_block == int(theirs):
            continue
        scaled = f"x DCP {dcp}" if group.spec.is_dcp_sharded else "not DCP-scaled"
        mismatches.append(
            f"group {group_id} ({group.kind.value}, block {group.block_size}, "
            f"{scaled}): planner {group.tokens_per_block} tokens per block, vLLM {theirs}"
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
    if PLANNED_LOOKUPS.get():
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
            '"kv_connector": "%s", "kv_connector_module_path": "%s" to '
            "plan lookups with the Mamba round-down",
            "; ".join(hazards),
            CONNECTOR_NAME,
            MODULE_PATH,
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


__all__ = [
    "PLANNED_LOOKUPS",
    "LazyPresence",
    "check_spans",
    "eagle_drop",
    "group_specs_from_kv_cache_config",
    "plan_from_kv_cache_config",
    "stock_lookup_hazards",
    "warn_stock_lookup_hazards",
]
