"""One adapter per supported vLLM release: the only code that knows which release runs.

Each supported release has one module here (``v0_33``, ``v0_34``) with the same names,
listed in :data:`INTERFACE`; :data:`RELEASE` is the installed release's module. The rest
of the package uses ``RELEASE.<name>`` and never asks for a version, so dropping a release
is deleting its module and its entries elsewhere (``compat.SUPPORTED_VLLM_MIN`` and
``compat.VLLM_EXTRA_CONFIG_KEYS``, its ``internals.RELIANCES`` releases, its
``ci/vllm-*`` lists). ``tests/vllm/test_releases.py`` holds every module to the interface.

The interface, by what differs between releases:

- ``WorkerMetadataBase``: the worker -> scheduler report class to extend (0.34's
  ``OffloadingWorkerMetadata`` carries ``failed_jobs`` and ``mark_completed(job_id,
  success)``; 0.33's gets the same names backported).
- ``DevicePointers``: vLLM's per-job pointer class, or None where workers get GPU block ids
  only; ``SubmitSignatures``: a mixin with ``submit_store`` / ``submit_load`` under the
  release's parameter names, both calling the worker's ``_store`` / ``_load``.
- ``lookup_answer(hit, boundary)`` and ``split_lookup(answer)``: what
  ``_lookup_complete_chunks`` returns (0.33: the hit; 0.34: ``(hit, boundary)``).
- ``eagle_drop(vllm_config)``: whether vLLM drops an EAGLE group's newest chunk.
- Where the connector's configuration is first checked, before the model loads:
  ``ConnectorClassHooks``, a mixin of the connector class with the classmethods the
  release calls with the KV transfer config while it builds ``VllmConfig`` (0.34:
  ``kv_cache_access``; 0.33: none), and ``config_of_class_lookup()``: the config vLLM's
  connector factory is looking the class up for, where the release hands the class
  nothing (0.33), else None.
- ``check_workers_on_one_node()``: refuse secondary tiers on workers across nodes where
  the release's tiering spec does (a collective), else nothing.
- The connector worker's steps, each ``f(worker, ..., stock)`` with ``stock`` vLLM's own
  method: ``start_kv_transfers``, ``handle_preemptions``, ``get_finished``; and
  ``route_failed_load(worker, result, failed_blocks, req_id)``: who tells vLLM's core of a
  failed load and how, returning the result vLLM's books see.
- ``transfer_results(worker, results)``: vLLM's ``get_transfer_results`` answer with
  what the release leaves to the connector.
- ``on_failed_store(log_context)`` / ``on_failed_load(excluded, keys)``: the scheduler's
  part of a failed job that the release does not do itself.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from triton_offload.vllm.compat import vllm_release

#: The names every release module defines (checked by the tests, not at import).
INTERFACE = (
    "WorkerMetadataBase",
    "DevicePointers",
    "SubmitSignatures",
    "lookup_answer",
    "split_lookup",
    "eagle_drop",
    "ConnectorClassHooks",
    "config_of_class_lookup",
    "check_workers_on_one_node",
    "start_kv_transfers",
    "handle_preemptions",
    "get_finished",
    "route_failed_load",
    "transfer_results",
    "on_failed_store",
    "on_failed_load",
)


def adapter_for(release: tuple[int, int]) -> ModuleType:
    """The adapter module of ``release`` (``(major, minor)``); ImportError if none."""
    major, minor = release
    return importlib.import_module(f"{__name__}.v{major}_{minor}")


#: The installed release's adapter.
RELEASE: ModuleType = adapter_for(vllm_release())

__all__ = ["INTERFACE", "RELEASE", "adapter_for"]
