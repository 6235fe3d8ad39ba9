"""pytest-benchmark suites for the CPU-measurable parts of the bench harness.

Run as smoke tests by default (``--benchmark-disable``), measured with
``pytest bench/suites/bench_harness.py --benchmark-enable``. Each benchmark states the bytes
or descriptors it handles in ``extra_info``.

- host cost of preparing one full-size Llama-3.1-8B job: this project's pair table
  (O(blocks)) vs vLLM 0.33's per-(block x layer) pointers (O(blocks x planes));
- one store job of a scaled Llama-3.1-8B TP4 case on the engine's CPU path, on a
  per-page ``copy_`` loop, and the one-copy ceiling of the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from triton_offload.bench import cases, harness, paths

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Single-threaded torch, as in ``harness.run`` on CPU: the copy paths use one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def preparation() -> Iterator[harness.JobPreparation]:
    prep = harness.job_preparation(cases.CASES["llama3.1-8b-tp1"])
    yield prep
    prep.close()


def test_job_table_project(benchmark: Any, preparation: harness.JobPreparation) -> None:
    ws = preparation.workspace
    benchmark.extra_info["block_pairs"] = sum(len(b) for b in ws.gpu_blocks)
    pairs, _ = benchmark(preparation.project)
    assert pairs.shape == (128, 3)


def test_job_pointers_per_block_and_layer(
    benchmark: Any, preparation: harness.JobPreparation
) -> None:
    benchmark.extra_info["descriptors"] = preparation.workspace.job_pages
    benchmark.extra_info["implementation"] = preparation.pointer_impl
    benchmark(preparation.pointers)


@pytest.fixture(scope="module")
def workspace() -> paths.Workspace:
    case = cases.scale_case(cases.CASES["llama3.1-8b-tp4"], 8 * cases.MiB)
    ws = paths.build_workspace(case, CPU)
    ws.fill_random(seed=0)
    return ws


@pytest.mark.parametrize("name", ["torch", "per-page-copy", paths.CEILING])
def test_store_job(benchmark: Any, workspace: paths.Workspace, name: str) -> None:
    runner = paths.make_path(name, workspace)
    try:
        assert runner.verify() is None  # byte-exact before it is timed
        benchmark.extra_info["bytes"] = workspace.job_bytes
        benchmark.extra_info["pages"] = workspace.job_pages

        def job() -> None:
            runner.submit(paths.STORE)
            runner.finish()

        benchmark(job)
    finally:
        runner.close()
