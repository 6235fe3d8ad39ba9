"""Seal keys (``triton_offload/transfer/seal_key.py``), judged from the module's docstring.

Every expected value comes from ``tests/helpers/keyed_seal_judge.py``, written from the
docstrings of ``seal.py`` and ``seal_key.py`` (the subkey derivation, which the docstring
does not spell out, is the one part it takes from the code). ``SealKey`` is only called.
The keyed seals themselves (sealer, attacks) are judged in ``tests/transfer/test_seal.py``.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import keyed_seal_judge as judge
from triton_offload.transfer import seal
from triton_offload.transfer.seal_key import (
    KEY_ID_BYTES,
    MAX_KEY_BYTES,
    MIN_KEY_BYTES,
    SealKey,
)

SECRET = bytes(range(32))
LENGTHS = [0, 1, 2, 3, 4, 5, 7, 15, 16, 17, 63, 700, 1001, 4093, 4096]


def payload(length: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8).tobytes()


def key_file(directory: Path, data: bytes, mode: int = 0o600, name: str = "seal.key") -> Path:
    """A key file of ``data`` created with ``mode`` (no moment with a wider one)."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, mode)
    return path


def same_key(a: SealKey, b: SealKey) -> bool:
    """Two keys that name themselves alike and hash and tag alike."""
    data = np.frombuffer(payload(333, 5), dtype=np.uint8)
    words = np.arange(8, dtype=np.uint64).reshape(1, 8)
    hashes = np.array([12345], dtype=np.uint64)
    return (
        a.key_id == b.key_id
        and a.keyed_wsum64(data) == b.keyed_wsum64(data)
        and a.keyed_ghash64(data.tobytes()) == b.keyed_ghash64(data.tobytes())
        and np.array_equal(a.tags(words, hashes), b.tags(words, hashes))
    )


# --- 1. the judge agrees with itself --------------------------------------------------


@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 100, 1000])
def test_the_judge_s_gcm_tag_is_ghash_written_out(length: int) -> None:
    """The docstring calls keyed_ghash64 GHASH: the GCM tag's first 8 bytes equal
    ``E_K(J0) xor GHASH_H(payload)`` computed in GF(2**128) by hand."""
    keys = judge.subkeys(SECRET)
    data = payload(length, length)
    assert judge.keyed_ghash64(data, keys) == judge.keyed_ghash64_by_hand(data, keys)


def test_the_judge_s_wsum64_and_cbc_mac_constants() -> None:
    assert judge.wsum64(b"") == 0
    assert judge.wsum64(b"\x07") == 7 * 0x9E3779B1
    # CBC-MAC of one block is AES of it: FIPS-197's AES-256 example (C.3).
    key = bytes(range(32))
    block = bytes.fromhex("00112233445566778899aabbccddeeff")
    assert judge.cbc_mac(key, [block]).hex() == "8ea2b7ca516745bfeafc49904b496089"


# --- 2. the subkeys and the universal hashes ------------------------------------------


@pytest.mark.parametrize("size", [MIN_KEY_BYTES, 33, 64, 65, 1000, MAX_KEY_BYTES])
def test_the_key_id_is_the_judge_s(size: int) -> None:
    secret = payload(size, size)
    key = SealKey(secret)
    assert key.key_id == judge.subkeys(secret).key_id
    assert len(key.key_id) == KEY_ID_BYTES
    assert SealKey(bytearray(secret)).key_id == key.key_id


@pytest.mark.parametrize("offload_key", [b"", b"k", bytes(range(36)), os.urandom(300)])
def test_the_keyed_chunk_digest_is_the_judge_s(offload_key: bytes) -> None:
    """Under a key a seal names its chunk by keyed BLAKE2b-64 of the offload key (an
    XXH3 collision searched offline must not let one chunk pass for another)."""
    key = SealKey(SECRET)
    assert key.chunk_digest(offload_key) == judge.chunk_key_digest(offload_key, SECRET)
    many = [offload_key, b"other", offload_key]
    rows = key.chunk_digests(many)
    assert rows.shape == (3, 8) and rows.dtype == np.uint8
    assert [bytes(row) for row in rows] == [judge.chunk_key_digest(k, SECRET) for k in many]
    assert key.chunk_digest(offload_key) != SealKey(bytes(range(7, 39))).chunk_digest(offload_key)
    assert judge.chunk_key_digest(offload_key, None) == seal.key_digest(offload_key)


def test_different_secrets_have_different_key_ids_and_hashes() -> None:
    data = payload(700)
    keys = [SealKey(payload(32, seed)) for seed in range(8)]
    assert len({k.key_id for k in keys}) == 8
    array = np.frombuffer(data, dtype=np.uint8)
    assert len({k.keyed_wsum64(array) for k in keys}) == 8
    assert len({k.keyed_ghash64(data) for k in keys}) == 8


@pytest.mark.parametrize("count", [0, 1, 7, 1024])
def test_the_weights_are_shake256_of_the_weights_subkey(count: int) -> None:
    key = SealKey(SECRET)
    got = key.weights(count)
    assert got.dtype == np.uint64
    assert [int(w) for w in got] == judge.weights(judge.subkeys(SECRET).weights, count)


@pytest.mark.parametrize("first", [0, 5])
def test_the_weights_are_read_only(first: int) -> None:
    """The docstring: "(uint64, read-only)", whatever length is asked for first (a fresh
    key's first answer to ``weights(0)`` is its initial empty table)."""
    key = SealKey(SECRET)
    for count in (first, 0, 3):
        assert not key.weights(count).flags.writeable, count


def test_the_weights_are_a_prefix_of_any_longer_table() -> None:
    key = SealKey(SECRET)
    long = [int(w) for w in key.weights(300)]
    assert [int(w) for w in key.weights(10)] == long[:10]  # after the longer one
    fresh = SealKey(SECRET)
    short = [int(w) for w in fresh.weights(10)]
    assert [int(w) for w in fresh.weights(300)] == long  # grown after a shorter one
    assert short == long[:10]
    with pytest.raises(ValueError, match="num_words"):
        key.weights(-1)


@pytest.mark.parametrize("length", LENGTHS)
def test_keyed_wsum64_is_the_judge_s(length: int) -> None:
    key, keys = SealKey(SECRET), judge.subkeys(SECRET)
    data = payload(length, length)
    assert key.keyed_wsum64(np.frombuffer(data, dtype=np.uint8)) == judge.keyed_wsum64(data, keys)


@pytest.mark.parametrize("length", [1, 3, 4, 5, 700, 1001])
def test_keyed_wsum64_rows_is_the_judge_s_per_row(length: int) -> None:
    key, keys = SealKey(SECRET), judge.subkeys(SECRET)
    region = np.frombuffer(payload(5 * 2 * length, length), dtype=np.uint8).reshape(5, 2 * length)
    rows = region[:, length:]  # strided rows
    got = key.keyed_wsum64_rows(rows)
    assert got.dtype == np.uint64
    assert [int(x) for x in got] == [judge.keyed_wsum64(r.tobytes(), keys) for r in rows]


@pytest.mark.parametrize("length", LENGTHS)
def test_keyed_ghash64_is_the_judge_s(length: int) -> None:
    key, keys = SealKey(SECRET), judge.subkeys(SECRET)
    data = payload(length, length)
    expected = judge.keyed_ghash64(data, keys)
    assert key.keyed_ghash64(data) == expected
    assert key.keyed_ghash64(memoryview(data)) == expected
    assert key.keyed_ghash64(np.frombuffer(data, dtype=np.uint8)) == expected


def test_keyed_wsum64_is_linear_and_zero_padded() -> None:
    """What the docstring's sum implies: trailing zero bytes add nothing, and sums of
    disjoint byte masks add up mod 2**64 (a kernel's per-tile partial sums)."""
    key = SealKey(SECRET)
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 1001, dtype=np.uint8)
    base = key.keyed_wsum64(data)
    for extra in (1, 2, 3, 4, 9):
        assert key.keyed_wsum64(np.concatenate([data, np.zeros(extra, np.uint8)])) == base
    part = rng.integers(0, 3, data.size)
    parts = [np.where(part == p, data, 0).astype(np.uint8) for p in range(3)]
    assert sum(key.keyed_wsum64(p) for p in parts) % 2**64 == base


def test_tags_are_the_judge_s_cbc_mac_over_the_seal_s_identity() -> None:
    """``tags`` takes seals as [n, 8] u64 words; the tag is the CBC-MAC over bytes 8-23,
    24-31 + 40-47 and 48-55 + the universal hash, first 8 bytes (little-endian u64)."""
    key, keys = SealKey(SECRET), judge.subkeys(SECRET)
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, (6, 64), dtype=np.uint8)
    words = raw.view("<u8").copy()
    hashes = rng.integers(0, 2**63, 6, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    got = key.tags(words, hashes)
    assert got.dtype == np.uint64
    for i in range(6):
        expected = judge.tag_of(raw[i, :56].tobytes(), int(hashes[i]), keys)
        assert int(got[i]).to_bytes(8, "little") == expected, i
    # The words the docstring leaves out (magic, checksum, header check) play no part.
    other = words.copy()
    other[:, [0, 4, 7]] ^= np.uint64(0xFFFF)
    assert np.array_equal(key.tags(other, hashes), got)
    assert key.tags(np.zeros((0, 8), dtype=np.uint64), np.zeros(0, np.uint64)).size == 0


def test_a_key_id_ending_in_zero_bytes_is_still_its_own() -> None:
    """A key id is 7 raw bytes; one ending in a zero byte must not be shortened."""
    secret = next(
        s
        for s in (payload(32, seed) for seed in range(100_000))
        if judge.subkeys(s).key_id.endswith(b"\x00")
    )
    assert SealKey(secret).key_id == judge.subkeys(secret).key_id
    assert len(SealKey(secret).key_id) == KEY_ID_BYTES


def test_the_weights_table_is_built_once_under_concurrent_use() -> None:
    key = SealKey(SECRET)
    seed = judge.subkeys(SECRET).weights
    expected = judge.weights(seed, 4096)
    errors: list[str] = []

    def use(count: int) -> None:
        for _ in range(20):
            got = [int(w) for w in key.weights(count)]
            if got != expected[:count]:
                errors.append(f"weights({count}) differ")

    threads = [threading.Thread(target=use, args=(n,)) for n in (1, 100, 1000, 4096, 33, 2048)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


# --- 3. secrets -----------------------------------------------------------------------


def test_a_secret_must_be_bytes_of_the_allowed_length() -> None:
    with pytest.raises(TypeError, match="str"):
        SealKey("0" * 32)  # type: ignore[arg-type]
    for size in (0, MIN_KEY_BYTES - 1, MAX_KEY_BYTES + 1):
        with pytest.raises(ValueError, match=f"got {size}"):
            SealKey(bytes(size))
    SealKey(bytes(MIN_KEY_BYTES))
    SealKey(bytes(MAX_KEY_BYTES))


# --- 4. key files ---------------------------------------------------------------------


def refusal(path: Path | str, match: str) -> str:
    with pytest.raises(ValueError) as caught:
        SealKey.from_file(path)
    text = str(caught.value)
    assert str(path) in text, text
    assert "seal_key_file" in text, text
    assert match in text, text
    return text


def test_a_0600_file_of_32_random_bytes_is_the_key_of_its_bytes(tmp_path: Path) -> None:
    secret = os.urandom(32)
    path = key_file(tmp_path, secret)
    key = SealKey.from_file(path)
    assert same_key(key, SealKey(secret))
    assert key.key_id == judge.subkeys(secret).key_id
    assert same_key(SealKey.from_file(str(path)), key)


def test_a_0400_file_is_accepted(tmp_path: Path) -> None:
    secret = os.urandom(32)
    key = SealKey.from_file(key_file(tmp_path, secret, 0o400))
    assert same_key(key, SealKey(secret))


def test_the_conftest_key_file_is_accepted(seal_key_file: Path) -> None:
    assert same_key(SealKey.from_file(seal_key_file), SealKey(seal_key_file.read_bytes()))


@pytest.mark.parametrize("size", [MIN_KEY_BYTES, 100, MAX_KEY_BYTES])
def test_every_allowed_size_is_read_whole(tmp_path: Path, size: int) -> None:
    secret = os.urandom(size)
    assert same_key(SealKey.from_file(key_file(tmp_path, secret)), SealKey(secret))


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    refusal(tmp_path / "absent.key", "does not exist")


@pytest.mark.parametrize("size", [0, 1, MIN_KEY_BYTES - 1])
def test_a_short_file_is_refused(tmp_path: Path, size: int) -> None:
    text = refusal(key_file(tmp_path, os.urandom(size)), f"holds {size} bytes")
    assert str(MIN_KEY_BYTES) in text


@pytest.mark.parametrize("size", [MAX_KEY_BYTES + 1, 3 * MAX_KEY_BYTES])
def test_a_large_file_is_refused(tmp_path: Path, size: int) -> None:
    refusal(key_file(tmp_path, os.urandom(size)), "larger than")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o606, 0o610, 0o601, 0o700 | 0o020])
def test_a_file_others_can_use_is_refused(tmp_path: Path, mode: int) -> None:
    text = refusal(key_file(tmp_path, os.urandom(32), mode), f"mode {mode:04o}")
    assert "chmod 600" in text


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o757])
def test_a_key_in_a_folder_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    """Whoever can write the key's folder can rename the key away and put their own file
    under its name: refused, naming the folder; with the sticky bit (as /tmp) they
    cannot, and the key is accepted."""
    folder = tmp_path / "keys"
    folder.mkdir()
    path = key_file(folder, os.urandom(32))
    folder.chmod(mode)
    text = refusal(path, f"mode {mode:04o}")
    assert repr(str(folder)) in text and "chmod go-w" in text
    folder.chmod(mode | stat.S_ISVTX)
    SealKey.from_file(path)
    folder.chmod(0o700)
    nested = folder / "deeper"
    nested.mkdir(mode=0o700)
    inner = key_file(nested, os.urandom(32))
    folder.chmod(mode)
    refusal(inner, f"its folder {str(folder)!r} has mode {mode:04o}")


def test_a_symlink_to_a_good_key_file_is_refused(tmp_path: Path) -> None:
    target = key_file(tmp_path, os.urandom(32))
    SealKey.from_file(target)  # the target itself is a good key
    link = tmp_path / "link.key"
    link.symlink_to(target)
    refusal(link, "cannot be opened")


def test_a_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o700)
    refusal(directory, "not a regular file")


def test_a_device_is_refused() -> None:
    if not os.path.exists("/dev/null"):
        pytest.skip("no /dev/null here")
    refusal("/dev/null", "not a regular file")


def test_a_file_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    path = key_file(tmp_path, os.urandom(32))
    os.chown(path, 54321, -1)
    refusal(path, "owned by uid 54321")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    """The docstring: a key is a regular file, anything else a ValueError naming it. A
    FIFO must be refused, not block the engine's start until someone writes to it."""
    fifo = tmp_path / "seal.key"
    os.mkfifo(fifo, 0o600)
    outcome: list[BaseException | SealKey] = []

    def load() -> None:
        try:
            outcome.append(SealKey.from_file(fifo))
        except BaseException as error:  # recorded for the assertion below
            outcome.append(error)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(3.0)
    blocked = thread.is_alive()
    if blocked:
        # Release the reader: a writer opens, then leaves without writing.
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5.0)
    assert not blocked, "SealKey.from_file blocked on a FIFO (open without O_NONBLOCK)"
    assert len(outcome) == 1 and isinstance(outcome[0], ValueError), outcome
    assert "not a regular file" in str(outcome[0])


def test_a_refused_file_leaves_nothing_behind(tmp_path: Path) -> None:
    """Each refusal is whole: fixing the file makes the same path a good key, equal to a
    key made from its bytes, and a key made before stays usable."""
    before = SealKey(SECRET)
    secret = os.urandom(40)
    path = key_file(tmp_path, secret, 0o644)
    refusal(path, "mode 0644")
    os.chmod(path, 0o600)
    assert same_key(SealKey.from_file(path), SealKey(secret))

    short = key_file(tmp_path, os.urandom(8), name="short.key")
    refusal(short, "holds 8 bytes")
    with open(short, "ab") as handle:
        handle.write(os.urandom(40))
    assert same_key(SealKey.from_file(short), SealKey(short.read_bytes()))
    assert stat.S_IMODE(os.stat(short).st_mode) == 0o600
    assert same_key(before, SealKey(SECRET))


def test_what_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="my_setting"):
        SealKey.from_file(tmp_path / "absent.key", what="my_setting")
