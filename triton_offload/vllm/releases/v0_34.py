"""vLLM 0.34: workers may get ``DevicePointers``, ``_lookup_complete_chunks`` returns
``(hit, full_attention_boundary)``, and vLLM routes failed jobs itself (``failed_jobs``,
``complete_store(success=False)``, ``load_failed``, ``failed_recving``). Where it does a
thing itself this module uses its way and adds only what it lacks: a failed sync load
raises in its worker (the engine stops) and ``failed_recving`` recomputes a request from
token 0, so a single-group failed load is reported by block id as on 0.33."""

from __future__ import annotations

from typing import Any

from triton_offload.vllm.compat import supported_vllm_api

with supported_vllm_api():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.kv_offload.base import DevicePointers as VLLMDevicePointers
    from vllm.v1.kv_offload.base import TransferResult
    from vllm.v1.kv_offload.tiering.spec import _reject_workers_across_nodes

RELEASE = (0, 34)

#: 0.34's metadata carries ``failed_jobs`` and ``mark_completed(job_id, success)``.
WorkerMetadataBase: Any = OffloadingWorkerMetadata
#: vLLM's connector worker may resolve a job's GPU blocks to these pointers first.
DevicePointers: Any = VLLMDevicePointers


class SubmitSignatures:
    """``OffloadingWorker``'s submit methods under 0.34's parameter names (``device_ptrs``);
    callers pass it positionally, and block-id specs are taken too."""

    def submit_store(self, job_id: int, device_ptrs: Any, dst_spec: Any) -> bool:
        return self._store(job_id, ("device_ptrs", device_ptrs), dst_spec)  # type: ignore[attr-defined]

    def submit_load(
        self, job_id: int, src_spec: Any, device_ptrs: Any, expedited: bool = False
    ) -> bool:
        return self._load(job_id, src_spec, ("device_ptrs", device_ptrs), expedited)  # type: ignore[attr-defined]


def lookup_answer(hit: int | None, boundary: int | None) -> Any:
    """0.34's ``_lookup_complete_chunks`` returns ``(hit, full_attention_boundary)``."""
    return hit, boundary


def split_lookup(answer: Any) -> tuple[int | None, int | None]:
    hit, boundary = answer
    return hit, boundary


def eagle_drop(vllm_config: Any) -> bool:
    """Only without lookahead block hashes (``num_hash_lookahead_tokens`` 0), as 0.34's
    scheduler's ``use_lookahead_block_hashes`` decides."""
    return not vllm_config.num_hash_lookahead_tokens > 0


class ConnectorClassHooks:
    """The connector class's part of 0.34's config checks: ``kv_cache_access`` is called
    with the KV transfer config in the front-end process while ``VllmConfig`` is built
    (``_resolve_extensible_kv_cache``, on every platform), before an engine process
    starts or a model loads. The configuration is checked there first."""

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        cls.check_transfer_config(kv_transfer_config)  # type: ignore[attr-defined]
        return super().kv_cache_access(kv_transfer_config)  # type: ignore[misc]


def config_of_class_lookup() -> Any:
    """None: 0.34 hands the connector class its config itself (:class:`ConnectorClassHooks`)."""
    return None


def check_workers_on_one_node() -> None:
    """0.34's tiering spec refuses secondary tiers on workers spanning nodes (the tiers run
    in the engine core and read its node's region only): the same collective check."""
    _reject_workers_across_nodes()


def start_kv_transfers(worker: Any, metadata: Any, stock: Any) -> None:
    """0.34's method with GPU block ids where it resolves pointers per job (this
    project's worker builds its own tables from the ids)."""
    worker._submit_deferred_stores()
    sync_job_ids: set[int] = set()
    for job_id, entry in metadata.load_jobs.items():
        if entry.sync:
            sync_job_ids.add(job_id)
            worker._load_jobs[job_id] = None
            worker.worker.submit_load(job_id, entry.src_spec, entry.dst_spec, expedited=True)
        else:
            worker._load_jobs[job_id] = entry.req_id
            worker.worker.submit_load(job_id, entry.src_spec, entry.dst_spec)
    if sync_job_ids:
        worker.worker.wait(sync_job_ids)


def handle_preemptions(worker: Any, metadata: Any, stock: Any) -> None:
    """The stores deferred from the last step go with block ids; vLLM's method then
    flushes the preempted requests' stores (resolved to pointers: rare)."""
    worker._submit_deferred_stores()
    stock(metadata)


def get_finished(worker: Any, finished_req_ids: set[str], stock: Any) -> tuple[set[str], set[str]]:
    return stock(finished_req_ids)


def route_failed_load(worker: Any, result: Any, failed_blocks: Any, req_id: str | None) -> Any:
    """One cache group: by block id (recomputed from the first failed block) and still a
    failed job in vLLM's books (``failed_jobs``: no bytes counted, the request's
    ``load_failed``). Several groups: vLLM's own ``failed_recving``."""
    if worker.triton_num_groups != 1:
        return result
    worker._triton_load_errors.update(int(b) for b in failed_blocks[0])
    worker._connector_worker_meta.failed_jobs.add(result.job_id)
    return TransferResult(result.job_id, True, None, None)


def transfer_results(worker: Any, results: Any) -> Any:
    """0.34's ``get_transfer_results`` fills ``failed_recving`` itself."""
    return results


def on_failed_store(num_keys: int, req_id: str) -> None:
    """0.34 completes a failed store with ``success=False`` and logs it itself."""


def on_failed_load(excluded: dict[str, set[Any]], req_id: str, keys: Any) -> None:
    """0.34 marks the request ``load_failed`` itself."""
