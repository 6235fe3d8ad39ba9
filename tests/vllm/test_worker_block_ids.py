"""Block ids the vLLM worker is given: integers only, refused by name before any byte moves.

vLLM's ``GPULoadStoreSpec`` / ``CPULoadStoreSpec`` constructors cast their ids with
``np.array(ids, dtype=np.int32)``, but ``block_ids`` is a plain attribute: a spec whose
ids were replaced (or a subclass that keeps its own array) reaches the worker with float,
string, bool or 2-D ids. The worker used to cast them again with ``np.asarray(...,
dtype=np.int64)``: 1.5 became block 1, a NaN became -2**63 (reported as a negative id),
a 2-D array was flattened. Each is refused naming the spec, the value and its index;
integer ids of any width are taken. The worker's cache tensors are checked by name too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.spec_geometry import BPC, NUM_BLOCKS, VLLM_ERROR, Caches, _config, _expected_pool

try:
    from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
except ImportError:  # pragma: no cover - exercised where vllm is absent
    pass

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")

# Attention: 3 blocks from logical block 1 (2 chunks), Mamba: 1 block at logical block 3.
GPU_IDS = [5, 2, 9, 7]
HOST_IDS = [0, 1, 2]
STORED = [(0, 5, 0, 1), (0, 2, 1, 0), (0, 9, 1, 1), (1, 7, 2, 1)]  # group, block, row, slot


def gpu_spec(ids: Any = None) -> Any:
    spec = GPULoadStoreSpec(GPU_IDS, group_sizes=[3, 1], block_indices=[1, 3])
    if ids is not None:
        spec.block_ids = ids  # past vLLM's own int32 cast, as a caller may set it
    return spec


def host_spec(ids: Any = None) -> Any:
    spec = CPULoadStoreSpec(HOST_IDS)
    if ids is not None:
        spec.block_ids = ids
    return spec


@pytest.fixture
def worker() -> Any:
    import triton_offload.vllm as tv

    spec = tv.TritonOffloadingSpec(_config({"backend": "torch"}))
    caches = Caches()
    worker = spec.get_worker(caches.canonical)
    worker.caches = caches  # for the checks below
    yield worker
    worker.shutdown()


def assert_refused(worker: Any, call: Any, match: str) -> None:
    """``call`` raises TypeError/ValueError matching ``match``, moves no byte and leaves
    no job behind; a valid store right after it works (also under the refused job id)."""
    engine, caches = worker.engine, worker.caches
    engine.pool.fill_(0x5A)
    pool_before, sources = engine.pool.clone(), caches.snapshot()
    with pytest.raises((TypeError, ValueError), match=match):
        call()
    assert torch.equal(engine.pool, pool_before)
    assert caches.equal(sources)
    assert worker.get_finished() == []
    assert worker.submit_store(1, gpu_spec(), host_spec())
    worker.wait({1})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    assert torch.equal(engine.pool, _expected_pool(engine, pool_before, caches, STORED))


GPU_NAME = r"submit_(store|load)\(job 1\): GPULoadStoreSpec block_ids"
HOST_NAME = r"submit_(store|load)\(job 1\): CPULoadStoreSpec block_ids"


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (np.array([5.0, 1.5, 9.0, 7.0]), r"must hold integer ids, got float64 1\.5 at index 1"),
        (np.array([5.0, 2.0, 9.0, 7.0]), r"must hold integer ids, got float64 5\.0 at index 0"),
        ([5, 2, 9, 7.0], r"must hold integer ids, got float64 7\.0 at index 3"),
        (np.array([5, np.nan, 9, 7]), r"must hold integer ids, got float64 NaN at index 1"),
        (np.array(["5", "2", "9", "7"]), r"must hold integer ids, got str '5' at index 0"),
        (["5", "2", "9", 7], r"must hold integer ids, got str '5' at index 0"),
        (np.array([5, 2, 9, 7], dtype=object), r"must hold integer ids, got object 5 at index 0"),
        (np.array([True, False, True, True]), r"must hold integer ids, got bool True at index 0"),
        ([5, 2, True, 7], r"must hold integer ids, got bool True at index 2"),
        (np.array([[5, 2], [9, 7]]), r"must be a 1-d sequence of ids, got shape \(2, 2\)"),
    ],
)
@pytest.mark.parametrize("store", [True, False])
def test_non_integer_gpu_block_ids_are_refused(
    worker: Any, ids: Any, match: str, store: bool
) -> None:
    def submit() -> Any:
        if store:
            return worker.submit_store(1, gpu_spec(ids), host_spec())
        return worker.submit_load(1, host_spec(), gpu_spec(ids))

    assert_refused(worker, submit, f"{GPU_NAME} {match}")


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (np.array([0.0, 1.0, 2.0]), r"must hold integer ids, got float64 0\.0 at index 0"),
        (np.array([0, 1, np.nan]), r"must hold integer ids, got float64 NaN at index 2"),
        (np.array(["0", "1", "2"]), r"must hold integer ids, got str '0' at index 0"),
        (np.array([[0, 1, 2]]), r"must be a 1-d sequence of ids, got shape \(1, 3\)"),
    ],
)
@pytest.mark.parametrize("store", [True, False])
def test_non_integer_cpu_block_ids_are_refused(
    worker: Any, ids: Any, match: str, store: bool
) -> None:
    def submit() -> Any:
        if store:
            return worker.submit_store(1, gpu_spec(), host_spec(ids))
        return worker.submit_load(1, host_spec(ids), gpu_spec())

    assert_refused(worker, submit, f"{HOST_NAME} {match}")


def test_a_two_dimensional_spec_from_vllms_constructor_is_refused(worker: Any) -> None:
    # vLLM's constructor keeps a nested list 2-D (its length check counts rows).
    nested = GPULoadStoreSpec([[5, 2], [9, 7]], group_sizes=[1, 1], block_indices=[1, 3])
    assert nested.block_ids.shape == (2, 2)
    assert_refused(
        worker,
        lambda: worker.submit_store(1, nested, host_spec([0, 1])),
        rf"{GPU_NAME} must be a 1-d sequence of ids, got shape \(2, 2\)",
    )


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
)
def test_integer_ids_of_any_width_are_taken(worker: Any, dtype: Any) -> None:
    engine, caches = worker.engine, worker.caches
    engine.pool.fill_(0x5A)
    before = engine.pool.clone()
    gpu = gpu_spec(np.array(GPU_IDS, dtype=dtype))
    assert worker.submit_store(3, gpu, host_spec(np.array(HOST_IDS, dtype=dtype)))
    worker.wait({3})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(3, True)]
    assert torch.equal(engine.pool, _expected_pool(engine, before, caches, STORED))


def test_python_int_ids_are_taken(worker: Any) -> None:
    engine, caches = worker.engine, worker.caches
    engine.pool.fill_(0x5A)
    before = engine.pool.clone()
    assert worker.submit_store(4, gpu_spec(list(GPU_IDS)), host_spec(tuple(HOST_IDS)))
    worker.wait({4})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(4, True)]
    assert torch.equal(engine.pool, _expected_pool(engine, before, caches, STORED))


# ------------------------------------------------------------------ cache tensors


def _with_third_tensor(caches: Caches, tensor: torch.Tensor) -> Any:
    canonical = caches.canonical
    tensors = [*canonical.tensors[:2], CanonicalKVCacheTensor(tensor, 48)]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=canonical.group_data_refs)


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        # A 0-block tensor cannot be viewed as [0, -1] bytes: it used to be refused as
        # "the bytes of one block must be contiguous".
        (torch.empty(0, 48, dtype=torch.int8), r"kv_caches.tensors\[2\].tensor has 0 blocks"),
        # A meta tensor used to be refused as a device mismatch with the other tensors.
        (
            torch.empty(NUM_BLOCKS, 48, dtype=torch.int8, device="meta"),
            r"cache tensor kv_caches.tensors\[2\].tensor \(shape \(12, 48\)\) is on the meta "
            "device: it has no memory",
        ),
    ],
)
def test_worker_caches_are_refused_naming_the_problem(tensor: torch.Tensor, match: str) -> None:
    import triton_offload.vllm as tv

    spec = tv.TritonOffloadingSpec(_config({"backend": "torch"}))
    with pytest.raises(ValueError, match=match):
        spec.get_worker(_with_third_tensor(Caches(), tensor))
    worker = spec.get_worker(Caches().canonical)  # the spec still builds a worker
    assert worker.engine.layout.blocks_per_chunk == BPC
    worker.shutdown()
