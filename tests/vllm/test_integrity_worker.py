"""Verification rides the data: what a sealed worker guarantees, on the CPU and kernel paths.

The guarantee (docs/verification.md): no byte of a page whose seal does not verify
is ever reported loaded. A load's result is a success only if every page it read has
a whole v2 seal of this configuration, layout, place and key, and the checksum its
copy computed over the page's payload equals the seal's; otherwise the chunk's GPU
blocks of that job are reported failed and its key named. Checked here from the rules:

- a store seals each page with ``page_checksum`` of the page's payload, by the
  algorithm the seal names (``wsum64`` on the kernel path, ``xxh3_64`` on the CPU path);
- on the kernel path the host computes no payload checksum at all (the functions that
  would are wrapped and must not be called); on the CPU path it hashes on the host;
- random trials: random pages corrupted (payload bytes the load moves, payload bytes of
  slots it does not move, header bytes, a seal of another key), random partial loads:
  success exactly when no loaded page is corrupt, failed blocks exactly the blocks the
  job loads from corrupt pages.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

try:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from tests.helpers.spec_geometry import BPC, NUM_CHUNKS, Caches, _config
    from triton_offload.vllm import spec as _spec  # noqa: F401  (checks vLLM's names first)
    from triton_offload.vllm.counters import CHUNKS_REFUSED, VERIFY_SECONDS
    from triton_offload.vllm.integrity import KeyedCPULoadStoreSpec

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"

from triton_offload.transfer import checksums as checksums_module
from triton_offload.transfer import cpu_copy as cpu_copy_module
from triton_offload.transfer import seal as seal_module
from triton_offload.transfer.seal import SEAL_BYTES, page_checksum, read_seal
from triton_offload.transfer.seal_key import SealKey

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")

ALGORITHM = {"torch": "xxh3_64", "triton": "wsum64"}


def sealed_worker(backend: str) -> Any:
    import triton_offload.vllm as tv

    spec = tv.TritonOffloadingSpec(_config({"verify_chunks": True, "backend": backend}))
    caches = Caches()
    return spec, caches, spec.get_worker(caches.canonical)


def key(chunk: int) -> bytes:
    return f"key-{chunk}".encode()


def pages_of(worker: Any) -> np.ndarray:
    return worker.sealer.pages


def finish(worker: Any, job: int) -> Any:
    worker.wait({job})
    (result,) = worker.get_finished()
    assert result.job_id == job
    return result


def store_all(worker: Any) -> None:
    """Store every chunk: group 0 (attention) blocks into chunks 0-3, group 1 (Mamba)
    into chunks 4-7, whole chunks, keys ``key(chunk)``."""
    attention, mamba = [0, 1, 2, 3], [4, 5, 6, 7]
    gpu = GPULoadStoreSpec(list(range(8)) + list(range(8)), [8, 8], [0, 0])
    host = KeyedCPULoadStoreSpec(attention + mamba, [key(c) for c in attention + mamba])
    assert worker.submit_store(1, gpu, host)
    assert finish(worker, 1).success


class Calls:
    """Counts calls of the functions that read payload bytes to checksum them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for module, name in (
            (seal_module, "page_checksum"),
            (seal_module, "page_checksums"),
            (checksums_module, "page_checksums"),
            (checksums_module, "host_checksums"),
            (cpu_copy_module, "copy_and_hash_pages"),
        ):
            monkeypatch.setattr(module, name, self._counted(getattr(module, name)))

    def _counted(self, function: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return function(*args, **kwargs)

        return counted


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stores_seal_each_page_with_the_checksum_of_its_payload(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, worker = sealed_worker(backend)
    try:
        # Stale bytes everywhere before the store (rows another group used): the bytes
        # between the planes' slots are covered by the checksum all the same.
        pages = pages_of(worker)
        room = pages.shape[1] - SEAL_BYTES
        pages[:, :room] = np.random.default_rng(7).integers(0, 256, (pages.shape[0], room))
        calls = Calls(monkeypatch)
        store_all(worker)
        # Kernel path: computed by the copy kernel, no payload byte checksummed on the
        # host. CPU path: the host hashes the pages it copied.
        assert (calls.count == 0) == (backend == "triton")
        payload = worker.sealer.group_payload
        for chunk in range(NUM_CHUNKS):
            group = 0 if chunk < 4 else 1
            seal = read_seal(np.ascontiguousarray(pages[chunk]))
            assert not isinstance(seal, str), seal
            assert seal.algorithm == ALGORITHM[backend]
            assert seal.payload_bytes == payload[group]
            expected = page_checksum(pages[chunk, : payload[group]], seal.algorithm)
            assert seal.payload_checksum == expected
            assert seal.key_digest == seal_module.key_digest(key(chunk))
        monkeypatch.undo()
        calls = Calls(monkeypatch)
        gpu = GPULoadStoreSpec([9, 10, 11], [3, 0], [1, 0])  # slot 1 of chunk 0, chunk 1
        host = KeyedCPULoadStoreSpec([0, 1], [key(0), key(1)])
        assert worker.submit_load(2, host, gpu)
        assert finish(worker, 2).success
        assert (calls.count == 0) == (backend == "triton")
        assert worker.sealer.host_checked_pages == 0
    finally:
        worker.shutdown()


def _corrupt(pages: np.ndarray, chunk: int, how: str, rng: random.Random, payload: int) -> None:
    page = pages[chunk]
    if how == "payload":
        page[rng.randrange(payload)] ^= 1 << rng.randrange(8)
    elif how == "header":
        page[page.size - SEAL_BYTES + rng.randrange(8, SEAL_BYTES)] ^= 1 << rng.randrange(8)
    else:  # another key's seal: a valid record of the same payload under another key
        seal = read_seal(np.ascontiguousarray(page))
        assert not isinstance(seal, str)
        records = seal_module.seal_records(
            1,
            seal_module.SealFormat(
                seal.config_digest, seal.layout_digest, seal.page_index, seal.page_count
            ),
            np.frombuffer(seal_module.key_digest(b"another key"), dtype=np.uint8),
            np.array([seal.payload_checksum], dtype=np.uint64),
            np.array([seal.payload_bytes]),
            seal.algorithm,
        )
        page[page.size - SEAL_BYTES :] = records.view(np.uint8)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_byte_of_a_page_that_fails_its_seal_is_reported_loaded(backend: str) -> None:
    rng = random.Random(29)
    _, caches, worker = sealed_worker(backend)
    try:
        store_all(worker)
        pages = pages_of(worker)
        clean = pages.copy()
        payload = worker.sealer.group_payload
        trials = 12 if backend == "triton" else 40
        for trial in range(trials):
            pages[:] = clean
            corrupt: dict[int, str] = {}
            for chunk in rng.sample(range(NUM_CHUNKS), rng.randrange(0, 3)):
                how = rng.choice(["payload", "header", "key"])
                _corrupt(pages, chunk, how, rng, payload[0 if chunk < 4 else 1])
                corrupt[chunk] = how
            # A random load: per group, a run of chunks, the first maybe from slot 1.
            gpu_ids: list[int] = []
            sizes, starts, chunks = [], [], []
            expected_failed: list[set[int]] = [set(), set()]
            next_block = 0
            for group, first_chunk in ((0, 0), (1, 4)):
                count = rng.randrange(0, 4)
                if count == 0:
                    sizes.append(0)
                    starts.append(0)
                    continue
                lo = first_chunk + rng.randrange(0, 4 - count + 1)
                skip = rng.randrange(BPC)
                blocks = list(range(next_block, next_block + count * BPC - skip))
                next_block += len(blocks)
                gpu_ids += blocks
                sizes.append(len(blocks))
                starts.append(skip)
                for index in range(count):
                    chunk = lo + index
                    chunks.append(chunk)
                    if chunk in corrupt:
                        mine = blocks[max(0, index * BPC - skip) : (index + 1) * BPC - skip]
                        expected_failed[group].update(mine)
            if not chunks:
                continue
            job = 100 + trial
            gpu = GPULoadStoreSpec(gpu_ids, sizes, starts)
            assert worker.submit_load(job, KeyedCPULoadStoreSpec(chunks, map(key, chunks)), gpu)
            result = finish(worker, job)
            loaded_corrupt = {c for c in chunks if c in corrupt}
            assert result.success == (not loaded_corrupt), (trial, corrupt, chunks, result)
            if loaded_corrupt:
                failed = [set(blocks) for blocks in result.failed_blocks]
                assert failed == expected_failed, (trial, corrupt, chunks)
                assert set(result.bad_keys) == {key(c) for c in loaded_corrupt}
        del caches
    finally:
        worker.shutdown()


def test_a_page_sealed_on_another_kind_of_host_is_checked_on_this_one() -> None:
    """A chunk sealed with XXH3 (a CPU host) read where the kernel computes wsum64: its
    payload is checked on the host (counted), and a flipped byte is still refused."""
    _, _, worker = sealed_worker("triton")
    try:
        store_all(worker)
        pages = pages_of(worker)
        sealer = worker.sealer
        sealer.seal(0, 0, seal_module.key_digest(key(0)), algorithm="xxh3_64")
        gpu = GPULoadStoreSpec([9, 10], [2, 0], [0, 0])
        host = KeyedCPULoadStoreSpec([0], [key(0)])
        assert worker.submit_load(3, host, gpu)
        assert finish(worker, 3).success
        assert sealer.host_checked_pages == 1
        pages[0, 5] ^= 0x10
        assert worker.submit_load(4, host, gpu)
        result = finish(worker, 4)
        assert not result.success and "payload checksum mismatch" in result.problem
        assert result.failed_blocks == ((9, 10), ())
        assert torch.is_tensor(worker.engine.pool)
    finally:
        worker.shutdown()


def test_the_cpu_path_s_hashing_counts_as_verification_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host hashes a CPU-path job's pages inside its copy; those seconds are part of
    ``verify_seconds`` (store and load), beside the sealing and the seal check."""
    hashing = 1000.0  # seconds each copy reports hashing: far above anything else counted
    real = cpu_copy_module.copy_and_hash_pages

    def slow_hash(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **kwargs)._replace(hash_seconds=hashing)

    monkeypatch.setattr(cpu_copy_module, "copy_and_hash_pages", slow_hash)
    _, _, worker = sealed_worker("torch")
    try:
        worker.counters.drain()
        store_all(worker)
        gpu = GPULoadStoreSpec([9, 10, 11], [3, 0], [1, 0])
        assert worker.submit_load(2, KeyedCPULoadStoreSpec([0, 1], [key(0), key(1)]), gpu)
        assert finish(worker, 2).success
        verified = worker.counters.drain()[VERIFY_SECONDS]
        assert set(verified) == {("store",), ("load",)}
        for seconds in verified.values():
            assert hashing <= seconds < hashing + 60
    finally:
        worker.shutdown()


# ------------------------------------------------------------------------ keyed seals

KEYED_ALGORITHM = {"torch": "keyed_ghash64", "triton": "keyed_wsum64"}


def keyed_worker(backend: str, key_file: Any) -> Any:
    import triton_offload.vllm as tv

    extra = {"verify_chunks": True, "backend": backend, "seal_key_file": str(key_file)}
    spec = tv.TritonOffloadingSpec(_config(extra))
    caches = Caches()
    return spec, caches, spec.get_worker(caches.canonical)


def _load_chunk_0(worker: Any, job: int) -> Any:
    gpu = GPULoadStoreSpec([9, 10], [2, 0], [0, 0])
    assert worker.submit_load(job, KeyedCPULoadStoreSpec([0], [key(0)]), gpu)
    return finish(worker, job)


def _refusals(worker: Any) -> dict[str, float]:
    counts = worker.counters.drain().get(CHUNKS_REFUSED, {})
    return {labels[0]: value for labels, value in counts.items()}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_keyed_seals_load_under_their_key_and_refuse_a_forgery(
    backend: str, seal_key_file: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``seal_key_file``, a store seals every page with the key's tag (its universal
    hash computed where the bytes move: no host payload pass on the kernel path); the
    same key loads; a page an attacker rewrote with an unkeyed seal recomputed over new
    bytes, a page sealed under another key and a page whose bytes changed under its
    keyed seal are refused, the first two counted as forgeries."""
    _, _, worker = keyed_worker(backend, seal_key_file)
    try:
        sealer = worker.sealer
        assert sealer.seal_key is not None
        calls = Calls(monkeypatch)
        store_all(worker)
        assert (calls.count == 0) == (backend == "triton")
        pages = pages_of(worker)
        for chunk in range(NUM_CHUNKS):
            seal = read_seal(np.ascontiguousarray(pages[chunk]))
            assert not isinstance(seal, str), seal
            assert seal.algorithm == KEYED_ALGORITHM[backend]
            assert seal.key_id == sealer.seal_key.key_id
        monkeypatch.undo()
        worker.counters.drain()
        assert _load_chunk_0(worker, 2).success
        clean = pages[0].copy()
        payload = sealer.group_payload[0]

        # The attacker writes new bytes and a valid unkeyed seal over them.
        pages[0, :payload] = np.random.default_rng(3).integers(0, 256, payload)
        seal_module.write_seal(pages[0], payload, sealer.format, seal_module.key_digest(key(0)))
        result = _load_chunk_0(worker, 3)
        assert not result.success and "forgery" in result.problem
        assert result.bad_keys == (key(0),)
        assert _refusals(worker) == {"forgery": 1}

        # A valid keyed seal of the same bytes under another key.
        pages[0] = clean
        other = SealKey(bytes(range(100, 132)))
        seal_module.write_seal(
            pages[0],
            payload,
            sealer.format,
            seal_module.key_digest(key(0), other),
            algorithm=KEYED_ALGORITHM[backend],
            seal_key=other,
        )
        result = _load_chunk_0(worker, 4)
        assert not result.success and "another seal key" in result.problem
        assert _refusals(worker) == {"forgery": 1}

        # The bytes changed under the page's own keyed seal.
        pages[0] = clean
        pages[0, 7] ^= 0x01
        result = _load_chunk_0(worker, 5)
        assert not result.success and "payload checksum mismatch" in result.problem
        assert _refusals(worker) == {"checksum": 1}

        pages[0] = clean
        assert _load_chunk_0(worker, 6).success
    finally:
        worker.shutdown()


def test_a_keyed_page_is_refused_by_an_engine_without_the_key(seal_key_file: Any) -> None:
    """An engine without a seal key cannot check a keyed tag: the page is refused, never
    read as an unkeyed checksum."""
    _, _, keyed = keyed_worker("torch", seal_key_file)
    _, _, plain = sealed_worker("torch")
    try:
        store_all(keyed)
        pages_of(plain)[:] = pages_of(keyed)
        plain.counters.drain()
        result = _load_chunk_0(plain, 2)
        assert not result.success and "no seal key" in result.problem
        assert _refusals(plain) == {"keyed": 1}
    finally:
        keyed.shutdown()
        plain.shutdown()


def test_a_page_keyed_on_another_kind_of_host_is_checked_on_this_one(
    seal_key_file: Any,
) -> None:
    """A page sealed with the key's GHASH (a CPU host) read where the kernel computes the
    keyed weighted sum: checked on the host under the same key, and a flipped byte is
    refused."""
    _, _, worker = keyed_worker("triton", seal_key_file)
    try:
        store_all(worker)
        sealer = worker.sealer
        sealer.seal(
            0, 0, seal_module.key_digest(key(0), sealer.seal_key), algorithm="keyed_ghash64"
        )
        assert _load_chunk_0(worker, 3).success
        assert sealer.host_checked_pages == 1
        pages_of(worker)[0, 5] ^= 0x10
        result = _load_chunk_0(worker, 4)
        assert not result.success and "payload checksum mismatch" in result.problem
    finally:
        worker.shutdown()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_keyed_page_does_not_pass_for_a_chunk_whose_unkeyed_digest_collides(
    backend: str, seal_key_file: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unkeyed, a seal names its chunk by the offload key's XXH3-64, whose collisions a
    writer of the tier can search offline for two prompts of their own, then swap one
    chunk's file for the other's. Under a key the seal names the chunk by a digest only
    the key makes: with every XXH3-64 digest made to collide, chunk 0's page still
    loads as chunk 0 and is refused as chunk 1."""
    monkeypatch.setattr(seal_module.xxhash, "xxh3_64_digest", lambda data: bytes(8))
    _, _, worker = keyed_worker(backend, seal_key_file)
    try:
        store_all(worker)
        assert _load_chunk_0(worker, 2).success
        worker.counters.drain()
        gpu = GPULoadStoreSpec([9, 10], [2, 0], [0, 0])
        assert worker.submit_load(3, KeyedCPULoadStoreSpec([0], [key(1)]), gpu)
        result = finish(worker, 3)
        assert not result.success and "another key's chunk" in result.problem
        assert result.bad_keys == (key(1),)
    finally:
        worker.shutdown()


def test_a_keyed_worker_refuses_a_host_spec_without_chunk_keys(seal_key_file: Any) -> None:
    """vLLM's plain host spec carries no chunk keys; under a key its seals would name no
    chunk, so any page of this configuration would pass for another chunk's: refused
    before any byte moves, naming the spec, and the worker stays usable."""
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    _, _, worker = keyed_worker("torch", seal_key_file)
    try:
        store_all(worker)
        before = pages_of(worker).copy()
        gpu = GPULoadStoreSpec([9, 10], [2, 0], [0, 0])
        for submit in (worker.submit_store, worker.submit_load):
            with pytest.raises(ValueError, match="CPULoadStoreSpec carries no chunk keys"):
                if submit == worker.submit_store:
                    submit(7, gpu, CPULoadStoreSpec([0]))
                else:
                    submit(7, CPULoadStoreSpec([0]), gpu)
        assert np.array_equal(pages_of(worker), before)
        assert worker.get_finished() == []
        assert _load_chunk_0(worker, 8).success
    finally:
        worker.shutdown()
