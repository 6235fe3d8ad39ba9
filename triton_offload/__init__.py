"""triton_offload: KV-cache offloading between GPU cache groups and a pinned host pool.

The planner (``GroupSpec`` -> ``plan_offload`` -> ``OffloadPlan``) is pure Python and
imports no torch; the data path (``TransferEngine``) imports torch and the Triton
kernels only when first used, so ``import triton_offload`` stays cheap for a
scheduler process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> defining module. Resolved on first attribute access (PEP 562) so
# that the planner can be used without importing torch or triton.
_EXPORTS: dict[str, str] = {
    "GroupKind": "triton_offload.planner.groups",
    "GroupSpec": "triton_offload.planner.groups",
    "ParallelSpec": "triton_offload.planner.groups",
    "PlanningError": "triton_offload.planner.groups",
    "OffloadPlan": "triton_offload.planner.plan",
    "GroupPlan": "triton_offload.planner.plan",
    "plan_offload": "triton_offload.planner.plan",
    "is_store_reachable_chunk": "triton_offload.planner.lookup",
    "JobSpec": "triton_offload.transfer.jobs",
    "TransferEngine": "triton_offload.transfer.engine",
    "TransferResult": "triton_offload.transfer.engine",
    "HostBlockManager": "triton_offload.transfer.host_blocks",
    "LoadHandle": "triton_offload.transfer.host_blocks",
    "StoreHandle": "triton_offload.transfer.host_blocks",
}

__all__ = [
    "GroupKind",
    "GroupPlan",
    "GroupSpec",
    "HostBlockManager",
    "JobSpec",
    "LoadHandle",
    "OffloadPlan",
    "ParallelSpec",
    "PlanningError",
    "StoreHandle",
    "TransferEngine",
    "TransferResult",
    "__version__",
    "is_store_reachable_chunk",
    "plan_offload",
]

if TYPE_CHECKING:
    from triton_offload.planner.groups import GroupKind, GroupSpec, ParallelSpec, PlanningError
    from triton_offload.planner.lookup import is_store_reachable_chunk
    from triton_offload.planner.plan import GroupPlan, OffloadPlan, plan_offload
    from triton_offload.transfer.engine import TransferEngine, TransferResult
    from triton_offload.transfer.host_blocks import HostBlockManager, LoadHandle, StoreHandle
    from triton_offload.transfer.jobs import JobSpec


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'triton_offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
