"""Keyed seals: a page's seal that only holders of the seal key can make.

An unkeyed seal (:mod:`triton_offload.transfer.seal`) catches damage, never a writer of
the tier: whoever can write a chunk file can also recompute its checksum. With a seal
key (``seal_key_file``), the seal's checksum field holds a 64-bit tag instead, made in
two steps so that the pass over the payload stays where the bytes move:

1. **A keyed universal hash of the payload**, computed in the copy's own pass:

   - ``keyed_wsum64`` (CUDA and the Triton interpreter: the copy kernel): with ``w_j``
     the payload's little-endian 32-bit words (the last one zero-padded),
     ``sum_j w_j * r_j mod 2**64``, where ``r_j`` are the key's *weights*: the
     little-endian u64 words of SHAKE-256 of the weights subkey. For two payloads of the
     same length that differ, the sums collide with probability at most ``2**-33`` over
     the key (a 32-bit word difference has at most 31 trailing zero bits), and the
     kernel adds per-tile partial sums in any order, as it does for ``wsum64``.
   - ``keyed_ghash64`` (the CPU path: the host, right after each page's copy): the first
     8 bytes, little-endian, of AES-256-GCM's tag with the GHASH subkey, a zero 96-bit
     nonce, no plaintext and the payload as associated data: GHASH, a universal hash
     over GF(2**128) (collision probability at most ``(L/16 + 1) * 2**-64`` for an
     ``L``-byte payload, truncated to 64 bits), at ~22 GB/s on one core with AES-NI.

The seal's key digest (bytes 24-31) names the chunk's offload key; unkeyed it is the
key's XXH3-64, which anyone can compute and whose collisions a forger can search offline
(about 2**32 work) for two chunks of prompts they choose, then swap one chunk's file for
the other's. Under a key it is the key's *keyed chunk digest* instead:
``BLAKE2b(offload key, key=chunk subkey, digest_size=8)``, which nobody without the key
can compute or search for collisions.

2. **A PRF over the chunk's identity and that hash**: AES-256 CBC-MAC (zero IV) with
   the tag subkey over exactly three 16-byte blocks (fixed length, so CBC-MAC is a PRF):
   seal bytes 8-23 (``config digest | layout digest``), bytes 24-31 and 40-47 (``key
   digest | length, page index, page count``), bytes 48-55 (``algorithm id, key id``)
   followed by the universal hash as 8 little-endian bytes; the tag is the first 8 bytes
   of the last block's encryption, stored little-endian as the seal's u64 at offset 32.
   The hash is never stored, so a reader of the tier learns nothing about the weights
   or the GHASH subkey; a chunk's tag binds its key digest, configuration, row layout
   and place in the row, so a valid chunk under another key's name or configuration
   fails.

A keyed seal names its algorithm (3 or 4) and carries the key's 7-byte *key id* in
bytes 49-55 (zero in unkeyed seals): a chunk sealed under another key is told apart from
damaged bytes, and an engine without a key refuses a keyed chunk instead of misreading
it. The header check (bytes 56-63) stays an unkeyed damage check.

What a key does not stop: replaying a chunk that was once validly sealed under the same
key, chunk key and configuration (its tag is still valid), and anything done by a holder
of the key. Distributing the key is the operator's job (docs/verification.md).

Subkeys come from the key file's bytes, one per use, so no subkey is used for two
things: ``root = BLAKE2b-256(secret, person=b"triton-offload")`` (the file may be longer
than a BLAKE2b key), then ``BLAKE2b-256(label, key=root)`` for the labels
``b"seal tag prf"`` (the AES-256 tag key), ``b"seal ghash"`` (the AES-256 GHASH key),
``b"seal weights"`` (the SHAKE-256 input of the weights), ``b"seal chunk key"`` (the
BLAKE2b key of the keyed chunk digests) and ``b"seal key id"`` (its first 7 bytes are the
key id).
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Sequence

import numpy as np

#: The fewest bytes a seal key file may hold (a 256-bit secret).
MIN_KEY_BYTES = 32
#: The most bytes a seal key file is read to (a larger file is not a key).
MAX_KEY_BYTES = 4096
#: Bytes of the key id in a keyed seal (bytes 49-55, after the algorithm id).
KEY_ID_BYTES = 7
_ZERO_NONCE = bytes(12)


def _cryptography() -> tuple[type, type, type, type]:
    """cryptography's AESGCM, Cipher, AES and ECB (imported only where a key is used)."""
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as error:  # pragma: no cover - the package's dependency
        raise ImportError(
            "keyed seals need the 'cryptography' package (pip install cryptography)"
        ) from error
    return AESGCM, Cipher, algorithms.AES, modes.ECB


def _check_key_folders(name: str, what: str) -> None:
    """Refuse a key whose folder, or any folder above it, another user could change:
    owned by a user other than this one or root, or writable by group or others without
    the sticky bit (there anyone who can write may rename the key away and put their
    own file under its name)."""
    folder = os.path.dirname(os.path.abspath(name))
    while True:
        info = os.stat(folder)
        if info.st_uid not in (os.geteuid(), 0):
            raise ValueError(
                f"{what} {name!r}: its folder {folder!r} belongs to uid {info.st_uid}, who "
                "could replace the key; keep it in folders of this user or root"
            )
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            raise ValueError(
                f"{what} {name!r}: its folder {folder!r} has mode "
                f"{stat.S_IMODE(info.st_mode):04o}: other users can rename the key away "
                "and put their own in its place; make the folder writable by this user "
                "only (chmod go-w)"
            )
        parent = os.path.dirname(folder)
        if parent == folder:
            return
        folder = parent


class SealKey:
    """The subkeys of one seal key (the bytes of ``seal_key_file``).

    Thread-safe: the weights table is built once per length under a lock; the AES
    contexts are made per call (cheap next to the pass over the bytes).
    """

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, (bytes, bytearray)):
            raise TypeError(f"a seal key must be bytes, got {type(secret).__name__}")
        if not MIN_KEY_BYTES <= len(secret) <= MAX_KEY_BYTES:
            raise ValueError(
                f"a seal key must be {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes, got {len(secret)}"
            )
        root = hashlib.blake2b(bytes(secret), digest_size=32, person=b"triton-offload").digest()

        def derive(label: bytes) -> bytes:
            return hashlib.blake2b(label, key=root, digest_size=32).digest()

        self._tag_key = derive(b"seal tag prf")
        self._ghash_key = derive(b"seal ghash")
        self._weights_seed = derive(b"seal weights")
        # Copied per digest: a keyed BLAKE2b state costs more to set up than to copy.
        self._chunk_state = hashlib.blake2b(key=derive(b"seal chunk key"), digest_size=8)
        #: Names the key in every seal it makes (reveals nothing about the key).
        self.key_id = derive(b"seal key id")[:KEY_ID_BYTES]
        self._weights = np.zeros(0, dtype=np.uint64)
        self._weights.flags.writeable = False
        self._weights_lock = threading.Lock()
        AESGCM, _, _, _ = _cryptography()
        self._gcm = AESGCM(self._ghash_key)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], what: str = "seal_key_file") -> SealKey:
        """The key in ``path``: a regular file of :data:`MIN_KEY_BYTES` to
        :data:`MAX_KEY_BYTES` bytes, not a symlink, owned by this process's user and
        neither group- nor world-accessible (a key
        others can read lets them forge; one others can write lets them choose it), in
        folders no other user can write to (sticky folders such as /tmp aside).
        ValueError names the file and what is wrong."""
        name = os.fspath(path)
        try:
            # Non-blocking: a FIFO under the key's name must not wait for a writer (it is
            # refused as no regular file right after).
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise ValueError(f"{what} {name!r} does not exist") from None
        except OSError as error:
            raise ValueError(f"{what} {name!r} cannot be opened: {error.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{what} {name!r} is not a regular file")
            if info.st_uid != os.geteuid():
                raise ValueError(
                    f"{what} {name!r} is owned by uid {info.st_uid}, not by this engine's "
                    f"user (uid {os.geteuid()})"
                )
            if info.st_mode & 0o077:
                raise ValueError(
                    f"{what} {name!r} has mode {stat.S_IMODE(info.st_mode):04o}: other users "
                    "can read or write it; make it readable by this user only (chmod 600)"
                )
            _check_key_folders(name, what)
            secret = os.read(fd, MAX_KEY_BYTES + 1)
        finally:
            os.close(fd)
        if len(secret) < MIN_KEY_BYTES:
            raise ValueError(
                f"{what} {name!r} holds {len(secret)} bytes; a seal key needs at least "
                f"{MIN_KEY_BYTES} random bytes (e.g. head -c 32 /dev/urandom)"
            )
        if len(secret) > MAX_KEY_BYTES:
            raise ValueError(f"{what} {name!r} is larger than {MAX_KEY_BYTES} bytes: not a key")
        return cls(secret)

    # ---------------------------------------------------------- keyed chunk digests

    def chunk_digest(self, key: bytes) -> bytes:
        """The keyed chunk digest of one offload key (8 bytes)."""
        state = self._chunk_state.copy()
        state.update(key)
        return state.digest()

    def chunk_digests(self, keys: Sequence[bytes]) -> np.ndarray:
        """``[len(keys), 8]`` uint8: :meth:`chunk_digest` of each key."""
        joined = b"".join(map(self.chunk_digest, keys))
        return np.frombuffer(joined, dtype=np.uint8).reshape(len(keys), 8)

    # ------------------------------------------------------------- universal hashes

    def weights(self, num_words: int) -> np.ndarray:
        """The first ``num_words`` weights ``r_j`` (uint64, read-only): SHAKE-256's
        output is a prefix of any longer one, so one table serves every length."""
        if num_words < 0:
            raise ValueError(f"num_words must be >= 0, got {num_words}")
        with self._weights_lock:
            if self._weights.size < num_words:
                raw = hashlib.shake_256(self._weights_seed).digest(8 * num_words)
                table = np.frombuffer(raw, dtype="<u8").astype(np.uint64)
                table.flags.writeable = False
                self._weights = table
            return self._weights[:num_words]

    def keyed_wsum64(self, payload: np.ndarray) -> int:
        """``keyed_wsum64`` of a 1-D uint8 payload (the host's form of the kernel's sum)."""
        return int(self.keyed_wsum64_rows(payload.reshape(1, -1))[0]) if payload.size else 0

    def keyed_wsum64_rows(self, rows: np.ndarray) -> np.ndarray:
        """``keyed_wsum64`` of each row of a ``[n, L]`` uint8 array, uint64."""
        count, length = rows.shape
        words = -(-length // 4)
        if length % 4:
            padded = np.zeros((count, words * 4), dtype=np.uint8)
            padded[:, :length] = rows
            rows = padded
        weights = self.weights(words)
        out = np.empty(count, dtype=np.uint64)
        for index in range(count):
            # Integer dot products wrap mod 2**64, as the kernel's sums do.
            out[index] = np.dot(
                np.ascontiguousarray(rows[index]).view("<u4").astype(np.uint64), weights
            )
        return out

    def keyed_ghash64(self, payload: object) -> int:
        """``keyed_ghash64`` of a bytes-like payload (one GMAC over it)."""
        tag = self._gcm.encrypt(_ZERO_NONCE, b"", payload)
        return int.from_bytes(tag[:8], "little")

    # -------------------------------------------------------------------- the tag

    def tags(self, words: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """The tags of seals given as ``[n, 8]`` u64 words (words 1-3, 5 and 6 filled:
        digests, place, algorithm and key id) over their payloads' universal ``hashes``
        (uint64 ``[n]``): uint64 ``[n]``, three batched AES calls for all of them."""
        count = len(words)
        if count == 0:
            return np.zeros(0, dtype=np.uint64)
        blocks = np.empty((count, 3, 2), dtype="<u8")
        blocks[:, 0, 0] = words[:, 1]
        blocks[:, 0, 1] = words[:, 2]
        blocks[:, 1, 0] = words[:, 3]
        blocks[:, 1, 1] = words[:, 5]
        blocks[:, 2, 0] = words[:, 6]
        blocks[:, 2, 1] = hashes
        _, Cipher, AES, ECB = _cryptography()
        encryptor = Cipher(AES(self._tag_key), ECB()).encryptor()
        state = np.frombuffer(encryptor.update(blocks[:, 0].tobytes()), dtype="<u8").reshape(-1, 2)
        for step in (1, 2):
            chained = np.ascontiguousarray(state ^ blocks[:, step])
            state = np.frombuffer(encryptor.update(chained.tobytes()), dtype="<u8").reshape(-1, 2)
        return state[:, 0].astype(np.uint64)


__all__ = ["KEY_ID_BYTES", "MAX_KEY_BYTES", "MIN_KEY_BYTES", "SealKey"]
