"""What chunk verification costs: verified and unverified jobs side by side, same run.

Verification (``triton_offload.transfer.seal``, format v2) computes each page's
checksum where its bytes move (the copy kernel or a device pass on CUDA, the host's
XXH3 right after the copy on the CPU path) and does only 64-byte header work on the
host, batched: stores write the seals from the computed checksums, loads compare them
once the copy ended. Two suites, each timing alternated rounds (an unverified job,
then a verified one, so that a busy machine slows both alike) and reporting medians:

- ``test_worker_verification_cost``: vLLM's worker as vLLM builds it (the spec from
  vLLM's ``OffloadingSpecFactory``, ``verify_chunks`` on and off from one config,
  backend "torch": the CPU path), store and load jobs submitted and collected with
  ``get_finished``, worker pages of 8 KiB and 256 KiB. Needs vLLM.
- ``test_engine_verification_cost``: the engine alone on every path that runs here
  (CPU: "torch"; CUDA: "triton", "dma", "auto"), jobs with and without page checksums
  plus the seal's header work; also the host's CPU seconds per verified GB.

Each row prints and stores in ``extra_info``: GB/s unverified and verified and
``ratio`` = verified speed / unverified speed (1.0: free). Run:
``python -m pytest bench/suites/bench_seal.py --benchmark-enable -s``; without
``--benchmark-enable`` each case runs a few small rounds as a smoke test.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from triton_offload import GroupSpec, plan_offload
from triton_offload.transfer.engine import TransferEngine
from triton_offload.transfer.jobs import JobSpec
from triton_offload.transfer.seal import SEAL_BYTES, PageSealer, SealFormat, digest8, key_digest

#: Worker page sizes of the acceptance figures: 8 KiB (small pages, per-page costs
#: dominate) and 256 KiB (bytes dominate).
PAGE_SIZES = [8 << 10, 256 << 10]
#: Pages per job: 256 (a 2 MiB job at 8 KiB pages, 64 MiB at 256 KiB).
JOB_PAGES = 256
SMOKE_PAGES = 16
ROUNDS = 15
SMOKE_ROUNDS = 3
FORMAT = SealFormat(digest8("bench config"), digest8("bench layout"), 0, 1)


def _rounds(benchmark: Any) -> tuple[int, int]:
    """(pages per job, alternated rounds) of this run."""
    return (SMOKE_PAGES, SMOKE_ROUNDS) if benchmark.disabled else (JOB_PAGES, ROUNDS)


def _alternate(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median seconds of each run over ``rounds`` alternated rounds (after one warm-up)."""
    for run in runs.values():
        run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def _report(benchmark: Any, what: str, nbytes: int, times: dict[str, float], **extra: Any) -> float:
    plain, verified = times["unverified"], times["verified"]
    ratio = plain / verified
    gbps = {name: round(nbytes / seconds / 1e9, 3) for name, seconds in times.items()}
    benchmark.extra_info.update(
        bytes=nbytes,
        unverified_GBps=gbps["unverified"],
        verified_GBps=gbps["verified"],
        ratio=round(ratio, 3),
        **extra,
    )
    notes = "".join(f", {key} {value}" for key, value in extra.items())
    print(
        f"\n{what}: {gbps['unverified']} GB/s unverified, {gbps['verified']} GB/s verified, "
        f"ratio {ratio:.2f}{notes}"
    )
    return ratio


# ------------------------------------------------------------------ vLLM's worker

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


def _worker_config(page: int, chunks: int, verify: bool) -> Any:
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

    def __init__(self, page: int, chunks: int, verify: bool) -> None:
        self.spec = OffloadingSpecFactory.create_spec(_worker_config(page, chunks, verify))
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
    chunks, rounds = _rounds(benchmark)
    plain, verified = WorkerJobs(page, chunks, False), WorkerJobs(page, chunks, True)
    try:
        assert plain.worker.sealer is None and verified.worker.sealer is not None
        plain.store()
        verified.store()  # every page sealed, so that the loads verify
        run = {"unverified": getattr(plain, direction), "verified": getattr(verified, direction)}
        benchmark.group = f"verification, vLLM worker, CPU path, {page >> 10} KiB pages"
        benchmark.pedantic(run["verified"], rounds=1, iterations=1)
        times = _alternate(run, rounds)
        _report(benchmark, f"worker {direction}, {page >> 10} KiB pages", page * chunks, times)
        # Every verified load checked its pages from the checksums its copy computed.
        assert verified.worker.sealer.host_checked_pages == 0
    finally:
        plain.close()
        verified.close()


# --------------------------------------------------------------------- the engine


class EngineJobs:
    """An engine over a sealed pool (pages + 64 bytes per row) on ``backend``."""

    def __init__(self, page: int, pages: int, device: str, backend: str) -> None:
        generator = torch.Generator().manual_seed(page)
        cache = torch.randint(0, 256, (2 * pages, page), dtype=torch.uint8, generator=generator)
        cache = cache.to(device)
        pool = torch.zeros(pages, page + SEAL_BYTES, dtype=torch.uint8)
        if device == "cuda":
            pool = pool.pin_memory()
        self.engine = TransferEngine(
            plan_offload([GroupSpec("full_attention", 16)]),
            [[cache]],
            pages,
            pool=pool[:, :page],
            backend=backend,
            page_checksums=True,
        )
        self.sealer = PageSealer(pool.numpy(), FORMAT, [page])
        rows = torch.randperm(pages, generator=generator).numpy()
        blocks = torch.randperm(2 * pages, generator=generator)[:pages].tolist()
        self.spec = JobSpec([blocks], [rows.tolist()])
        self.chunks = rows.astype(np.int64)
        self.groups = np.zeros(pages, dtype=np.int64)
        digests = b"".join(key_digest(f"chunk-{row}".encode()) for row in rows.tolist())
        self.keys = np.frombuffer(digests, dtype=np.uint8).reshape(-1, 8)
        self.job = 0

    def _run(self, store: bool, checksum: bool) -> Any:
        self.job += 1
        if store:
            self.engine.submit_store(self.job, self.spec, checksum=checksum)
        else:
            self.engine.submit_load(self.job, self.spec, checksum=checksum)
        self.engine.wait([self.job])
        (result,) = self.engine.get_finished()
        assert result.success
        return result

    def _values(self, result: Any) -> np.ndarray:
        sums = result.checksums
        return sums.values[np.searchsorted(sums.rows, self.chunks)]

    def store(self) -> None:
        self._run(True, False)

    def store_sealed(self) -> None:
        result = self._run(True, True)
        algorithm = result.checksums.algorithm
        self.sealer.seal_pages(self.chunks, self.groups, self.keys, self._values(result), algorithm)

    def load(self) -> None:
        self._run(False, False)

    def load_checked(self) -> None:
        result = self._run(False, True)
        problems, records = self.sealer.header_problems(self.chunks, self.groups, self.keys)
        problems = self.sealer.payload_problems(
            self.chunks, records, problems, self._values(result), result.checksums.algorithm
        )
        assert not any(problems), problems


def _engine_cost(benchmark: Any, page: int, direction: str, device: str, backend: str) -> None:
    pages, rounds = _rounds(benchmark)
    bench = EngineJobs(page, pages, device, backend)
    bench.store_sealed()
    plain, verified = (
        (bench.store, bench.store_sealed)
        if direction == "store"
        else (bench.load, bench.load_checked)
    )
    benchmark.group = f"verification, engine, {device} {backend}, {page >> 10} KiB pages"
    benchmark.pedantic(verified, rounds=1, iterations=1)
    times = _alternate({"unverified": plain, "verified": verified}, rounds)
    # Host CPU seconds per verified GB: the process's CPU time over verified jobs.
    cpu_start = time.process_time()
    for _ in range(rounds):
        verified()
    cpu_per_gb = (time.process_time() - cpu_start) / (rounds * page * pages / 1e9)
    _report(
        benchmark,
        f"engine {device} {backend} {direction}, {page >> 10} KiB pages",
        page * pages,
        times,
        host_cpu_s_per_GB=round(cpu_per_gb, 4),
        algorithm=bench.engine.checksum_algorithm,
    )
    assert bench.sealer.host_checked_pages == 0


@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"{p >> 10}KiB")
@pytest.mark.parametrize("direction", ["store", "load"])
def test_engine_verification_cost(benchmark: Any, page: int, direction: str) -> None:
    _engine_cost(benchmark, page, direction, "cpu", "torch")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "dma", "auto"])
@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"{p >> 10}KiB")
@pytest.mark.parametrize("direction", ["store", "load"])
def test_engine_verification_cost_cuda(
    benchmark: Any, page: int, direction: str, backend: str
) -> None:
    _engine_cost(benchmark, page, direction, "cuda", backend)
