"""vLLM 0.33: what this release does differently, and what it lacks that 0.34 has.

0.33 hands workers GPU block ids, returns the hit alone from ``_lookup_complete_chunks``,
and asserts that every transfer succeeded: its worker metadata has no ``failed_jobs``, its
connector worker's ``get_finished`` asserts each result, and its scheduler has no
``load_failed`` route. This module gives the rest of the package 0.34's shapes on it.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any

from triton_offload.vllm.compat import CONNECTOR_NAME, logger, supported_vllm_api

with supported_vllm_api():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )

RELEASE = (0, 33)


@dataclasses.dataclass
class WorkerMetadataBase(OffloadingWorkerMetadata):  # type: ignore[misc]
    """0.34's ``failed_jobs`` / ``mark_completed(job_id, success)`` on 0.33's metadata,
    the same names and meaning, so the rest of the package reads one API."""

    failed_jobs: set[int] = dataclasses.field(default_factory=set)

    def mark_completed(self, job_id: int, success: bool = True) -> None:
        super().mark_completed(job_id)
        if not success:
            self.failed_jobs.add(job_id)


#: Workers get GPU block ids only.
DevicePointers: Any = None


class SubmitSignatures:
    """``OffloadingWorker``'s submit methods under 0.33's parameter names."""

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._store(job_id, ("src_spec", src_spec), dst_spec)  # type: ignore[attr-defined]

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        return self._load(job_id, src_spec, ("dst_spec", dst_spec), expedited)  # type: ignore[attr-defined]


def lookup_answer(hit: int | None, boundary: int | None) -> Any:
    """0.33's ``_lookup_complete_chunks`` returns the hit alone."""
    return hit


def split_lookup(answer: Any) -> tuple[int | None, int | None]:
    return answer, None


def eagle_drop(vllm_config: Any) -> bool:
    """0.33 always drops an EAGLE group's newest chunk (it has no lookahead hashes)."""
    return True


class ConnectorClassHooks:
    """None on 0.33: while it builds its config, 0.33 hands a connector class its config
    only under sleep mode (``supports_sleep_mode``) or full CUDA graphs
    (``requires_piecewise_for_cudagraph``, the extra config alone), and on a CPU or under
    ``--enforce-eager`` not at all before the model loads; see
    :func:`config_of_class_lookup`."""


#: vLLM's connector factory module: the caller whose frame holds the config.
_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"


def config_of_class_lookup() -> Any:
    """The KV transfer config vLLM is looking this package's connector class up for, or
    None when the class is not being looked up by vLLM's connector factory.

    0.33's front-end process looks the class up while it builds ``VllmConfig`` (its
    hybrid-allocator check calls ``KVConnectorFactory.get_connector_class``, which
    imports ``kv_connector_module_path`` and reads the class from it through this
    package's lazy ``__getattr__``), long before an engine process starts or a model
    loads, and calls nothing else of the class with the config on a CPU or under
    ``--enforce-eager``. The lookup's argument is read from that call's frame, found by
    its code object, so no other frame is taken for it.
    """
    factory = sys.modules.get(_FACTORY)
    if factory is None:
        return None  # the factory never ran in this process: vLLM is not looking it up
    code = factory.KVConnectorFactory.get_connector_class.__func__.__code__
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is code:
                return frame.f_locals.get("kv_transfer_config")
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame kept here would keep every caller's locals alive


def check_workers_on_one_node() -> None:
    """0.33's tiering spec does not refuse workers across nodes: nothing to match."""


def start_kv_transfers(worker: Any, metadata: Any, stock: Any) -> None:
    stock(metadata)


def handle_preemptions(worker: Any, metadata: Any, stock: Any) -> None:
    stock(metadata)


def get_finished(worker: Any, finished_req_ids: set[str], stock: Any) -> tuple[set[str], set[str]]:
    """0.33's loop without its assert on success: a failed job is marked failed in the
    metadata (the scheduler completes it unpublished), its request still finishes."""
    meta = worker._connector_worker_meta
    finished_recving: set[str] = set()
    for result in worker.worker.get_finished():
        job_id = result.job_id
        is_load = job_id in worker._load_jobs
        if result.success and result.transfer_size is not None:
            stats = meta.transfer_stats.load if is_load else meta.transfer_stats.store
            stats.record(result.transfer_size, result.transfer_time or 0.0)
        meta.mark_completed(job_id, success=bool(result.success))
        req_id = worker._load_jobs.pop(job_id, None)
        if req_id is not None:
            finished_recving.add(req_id)
    return set(), finished_recving


def route_failed_load(worker: Any, result: Any, failed_blocks: Any, req_id: str | None) -> Any:
    """One cache group: by block id (vLLM's policy recomputes from the first failed block).
    Several groups: the request in ``failed_recving`` (0.33 refuses block ids that are
    unique per group only); sync loads never reach here then (the scheduler gives hybrid
    models none)."""
    if worker.triton_num_groups == 1:
        worker._triton_load_errors.update(int(b) for b in failed_blocks[0])
    elif req_id is not None:
        worker._triton_failed_requests.add(req_id)
    else:
        logger.error(
            "%s: a sync load of a model with %d groups failed; vLLM has no way to hear of "
            "it per request",
            CONNECTOR_NAME,
            worker.triton_num_groups,
        )
    return result


def transfer_results(worker: Any, results: Any) -> Any:
    """0.33 has no ``failed_recving`` of its own for offloading: add the failed requests."""
    results.failed_recving |= worker.take_failed_requests()
    return results


def on_failed_store(num_keys: int, req_id: str) -> None:
    """0.33 completes a failed store only because the connector says so: log it."""
    logger.warning(
        "%s: store of %d chunks for request %s failed on a worker; nothing of it is "
        "published, its keys are free for a later store",
        CONNECTOR_NAME,
        num_keys,
        req_id,
    )


def on_failed_load(excluded: dict[str, set[Any]], req_id: str, keys: Any) -> None:
    """0.33 has no ``load_failed``: the keys stay out of the request's next lookup."""
    excluded.setdefault(req_id, set()).update(keys)
