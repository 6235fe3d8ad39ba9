"""The DCP/Mamba span case under TritonOffloadingSpec: its config and vLLM-style caches.

A hybrid model with a full-attention group and a Mamba group under DCP=2, so vLLM's
spans are 32 and 16 tokens per block, with ``blocks_per_chunk`` 2. The caches are built
the way vLLM's connector builds its ``CanonicalKVCaches`` (``tests/vllm/test_spec.py``
describes them). Importing this module needs no vLLM: ``VLLM_ERROR`` says why it cannot
be imported, or is None.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tests.helpers.vllm_fixtures import hybrid_groups, offloading_config

try:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )
    from vllm.v1.kv_offload.config import OffloadingConfig

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"


SPEC_NAME = "TritonOffloadingSpec"
MODULE = "triton_offload.vllm"
NUM_BLOCKS = 12
BPC = 2
# Bytes of one block over all of a worker's cache tensors (what vLLM derives from
# its KVCacheConfig): the shared 128-byte tensor, the 160-byte strided buffer and
# the 48-byte Mamba SSM tensor.
WORKER_BYTES_PER_BLOCK = 128 + 160 + 48
WORLD_SIZE = 2  # TP=2, DCP=2
PAGE = 4096  # vLLM rounds each host chunk up to the OS page
# One chunk: 336 bytes x 2 workers x 2 blocks = 1344 -> 4096 bytes; 8 of them.
CPU_BYTES = 8 * PAGE
NUM_CHUNKS = 8


def _config(extra: dict[str, Any] | None = None, **changes: Any) -> OffloadingConfig:
    extra_config = {"spec_name": SPEC_NAME, "spec_module_path": MODULE}
    extra_config["cpu_bytes_to_use"] = CPU_BYTES
    extra_config["verify_chunks"] = (
        False  # the copy is judged in tests/vllm/test_spec.py; seals in test_integrity.py
    )
    extra_config.update(extra or {})
    config = offloading_config(
        groups=hybrid_groups(attention_tokens_per_block=32),
        worker_bytes=WORKER_BYTES_PER_BLOCK,
        blocks_per_chunk=BPC,
        extra_config=extra_config,
        engine_id="engine-0",
        world_size=WORLD_SIZE,
        tp_size=2,
        dcp_size=2,
        model_name="hybrid",
    )
    return dataclasses.replace(config, **changes)


class Caches:
    """vLLM-style canonical caches plus the plain tensors behind them."""

    def __init__(self, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randint(-128, 128, shape, dtype=torch.int8, generator=generator)

        # Shared by the attention layer (whole 128-byte page) and the Mamba conv state
        # (76 real bytes, padded to the attention page).
        self.shared = rand(NUM_BLOCKS, 128)
        # Second attention layer: 96-byte pages with a 160-byte block stride.
        self.strided_buffer = rand(NUM_BLOCKS, 160)
        # Mamba SSM state: 40 real bytes in a 48-byte block.
        self.ssm = rand(NUM_BLOCKS, 48)
        self.canonical = CanonicalKVCaches(
            tensors=[
                CanonicalKVCacheTensor(self.shared, 128),
                CanonicalKVCacheTensor(self.strided_buffer[:, :96], 96),
                CanonicalKVCacheTensor(self.ssm, 48),
            ],
            group_data_refs=[
                [CanonicalKVCacheRef(0, 128), CanonicalKVCacheRef(1, 96)],
                [CanonicalKVCacheRef(0, 76), CanonicalKVCacheRef(2, 40)],
            ],
        )
        # (tensor, page bytes) per group and plane, in ref order.
        self.pages = [
            [(self.shared, 128), (self.strided_buffer, 96)],
            [(self.shared, 76), (self.ssm, 40)],
        ]

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.shared, self.strided_buffer, self.ssm)]

    def equal(self, expected: list[torch.Tensor]) -> bool:
        actual = (self.shared, self.strided_buffer, self.ssm)
        return all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))

    def page(self, group: int, plane: int, block: int) -> torch.Tensor:
        tensor, size = self.pages[group][plane]
        return tensor[block, :size].view(torch.uint8)


def _expected_pool(
    engine: Any, before: torch.Tensor, caches: Caches, writes: list[tuple[int, int, int, int]]
) -> torch.Tensor:
    """``before`` with (group, gpu block, host row, slot) pages written, all planes."""
    from triton_offload.transfer.layout import pool_plane_view

    expected = before.clone()
    for group, block, row, slot in writes:
        for plane_number, index in enumerate(engine.layout.group_planes[group]):
            view = pool_plane_view(expected, engine.layout.planes[index], BPC)
            view[row, slot] = caches.page(group, plane_number, block)
    return expected
