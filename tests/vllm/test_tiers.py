"""TritonTieringOffloadingSpec with vLLM's ``fs`` secondary tier, on CPU.

A round trip through every tier: a chunk is stored from GPU blocks into the CPU tier
by this project's worker, vLLM's tiering manager cascades it to the fs tier (a file
appears), two more chunks evict its CPU copy (its row is overwritten), a lookup finds
it in fs and promotes it into the CPU tier, and the worker loads it into other GPU
blocks byte-exactly. The scheduler side (manager, region, fs tier) is vLLM's own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.tiering_config import (
    NUM_CHUNKS,
    PAGE,
    PLANE_BYTES,
    TIMEOUT_S,
    _finish,
    _parallel,
    _settle,
    make_config,
)

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
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    from triton_offload.vllm.tiers import check_secondary_tiers, ensure_private_fs_roots

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")

NUM_BLOCKS = 16


def test_round_trip_through_the_fs_tier(tmp_path: Path) -> None:
    spec = OffloadingSpecFactory.create_spec(make_config(tmp_path))
    assert type(spec).__name__ == "TritonTieringOffloadingSpec"
    assert spec.num_chunks == NUM_CHUNKS
    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    generator = torch.Generator().manual_seed(3)
    planes = [
        torch.randint(-128, 128, (NUM_BLOCKS, PLANE_BYTES), dtype=torch.int8, generator=generator)
        for _ in range(2)
    ]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(p, PLANE_BYTES) for p in planes],
        group_data_refs=[
            [CanonicalKVCacheRef(0, PLANE_BYTES), CanonicalKVCacheRef(1, PLANE_BYTES)]
        ],
    )
    worker = spec.get_worker(caches)
    region_path = worker.region.mmap_path
    # The scheduler's view of the region: the bytes the fs tier reads and writes.
    rows = torch.frombuffer(manager.primary_tier.get_kv_memoryview(), dtype=torch.int8)
    rows = rows.view(NUM_CHUNKS, PAGE)
    fs_tier = manager.secondary_tiers[0]
    sources = [p.clone() for p in planes]
    context = ReqContext(req_id="request")
    manager.on_new_request(context)
    key0, key1, key2 = (make_offload_key(f"chunk-{i}".encode(), 0) for i in range(3))
    try:
        # 1. Store chunk 0 from GPU blocks 3 and 8; complete_store cascades it to fs.
        out = manager.prepare_store([key0], context)
        assert out is not None and out.keys_to_store == [key0]
        (row0,) = (int(r) for r in out.store_spec.block_ids)
        assert worker.submit_store(1, GPULoadStoreSpec([3, 8], [2], [0]), out.store_spec)
        _finish(worker, 1)
        expected_row = torch.cat([sources[0][3], sources[0][8], sources[1][3], sources[1][8]])
        assert torch.equal(rows[row0], expected_row)
        manager.complete_store([key0], context)
        _settle(manager)
        assert os.path.exists(fs_tier.file_mapper.get_file_name(key0))

        # 2. Two more chunks fill the CPU tier and evict chunk 0's copy.
        out = manager.prepare_store([key1, key2], context)
        assert out is not None and out.evicted_keys == [key0]
        assert row0 in [int(r) for r in out.store_spec.block_ids]
        assert worker.submit_store(2, GPULoadStoreSpec([0, 1, 5, 6], [4], [0]), out.store_spec)
        _finish(worker, 2)
        manager.complete_store([key1, key2], context)
        _settle(manager)
        assert not torch.equal(rows[row0], expected_row)

        # 3. A lookup misses the CPU tier, finds chunk 0 in fs and promotes it.
        deadline = time.monotonic() + TIMEOUT_S
        seen = []
        while (result := manager.lookup(key0, context)) is not LookupResult.HIT:
            seen.append(result)
            assert time.monotonic() < deadline, f"promotion did not finish: {seen}"
            _settle(manager)
        assert LookupResult.HIT_PENDING in seen  # it was not in the CPU tier any more

        # 4. Load it into GPU blocks 10 and 12 (poisoned first).
        for plane in planes:
            plane[[10, 12]] = 0x55
        expected = [p.clone() for p in planes]
        for plane, source in zip(expected, sources, strict=True):
            plane[10], plane[12] = source[3], source[8]
        load_spec = manager.prepare_load([key0], context)
        assert worker.submit_load(3, load_spec, GPULoadStoreSpec([10, 12], [2], [0]))
        _finish(worker, 3)
        manager.complete_load([key0], context)
        for actual, wanted in zip(planes, expected, strict=True):
            assert torch.equal(actual, wanted)
    finally:
        del rows
        worker.shutdown()
        manager.shutdown()
    assert not os.path.exists(region_path)


# ------------------------------------------------------------ tier namespaces


def _fs_folder(config: OffloadingConfig, root: Path) -> str:
    """The folder vLLM's fs tier files this spec's chunks in: its own FileMapper call."""
    from vllm.v1.kv_offload.file_mapper import FileMapper

    spec = OffloadingSpecFactory.create_spec(config)
    mapper = FileMapper.from_offloading_spec(
        root_dir=str(root),
        offloading_spec=spec,
        blocks_per_file=spec.blocks_per_chunk,
        parallel_agnostic=True,
    )
    return mapper.base_path


def test_fs_tier_files_these_rows_apart_from_stock_vllm(tmp_path: Path) -> None:
    """One root_dir, one model: vLLM's CPU tier layout and this one get different folders."""
    stock_spec = OffloadingSpecFactory.create_spec(make_config(tmp_path, "TieringOffloadingSpec"))
    ours_spec = OffloadingSpecFactory.create_spec(make_config(tmp_path))
    assert type(stock_spec).__name__ == "TieringOffloadingSpec"
    folders = []
    for spec in (stock_spec, ours_spec):
        manager = spec.get_manager()
        try:
            (fs_tier,) = manager.secondary_tiers
            folders.append(fs_tier.file_mapper.base_path)
            key = make_offload_key(b"chunk", 0)
            assert fs_tier.file_mapper.get_file_name(key).startswith(str(tmp_path))
        finally:
            manager.shutdown()
    stock, ours = folders
    assert stock != ours
    # The folder's config.json says which layout its chunks are in.
    with open(os.path.join(ours, "config.json")) as handle:
        dtype = json.load(handle)["dtype"]
    assert dtype == f"bfloat16+{ours_spec.storage_layout}"
    assert ours_spec.storage_layout.startswith("triton_offload-rows-v1:page4096:bpc2")
    # Another spec instance of the same deployment (a restart) finds the same folder.
    assert _fs_folder(make_config(tmp_path), tmp_path) == ours


def test_parallel_agnostic_fs_folders_still_separate_tp_sizes(tmp_path: Path) -> None:
    """vLLM folds TP sizes into one folder for a parallelism-invariant block; this
    layout's rows are per-worker pages, so TP 2 and TP 4 must not share chunks."""
    cpu_bytes = {"cpu_bytes_to_use": 4 * NUM_CHUNKS * PAGE}

    def config(spec_name: str, tp: int) -> OffloadingConfig:
        base = make_config(tmp_path, spec_name, parallel=_parallel(tp, agnostic=True))
        return dataclasses.replace(base, extra_config={**base.extra_config, **cpu_bytes})

    stock = {tp: _fs_folder(config("TieringOffloadingSpec", tp), tmp_path) for tp in (2, 4)}
    ours = {tp: _fs_folder(config("TritonTieringOffloadingSpec", tp), tmp_path) for tp in (2, 4)}
    assert stock[2] == stock[4]  # what vLLM does with its own layout
    assert ours[2] != ours[4]
    assert not set(ours.values()) & set(stock.values())


def test_replicated_layout_shares_fs_folders_across_tp_sizes(tmp_path: Path) -> None:
    """Under replicated_layout one copy of a chunk is the same rows whatever the TP size."""
    folders = {
        tp: _fs_folder(
            make_config(tmp_path, parallel=_parallel(tp, agnostic=False), replicated_layout=True),
            tmp_path,
        )
        for tp in (2, 4)
    }
    assert folders[2] == folders[4]
    stock = make_config(
        tmp_path,
        "TieringOffloadingSpec",
        parallel=_parallel(2, agnostic=False),
        replicated_layout=True,
    )
    assert _fs_folder(stock, tmp_path) != folders[2]


def test_kvcr_tier_is_refused_and_out_of_tree_tiers_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tiers = [{"type": "fs", "root_dir": str(tmp_path)}, {"type": "kvcr", "control_ports": [1]}]
    with pytest.raises(
        ValueError, match=r"\['secondary_tiers'\]\[1\]\['type'\] 'kvcr' is not supported"
    ):
        OffloadingSpecFactory.create_spec(make_config(tmp_path, tiers=tiers))
    tiers = [{"type": "mine", "module_path": "my_tiers"}]
    with caplog.at_level(logging.WARNING, logger="vllm.triton_offload"):
        spec = OffloadingSpecFactory.create_spec(make_config(tmp_path, tiers=tiers))
    assert "['secondary_tiers'][0]['type'] 'mine' is an out-of-tree tier" in caplog.text
    assert spec.storage_layout in spec.config.model.dtype


def test_manager_shutdown_releases_the_region(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduler's chunk guard reads the primary tier's region to check promotions;
    it must not keep a view of it: vLLM's shutdown then cannot release the memoryview
    and logs that the region stays mapped."""
    config = make_config(tmp_path)
    # Sealed rows need a page of room for the seal: twice the chunks' bytes.
    extra = {
        **config.extra_config,
        "verify_chunks": True,
        "cpu_bytes_to_use": 2 * NUM_CHUNKS * PAGE,
    }
    spec = OffloadingSpecFactory.create_spec(dataclasses.replace(config, extra_config=extra))
    manager = spec.get_manager()
    guard = manager.triton_guard
    assert guard.promotion_problem(0, b"x" * 8) is not None  # reads the region (no seal)
    path = manager.primary_tier._mmap_region.mmap_path
    with caplog.at_level(logging.WARNING):
        manager.shutdown()
    assert not [r for r in caplog.records if "mapped" in r.getMessage()]
    assert not os.path.exists(path)


# ------------------------------------------------------------ private fs tiers


@pytest.fixture
def open_parent() -> Iterator[Path]:
    """A folder every local user may enter (0755, in the system's temporary folder): a
    tier root inside it is private only by its own mode (pytest's own folders are 0700,
    which would hide any mistake below them)."""
    parent = Path(tempfile.mkdtemp(prefix="triton-offload-tiers-"))
    parent.chmod(0o755)
    try:
        yield parent
    finally:
        shutil.rmtree(parent)


def fs_tiers(root: Path) -> list[dict[str, Any]]:
    return [{"type": "fs", "root_dir": str(root), "n_read_threads": 1, "n_write_threads": 1}]


def test_an_absent_fs_root_is_created_for_the_engine_user_alone(open_parent: Path) -> None:
    """Even under a umask that lets everyone in, the root the spec creates is 0700 and
    the engine user's; vLLM's tier then writes its folders inside it."""
    root = open_parent / "cache" / "fs"
    previous = os.umask(0)
    try:
        spec = OffloadingSpecFactory.create_spec(make_config(root, tiers=fs_tiers(root)))
        manager = spec.get_manager()
        manager.shutdown()
    finally:
        os.umask(previous)
    status = root.stat()
    assert (stat.S_IMODE(status.st_mode), status.st_uid) == (0o700, os.geteuid())
    assert [p.name for p in root.iterdir() if (p / "config.json").exists()]


@pytest.mark.parametrize(
    "mode", [0o755, 0o750, 0o705, 0o701, 0o710, 0o770, 0o777], ids=lambda mode: f"{mode:o}"
)
def test_an_fs_root_other_users_can_reach_is_refused_naming_it(tmp_path: Path, mode: int) -> None:
    """Refused before vLLM writes anything into it: the message names the key, the folder,
    its mode and the command that makes it private."""
    root = tmp_path / "fs"
    root.mkdir()
    root.chmod(mode)
    key = r"kv_connector_extra_config\['secondary_tiers'\]\[0\]\['root_dir'\]"
    with pytest.raises(ValueError, match=rf"{key} '{root}' has mode 0o{mode:o}: .*chmod 700"):
        OffloadingSpecFactory.create_spec(make_config(root, tiers=fs_tiers(root)))
    assert list(root.iterdir()) == []
    # Under canonical_layout too (the rows are stock vLLM's bytes, the prompts the same).
    with pytest.raises(ValueError, match=rf"has mode 0o{mode:o}"):
        check_secondary_tiers(fs_tiers(root), "TritonTieringOffloadingSpec", canonical=True)


def test_an_fs_root_of_another_user_a_file_or_an_impossible_folder_is_refused(
    tmp_path: Path,
) -> None:
    key = r"kv_connector_extra_config\['secondary_tiers'\]\[1\]\['root_dir'\]"
    tiers = [{"type": "p2p", "host": "127.0.0.1", "port": 1}]
    a_file = tmp_path / "file"
    a_file.write_bytes(b"x")
    with pytest.raises(ValueError, match=rf"{key} '{a_file}' is not a folder"):
        ensure_private_fs_roots([*tiers, {"type": "fs", "root_dir": str(a_file)}])
    with pytest.raises(ValueError, match=rf"{key} is empty: vLLM's fs tier would write into /"):
        ensure_private_fs_roots([*tiers, {"type": "fs", "root_dir": ""}])
    below_a_file = a_file / "fs"
    with pytest.raises(ValueError, match=rf"{key} '{below_a_file}': cannot create it \("):
        ensure_private_fs_roots([*tiers, {"type": "fs", "root_dir": str(below_a_file)}])
    if os.geteuid() != 0:
        pytest.skip("a folder of another user needs root to make")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, -1)
    with pytest.raises(ValueError, match=rf"{key} '{theirs}' belongs to uid 12345, not to"):
        ensure_private_fs_roots([*tiers, {"type": "fs", "root_dir": str(theirs)}])


def can_read_as_nobody(path: Path) -> bool:
    """Whether a process of the unprivileged user ``nobody`` (uid 65534) reads ``path``:
    the kernel's own permission check, independent of this code."""
    reader = shutil.which("head")
    assert reader is not None, "coreutils' head is needed to read as another user"
    result = subprocess.run(
        [reader, "-c", "1", str(path)], user=65534, group=65534, capture_output=True, cwd="/"
    )
    return result.returncode == 0


def test_no_other_local_user_reads_a_chunk_the_fs_tier_wrote(open_parent: Path) -> None:
    """A chunk stored through vLLM's fs tier under this spec (files 0644, folders 0755 as
    vLLM makes them) cannot be read by another local user: the root keeps them out. The
    same file under a root opened to others is read: the judge can tell."""
    if os.geteuid() != 0:
        pytest.skip("acting as another local user needs root")
    root = open_parent / "fs"
    spec = OffloadingSpecFactory.create_spec(make_config(root, tiers=fs_tiers(root)))
    manager = spec.get_manager()
    planes = [torch.ones(NUM_BLOCKS, PLANE_BYTES, dtype=torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(p, PLANE_BYTES) for p in planes],
        group_data_refs=[
            [CanonicalKVCacheRef(0, PLANE_BYTES), CanonicalKVCacheRef(1, PLANE_BYTES)]
        ],
    )
    worker = spec.get_worker(caches)
    context = ReqContext(req_id="request")
    manager.on_new_request(context)
    key = make_offload_key(b"private-chunk", 0)
    try:
        out = manager.prepare_store([key], context)
        assert out is not None
        assert worker.submit_store(1, GPULoadStoreSpec([3, 8], [2], [0]), out.store_spec)
        _finish(worker, 1)
        manager.complete_store([key], context)
        _settle(manager)
        chunk = Path(manager.secondary_tiers[0].file_mapper.get_file_name(key))
        assert chunk.exists()
    finally:
        worker.shutdown()
        manager.shutdown()
    assert stat.S_IMODE(chunk.stat().st_mode) & 0o004  # vLLM's own file mode: 0644
    assert not can_read_as_nobody(chunk)
    root.chmod(0o755)
    assert can_read_as_nobody(chunk)
