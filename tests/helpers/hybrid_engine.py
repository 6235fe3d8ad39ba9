"""The hybrid model's caches and TransferEngine, shared by the engine and copier tests.

A full-attention group with K/V planes (views of one ``(2, blocks, ...)`` tensor), a
sliding-window group whose blocks have a padded stride, and a Mamba group with a conv
and an SSM state plane of different (odd) sizes; DCP=2 (``tests/transfer/test_engine.py``
describes the checks).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from triton_offload import GroupSpec, ParallelSpec, plan_offload
from triton_offload.transfer.engine import TransferEngine

NUM_BLOCKS = 12
NUM_HOST_BLOCKS = 9
# The kernel runs on these CPU tensors only under the interpreter (the default without
# CUDA); on a GPU machine tests/transfer/test_engine_cuda.py covers it.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1"),
    ),
]


def hybrid_plan(blocks_per_chunk: int):
    groups = [
        GroupSpec("full_attention", 16),
        GroupSpec("sliding_window", 16, sliding_window=64),
        GroupSpec("mamba", 16, mamba_cache_mode="align"),
    ]
    return plan_offload(
        groups, ParallelSpec(tp_size=2, dcp_size=2), blocks_per_chunk=blocks_per_chunk
    )


def fill_random(tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Random bytes into ``tensor`` whatever its dtype (NaN patterns included)."""
    raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def hybrid_caches(seed: int = 0, layers: int = 2) -> tuple[list, list[torch.Tensor]]:
    """(caches, storages): storages are the whole tensors, to snapshot every byte."""
    generator = torch.Generator().manual_seed(seed)
    storages: list[torch.Tensor] = []
    attention = []
    for _ in range(layers):
        kv = torch.empty(2, NUM_BLOCKS, 4, 2, 8, dtype=torch.bfloat16)  # 128 B pages
        storages.append(kv)
        attention.append((kv[0], kv[1]))
    window = []
    for _ in range(layers):
        padded = torch.empty(NUM_BLOCKS, 40, dtype=torch.float16)  # 64 B pages, stride 80 B
        storages.append(padded)
        window.append(padded[:, 4:36].unflatten(1, (4, 8)))
    mamba = []
    for _ in range(layers):
        conv = torch.empty(NUM_BLOCKS, 3, 5, dtype=torch.float16)  # 30 B pages
        ssm = torch.empty(NUM_BLOCKS, 4, 33, dtype=torch.float32)  # 528 B pages
        storages += [conv, ssm]
        mamba.append((conv, ssm))
    for tensor in storages:
        fill_random(tensor, generator)
    return [attention, window, mamba], storages


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """uint8 view of the tensor's whole storage (compare bytes: random bytes include NaNs)."""
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [raw_bytes(t).clone() for t in tensors]


def same_bytes(tensors: list[torch.Tensor], copies: list[torch.Tensor]) -> bool:
    return all(torch.equal(raw_bytes(t), c) for t, c in zip(tensors, copies, strict=True))


def expected_store(
    engine: TransferEngine, pool_before: torch.Tensor, pairs: np.ndarray, offsets: np.ndarray
) -> torch.Tensor:
    """The pool after a store, computed page by page from the uint8 plane views."""
    expected = pool_before.clone()
    for group in range(engine.num_groups):
        for gpu, row, slot in pairs[offsets[group] : offsets[group + 1]].tolist():
            for index in engine.layout.group_planes[group]:
                plane = engine.layout.planes[index]
                start = plane.pool_offset + slot * plane.page_bytes
                expected[row, start : start + plane.page_bytes] = plane.view[gpu]
    return expected


def store_job(blocks_per_chunk: int) -> tuple[list, list, list]:
    """GPU blocks, host blocks and first indices of a store with partial first chunks."""
    if blocks_per_chunk == 1:
        gpu = [[7, 2, 9], [4, 11], [5]]
        host = [[3, 0, 6], [8, 1], [2]]
        first = [0, 5, 3]
    else:
        # Group 0 starts at slot 2 (partial first chunk), group 1 at slot 1, group 2 at 0.
        gpu = [[7, 2, 9, 0], [4, 11], [5, 10, 3]]
        host = [[3, 0], [8], [2]]
        first = [5, 4, 3]
    return gpu, host, first


def make_engine(caches: list, blocks_per_chunk: int, backend: str) -> TransferEngine:
    return TransferEngine(hybrid_plan(blocks_per_chunk), caches, NUM_HOST_BLOCKS, backend=backend)


class _HostCopies:
    """Stands in for the CUDA API: performs each 'async' copy at once with memmove."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int]] = []

    def memcpy_async(self, dst: int, src: int, size: int, stream: int) -> None:
        import ctypes

        self.calls.append((dst, src, size, stream))
        ctypes.memmove(dst, src, size)
