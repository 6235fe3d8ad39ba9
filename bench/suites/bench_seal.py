"""What chunk verification costs: engine jobs with and without the seal, same run.

The seal is host work (``triton_offload.transfer.seal``): after a store's copy the
worker computes the CRC-32 of each page it wrote and writes the 64-byte record; before
a load it checks every page's record and CRC. No copy path changes (the kernel's PTX is
the same with verification on or off), so the cost is the CRC over the job's bytes on
the host, paid on the worker's thread.

Rows per page size (one benchmark group each): ``store``, ``store+seal``, ``load``,
``check+load`` (one job of ``JOB_BYTES`` over ``JOB_BYTES / page`` random pages) and
``crc`` (the CRC alone over the same bytes). ``extra_info`` and ``-s`` print GB/s of
each and ``sealed_ratio`` = plain job time / sealed job time from alternated rounds
(fastest runs), so that a busy machine slows both alike.

CPU path (backend "torch") everywhere; with CUDA, the same on the device's default
path with a page-locked pool (``-m cuda``, run by ``bench/gpu_check.sh``).

Run: ``python -m pytest bench/suites/bench_seal.py --benchmark-enable -s``; without
``--benchmark-enable`` each case runs once on 2 MiB as a smoke test.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import pytest
import torch

from triton_offload import GroupSpec, plan_offload
from triton_offload.transfer.engine import TransferEngine
from triton_offload.transfer.jobs import JobSpec
from triton_offload.transfer.seal import SEAL_BYTES, PageSealer, SealFormat, digest8, key_digest

PAGE_SIZES = [64 << 10, 1 << 20, 4 << 20]
JOB_BYTES = 64 << 20
SMOKE_BYTES = 2 << 20
ROUNDS = 9
FORMAT = SealFormat(digest8("bench config"), digest8("bench layout"), 0, 1)


class Sealed:
    """One engine over ``pages`` pages with a sealed pool (pages + 64 bytes per row)."""

    def __init__(self, page: int, pages: int, device: str) -> None:
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
            backend="torch" if device == "cpu" else "auto",
        )
        self.sealer = PageSealer(pool.numpy(), FORMAT, [page])
        self.rows = torch.randperm(pages, generator=generator).tolist()
        blocks = torch.randperm(2 * pages, generator=generator)[:pages].tolist()
        self.spec = JobSpec([blocks], [self.rows])
        self.keys = [key_digest(f"chunk-{row}".encode()) for row in self.rows]
        self.pool = pool
        self.job = 0

    def _run(self, store: bool) -> None:
        self.job += 1
        if store:
            self.engine.submit_store(self.job, self.spec)
        else:
            self.engine.submit_load(self.job, self.spec)
        self.engine.wait([self.job])
        (result,) = self.engine.get_finished()
        assert result.success

    def store(self) -> None:
        self._run(True)

    def store_sealed(self) -> None:
        self._run(True)
        self.sealer.seal_all([(row, 0, key) for row, key in zip(self.rows, self.keys, strict=True)])

    def load(self) -> None:
        self._run(False)

    def check_load(self) -> None:
        entries = [(row, 0, key) for row, key in zip(self.rows, self.keys, strict=True)]
        assert not any(self.sealer.problems(entries))
        self._run(False)

    def crc(self) -> None:
        pages = self.pool.numpy()
        for row in self.rows:
            zlib.crc32(pages[row, : self.pool.shape[1] - SEAL_BYTES])


def _best(run: Any, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"{p >> 10}KiB")
@pytest.mark.parametrize("direction", ["store", "load"])
def test_seal_cost(benchmark: Any, page: int, direction: str) -> None:
    _seal_cost(benchmark, page, direction, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"{p >> 10}KiB")
@pytest.mark.parametrize("direction", ["store", "load"])
def test_seal_cost_cuda(benchmark: Any, page: int, direction: str) -> None:
    _seal_cost(benchmark, page, direction, "cuda")


def _seal_cost(benchmark: Any, page: int, direction: str, device: str) -> None:
    nbytes = SMOKE_BYTES if benchmark.disabled else JOB_BYTES
    pages = max(1, nbytes // page)
    nbytes = pages * page
    bench = Sealed(page, pages, device)
    bench.store_sealed()  # every row sealed, so that loads verify
    plain, sealed = (
        (bench.store, bench.store_sealed)
        if direction == "store"
        else (bench.load, bench.check_load)
    )
    benchmark.group = f"seal, {device}, {page >> 10} KiB pages"
    benchmark(sealed)
    rounds = 1 if benchmark.disabled else ROUNDS
    # Alternated rounds: plain job, sealed job, CRC alone.
    times: dict[str, float] = {"plain": float("inf"), "sealed": float("inf"), "crc": float("inf")}
    for _ in range(rounds):
        for name, run in (("plain", plain), ("sealed", sealed), ("crc", bench.crc)):
            times[name] = min(times[name], _best(run, 1))
    gbps = {name: round(nbytes / seconds / 1e9, 2) for name, seconds in times.items()}
    ratio = times["plain"] / times["sealed"]
    benchmark.extra_info.update(
        bytes=nbytes,
        pages=pages,
        plain_GBps=gbps["plain"],
        sealed_GBps=gbps["sealed"],
        crc_GBps=gbps["crc"],
        sealed_ratio=round(ratio, 3),
    )
    print(
        f"\n{device} {direction} {page >> 10} KiB pages: {gbps['plain']} GB/s plain, "
        f"{gbps['sealed']} GB/s {'sealed' if direction == 'store' else 'checked'} "
        f"(ratio {ratio:.2f}), CRC alone {gbps['crc']} GB/s"
    )
    # The bytes moved are right both ways (block and row are equal after a store and
    # after a load) and every seal still verifies.
    row = bench.rows[0]
    assert bench.sealer.problem(row, 0, bench.keys[0]) is None
    block = bench.engine.layout.planes[0].view[int(bench.spec.gpu_blocks[0][0])]
    assert torch.equal(bench.pool[row, :page], block.cpu())
