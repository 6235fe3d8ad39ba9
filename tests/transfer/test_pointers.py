"""vLLM 0.34's ``DevicePointers``: block ids derived from them, every pointer checked.

The pointers are built here from the rule in vLLM 0.34's ``DevicePointers`` docstring
(flat, ordered by group, then ref, then block; ``base + id * stride`` of the ref's
tensor, size = the ref's page), not from the code under test. Where vLLM 0.34 is
installed its own ``resolve_device_pointers`` is checked against the same rule, and a
worker given vLLM's pointers moves exactly the bytes it moves given block ids.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from triton_offload.transfer.pointers import blocks_from_pointers, device_planes

NUM_BLOCKS = 20


def _caches() -> Any:
    """Two groups: group 0 with two refs on two tensors (odd page in a padded row),
    group 1 with one ref on a third tensor."""
    tensors = [
        torch.zeros((NUM_BLOCKS, 96), dtype=torch.int8),
        torch.zeros((NUM_BLOCKS, 64), dtype=torch.int8),
        torch.zeros((NUM_BLOCKS, 40), dtype=torch.int8),
    ]
    return SimpleNamespace(
        tensors=[SimpleNamespace(tensor=t, page_size_bytes=t.size(1)) for t in tensors],
        group_data_refs=[
            [
                SimpleNamespace(tensor_idx=0, page_size_bytes=90),
                SimpleNamespace(tensor_idx=1, page_size_bytes=64),
            ],
            [SimpleNamespace(tensor_idx=2, page_size_bytes=40)],
        ],
    )


def _pointers(caches: Any, groups: list[list[int]], indices: list[int]) -> Any:
    """DevicePointers by the docstring's rule."""
    ptrs: list[int] = []
    sizes: list[int] = []
    for ids, refs in zip(groups, caches.group_data_refs, strict=True):
        for ref in refs if ids else ():
            tensor = caches.tensors[ref.tensor_idx].tensor
            ptrs += [tensor.data_ptr() + b * tensor.stride(0) for b in ids]
            sizes += [ref.page_size_bytes] * len(ids)
    return SimpleNamespace(
        ptrs=np.array(ptrs, dtype=np.uint64),
        sizes=np.array(sizes, dtype=np.uint64),
        group_block_counts=tuple(len(ids) for ids in groups),
        group_data_ref_counts=tuple(len(refs) for refs in caches.group_data_refs),
        block_indices=tuple(indices),
    )


def test_block_ids_come_back_from_the_pointers() -> None:
    caches = _caches()
    groups = [[7, 0, 19, 3, 0], [11, 2]]  # null block 0 kept in place, as vLLM 0.34 does
    blocks = blocks_from_pointers(_pointers(caches, groups, [5, 1]), device_planes(caches), "j")
    assert blocks.block_ids.tolist() == [7, 0, 19, 3, 0, 11, 2]
    assert blocks.group_sizes == (5, 2) and blocks.block_indices == (5, 1)


def test_an_empty_group_has_no_pointers() -> None:
    caches = _caches()
    blocks = blocks_from_pointers(_pointers(caches, [[], [4]], [0, 2]), device_planes(caches), "j")
    assert blocks.block_ids.tolist() == [4] and blocks.group_sizes == (0, 1)


def _bad(pointers: Any, index: int, value: int) -> Any:
    ptrs = pointers.ptrs.copy()
    ptrs[index] = np.uint64(value)
    return SimpleNamespace(**{**vars(pointers), "ptrs": ptrs})


@pytest.mark.parametrize(
    ("what", "index", "make", "message"),
    [
        ("between two blocks", 1, lambda t, p: p + 8, r"group 0, ref 0, block 1"),
        ("another tensor's block", 3, lambda t, p: t[0].data_ptr(), r"group 0, ref 1, block 0"),
        ("past the cache", 2, lambda t, p: t[0].data_ptr() + NUM_BLOCKS * 96, r"block 2"),
        ("second ref disagrees", 4, lambda t, p: p + 64, r"group 0, ref 1, block 1"),
        ("below the base", 6, lambda t, p: t[2].data_ptr() - 40, r"group 1, ref 0, block 0"),
    ],
)
def test_a_pointer_off_the_rule_is_refused_naming_it(
    what: str, index: int, make: Any, message: str
) -> None:
    caches = _caches()
    tensors = [entry.tensor for entry in caches.tensors]
    good = _pointers(caches, [[1, 2, 3], [4]], [0, 0])
    bad = _bad(good, index, make(tensors, int(good.ptrs[index])))
    with pytest.raises(ValueError, match=message) as info:
        blocks_from_pointers(bad, device_planes(caches), "submit_store(job 3)")
    assert "submit_store(job 3)" in str(info.value) and f"{int(bad.ptrs[index]):#x}" in str(
        info.value
    ), what


def test_a_wrong_size_or_count_is_refused() -> None:
    caches = _caches()
    planes = device_planes(caches)
    good = _pointers(caches, [[1, 2], [3]], [0, 0])
    sizes = good.sizes.copy()
    sizes[1] = 91
    with pytest.raises(ValueError, match=r"size 91 of group 0, ref 0, block 1 .* 90-byte page"):
        blocks_from_pointers(SimpleNamespace(**{**vars(good), "sizes": sizes}), planes, "j")
    with pytest.raises(ValueError, match=r"3 pointers .* need 5"):
        blocks_from_pointers(SimpleNamespace(**{**vars(good), "ptrs": good.ptrs[:3]}), planes, "j")
    with pytest.raises(ValueError, match=r"but the offloaded caches have 2 groups"):
        blocks_from_pointers(
            SimpleNamespace(**{**vars(good), "group_block_counts": (2,)}), planes, "j"
        )
    with pytest.raises(TypeError, match=r"uint64"):
        blocks_from_pointers(
            SimpleNamespace(**{**vars(good), "ptrs": good.ptrs.astype(np.int64)}), planes, "j"
        )
    empty = (planes[0], device_planes(SimpleNamespace(tensors=[], group_data_refs=[[]]))[0])
    with pytest.raises(ValueError, match=r"group 1 has 1 blocks but no cache on this worker"):
        blocks_from_pointers(
            SimpleNamespace(
                **{
                    **vars(good),
                    "ptrs": good.ptrs[:4],
                    "sizes": good.sizes[:4],
                    "group_data_ref_counts": (2, 0),
                }
            ),
            empty,
            "j",
        )
    with pytest.raises(TypeError, match=r"DevicePointers or GPULoadStoreSpec, got list"):
        blocks_from_pointers([1, 2], planes, "j")


# ------------------------------------------------------------------ vLLM 0.34 itself


def _vllm_034() -> Any:
    try:
        from vllm.v1.kv_offload import pointer_utils
    except ImportError:
        pytest.skip("vLLM 0.34's pointer_utils is not installed (vLLM 0.33 hands block ids)")
    return pointer_utils


def test_vllms_resolution_follows_the_rule_these_tests_use() -> None:
    pointer_utils = _vllm_034()
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    caches = _caches()
    groups = [[7, 0, 19], [11, 2]]
    spec = GPULoadStoreSpec([7, 0, 19, 11, 2], group_sizes=[3, 2], block_indices=[1, 0])
    theirs = pointer_utils.resolve_device_pointers(spec, caches)
    ours = _pointers(caches, groups, [1, 0])
    assert theirs.ptrs.tolist() == ours.ptrs.tolist()
    assert theirs.sizes.tolist() == ours.sizes.tolist()
    blocks = blocks_from_pointers(theirs, device_planes(caches), "j")
    assert blocks.block_ids.tolist() == [7, 0, 19, 11, 2]


def test_a_worker_given_vllms_pointers_moves_what_block_ids_move() -> None:
    pointer_utils = _vllm_034()
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    import triton_offload.vllm as tv
    from tests.helpers.spec_geometry import Caches, _config

    results = []
    for use_pointers in (False, True):
        spec = tv.TritonOffloadingSpec(_config())
        caches = Caches(seed=3)
        worker = spec.get_worker(caches.canonical)
        try:
            worker.engine.pool.fill_(0x5A)
            sources = caches.snapshot()
            gpu = GPULoadStoreSpec([5, 2, 9, 7], group_sizes=[3, 1], block_indices=[1, 3])
            side = (
                pointer_utils.resolve_device_pointers(gpu, caches.canonical)
                if use_pointers
                else gpu
            )
            assert worker.submit_store(1, side, CPULoadStoreSpec([0, 1, 2]))
            worker.wait([1])
            assert [r.success for r in worker.get_finished()] == [True]
            assert all(torch.equal(a, b) for a, b in zip(sources, caches.snapshot(), strict=True))
            results.append(worker.engine.pool.clone())
        finally:
            worker.shutdown()
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], torch.full_like(results[0], 0x5A))
