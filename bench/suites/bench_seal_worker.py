"""What chunk verification costs in vLLM's worker as vLLM builds it: same run, side by side.

The spec comes from vLLM's ``OffloadingSpecFactory`` with ``verify_chunks`` on and off
from one config (backend "torch": the CPU path); store and load jobs of 256 chunks are
submitted and collected with ``get_finished`` in alternated rounds, medians reported,
at worker pages of 8 KiB and 256 KiB. Each row prints and stores in ``extra_info``
GB/s unverified and verified and ``ratio`` = verified speed / unverified speed.
``bench_seal.py`` measures the engine alone on every path. A last row times 1-chunk
loads (8 KiB pages), verified and not, and prints the difference of their medians: the
fixed cost of verifying a load (goal: at most 60 us). The keyed rows compare verified
jobs with a seal key (``seal_key_file``: the host's GHASH and the tags' AES) against
verified jobs without one, same run (goal: keyed >= 0.9 of unkeyed). Needs vLLM.

Run: ``python -m pytest bench/suites/bench_seal_worker.py --benchmark-enable -s``;
without ``--benchmark-enable`` a few small rounds run as a smoke test.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from triton_offload.bench.alternate import alternate, report

from triton_offload.transfer.seal import SEAL_BYTES

PAGE_SIZES = [8 << 10, 256 << 10]
JOB_CHUNKS = 256
SMOKE_CHUNKS = 16
ROUNDS = 15
SMOKE_ROUNDS = 3

try:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from triton_offload.vllm.integrity import KeyedCPULoadStoreSpec

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"

BLOCKS_PER_CHUNK = 2


def _worker_config(page: int, chunks: int, verify: bool, key_file: str | None = None) -> Any:
    """One full-attention group, one worker, ``page``-byte worker pages, room for
    ``chunks`` chunks; as vLLM's connector builds it."""
    from vllm.v1.kv_offload.config import OffloadingGroupConfig

    block_bytes = page // BLOCKS_PER_CHUNK
    group = OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0",), group_id=0)
    # Rows grow by the seal (and round up to the OS page): room for every chunk.
    row = -(-(page + SEAL_BYTES) // 4096) * 4096
    return OffloadingConfig(
        groups=(group,),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TritonOffloadingSpec",
            "spec_module_path": "triton_offload.vllm",
            "cpu_bytes_to_use": row * chunks,
            "backend": "torch",
            "verify_chunks": verify,
            **({"seal_key_file": key_file} if key_file else {}),
        },
        engine_id=f"bench-seal-{uuid.uuid4()}",
        model=OffloadingModelConfig(name="bench", dtype="bfloat16", max_model_len=1 << 20),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=False,
    )


class WorkerJobs:
    """vLLM's worker for one config: a store and a load of ``chunks`` chunks, repeatable."""

    def __init__(self, page: int, chunks: int, verify: bool, key_file: str | None = None) -> None:
        config = _worker_config(page, chunks, verify, key_file)
        self.spec = OffloadingSpecFactory.create_spec(config)
        blocks = chunks * BLOCKS_PER_CHUNK
        generator = torch.Generator().manual_seed(page)
        self.cache = torch.randint(
            -128, 128, (2 * blocks, page // BLOCKS_PER_CHUNK), dtype=torch.int8, generator=generator
        )
        canonical = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(self.cache, page // BLOCKS_PER_CHUNK)],
            group_data_refs=[[CanonicalKVCacheRef(0, page // BLOCKS_PER_CHUNK)]],
        )
        self.worker = self.spec.get_worker(canonical)
        gpu = torch.randperm(2 * blocks, generator=generator)[:blocks].tolist()
        host = torch.randperm(chunks, generator=generator).tolist()
        keys = [f"chunk-{chunk}".encode() for chunk in host]
        self.gpu = GPULoadStoreSpec(gpu, [blocks], [0])
        self.host = KeyedCPULoadStoreSpec(host, keys)
        self.job = 0

    def _run(self, submit: Callable[[int], bool]) -> None:
        self.job += 1
        assert submit(self.job)
        self.worker.wait({self.job})
        results = self.worker.get_finished()
        while not results:  # pragma: no cover - wait() drains the job on this path
            results = self.worker.get_finished()
        assert [r.success for r in results] == [True], results

    def store(self) -> None:
        self._run(lambda job: self.worker.submit_store(job, self.gpu, self.host))

    def load(self) -> None:
        self._run(lambda job: self.worker.submit_load(job, self.host, self.gpu))

    def close(self) -> None:
        self.worker.shutdown()


@pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")
@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"{p >> 10}KiB")
@pytest.mark.parametrize("direction", ["store", "load"])
def test_worker_verification_cost(benchmark: Any, page: int, direction: str) -> None:
    chunks, rounds = (SMOKE_CHUNKS, SMOKE_ROUNDS) if benchmark.disabled else (JOB_CHUNKS, ROUNDS)
    plain, verified = WorkerJobs(page, chunks, False), WorkerJobs(page, chunks, True)
    try:
        assert plain.worker.sealer is None and verified.worker.sealer is not None
        plain.store()
        verified.store()  # every page sealed, so that the loads verify
        run = {"unverified": getattr(plain, direction), "verified": getattr(verified, direction)}
        benchmark.group = f"verification, vLLM worker, CPU path, {page >> 10} KiB pages"
        benchmark.pedantic(run["verified"], rounds=1, iterations=1)
        times = alternate(run, rounds)
        report(benchmark, f"worker {direction}, {page >> 10} KiB pages", page * chunks, times)
        # Every verified load checked its pages from the checksums its copy computed.
        assert verified.worker.sealer.host_checked_pages == 0
    finally:
        plain.close()
        verified.close()


@pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")
@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"{p >> 10}KiB")
@pytest.mark.parametrize("direction", ["store", "load"])
def test_worker_keyed_verification_cost(
    benchmark: Any, page: int, direction: str, tmp_path: Any
) -> None:
    chunks, rounds = (SMOKE_CHUNKS, SMOKE_ROUNDS) if benchmark.disabled else (JOB_CHUNKS, ROUNDS)
    key_file = tmp_path / "seal.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    unkeyed, keyed = WorkerJobs(page, chunks, True), WorkerJobs(page, chunks, True, str(key_file))
    try:
        assert unkeyed.worker.sealer.seal_key is None
        assert keyed.worker.sealer.seal_key is not None
        unkeyed.store()
        keyed.store()
        run = {"unkeyed": getattr(unkeyed, direction), "keyed": getattr(keyed, direction)}
        benchmark.group = f"keyed seals, vLLM worker, CPU path, {page >> 10} KiB pages"
        benchmark.pedantic(run["keyed"], rounds=1, iterations=1)
        times = alternate(run, rounds)
        report(
            benchmark,
            f"worker {direction}, {page >> 10} KiB pages",
            page * chunks,
            times,
            names=("unkeyed", "keyed"),
        )
        assert keyed.worker.sealer.host_checked_pages == 0
    finally:
        unkeyed.close()
        keyed.close()


ONE_CHUNK_ROUNDS = 300


@pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")
def test_worker_one_chunk_load_verification_cost(benchmark: Any) -> None:
    page = 8 << 10
    rounds = SMOKE_ROUNDS if benchmark.disabled else ONE_CHUNK_ROUNDS
    plain, verified = WorkerJobs(page, 1, False), WorkerJobs(page, 1, True)
    try:
        plain.store()
        verified.store()
        benchmark.group = "verification, vLLM worker, CPU path, 1-chunk load"
        benchmark.pedantic(verified.load, rounds=1, iterations=1)
        times = alternate({"unverified": plain.load, "verified": verified.load}, rounds)
        extra_us = (times["verified"] - times["unverified"]) * 1e6
        report(benchmark, "worker load, 1 chunk of 8 KiB", page, times, extra_us=round(extra_us, 1))
        assert verified.worker.sealer.host_checked_pages == 0
    finally:
        plain.close()
        verified.close()
