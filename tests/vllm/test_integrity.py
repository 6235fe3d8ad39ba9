"""Verified chunks under vLLM's tiering manager and its real ``fs`` tier (CPU).

A sealed store writes the chunk's bytes and its seal and nothing else; a chunk
promoted from fs is checked before it counts: a file flipped, cut short, emptied,
replaced by garbage, by another key's valid file or by another layout's file is
refused at the promotion (never a HIT), logged once with the tier and key, and the
key is quarantined (later lookups miss instead of promoting it again). A good file
still promotes and loads byte-exactly.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

try:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    pytest.skip(f"vllm cannot be imported: {error}", allow_module_level=True)

from tests.helpers.tiered_spec import PAGE, PAYLOAD, PLANE, Tiered, _evict_to_fs, _tamper, key
from tests.helpers.tiering_config import _finish, make_config
from triton_offload.transfer.seal import SEAL_BYTES, page_checksum, read_seal


@pytest.fixture
def tiered(tmp_path: Path) -> Any:
    made = Tiered(tmp_path / "fs")
    yield made
    made.close()


def test_a_sealed_store_writes_the_chunk_and_its_seal_only(tiered: Tiered) -> None:
    tiered.rows[:] = 0xA5  # poisoned: bytes the store must leave alone stay 0xA5
    (row,) = tiered.store([key(0)], [3, 8])
    p0, p1 = tiered.planes
    payload = torch.cat([p0[3], p0[8], p1[3], p1[8]]).view(torch.uint8)
    assert torch.equal(tiered.rows[row, :PAYLOAD], payload)
    # The seal is the last 64 bytes of the worker's page (payload + 64 bytes here).
    page_end = tiered.spec.cpu_page_size_per_worker
    assert page_end == PAYLOAD + SEAL_BYTES
    assert bytes(tiered.rows[row, PAYLOAD : PAYLOAD + 8].numpy()) == b"TOSEAL\x00\x02"
    seal = read_seal(tiered.rows[row, :page_end].numpy())
    assert not isinstance(seal, str) and seal.payload_bytes == PAYLOAD
    assert seal.payload_checksum == page_checksum(payload.numpy(), seal.algorithm)
    # Nothing else changed: the rest of the row and every other row keep the poison.
    assert torch.all(tiered.rows[row, page_end:] == 0xA5)
    assert all(torch.all(tiered.rows[r] == 0xA5) for r in range(3) if r != row)


FAULTS = [
    "flipped byte",
    "truncated",
    "zero-length",
    "same-size garbage",
    "another key's file",
]


@pytest.mark.parametrize("how", FAULTS)
def test_a_bad_fs_file_is_refused_and_quarantined(
    tiered: Tiered, how: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _evict_to_fs(tiered)
    _tamper(tiered, how, tmp_path)
    guard = tiered.manager.triton_guard
    with caplog.at_level("WARNING", logger="vllm.triton_offload"):
        seen = tiered.lookup_until_settled(key(0))
        if how == "flipped byte":
            # The seal's header is whole: the scheduler (headers only) promotes it, and
            # the worker's load refuses the payload once the copy computed its checksum.
            assert seen[-1] is LookupResult.HIT and guard.promotions_refused == 0
            load = tiered.manager.prepare_load([key(0)], tiered.context)
            tiered.job += 1
            gpu = GPULoadStoreSpec([12, 13], [2], [0])
            assert tiered.worker.submit_load(tiered.job, load, gpu)
            tiered.worker.wait({tiered.job})
            (result,) = tiered.worker.get_finished()
            tiered.manager.complete_load([key(0)], tiered.context)
            assert not result.success and "payload checksum mismatch" in result.problem
            assert result.failed_blocks == ((12, 13),)
            assert result.bad_keys == (bytes(key(0)),)
            guard.quarantine(tiered.manager, result.bad_keys)  # as the connector does
            seen = tiered.lookup_until_settled(key(0))
    assert seen[-1] is LookupResult.MISS
    assert bytes(key(0)) in guard.quarantined
    # Looked up again: a miss at once, no second promotion of the bad file.
    assert tiered.lookup_until_settled(key(0)) == [LookupResult.MISS]
    if how not in ("truncated", "zero-length", "flipped byte"):  # fs fails those reads
        assert guard.promotions_refused == 1
    if how != "flipped byte":
        assert "secondary tier 'fs'" in caplog.text
    assert bytes(key(0)).hex() in caplog.text
    # The good neighbour still promotes and loads byte-exactly.
    assert tiered.lookup_until_settled(key(1))[-1] is LookupResult.HIT
    for plane in tiered.planes:
        plane[[12, 13]] = 0x55
    expected = [p.clone() for p in tiered.planes]
    for plane in expected:
        plane[12], plane[13] = plane[4].clone(), plane[9].clone()
    load = tiered.manager.prepare_load([key(1)], tiered.context)
    tiered.job += 1
    assert tiered.worker.submit_load(tiered.job, load, GPULoadStoreSpec([12, 13], [2], [0]))
    _finish(tiered.worker, tiered.job)
    tiered.manager.complete_load([key(1)], tiered.context)
    for actual, wanted in zip(tiered.planes, expected, strict=True):
        assert torch.equal(actual, wanted)


def test_a_chunk_of_another_row_layout_is_refused_at_the_load(tmp_path: Path) -> None:
    """K/V fused into one plane vs split into two: same config, other row bytes. Here
    the schedulers name their storage before any worker published its planes (so both
    use one fs folder, as a scheduler started before its workers would); the promotion
    passes (the scheduler cannot know the planes), the worker's check of the layout
    digest refuses the load. In vLLM's engine the workers publish first and the two
    get different folders (test_split_and_fused_planes_get_different_storage_names)."""
    fused, split = Tiered(tmp_path / "fs", fused=True), Tiered(tmp_path / "fs")
    try:
        fused.store([key(0)], [3, 8])
        assert os.path.exists(split.file(key(0)))  # one folder for both
        assert split.lookup_until_settled(key(0))[-1] is LookupResult.HIT
        load = split.manager.prepare_load([key(0)], split.context)
        assert split.worker.submit_load(7, load, GPULoadStoreSpec([12, 13], [2], [0]))
        split.worker.wait({7})
        (result,) = split.worker.get_finished()
        assert not result.success and "row layout" in result.problem
        assert result.failed_blocks == ((12, 13),)
    finally:
        split.close()
        fused.close()


def test_a_good_fs_file_promotes_and_loads(tiered: Tiered) -> None:
    _evict_to_fs(tiered)
    seen = tiered.lookup_until_settled(key(0))
    assert LookupResult.HIT_PENDING in seen and seen[-1] is LookupResult.HIT
    assert tiered.manager.triton_guard.promotions_refused == 0


def test_a_flipped_host_byte_fails_the_load_before_any_byte_moves(tiered: Tiered) -> None:
    (row,) = tiered.store([key(0)], [3, 8])
    tiered.rows[row, 17] ^= 0x80
    for plane in tiered.planes:
        plane[[12, 13]] = 0x55
    before = [p.clone() for p in tiered.planes]
    load = tiered.manager.prepare_load([key(0)], tiered.context)
    assert tiered.worker.submit_load(99, load, GPULoadStoreSpec([12, 13], [2], [0]))
    tiered.worker.wait({99})
    (result,) = tiered.worker.get_finished()
    assert (result.job_id, result.success) == (99, False)
    assert result.failed_blocks == ((12, 13),)
    assert result.bad_keys == (bytes(key(0)),)
    assert "payload checksum" in result.problem
    del before


def test_verification_off_gives_vllms_own_row_size(tmp_path: Path) -> None:
    base = make_config(tmp_path)
    config = dataclasses.replace(
        base,
        worker_kv_bytes_per_block=2 * PLANE,
        extra_config={**base.extra_config, "verify_chunks": False, "cpu_bytes_to_use": PAGE},
    )
    spec = OffloadingSpecFactory.create_spec(config)
    assert spec.cpu_page_size_per_worker == PAYLOAD
    assert not spec.sealed_pages
    with pytest.raises(ValueError, match=r"\['verify_chunks'\] must be true or false, got 'no'"):
        OffloadingSpecFactory.create_spec(
            dataclasses.replace(config, extra_config={**config.extra_config, "verify_chunks": "no"})
        )


def test_split_and_fused_planes_get_different_storage_names(tmp_path: Path) -> None:
    """vLLM's engine registers the caches (workers) before it builds the scheduler: the
    scheduler's spec names its tiers' storage after the workers' published planes."""
    from triton_offload.vllm.tiers import PLANES_UNPUBLISHED, layout_note_path

    names = {}
    for fused in (True, False):
        workers = Tiered(tmp_path / "fs", fused=fused)  # publishes its planes
        try:
            note = layout_note_path(workers.spec.config.engine_id, 0)
            assert os.path.exists(note)
            scheduler_spec = OffloadingSpecFactory.create_spec(
                dataclasses.replace(
                    make_config(tmp_path / "fs"),
                    worker_kv_bytes_per_block=2 * PLANE,
                    engine_id=workers.spec.config.engine_id,
                    extra_config={**workers.spec.extra_config},
                )
            )
            names[fused] = scheduler_spec.storage_layout
            assert not names[fused].endswith(PLANES_UNPUBLISHED)
            # The seals' config digest does not depend on the planes (workers built
            # their spec before publishing): scheduler and workers agree on it.
            assert scheduler_spec.seal_config_digest() == workers.spec.seal_config_digest()
        finally:
            workers.close()
        assert not os.path.exists(note)  # withdrawn at shutdown
    assert names[True] != names[False]
    assert names[True].rsplit(":", 1)[0] == names[False].rsplit(":", 1)[0]


def test_the_config_digest_names_the_model_and_its_dtype(tmp_path: Path) -> None:
    """Seals of another model (or dtype) under this configuration are another config's."""
    from vllm.v1.kv_offload.config import OffloadingModelConfig

    def digest(name: str, dtype: str) -> bytes:
        base = make_config(tmp_path)
        config = dataclasses.replace(
            base,
            worker_kv_bytes_per_block=2 * PLANE,
            model=OffloadingModelConfig(name=name, dtype=dtype, max_model_len=1024),
            extra_config={**base.extra_config, "verify_chunks": True, "cpu_bytes_to_use": PAGE},
        )
        return OffloadingSpecFactory.create_spec(config).seal_config_digest()

    assert digest("model-a", "bfloat16") == digest("model-a", "bfloat16")
    assert digest("model-a", "bfloat16") != digest("model-b", "bfloat16")
    assert digest("model-a", "bfloat16") != digest("model-a", "float16")


def test_an_engine_without_the_key_never_removes_a_keyed_tier_file(seal_key_file: Path) -> None:
    """A keyed chunk file is refused by an engine without the seal key (it cannot check
    the tag) but is no verdict for the repair: the engines holding the key own it. Under
    another key the same file is refused as a forgery and may be removed."""
    from triton_offload.transfer.seal import SealFormat, key_digest, write_seal
    from triton_offload.transfer.seal_key import SealKey
    from triton_offload.vllm.integrity import ChunkGuard

    page = 4096
    digest = b"c" * 8
    row = np.random.default_rng(5).integers(0, 256, page, dtype=np.uint8)
    seal_key = SealKey.from_file(seal_key_file)
    write_seal(
        row,
        page - SEAL_BYTES,
        SealFormat(digest, b"l" * 8, 0, 1),
        key_digest(b"chunk", seal_key),
        algorithm="keyed_ghash64",
        seal_key=seal_key,
    )
    common = {"row_stride": page, "page_bytes": page, "page_count": 1, "digest": digest}
    unkeyed = ChunkGuard(**common)
    assert "no seal key" in str(unkeyed.row_problem(row, b"chunk", check_payload=True))
    assert unkeyed.tier_file_problem(b"chunk")(row.tobytes()) is None
    keyed = ChunkGuard(**common, seal_key=seal_key)
    assert keyed.tier_file_problem(b"chunk")(row.tobytes()) is None
    other = ChunkGuard(**common, seal_key=SealKey(bytes(range(32))))
    assert "forgery" in str(other.tier_file_problem(b"chunk")(row.tobytes()))
