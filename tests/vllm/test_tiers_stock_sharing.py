"""The default layout shares chunks with stock vLLM where its rows are provably vLLM's.

With ``verify_chunks`` off and one plane per cache tensor at the offsets vLLM's CPU
worker uses (a worker page = each tensor's ``page * blocks_per_chunk`` bytes, tensors in
order, slot ``s`` at ``s * page``: vLLM's ``SharedOffloadRegion.create_next_worker_view``
and ``compute_sub_block_ptrs``), every worker publishes ``rows=stock`` and the
scheduler's tiering spec files chunks under vLLM's own names: a stock
``TieringOffloadingSpec`` and this backend then read each other's fs chunks, byte for
byte, in both directions. Sealed rows, or planes off vLLM's offsets, keep the tag.

vLLM's CPU worker does not run on CPU tensors, so the stock side's rows are written and
read in its region by the layout rule above (the judge), and its manager and fs tier
move them.
"""

from __future__ import annotations

import dataclasses
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

PLANE = 1024  # two cache tensors (K, V) of 1 KiB per block, 2 blocks per chunk: 4 KiB
BPC = 2
NUM_BLOCKS = 16


def _config(root: Path, spec_name: str, engine_id: str, verify: bool = False) -> Any:
    base = make_config(root, spec_name)
    return dataclasses.replace(
        base,
        engine_id=engine_id,
        extra_config={**base.extra_config, "verify_chunks": verify, "cpu_bytes_to_use": 4 * 4096},
    )


def _caches(planes: list[torch.Tensor]) -> Any:
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(p, PLANE) for p in planes],
        group_data_refs=[[CanonicalKVCacheRef(0, PLANE), CanonicalKVCacheRef(1, PLANE)]],
    )


def stock_row(planes: list[torch.Tensor], blocks: list[int]) -> torch.Tensor:
    """vLLM's CPU worker's row for GPU blocks ``blocks`` (tensor-major, slot-minor)."""
    return torch.cat([plane[b] for plane in planes for b in blocks]).view(torch.uint8)


class Ours:
    """This backend in vLLM's engine order: workers register caches (and publish their
    planes), then the scheduler's spec names the tiers' storage."""

    def __init__(self, root: Path, verify: bool = False) -> None:
        engine_id = f"ours-{time.monotonic_ns()}"
        config = _config(root, "TritonTieringOffloadingSpec", engine_id, verify)
        generator = torch.Generator().manual_seed(5)
        self.planes = [
            torch.randint(-128, 128, (NUM_BLOCKS, PLANE), dtype=torch.int8, generator=generator)
            for _ in range(2)
        ]
        self.worker_spec = OffloadingSpecFactory.create_spec(config)
        self.worker = self.worker_spec.get_worker(_caches(self.planes))
        self.spec = OffloadingSpecFactory.create_spec(config)  # the scheduler's
        self.manager = self.spec.get_manager()
        self.context = ReqContext(req_id="ours")
        self.manager.on_new_request(self.context)

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()


class Stock:
    """vLLM's own tiering spec: its manager, region and fs tier."""

    def __init__(self, root: Path) -> None:
        self.spec = OffloadingSpecFactory.create_spec(
            _config(root, "TieringOffloadingSpec", f"stock-{time.monotonic_ns()}")
        )
        self.manager = self.spec.get_manager()
        view = self.manager.primary_tier.get_kv_memoryview()
        self.rows = torch.frombuffer(view, dtype=torch.uint8).view(self.spec.num_chunks, -1)
        self.context = ReqContext(req_id="stock")
        self.manager.on_new_request(self.context)

    def close(self) -> None:
        del self.rows
        self.manager.shutdown()


def _lookup_until_hit(manager: Any, key: Any, context: Any) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while (result := manager.lookup(key, context)) is not LookupResult.HIT:
        assert result is not LookupResult.MISS, "the other side's chunk was not found"
        assert time.monotonic() < deadline, "promotion did not finish"
        _settle(manager)


@pytest.fixture
def pair(tmp_path: Path) -> Any:
    ours, stock = Ours(tmp_path / "fs"), Stock(tmp_path / "fs")
    yield ours, stock
    ours.close()
    stock.close()


def test_unsealed_stock_geometry_uses_vllms_names(pair: Any) -> None:
    ours, stock = pair
    assert ours.spec.shares_stock_rows and ours.spec.storage_layout is None
    assert ours.spec.config.model.dtype == stock.spec.config.model.dtype
    (ours_fs,), (stock_fs,) = ours.manager.secondary_tiers, stock.manager.secondary_tiers
    assert ours_fs.file_mapper.base_path == stock_fs.file_mapper.base_path


def test_stock_reads_this_backends_chunk(pair: Any) -> None:
    ours, stock = pair
    key = make_offload_key(b"from-ours", 0)
    out = ours.manager.prepare_store([key], ours.context)
    assert out is not None
    assert ours.worker.submit_store(1, GPULoadStoreSpec([3, 8], [2], [0]), out.store_spec)
    _finish(ours.worker, 1)
    ours.manager.complete_store([key], ours.context)
    _settle(ours.manager)
    _lookup_until_hit(stock.manager, key, stock.context)
    (row,) = (int(r) for r in stock.manager.prepare_load([key], stock.context).block_ids)
    expected = stock_row(ours.planes, [3, 8])
    assert torch.equal(stock.rows[row, : expected.numel()], expected)


def test_this_backend_reads_stock_vllms_chunk(pair: Any) -> None:
    ours, stock = pair
    key = make_offload_key(b"from-stock", 0)
    generator = torch.Generator().manual_seed(9)
    theirs = [
        torch.randint(-128, 128, (NUM_BLOCKS, PLANE), dtype=torch.int8, generator=generator)
        for _ in range(2)
    ]
    out = stock.manager.prepare_store([key], stock.context)
    assert out is not None
    (row,) = (int(r) for r in out.store_spec.block_ids)
    written = stock_row(theirs, [1, 6])  # what vLLM's worker writes for blocks 1 and 6
    stock.rows[row, : written.numel()] = written
    stock.manager.complete_store([key], stock.context)
    _settle(stock.manager)
    _lookup_until_hit(ours.manager, key, ours.context)
    for plane in ours.planes:
        plane[[12, 13]] = 0x55
    expected = [p.clone() for p in ours.planes]
    for mine, source in zip(expected, theirs, strict=True):
        mine[12], mine[13] = source[1], source[6]
    load = ours.manager.prepare_load([key], ours.context)
    assert ours.worker.submit_load(2, load, GPULoadStoreSpec([12, 13], [2], [0]))
    _finish(ours.worker, 2)
    for actual, wanted in zip(ours.planes, expected, strict=True):
        assert torch.equal(actual, wanted)


def test_sealed_rows_keep_their_own_names(tmp_path: Path) -> None:
    ours, stock = Ours(tmp_path / "fs", verify=True), Stock(tmp_path / "fs")
    try:
        assert not ours.spec.shares_stock_rows
        assert ours.spec.storage_layout and ours.spec.storage_layout.startswith("triton_offload")
        (ours_fs,), (stock_fs,) = ours.manager.secondary_tiers, stock.manager.secondary_tiers
        assert ours_fs.file_mapper.base_path != stock_fs.file_mapper.base_path
    finally:
        ours.close()
        stock.close()


def test_planes_off_vllms_offsets_are_not_stock() -> None:
    from triton_offload.vllm.tiers import rows_are_stock

    refs = [(0, 1024), (1, 1024)]
    assert rows_are_stock([1024, 1024], refs, [(0, 1024), (2048, 1024)], 2)
    assert not rows_are_stock([1024, 1024], refs, [(0, 1024), (2064, 1024)], 2)  # a gap
    assert not rows_are_stock([1040, 1024], [(0, 1024), (1, 1024)], [(0, 1024), (2080, 1024)], 2)
    # Two refs of one tensor (groups overlaying one allocation): not vLLM's rows.
    assert not rows_are_stock([2048], [(0, 1024), (0, 1024)], [(0, 1024), (0, 1024)], 2)
