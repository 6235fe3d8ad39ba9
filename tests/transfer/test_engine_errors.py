"""Bad input: ValueError naming the value, before any byte moves; the engine stays usable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from triton_offload import GroupSpec, plan_offload
from triton_offload.transfer.engine import TransferEngine

NUM_BLOCKS = 6
HOST_BLOCKS = 4


def two_group_plan(blocks_per_chunk: int = 2) -> Any:
    groups = [GroupSpec("full_attention", 16), GroupSpec("mamba", 16, mamba_cache_mode="align")]
    return plan_offload(groups, blocks_per_chunk=blocks_per_chunk)


def make_caches() -> list:
    generator = torch.Generator().manual_seed(3)
    kv = torch.randn(2, NUM_BLOCKS, 4, 8, generator=generator)
    conv = torch.randn(NUM_BLOCKS, 3, 5, generator=generator).half()
    ssm = torch.randn(NUM_BLOCKS, 2, 9, generator=generator)
    return [[(kv[0], kv[1])], [(conv, ssm)]]


@pytest.fixture(params=["python", "numpy"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> TransferEngine:
    """An engine; jobs built and checked by the small-job (Python) or the numpy path."""
    if request.param == "numpy":
        from triton_offload.transfer import jobs

        monkeypatch.setattr(jobs, "SMALL_JOB_PAIRS", 0)
    return TransferEngine(two_group_plan(), make_caches(), HOST_BLOCKS, backend="torch")


def raw(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).clone()


def state(engine: TransferEngine) -> list[torch.Tensor]:
    views = [raw(plane.view) for plane in engine.layout.planes]
    return [engine.pool.clone(), *views]


def assert_rejected(engine: TransferEngine, call: Callable[[], Any], match: str) -> None:
    """``call`` raises ValueError (TypeError for a wrong type) matching ``match``, moves no
    byte; the engine still works."""
    engine.pool.copy_(torch.randint(0, 256, engine.pool.shape, dtype=torch.uint8))
    before = state(engine)
    with pytest.raises((ValueError, TypeError), match=match):
        call()
    after = state(engine)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert engine.get_finished() == []
    # Still usable, including the job id of a rejected job.
    assert engine.submit_store(7, gpu_blocks=[[0, 1], [2]], host_blocks=[[3], [1]])
    (result,) = engine.get_finished()
    assert result.job_id == 7 and result.success
    plane = engine.layout.planes[0]
    assert torch.equal(engine.pool_view(0)[3, 1], plane.view[1])


def test_reused_in_flight_job_id(engine: TransferEngine) -> None:
    assert engine.submit_store(1, gpu_blocks=[[0], []], host_blocks=[[0], []])

    def reuse() -> None:
        engine.submit_load(1, gpu_blocks=[[2], []], host_blocks=[[0], []])

    with pytest.raises(ValueError, match="job id 1 is already in flight"):
        reuse()
    assert [r.job_id for r in engine.get_finished()] == [1]
    assert_rejected(engine, lambda: engine.wait([12345]), "job id 12345 is unknown")


def test_unhashable_job_id(engine: TransferEngine) -> None:
    assert_rejected(
        engine,
        lambda: engine.submit_store([1], gpu_blocks=[[0], []], host_blocks=[[0], []]),
        "hashable",
    )


@pytest.mark.parametrize(
    ("gpu", "host", "first", "match"),
    [
        ([[0]], [[0], []], None, "gpu_blocks has 1 groups but host_blocks has 2"),
        ([[0], [], []], [[0], [], []], None, "the job has 3 groups but the engine has 2"),
        ([[0], []], [[0], [], []], None, "gpu_blocks has 2 groups but host_blocks has 3"),
        ([[0], []], [[0], []], [0], "first_block_index has 1 groups"),
        ([[0, 6], []], [[0], []], None, r"GPU block id 6 of group 0 out of range \[0, 6\)"),
        ([[], [-1]], [[], [0]], None, r"GPU block id -1 of group 1 is negative"),
        ([[0], []], [[4], []], None, r"host block id 4 of group 0 out of range \[0, 4\)"),
        ([[0], []], [[-2], []], None, r"host block id -2 of group 0 is negative"),
        ([[0, 1, 2], []], [[0], []], None, "3 GPU blocks starting at slot 0 need 2 host chunks"),
        ([[0, 1], []], [[0], []], [1, 0], "2 GPU blocks starting at slot 1 need 2 host chunks"),
        ([[0], []], [[0], []], [-1, 0], r"first_block_index\[0\] -1 is negative"),
        ([[0], []], [[0], []], [0.5, 0], r"first_block_index\[0\] 0.5 is not an int"),
        ([[0.0], []], [[0], []], None, r"gpu_blocks\[0\] must hold integer ids"),
        ([[[0]], []], [[0], []], None, r"gpu_blocks\[0\] must be a 1-d sequence"),
        ([[0, 1, 2], []], [[1, 1], []], None, "pool row 1 slot 0"),  # two pages, one slot
        ([[0], [1]], [[2], [2]], None, "pool row 2 is written by groups 0 and 1"),
    ],
)
def test_bad_store(
    engine: TransferEngine, gpu: list, host: list, first: list | None, match: str
) -> None:
    assert_rejected(
        engine,
        lambda: engine.submit_store(5, gpu_blocks=gpu, host_blocks=host, first_block_index=first),
        match,
    )


def test_bad_load(engine: TransferEngine) -> None:
    assert_rejected(
        engine,
        lambda: engine.submit_load(5, gpu_blocks=[[2, 3, 2], []], host_blocks=[[0, 1], []]),
        "both write GPU block id 2",
    )
    assert_rejected(
        engine,
        lambda: engine.submit_load(5, gpu_blocks=[[9], []], host_blocks=[[0], []]),
        r"GPU block id 9 of group 0 out of range",
    )


def test_bad_caches() -> None:
    plan = two_group_plan()
    caches = make_caches()
    with pytest.raises(ValueError, match="caches has 1 groups but the plan has 2"):
        TransferEngine(plan, caches[:1], HOST_BLOCKS)
    with pytest.raises(ValueError, match="group 1 layer 0 plane 1 has 5 blocks"):
        TransferEngine(plan, [caches[0], [(caches[1][0][0], torch.zeros(5, 4))]], HOST_BLOCKS)
    transposed = torch.zeros(NUM_BLOCKS, 8, 4).transpose(1, 2)
    with pytest.raises(ValueError, match="group 0 layer 1 plane 0: the bytes of one block"):
        TransferEngine(plan, [[caches[0][0], transposed], caches[1]], HOST_BLOCKS)
    with pytest.raises(ValueError, match="caches are on cpu but device is cuda"):
        TransferEngine(plan, caches, HOST_BLOCKS, device="cuda")
    with pytest.raises(ValueError, match="backend 'dma' needs CUDA caches"):
        TransferEngine(plan, caches, HOST_BLOCKS, backend="dma")
    with pytest.raises(ValueError, match="backend 'cuda' is not one of"):
        TransferEngine(plan, caches, HOST_BLOCKS, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_host_blocks 0 must be >= 1"):
        TransferEngine(plan, caches, 0)


def test_pool_argument() -> None:
    plan = two_group_plan()
    engine = TransferEngine(plan, make_caches(), HOST_BLOCKS, backend="torch")
    pool = torch.zeros(HOST_BLOCKS, engine.row_bytes, dtype=torch.uint8)
    mine = TransferEngine(plan, make_caches(), HOST_BLOCKS, backend="torch", pool=pool)
    assert mine.pool.data_ptr() == pool.data_ptr()
    with pytest.raises(ValueError, match=r"pool must be a uint8 tensor of shape \(4, "):
        TransferEngine(plan, make_caches(), HOST_BLOCKS, pool=pool[:3])
    region = torch.zeros(HOST_BLOCKS * engine.row_bytes * 2, dtype=torch.uint8)
    overlapping = region.as_strided((HOST_BLOCKS, engine.row_bytes), (engine.row_bytes - 1, 1))
    with pytest.raises(ValueError, match=r"pool row stride \d+ bytes is smaller than the"):
        TransferEngine(plan, make_caches(), HOST_BLOCKS, backend="torch", pool=overlapping)
    columns = region.as_strided((HOST_BLOCKS, engine.row_bytes), (2 * engine.row_bytes, 2))
    with pytest.raises(ValueError, match=r"pool rows must be contiguous \(stride\(1\) == 1\)"):
        TransferEngine(plan, make_caches(), HOST_BLOCKS, backend="torch", pool=columns)
    with pytest.raises(TypeError, match=r"pool must be a torch\.Tensor, got ndarray"):
        TransferEngine(plan, make_caches(), HOST_BLOCKS, pool=pool.numpy())  # type: ignore[arg-type]
    # With CUDA, a pageable or partly locked CPU pool is refused: tests/transfer/test_pool.py.


def test_block_lists_cannot_be_given_by_position(engine: TransferEngine) -> None:
    """Store and load once took their two lists in opposite orders; now only keywords or
    a JobSpec are accepted, so a swapped pair of lists cannot be passed by position."""
    from triton_offload.transfer.jobs import JobSpec

    assert_rejected(
        engine,
        lambda: engine.submit_store(1, [[0], []], [[0], []]),  # type: ignore[arg-type, misc]
        "submit_store takes the job as a JobSpec or as keywords gpu_blocks=, host_blocks=",
    )
    assert_rejected(
        engine,
        lambda: engine.submit_load(1, [[0], []]),  # type: ignore[arg-type]
        r"must be a JobSpec or given as gpu_blocks=/host_blocks= keywords, got list",
    )
    assert_rejected(
        engine,
        lambda: engine.submit_load(1, gpu_blocks=[[0], []]),
        "a job needs gpu_blocks= and host_blocks=",
    )
    spec = JobSpec([[0], []], [[0], []])
    assert_rejected(
        engine,
        lambda: engine.submit_store(1, spec, gpu_blocks=[[0], []]),
        "either a JobSpec or gpu_blocks=/host_blocks=, not both",
    )
    assert engine.submit_store(2, spec)
    assert [r.job_id for r in engine.get_finished()] == [2]


def test_job_spec_is_immutable_and_checks_its_values() -> None:
    from triton_offload.transfer.jobs import JobSpec

    gpu = [3, 4]
    spec = JobSpec([gpu, []], [[1], []], [2, 0])
    gpu[0] = 99  # the spec copied the ids
    assert spec.gpu_blocks[0].tolist() == [3, 4]
    assert spec.first_block_index == (2, 0) and spec.num_pairs == 2
    with pytest.raises(ValueError, match="read-only"):
        spec.gpu_blocks[0][0] = 5
    with pytest.raises(TypeError, match=r"host_blocks\[1\] must hold integer ids, got float64"):
        JobSpec([[0], []], [[0], [1.5]])
    by_group = JobSpec.from_groups([([3, 4], [1], 2), ([], [], 0)])
    assert [b.tolist() for b in by_group.gpu_blocks] == [[3, 4], []]
    assert [h.tolist() for h in by_group.host_blocks] == [[1], []]
    assert by_group.first_block_index == (2, 0)
    with pytest.raises(TypeError, match="gpu_blocks must be a sequence with one entry per group"):
        JobSpec("01", [[0], []])  # type: ignore[arg-type]


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = two_group_plan()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        TransferEngine(plan, make_caches(), HOST_BLOCKS, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from triton_offload.kernels import copy_blocks

    monkeypatch.setattr(copy_blocks, "_INTERPRETED", False)
    with pytest.raises(ValueError, match="imported before TRITON_INTERPRET=1 was set"):
        TransferEngine(plan, make_caches(), HOST_BLOCKS, backend="triton")


@pytest.mark.parametrize(
    ("crossover", "error", "match"),
    [
        ({"store": 4096}, ValueError, r"crossover \{'store': 4096\} needs exactly the keys"),
        ({"store": 1, "load": 2, "both": 3}, ValueError, "needs exactly the keys"),
        (True, TypeError, r"crossover\['store'\] must be an int of page bytes, got True"),
        ({"store": 4096, "load": "64k"}, TypeError, r"crossover\['load'\] .* got '64k'"),
        (-1, ValueError, r"crossover\['store'\] -1 must be >= 0"),
    ],
)
def test_bad_crossover_is_rejected_on_every_device(crossover: Any, error: type, match: str) -> None:
    # The setting only matters for "auto" on CUDA, but a typo must not wait for a GPU.
    with pytest.raises(error, match=match):
        TransferEngine(two_group_plan(), make_caches(), HOST_BLOCKS, crossover=crossover)


def test_a_valid_crossover_is_accepted_on_cpu() -> None:
    engine = TransferEngine(
        two_group_plan(), make_caches(), HOST_BLOCKS, crossover={"store": 0, "load": 65536}
    )
    assert engine.backend == "torch"
    engine.shutdown()


# ------------------------------------------- errors in the project's own words


def _small_engine(**options: Any) -> TransferEngine:
    from triton_offload import GroupSpec, plan_offload

    plan = plan_offload([GroupSpec("full_attention", 16)])
    return TransferEngine(plan, [[torch.zeros(8, 64, dtype=torch.uint8)]], 4, **options)


def test_pool_piece_bytes_is_named_as_the_argument() -> None:
    with pytest.raises(ValueError, match=r"^pool_piece_bytes 0 must be >= 1"):
        _small_engine(backend="torch", pool_piece_bytes=0)


def test_a_positional_block_list_is_refused_naming_the_keywords() -> None:
    engine = _small_engine(backend="torch")
    with pytest.raises(TypeError, match=r"submit_store.*gpu_blocks=.*host_blocks="):
        engine.submit_store("a", [[0]], [[1]])  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"submit_load.*gpu_blocks=.*host_blocks="):
        engine.submit_load("b", [[0]], [[1]])  # type: ignore[call-arg]
    assert engine.submit_store("a", gpu_blocks=[[0]], host_blocks=[[1]])  # still usable
    assert [r.success for r in engine.get_finished()] == [True]


def test_ids_on_the_meta_device_are_refused_naming_them() -> None:
    engine = _small_engine(backend="torch")
    meta = torch.tensor([0], device="meta")
    with pytest.raises(ValueError, match=r"gpu_blocks\[0\] is a tensor on the meta device"):
        engine.submit_store("m", gpu_blocks=[meta], host_blocks=[[1]])


def test_pool_view_of_a_missing_plane_names_the_range() -> None:
    engine = _small_engine(backend="torch")
    with pytest.raises(ValueError, match=r"plane index 99 out of range \[0, 1\)"):
        engine.pool_view(99)


def test_ids_beyond_int64_are_named_as_such() -> None:
    engine = _small_engine(backend="torch")
    with pytest.raises(ValueError, match=r"gpu_blocks\[0\] id 9223372036854775808 does not fit"):
        engine.submit_store("d", gpu_blocks=[[2**63, -1]], host_blocks=[[1, 2]])


# NaN and fractional ids: numpy casts NaN to int64 as -2**63, which used to be reported
# as a negative id; every float id is refused naming the value and its position.
@pytest.mark.parametrize(
    ("gpu", "host", "match"),
    [
        ([np.array([np.nan]), []], [[0], []], r"gpu_blocks\[0\] .* got float64 NaN at index 0"),
        ([[0, 1.5], []], [[0], []], r"gpu_blocks\[0\] .* got float64 1\.5 at index 1"),
        ([[0, 2.0], []], [[0], []], r"gpu_blocks\[0\] .* got float64 2\.0 at index 1"),
        ([[0], []], [[np.nan], []], r"host_blocks\[0\] .* got float64 NaN at index 0"),
        ([[0], []], [[0], [np.inf]], r"host_blocks\[1\] .* got float64 inf at index 0"),
        ([torch.tensor([0.0, 2.5]), []], [[0], []], r"gpu_blocks\[0\] .* float32 2\.5 at index 1"),
        ([["0"], []], [[0], []], r"gpu_blocks\[0\] must hold integer ids, got str '0' at index 0"),
    ],
)
def test_float_ids_are_refused_naming_the_value(
    engine: TransferEngine, gpu: list, host: list, match: str
) -> None:
    assert_rejected(engine, lambda: engine.submit_load(5, gpu_blocks=gpu, host_blocks=host), match)


def _engine_after_refusal() -> None:
    """A valid engine built right after a refused one works."""
    engine = TransferEngine(two_group_plan(), make_caches(), HOST_BLOCKS, backend="torch")
    assert engine.submit_store(1, gpu_blocks=[[0, 1], [2]], host_blocks=[[3], [1]])
    assert [r.success for r in engine.get_finished()] == [True]


def test_meta_caches_are_refused_naming_the_meta_device() -> None:
    # A meta tensor has no memory (data_ptr 0): it used to be refused as "plane 0
    # base_address 0 must be >= 1", or, next to real caches, as a device mismatch.
    plan = two_group_plan()
    meta = [[tuple(t.to("meta") for t in layer) for layer in group] for group in make_caches()]
    with pytest.raises(
        ValueError,
        match=r"cache tensor group 0 layer 0 plane 0 \(shape \(6, 4, 8\)\) is on the meta "
        "device: it has no memory",
    ):
        TransferEngine(plan, meta, HOST_BLOCKS, backend="torch")
    caches = make_caches()
    mixed = [caches[0], [(caches[1][0][0], caches[1][0][1].to("meta"))]]
    with pytest.raises(ValueError, match=r"group 1 layer 0 plane 1 .* is on the meta device"):
        TransferEngine(plan, mixed, HOST_BLOCKS, backend="torch")
    _engine_after_refusal()


def test_zero_block_caches_are_refused_naming_the_block_count() -> None:
    # A 0-block tensor's strides are arbitrary: one whose (empty) blocks looked
    # non-contiguous used to be refused as "the bytes of one block are not contiguous".
    plan = two_group_plan()
    caches = make_caches()
    empty = torch.empty(0, 5, 3, dtype=torch.half).transpose(1, 2)
    with pytest.raises(ValueError, match=r"group 1 layer 0 plane 0 has 0 blocks \(shape \(0, 3, 5"):
        TransferEngine(plan, [caches[0], [(empty, caches[1][0][1])]], HOST_BLOCKS)
    with pytest.raises(ValueError, match=r"group 0 layer 0 plane 0 has 0 blocks"):
        TransferEngine(plan, [[torch.empty(0, 0)], caches[1]], HOST_BLOCKS)
    _engine_after_refusal()
