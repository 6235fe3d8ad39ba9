"""The planner: which chunks are worth storing, how many tokens a lookup may load.

Pure Python (no torch, no triton), so a scheduler process can plan without loading the
data path. ``groups`` declares cache groups and parallel sizes (``GroupSpec``,
``ParallelSpec``); ``plan`` turns them into an ``OffloadPlan`` (spans, chunks, windows,
alignment); ``lookup`` holds the store-side reachability and load-side hit rules the
plan answers with; ``presets`` names the models every command knows.

Imports point one way inside the layer: presets -> plan -> lookup -> groups.
"""

from __future__ import annotations

from triton_offload.planner.groups import GroupKind, GroupSpec, ParallelSpec, PlanningError
from triton_offload.planner.lookup import is_store_reachable_chunk
from triton_offload.planner.plan import GroupPlan, OffloadPlan, plan_offload

__all__ = [
    "GroupKind",
    "GroupPlan",
    "GroupSpec",
    "OffloadPlan",
    "ParallelSpec",
    "PlanningError",
    "is_store_reachable_chunk",
    "plan_offload",
]
