"""Keyed chunk seals, judged from their specification alone (no package code).

The specification is two module docstrings: the seal record's table in
``triton_offload/transfer/seal.py`` and the keyed tag's construction in
``triton_offload/transfer/seal_key.py``. Everything here is written from them with
hashlib, struct, the ``cryptography`` package (AES-GCM, and AES-ECB for a hand-made
CBC-MAC) and, for the unkeyed ``xxh3_64`` the table names, xxhash. Nothing is imported
from ``triton_offload``.

The seal, 64 bytes, little-endian::

    0  8  magic b"TOSEAL\\x00\\x02"        32 8  checksum (keyed: the tag)
    8  8  config digest                   40 4  payload length
    16 8  layout digest                   44 2  page index; 46 2 page count
    24 8  key digest                      48 1  algorithm: 1 wsum64, 2 xxh3_64,
                                                3 keyed_wsum64, 4 keyed_ghash64
    49 7  key id (keyed; zero unkeyed)    56 8  header check: wsum64 of bytes 0-55

The keyed tag: the first 8 bytes of AES-256 CBC-MAC (tag subkey, zero IV) over three
blocks: seal bytes 8-23; bytes 24-31 then 40-47; bytes 48-55 then the payload's 8-byte
universal hash (little-endian, as every integer of the seal). The universal hashes:

- ``keyed_wsum64``: ``sum_j w_j * r_j mod 2**64``, ``w_j`` the payload's little-endian
  u32 words (the last zero-padded), ``r_j`` the little-endian u64 words of SHAKE-256 of
  the weights subkey;
- ``keyed_ghash64``: the first 8 bytes, little-endian, of AES-256-GCM's tag (GHASH
  subkey, zero 96-bit nonce, no plaintext, the payload as associated data).

The subkeys (seal_key.py's docstring): ``root = BLAKE2b-256(secret,
person=b"triton-offload")``, then ``subkey = BLAKE2b-256(label, key=root)`` with labels
``b"seal tag prf"``, ``b"seal ghash"``, ``b"seal weights"``, ``b"seal chunk key"`` and
``b"seal key id"`` (the key id is the first 7 bytes of its subkey). Under a key the key
digest (bytes 24-31) is the offload key's keyed chunk digest,
``BLAKE2b(offload key, key=chunk subkey, digest_size=8)``; unkeyed, its XXH3-64 as 8
big-endian bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import xxhash
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

SEAL_BYTES = 64
MAGIC = b"TOSEAL\x00\x02"
ALGORITHM_IDS: dict[str, int] = {
    "wsum64": 1,
    "xxh3_64": 2,
    "keyed_wsum64": 3,
    "keyed_ghash64": 4,
}
ALGORITHM_NAMES: dict[int, str] = {number: name for name, number in ALGORITHM_IDS.items()}
KEYED_ALGORITHMS = ("keyed_wsum64", "keyed_ghash64")
KEY_ID_BYTES = 7
MIN_SECRET_BYTES = 32
MAX_SECRET_BYTES = 4096
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B1


# --- unkeyed rules (seal.py) ----------------------------------------------------------


def wsum64(data: bytes) -> int:
    """``sum_j w_j * h(j) mod 2**64``, ``w_j`` the little-endian u32 words of ``data``
    (the last zero-padded), ``h(j) = ((2j + 1) * 0x9E3779B1) mod 2**32``."""
    padded = bytes(data) + bytes(-len(data) % 4)
    total = 0
    for j, (word,) in enumerate(struct.iter_unpack("<I", padded)):
        total += word * (((2 * j + 1) * _GOLDEN) % 2**32)
    return total & _MASK64


def unkeyed_checksum(payload: bytes, algorithm: str) -> int:
    """``wsum64`` or ``xxh3_64`` (XXH3-64, seed 0) of ``payload``."""
    if algorithm == "wsum64":
        return wsum64(payload)
    if algorithm == "xxh3_64":
        return xxhash.xxh3_64_intdigest(bytes(payload))
    raise ValueError(f"{algorithm!r} is no unkeyed algorithm")


# --- subkeys --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Subkeys:
    """The subkeys of one secret, one per use."""

    tag: bytes  # AES-256 key of the CBC-MAC
    ghash: bytes  # AES-256 key of the GMAC (keyed_ghash64)
    weights: bytes  # SHAKE-256 seed of keyed_wsum64's weights
    chunk: bytes  # BLAKE2b key of the keyed chunk digests
    key_id: bytes  # 7 bytes, written into bytes 49-55 of every keyed seal


def subkeys(secret: bytes) -> Subkeys:
    """The subkeys of a key file's bytes (see the module docstring)."""
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise ValueError(f"a secret of {len(secret)} bytes is no seal key")
    root = hashlib.blake2b(bytes(secret), digest_size=32, person=b"triton-offload").digest()

    def derive(label: bytes) -> bytes:
        return hashlib.blake2b(label, key=root, digest_size=32).digest()

    return Subkeys(
        tag=derive(b"seal tag prf"),
        ghash=derive(b"seal ghash"),
        weights=derive(b"seal weights"),
        chunk=derive(b"seal chunk key"),
        key_id=derive(b"seal key id")[:KEY_ID_BYTES],
    )


def chunk_key_digest(offload_key: bytes, secret: bytes | None) -> bytes:
    """The seal's key digest of an offload key: keyed BLAKE2b-64 under a key, else its
    XXH3-64 as 8 big-endian bytes."""
    if secret is None:
        return xxhash.xxh3_64_intdigest(offload_key).to_bytes(8, "big")
    return hashlib.blake2b(offload_key, key=subkeys(secret).chunk, digest_size=8).digest()


# --- the universal hashes -------------------------------------------------------------


def weights(seed: bytes, num_words: int) -> list[int]:
    """``r_j`` for ``j < num_words``: little-endian u64 words of SHAKE-256(seed)."""
    raw = hashlib.shake_256(seed).digest(8 * num_words) if num_words else b""
    return [word for (word,) in struct.iter_unpack("<Q", raw)]


def keyed_wsum64(payload: bytes, keys: Subkeys) -> int:
    padded = bytes(payload) + bytes(-len(payload) % 4)
    words = [word for (word,) in struct.iter_unpack("<I", padded)]
    r = weights(keys.weights, len(words))
    return sum(w * rj for w, rj in zip(words, r, strict=True)) & _MASK64


def keyed_ghash64(payload: bytes, keys: Subkeys) -> int:
    tag = AESGCM(keys.ghash).encrypt(bytes(12), b"", bytes(payload))
    return int.from_bytes(tag[:8], "little")


def _gf128_mul(x: int, y: int) -> int:
    """Product in GCM's GF(2**128) (NIST SP 800-38D, algorithm 1; bit 0 is the MSB)."""
    r = 0xE1 << 120
    z, v = 0, y
    for i in range(127, -1, -1):
        if (x >> i) & 1:
            z ^= v
        v = (v >> 1) ^ r if v & 1 else v >> 1
    return z


def keyed_ghash64_by_hand(payload: bytes, keys: Subkeys) -> int:
    """``keyed_ghash64`` as GHASH written out: ``E_K(J0) xor GHASH_H(A, C)`` with
    ``H = E_K(0**128)``, ``J0 = nonce || 0**31 1``, ``A`` the payload, ``C`` empty: the
    check that the docstring's "GHASH, a universal hash" is what the GCM tag holds."""
    encrypt = Cipher(algorithms.AES(keys.ghash), modes.ECB()).encryptor()
    h = int.from_bytes(encrypt.update(bytes(16)), "big")
    j0 = encrypt.update(bytes(12) + b"\x00\x00\x00\x01")
    data = bytes(payload) + bytes(-len(payload) % 16)
    state = 0
    for start in range(0, len(data), 16):
        state = _gf128_mul(state ^ int.from_bytes(data[start : start + 16], "big"), h)
    lengths = struct.pack(">QQ", 8 * len(payload), 0)
    state = _gf128_mul(state ^ int.from_bytes(lengths, "big"), h)
    tag = bytes(a ^ b for a, b in zip(j0, state.to_bytes(16, "big"), strict=True))
    return int.from_bytes(tag[:8], "little")


def universal_hash(payload: bytes, keys: Subkeys, algorithm: str) -> int:
    if algorithm == "keyed_wsum64":
        return keyed_wsum64(payload, keys)
    if algorithm == "keyed_ghash64":
        return keyed_ghash64(payload, keys)
    raise ValueError(f"{algorithm!r} is no keyed algorithm")


# --- the tag and the seal -------------------------------------------------------------


def cbc_mac(key: bytes, blocks: list[bytes]) -> bytes:
    """AES-256 CBC-MAC (zero IV) over whole 16-byte blocks, built from AES-ECB."""
    encrypt = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    state = bytes(16)
    for block in blocks:
        assert len(block) == 16
        state = encrypt.update(bytes(a ^ b for a, b in zip(state, block, strict=True)))
    return state


def tag_of(head: bytes, hash64: int, keys: Subkeys) -> bytes:
    """The 8-byte tag of a seal whose bytes 0-55 are ``head`` (its checksum field
    ignored) over a payload whose universal hash is ``hash64``."""
    assert len(head) == 56
    blocks = [head[8:24], head[24:32] + head[40:48], head[48:56] + struct.pack("<Q", hash64)]
    return cbc_mac(keys.tag, blocks)[:8]


def seal_head(
    *,
    config_digest: bytes,
    layout_digest: bytes,
    key_digest: bytes,
    checksum_field: bytes,
    length: int,
    page_index: int,
    page_count: int,
    algorithm_id: int,
    key_id: bytes,
) -> bytes:
    """Bytes 0-55 of a seal, field by field from the table."""
    for name, value, size in (
        ("config_digest", config_digest, 8),
        ("layout_digest", layout_digest, 8),
        ("key_digest", key_digest, 8),
        ("checksum_field", checksum_field, 8),
        ("key_id", key_id, KEY_ID_BYTES),
    ):
        assert len(value) == size, (name, value)
    head = (
        MAGIC
        + config_digest
        + layout_digest
        + key_digest
        + checksum_field
        + struct.pack("<IHHB", length, page_index, page_count, algorithm_id)
        + key_id
    )
    assert len(head) == 56
    return head


def with_header_check(head: bytes) -> bytes:
    """The whole seal: ``head`` (bytes 0-55) and ``wsum64`` of it."""
    assert len(head) == 56
    return head + struct.pack("<Q", wsum64(head))


def expected_seal(
    payload: bytes,
    secret: bytes,
    config_digest: bytes,
    layout_digest: bytes,
    key_digest: bytes,
    page_index: int,
    page_count: int,
    algorithm: str,
) -> bytes:
    """The 64 bytes a keyed seal of ``payload`` (all of the bytes the seal covers) must
    be, under the key whose file holds ``secret``."""
    if algorithm not in KEYED_ALGORITHMS:
        raise ValueError(f"{algorithm!r} is no keyed algorithm")
    keys = subkeys(secret)

    def head(checksum_field: bytes) -> bytes:
        return seal_head(
            config_digest=config_digest,
            layout_digest=layout_digest,
            key_digest=key_digest,
            checksum_field=checksum_field,
            length=len(payload),
            page_index=page_index,
            page_count=page_count,
            algorithm_id=ALGORITHM_IDS[algorithm],
            key_id=keys.key_id,
        )

    tag = tag_of(head(bytes(8)), universal_hash(payload, keys, algorithm), keys)
    return with_header_check(head(tag))


def expected_unkeyed_seal(
    payload: bytes,
    config_digest: bytes,
    layout_digest: bytes,
    key_digest: bytes,
    page_index: int,
    page_count: int,
    algorithm: str,
) -> bytes:
    """The 64 bytes of an unkeyed seal (``wsum64`` or ``xxh3_64``; key id zero)."""
    return with_header_check(
        seal_head(
            config_digest=config_digest,
            layout_digest=layout_digest,
            key_digest=key_digest,
            checksum_field=struct.pack("<Q", unkeyed_checksum(payload, algorithm)),
            length=len(payload),
            page_index=page_index,
            page_count=page_count,
            algorithm_id=ALGORITHM_IDS[algorithm],
            key_id=bytes(KEY_ID_BYTES),
        )
    )


def verdict(
    page: bytes,
    secret: bytes | None,
    config_digest: bytes,
    layout_digest: bytes,
    key_digest: bytes,
    page_index: int,
    page_count: int,
    payload_length: int,
) -> bool:
    """Whether ``page`` may be loaded as this chunk: its last 64 bytes are exactly the
    seal of its first ``payload_length`` bytes, by the algorithm its seal names. With a
    secret only keyed seals under it count; without one only unkeyed seals do."""
    page = bytes(page)
    if len(page) <= SEAL_BYTES or payload_length > len(page) - SEAL_BYTES:
        return False
    seal = page[-SEAL_BYTES:]
    algorithm = ALGORITHM_NAMES.get(seal[48])
    if algorithm is None:
        return False
    payload = page[:payload_length]
    identity = (config_digest, layout_digest, key_digest, page_index, page_count)
    if secret is None:
        if algorithm in KEYED_ALGORITHMS:
            return False
        return seal == expected_unkeyed_seal(payload, *identity, algorithm)
    if algorithm not in KEYED_ALGORITHMS:
        return False
    return seal == expected_seal(payload, secret, *identity, algorithm)


__all__ = [
    "ALGORITHM_IDS",
    "KEYED_ALGORITHMS",
    "KEY_ID_BYTES",
    "MAGIC",
    "SEAL_BYTES",
    "Subkeys",
    "cbc_mac",
    "chunk_key_digest",
    "expected_seal",
    "expected_unkeyed_seal",
    "keyed_ghash64",
    "keyed_ghash64_by_hand",
    "keyed_wsum64",
    "seal_head",
    "subkeys",
    "tag_of",
    "universal_hash",
    "unkeyed_checksum",
    "verdict",
    "weights",
    "with_header_check",
    "wsum64",
]
