"""What chunk verification costs: verified and unverified jobs side by side, same run.

Verification (``triton_offload.transfer.seal``, format v2) computes each page's
checksum where its bytes move (the copy kernel or a device pass on CUDA, the host's
XXH3 right after the copy on the CPU path) and does only 64-byte header work on the
host, batched: stores write the seals from the computed checksums, loads compare them
once the copy ended. Two suites time alternated rounds (an unverified job,
then a verified one, so that a busy machine slows both alike) and reporting medians:

- ``bench_seal_worker.py``: vLLM's worker as vLLM builds it (needs vLLM);
- here, ``test_engine_verification_cost``: the engine alone on every path that runs here
  (CPU: "torch"; CUDA: "triton", "dma", "auto"), jobs with and without page checksums
  plus the seal's header work; also the host's CPU seconds per verified GB;
- here, ``test_engine_keyed_cost``: verified jobs with a seal key (keyed universal
  hashes, ``transfer.seal_key``) against verified jobs without one, on the same paths
  (goal: keyed >= 0.9 of unkeyed; the rows name ``unkeyed`` and ``keyed``);
- here, ``test_page_hash_bound``: the CPU path's bound on that ratio, a page's copy and
  hash with nothing around them (XXH3-64 against ``keyed_ghash64``).

Each row prints and stores in ``extra_info``: GB/s unverified and verified and
``ratio`` = verified speed / unverified speed (1.0: free). Run:
``python -m pytest bench/suites/bench_seal.py --benchmark-enable -s``; without
``--benchmark-enable`` each case runs a few small rounds as a smoke test.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from triton_offload.bench.alternate import alternate, report

from triton_offload import GroupSpec, plan_offload
from triton_offload.transfer.engine import TransferEngine
from triton_offload.transfer.jobs import JobSpec
from triton_offload.transfer.seal import SEAL_BYTES, PageSealer, SealFormat, digest8, key_digest
from triton_offload.transfer.seal_key import SealKey

#: Worker page sizes of the acceptance figures: 8 KiB (small pages, per-page costs
#: dominate) and 256 KiB (bytes dominate).
PAGE_SIZES = [8 << 10, 256 << 10]
#: Pages per job: 256 (a 2 MiB job at 8 KiB pages, 64 MiB at 256 KiB).
JOB_PAGES = 256
SMOKE_PAGES = 16
ROUNDS = 15
SMOKE_ROUNDS = 3
FORMAT = SealFormat(digest8("bench config"), digest8("bench layout"), 0, 1)


def _rounds(benchmark: Any, device: str = "cpu") -> tuple[int, int]:
    """(pages per job, alternated rounds) of this run: full size with
    ``--benchmark-enable``, and always on CUDA, where a whole case takes a second or two
    (``bench/gpu_check.sh`` records these ratios without enabling pytest-benchmark)."""
    if benchmark.disabled and device == "cpu":
        return SMOKE_PAGES, SMOKE_ROUNDS
    return JOB_PAGES, ROUNDS


# --------------------------------------------------------------------- the engine


class EngineJobs:
    """An engine over a sealed pool (pages + 64 bytes per row) on ``backend``."""

    def __init__(
        self, page: int, pages: int, device: str, backend: str, seal_key: SealKey | None = None
    ) -> None:
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
            seal_key=seal_key,
        )
        self.sealer = PageSealer(pool.numpy(), FORMAT, [page], seal_key)
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
        values, algorithm = self._values(result), result.checksums.algorithm
        # As vLLM's worker checks: every seal exactly as stored, in one comparison.
        if self.sealer.accepted(self.chunks, self.groups, self.keys, values, algorithm).all():
            return
        problems, records = self.sealer.header_problems(self.chunks, self.groups, self.keys)
        problems = self.sealer.payload_problems(
            self.chunks, records, problems, self._values(result), result.checksums.algorithm
        )
        assert not any(problems), problems


def _engine_cost(benchmark: Any, page: int, direction: str, device: str, backend: str) -> None:
    pages, rounds = _rounds(benchmark, device)
    bench = EngineJobs(page, pages, device, backend)
    bench.store_sealed()
    plain, verified = (
        (bench.store, bench.store_sealed)
        if direction == "store"
        else (bench.load, bench.load_checked)
    )
    benchmark.group = f"verification, engine, {device} {backend}, {page >> 10} KiB pages"
    benchmark.pedantic(verified, rounds=1, iterations=1)
    times = alternate({"unverified": plain, "verified": verified}, rounds)
    # Host CPU seconds per verified GB: the process's CPU time over verified jobs.
    cpu_start = time.process_time()
    for _ in range(rounds):
        verified()
    cpu_per_gb = (time.process_time() - cpu_start) / (rounds * page * pages / 1e9)
    report(
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


#: The key of the keyed rows (a fixed test key: the cost does not depend on its bytes).
BENCH_KEY = bytes(range(32))


def _keyed_cost(benchmark: Any, page: int, direction: str, device: str, backend: str) -> None:
    pages, rounds = _rounds(benchmark, device)
    unkeyed = EngineJobs(page, pages, device, backend)
    keyed = EngineJobs(page, pages, device, backend, SealKey(BENCH_KEY))
    unkeyed.store_sealed()
    keyed.store_sealed()
    name = "store_sealed" if direction == "store" else "load_checked"
    run = {"unkeyed": getattr(unkeyed, name), "keyed": getattr(keyed, name)}
    benchmark.group = f"keyed seals, engine, {device} {backend}, {page >> 10} KiB pages"
    benchmark.pedantic(run["keyed"], rounds=1, iterations=1)
    times = alternate(run, rounds)
    report(
        benchmark,
        f"engine {device} {backend} {direction} keyed, {page >> 10} KiB pages",
        page * pages,
        times,
        names=("unkeyed", "keyed"),
        algorithm=keyed.engine.checksum_algorithm,
    )
    assert keyed.sealer.host_checked_pages == 0


@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"{p >> 10}KiB")
@pytest.mark.parametrize("direction", ["store", "load"])
def test_engine_keyed_cost(benchmark: Any, page: int, direction: str) -> None:
    _keyed_cost(benchmark, page, direction, "cpu", "torch")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "dma", "auto"])
@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"{p >> 10}KiB")
@pytest.mark.parametrize("direction", ["store", "load"])
def test_engine_keyed_cost_cuda(benchmark: Any, page: int, direction: str, backend: str) -> None:
    _keyed_cost(benchmark, page, direction, "cuda", backend)


def _copy_and_hash(pages: np.ndarray, out: np.ndarray, digest: Any) -> Any:
    """One page at a time: copy it, then hash the copy while it is in cache (the CPU
    path's order), with none of a job's other work."""

    def run() -> None:
        for index in range(len(pages)):
            np.copyto(out[index], pages[index])
            digest(out[index])

    return run


@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"{p >> 10}KiB")
def test_page_hash_bound(benchmark: Any, page: int) -> None:
    """The CPU path's per-page bound on keyed / unkeyed: a page's copy plus XXH3-64
    against its copy plus ``keyed_ghash64`` (one AES-GCM GMAC call), nothing else. An
    engine or worker row exceeds this ratio only by what its per-job costs (the same
    keyed or not) dilute it."""
    import xxhash

    count, rounds = _rounds(benchmark)
    pages = np.random.default_rng(page).integers(0, 256, (count, page), dtype=np.uint8)
    out = np.empty_like(pages)
    run = {
        "unkeyed": _copy_and_hash(pages, out, xxhash.xxh3_64_intdigest),
        "keyed": _copy_and_hash(pages, out, SealKey(BENCH_KEY).keyed_ghash64),
    }
    benchmark.group = f"keyed seals, per page, {page >> 10} KiB pages"
    benchmark.pedantic(run["keyed"], rounds=1, iterations=1)
    times = alternate(run, rounds)
    report(
        benchmark,
        f"copy and hash per page, {page >> 10} KiB pages",
        page * count,
        times,
        names=("unkeyed", "keyed"),
        us_per_page={name: round(seconds / count * 1e6, 3) for name, seconds in times.items()},
    )
