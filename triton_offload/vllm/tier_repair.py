"""Refused chunks taken out of vLLM's secondary tiers, so the next store repairs the tier.

Why: vLLM's fs tier never overwrites a chunk file (its store returns at once when the
file exists: ``_store_block`` in ``vllm/v1/kv_offload/tiering/fs/io.py``). A file whose
chunk this backend refused (a seal that fails at the promotion or at a worker's load,
another key's chunk, a short file) would stay: each time the chunk left host memory it
would be promoted, refused and recomputed again, forever. Removed, the next store of the
key writes a good file and the promotion after it is accepted.

What is removed, and when (:func:`remove_refused_file`):

- only a regular file inside the tier's own chunk folder (vLLM's ``FileMapper`` files a
  rank's chunks under ``<base_path>_r<rank>``), never through a symbolic link, never a
  path that leaves the folder (ValueError);
- only when the file's own bytes fail the check (the caller's verdict; for this backend
  every page's seal with its configuration digest, key and payload checksum, or a file
  shorter than a row). A refusal whose bytes are not the file's (a host row changed after
  the chunk went to the tier; a read that failed for another reason) or that only a
  worker can make (a valid chunk of another row layout in a shared folder: good for its
  writer) removes nothing;
- only the file that was judged. It is read through one descriptor, judged, then renamed
  (atomically) to a private name beside it. If the renamed file is not the judged one
  (device, inode, size and modification time differ: another engine published a file at
  the path in between, as vLLM's write-then-rename does), it is linked back (never over a
  file that is there by then) and nothing is removed. The descriptor stays open to the
  end, so the judged inode cannot be reused meanwhile. A reader that opens the path in
  the instant it is renamed away finds no file: a miss, recomputed, never a wrong chunk.

Judging a file reads it whole and computes its checksum on the thread that saw the
refusal (the scheduler's, or vLLM's tier-poll thread): once per refused chunk, never per
promotion.

The other tiers of vLLM's tiering spec:

- ``obj``: vLLM's tier writes every store (no existence check; NIXL's OBJ backend puts the
  object, replacing the old one), so the next store of a refused key repairs it. Nothing
  is removed before that store: neither vLLM's tier nor NIXL's agent offers a delete
  (the agent registers, queries and transfers; its OBJ plugin issues only PutObject,
  GetObject and HeadObject requests).
- ``p2p``: the chunk lives in the peer instance's host region. vLLM's p2p protocol
  (connect, connect_ack, lookup, lookup_resp, fetch, transfer_done, abort_fetch,
  abort_ack, disconnect) has no message that drops a key on the peer, and this
  instance's stores never write the peer's region, so a peer's bad copy cannot be
  removed or replaced from here: it is refused again each time the chunk is promoted
  from that peer, until the peer evicts or re-stores it.
- ``kvcr``: accepted only under ``canonical_layout``, whose rows carry no seal: nothing
  is refused by a seal.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import stat
import uuid
from collections.abc import Callable
from typing import Any

from triton_offload.vllm.compat import supported_vllm_api

with supported_vllm_api():
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager


class RemovalOutcome(enum.Enum):
    """What :func:`remove_refused_file` did with a tier's copy of a refused chunk."""

    REMOVED = "removed"
    GOOD = "kept: its bytes pass the check"
    ABSENT = "no file at the path"
    REPLACED = "kept: another file was published at the path while it was judged"
    NOT_A_FILE = "kept: not a regular file (a symbolic link or a folder)"


def fs_chunk_folder(tier: Any) -> str | None:
    """The folder vLLM's fs tier ``tier`` files this rank's chunks in (None: not an fs
    tier, so no file of it is ever removed here)."""
    if not isinstance(tier, FileSystemTierManager):
        return None
    mapper = tier.file_mapper
    return f"{mapper.base_path}_r{mapper.rank}"


def fs_chunk_file(tier: Any, key: bytes) -> str:
    """The file vLLM's fs tier ``tier`` keeps ``key``'s chunk in."""
    return str(tier.file_mapper.get_file_name(key))


def _check_inside(path: str, folder: str) -> None:
    """ValueError unless ``path`` names an entry inside ``folder`` (links in the folders
    on the way resolved; the entry itself is never followed)."""
    real_folder = os.path.realpath(folder)
    name = os.path.basename(path)
    real_parent = os.path.realpath(os.path.dirname(path))
    inside = os.path.commonpath([real_parent, real_folder]) == real_folder
    if not inside or name in ("", ".", ".."):
        raise ValueError(f"chunk file {path!r} is not inside the tier folder {folder!r}")


def _read_up_to(descriptor: int, size: int) -> bytes:
    parts, left = [], size
    while left > 0:
        part = os.read(descriptor, left)
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (
        b.st_dev,
        b.st_ino,
        b.st_size,
        b.st_mtime_ns,
    )


def _put_back(aside: str, path: str) -> None:
    """Return a file renamed away by mistake to ``path``, unless a file is there by now
    (published later: it stays)."""
    try:
        os.link(aside, path)
    except FileExistsError:
        pass
    except OSError:
        # A file system without hard links: rename back. A file published at the path
        # in this instant is replaced by one published an instant before it, written
        # the same way (neither was judged; both are the writers').
        os.replace(aside, path)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside)


def remove_refused_file(
    path: str, folder: str, size: int, problem: Callable[[bytes], str | None]
) -> RemovalOutcome:
    """Remove the chunk file ``path`` (inside ``folder``) if its first ``size`` bytes, as
    read, fail ``problem`` (which returns why, or None for a good chunk); see the module
    docstring for the guarantees. OSError from the file system propagates."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"size must be positive, got {size!r}")
    _check_inside(path, folder)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return RemovalOutcome.ABSENT
    except OSError as error:
        if error.errno == errno.ELOOP:  # the entry is a symbolic link
            return RemovalOutcome.NOT_A_FILE
        raise
    try:
        judged = os.fstat(descriptor)
        if not stat.S_ISREG(judged.st_mode):
            return RemovalOutcome.NOT_A_FILE
        if problem(_read_up_to(descriptor, size)) is None:
            return RemovalOutcome.GOOD
        aside = f"{path}.refused-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return RemovalOutcome.ABSENT  # removed by someone else meanwhile
        if _same_file(os.lstat(aside), judged):
            os.unlink(aside)
            return RemovalOutcome.REMOVED
        _put_back(aside, path)
        return RemovalOutcome.REPLACED
    finally:
        os.close(descriptor)


__all__ = [
    "RemovalOutcome",
    "fs_chunk_file",
    "fs_chunk_folder",
    "remove_refused_file",
]
