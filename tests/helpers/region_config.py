"""vLLM's shared region under TritonOffloadingSpec: a config and canonical caches sized
for it (``groups`` groups of two 512-byte planes, 4 KiB host chunks;
``tests/vllm/test_region.py``), and what of a region is left in this process (its
mappings, its files). Importing this module skips the importing test module, with the
import error as the reason, where vLLM cannot be imported.
"""

from __future__ import annotations

import glob
import uuid
from typing import Any

import pytest
import torch

try:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    pytest.skip(f"vllm cannot be imported: {error}", allow_module_level=True)


PAGE = 4096
NUM_BLOCKS = 8
BPC = 2
PLANE = 512  # two planes per group: 2 KiB of a worker per block


def make_config(
    *,
    groups: int = 2,
    world_size: int = 1,
    rank: int = 0,
    replicated: bool = False,
    worker_bytes: int = 2 * 2 * PLANE,
    cpu_bytes: int = 8 * PAGE,
    spec_name: str = "TritonOffloadingSpec",
    extra: dict[str, Any] | None = None,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=(f"layer.{g}",), group_id=g)
            for g in range(groups)
        ),
        worker_kv_bytes_per_block=worker_bytes,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": spec_name,
            "cpu_bytes_to_use": cpu_bytes,
            "verify_chunks": False,  # copies judged in test_region.py; seals in test_integrity.py
            "backend": "torch",
            **(extra or {}),
        },
        engine_id=f"region-{uuid.uuid4()}",
        model=OffloadingModelConfig(name="test", dtype="bfloat16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BPC),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=replicated,
    )


class Caches:
    """``groups`` groups of two 512-byte planes; a group in ``empty`` has no layer."""

    def __init__(self, groups: int = 2, empty: tuple[int, ...] = ()) -> None:
        generator = torch.Generator().manual_seed(5)
        self.tensors = [
            torch.randint(-128, 128, (NUM_BLOCKS, PLANE), dtype=torch.int8, generator=generator)
            for _ in range(2 * groups)
        ]
        self.canonical = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, PLANE) for t in self.tensors],
            group_data_refs=[
                []
                if g in empty
                else [CanonicalKVCacheRef(2 * g, PLANE), CanonicalKVCacheRef(2 * g + 1, PLANE)]
                for g in range(groups)
            ],
        )


def region_mappings(engine_id: str) -> list[str]:
    """Lines of ``/proc/self/maps`` that map one of the engine's files: its region or
    its store ledger."""
    name = f"vllm_offload_{engine_id}"
    with open("/proc/self/maps") as maps:
        return [line.strip() for line in maps if name in line]


def region_files(engine_id: str) -> list[str]:
    return glob.glob(glob.escape(f"/dev/shm/vllm_offload_{engine_id}") + "*")
