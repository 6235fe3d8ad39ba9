"""A sealed TritonTieringOffloadingSpec over vLLM's manager and its real ``fs`` tier, and
the steps that push a chunk out to fs and tamper with its file
(``tests/vllm/test_integrity.py`` and the tests built on it). Importing this module skips
the importing test module, with the import error as the reason, where vLLM cannot be
imported.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        LookupResult,
        ReqContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    pytest.skip(f"vllm cannot be imported: {error}", allow_module_level=True)

from tests.helpers.tiering_config import TIMEOUT_S, _finish, _settle, make_config
from triton_offload.transfer.seal import SEAL_BYTES

PLANE = 512  # bytes per block per plane: a chunk's payload is 2 planes x 2 blocks x 512
PAYLOAD = 2 * 2 * PLANE
PAGE = 4096  # payload + seal, rounded up to the OS page by vLLM's spec
NUM_BLOCKS = 16


class Tiered:
    """A sealed TritonTieringOffloadingSpec: vLLM's manager and fs tier, this worker
    (``model``: the model name vLLM would give, a path or a hub id)."""

    def __init__(
        self,
        root: Path,
        num_chunks: int = 3,
        fused: bool = False,
        model: str = "test",
        **extra: Any,
    ) -> None:
        base = make_config(root)
        config = dataclasses.replace(
            base,
            worker_kv_bytes_per_block=2 * PLANE,
            model=dataclasses.replace(base.model, name=model),
            extra_config={
                **base.extra_config,
                "verify_chunks": True,
                "cpu_bytes_to_use": num_chunks * PAGE,
                **extra,
            },
        )
        self.spec = OffloadingSpecFactory.create_spec(config)
        assert self.spec.num_chunks == num_chunks
        assert self.spec.cpu_page_size_per_worker == PAYLOAD + SEAL_BYTES
        self.manager = self.spec.get_manager()
        generator = torch.Generator().manual_seed(11)
        self.planes = [
            torch.randint(-128, 128, (NUM_BLOCKS, PLANE), dtype=torch.int8, generator=generator)
            for _ in range(2)
        ]
        if fused:
            # K and V as one plane of both pages: the same bytes per block, another row.
            fused_plane = torch.cat(self.planes, dim=1)
            caches = CanonicalKVCaches(
                tensors=[CanonicalKVCacheTensor(fused_plane, 2 * PLANE)],
                group_data_refs=[[CanonicalKVCacheRef(0, 2 * PLANE)]],
            )
        else:
            caches = CanonicalKVCaches(
                tensors=[CanonicalKVCacheTensor(p, PLANE) for p in self.planes],
                group_data_refs=[[CanonicalKVCacheRef(0, PLANE), CanonicalKVCacheRef(1, PLANE)]],
            )
        self.worker = self.spec.get_worker(caches)
        self.rows = torch.frombuffer(
            self.manager.primary_tier.get_kv_memoryview(), dtype=torch.uint8
        )
        self.rows = self.rows.view(num_chunks, PAGE)
        self.fs = self.manager.secondary_tiers[0]
        self.context = ReqContext(req_id="request")
        self.manager.on_new_request(self.context)
        self.job = 0

    def close(self) -> None:
        del self.rows
        self.worker.shutdown()
        self.manager.shutdown()

    def store(self, keys: list[Any], blocks: list[int]) -> list[int]:
        out = self.manager.prepare_store(keys, self.context)
        assert out is not None and out.keys_to_store == keys
        self.job += 1
        spec = GPULoadStoreSpec(blocks, [len(blocks)], [0])
        assert self.worker.submit_store(self.job, spec, out.store_spec)
        _finish(self.worker, self.job)
        self.manager.complete_store(keys, self.context)
        _settle(self.manager)
        return [int(r) for r in out.store_spec.block_ids]

    def lookup_until_settled(self, key: Any) -> list[Any]:
        """Look ``key`` up until it is a HIT or a MISS (promotions run in between)."""
        seen = []
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            result = self.manager.lookup(key, self.context)
            seen.append(result)
            if result in (LookupResult.HIT, LookupResult.MISS):
                return seen
            assert time.monotonic() < deadline, f"lookup did not settle: {seen}"
            _settle(self.manager)

    def file(self, key: Any) -> str:
        return self.fs.file_mapper.get_file_name(key)


def key(index: int) -> Any:
    return make_offload_key(f"chunk-{index}".encode(), 0)


def _evict_to_fs(tiered: Tiered) -> None:
    """Store chunks 0 and 1 (cascaded to fs), then evict both CPU copies."""
    tiered.store([key(0)], [3, 8])
    tiered.store([key(1)], [4, 9])
    assert os.path.exists(tiered.file(key(0))) and os.path.exists(tiered.file(key(1)))
    tiered.store([key(2), key(3), key(4)], [0, 1, 5, 6, 10, 11])
    for k in (key(0), key(1)):
        assert tiered.manager.primary_tier.lookup(k, tiered.context) is LookupResult.MISS


def _tamper(tiered: Tiered, how: str, tmp_path: Path) -> None:
    path = tiered.file(key(0))
    data = Path(path).read_bytes()
    if how == "flipped byte":
        changed = bytearray(data)
        changed[100] ^= 0x01
        Path(path).write_bytes(bytes(changed))
    elif how == "truncated":
        Path(path).write_bytes(data[: len(data) // 2])
    elif how == "zero-length":
        Path(path).write_bytes(b"")
    elif how == "same-size garbage":
        Path(path).write_bytes(os.urandom(len(data)))
    elif how == "another key's file":
        shutil.copyfile(tiered.file(key(1)), path)
    else:  # pragma: no cover
        raise AssertionError(how)
