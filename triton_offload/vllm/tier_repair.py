"""Refused chunks taken out of vLLM's secondary tiers, so the next store repairs the tier.

Why: vLLM's fs tier never overwrites a chunk file (its store returns at once when the
file exists: ``_store_block`` in ``vllm/v1/kv_offload/tiering/fs/io.py``). A file whose
chunk this backend refused (a seal that fails at the promotion or at a worker's load,
another key's chunk, a short file) would stay: each time the chunk left host memory it
would be promoted, refused and recomputed again, forever. Removed, the next store of the
key writes a good file and the promotion after it is accepted.

What is removed, and when (:func:`remove_refused_file`, :meth:`TierFolder.remove_if_refused`):

- only a regular file inside the tier's own chunk folder (vLLM's ``FileMapper`` files a
  rank's chunks under ``<base_path>_r<rank>``). The folder is opened once; every folder
  below it is opened relative to its parent's descriptor with ``O_NOFOLLOW``, and the
  file is read, renamed and unlinked relative to its folder's descriptor. No symbolic
  link is followed and no path is resolved twice: a folder on the way that is (or
  becomes, at any moment) a link, or any other writer's rename, can only make the
  removal find nothing or keep the file, never reach a file outside the tier. A path
  that names no entry inside the folder (``..``, ``.``, an empty component, another
  folder) is refused with a ValueError before anything is opened;
- only when the file's own bytes fail the check (the caller's verdict; for this backend
  every page's seal with its configuration digest, key and payload checksum, or a file
  shorter than a row). A refusal whose bytes are not the file's (a host row changed after
  the chunk went to the tier; a read that failed for another reason) or that only a
  worker can make (a valid chunk of another row layout in a shared folder: good for its
  writer) removes nothing;
- only the file that was judged. It is read through one descriptor, judged, then renamed
  (atomically, in the folder the descriptor walk reached) to a private name beside it.
  If the renamed file is not the judged one (device, inode, size and modification time
  differ: another engine published a file at the name in between, as vLLM's
  write-then-rename does), it is linked back (never over a file that is there by then)
  and nothing is removed. The descriptor stays open to the end, so the judged inode
  cannot be reused meanwhile. A reader that opens the path in the instant it is renamed
  away finds no file: a miss, recomputed, never a wrong chunk.

What a writer of the tier can still do: whoever may write the tier's folders can remove
or replace its files (and, with unkeyed seals, forge chunks): the folders must be this
engine user's alone (:func:`triton_offload.vllm.tiers.ensure_private_fs_roots`). The
repair never lends such a writer the engine's rights outside the tier.

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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from triton_offload.vllm.compat import supported_vllm_api

#: Flags every folder of a tier is opened with: a folder, never through a link.
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Flags a chunk file is read with: never through a link, and never blocking on a FIFO
#: or device planted under a chunk's name.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
#: Where a removed file is renamed to first: ``<name>.refused-<pid>-<12 hex digits>``.
REFUSED_INFIX = ".refused-"


class RemovalOutcome(enum.Enum):
    """What :func:`remove_refused_file` did with a tier's copy of a refused chunk."""

    REMOVED = "removed"
    GOOD = "kept: its bytes pass the check"
    ABSENT = "no file at the path"
    REPLACED = "kept: another file was published at the path while it was judged"
    NOT_A_FILE = "kept: not a regular file (a symbolic link or a folder)"
    LINK_ON_THE_WAY = "kept: a folder on its path is a symbolic link or no folder (not followed)"


class Unreachable(Exception):
    """A folder on the way is missing (``outcome`` ABSENT) or is a link or no folder
    (LINK_ON_THE_WAY): nothing below it is opened."""

    def __init__(self, outcome: RemovalOutcome, name: str) -> None:
        super().__init__(f"{name}: {outcome.value}")
        self.outcome = outcome


def fs_chunk_folder(tier: Any) -> str | None:
    """The folder vLLM's fs tier ``tier`` files this rank's chunks in (None: not an fs
    tier, so no file of it is ever removed here)."""
    with supported_vllm_api():
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    if not isinstance(tier, FileSystemTierManager):
        return None
    mapper = tier.file_mapper
    return f"{mapper.base_path}_r{mapper.rank}"


def fs_chunk_file(tier: Any, key: bytes) -> str:
    """The file vLLM's fs tier ``tier`` keeps ``key``'s chunk in."""
    return str(tier.file_mapper.get_file_name(key))


def entry_parts(path: str, folder: str) -> tuple[str, ...]:
    """The names leading from ``folder`` to ``path``, compared as text (no link resolved:
    the walk resolves nothing either); ValueError unless each is a plain name."""
    prefix = folder.rstrip("/") + "/"
    parts = tuple(path[len(prefix) :].split("/")) if path.startswith(prefix) else ()
    if not parts or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"chunk file {path!r} is not inside the tier folder {folder!r}")
    return parts


def read_up_to(descriptor: int, size: int) -> bytes:
    """Up to ``size`` bytes from the start of ``descriptor`` (fewer at its end)."""
    parts, left, offset = [], size, 0
    while left > 0:
        part = os.pread(descriptor, min(left, 1 << 24), offset)
        if not part:
            break
        parts.append(part)
        left -= len(part)
        offset += len(part)
    return b"".join(parts)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (
        b.st_dev,
        b.st_ino,
        b.st_size,
        b.st_mtime_ns,
    )


def _put_back(folder: int, aside: str, name: str) -> None:
    """Return a file renamed away by mistake to ``name`` in ``folder``, unless a file is
    there by now (published later: it stays)."""
    try:
        os.link(aside, name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
    except FileExistsError:
        pass
    except OSError:
        # A file system without hard links: rename back. A file published at the name
        # in this instant is replaced by one published an instant before it, written
        # the same way (neither was judged; both are the writers').
        os.replace(aside, name, src_dir_fd=folder, dst_dir_fd=folder)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside, dir_fd=folder)


class TierFolder:
    """An fs tier's folder opened once (``O_DIRECTORY | O_NOFOLLOW``): every entry below it
    is reached by names relative to directory descriptors, never through a link.

    ``parts`` name an entry below the folder, one name per level (``("abc", "de_g0",
    "x.bin")``). OSError from opening the folder itself propagates (a missing folder,
    one that is a link: ``ELOOP``, or not a folder: ``ENOTDIR``).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._descriptor: int | None = os.open(path, _FOLDER_FLAGS)

    @property
    def descriptor(self) -> int:
        if self._descriptor is None:
            raise ValueError(f"tier folder {self.path!r} is closed")
        return self._descriptor

    def close(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None

    def __enter__(self) -> TierFolder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextlib.contextmanager
    def folder(self, parts: Sequence[str]) -> Iterator[int]:
        """A descriptor of the folder ``parts`` names (the tier folder itself for no
        parts), walked one level at a time; :class:`Unreachable` where a level is missing,
        a link or no folder."""
        _check_names(parts)
        current = os.dup(self.descriptor)
        try:
            for name in parts:
                try:
                    below = os.open(name, _FOLDER_FLAGS, dir_fd=current)
                except FileNotFoundError:
                    raise Unreachable(RemovalOutcome.ABSENT, name) from None
                except OSError as error:
                    if error.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise Unreachable(RemovalOutcome.LINK_ON_THE_WAY, name) from None
                    raise
                os.close(current)
                current = below
            yield current
        finally:
            os.close(current)

    def entries(self, parts: Sequence[str]) -> list[os.DirEntry[str]]:
        """The entries of the folder ``parts`` names (links are entries, never followed);
        :class:`Unreachable` as :meth:`folder`."""
        with self.folder(parts) as descriptor, os.scandir(descriptor) as listing:
            return list(listing)

    @contextlib.contextmanager
    def opened_file(self, parts: Sequence[str]) -> Iterator[tuple[int, int, os.stat_result]]:
        """``(folder descriptor, file descriptor, the file's stat)`` of the regular file
        ``parts`` names, opened without following a link; :class:`Unreachable` where it
        or a folder on the way is missing (ABSENT), a link or no regular file
        (LINK_ON_THE_WAY for a folder, NOT_A_FILE for the entry itself)."""
        if not parts:
            raise ValueError("a file inside the tier folder needs at least one name")
        with self.folder(parts[:-1]) as folder:
            name = parts[-1]
            try:
                descriptor = os.open(name, _FILE_FLAGS, dir_fd=folder)
            except FileNotFoundError:
                raise Unreachable(RemovalOutcome.ABSENT, name) from None
            except OSError as error:
                if error.errno == errno.ELOOP:  # the entry is a symbolic link
                    raise Unreachable(RemovalOutcome.NOT_A_FILE, name) from None
                raise
            try:
                status = os.fstat(descriptor)
                if not stat.S_ISREG(status.st_mode):
                    raise Unreachable(RemovalOutcome.NOT_A_FILE, name)
                yield folder, descriptor, status
            finally:
                os.close(descriptor)

    def read(self, parts: Sequence[str], size: int | None = None) -> tuple[os.stat_result, bytes]:
        """The stat and first ``size`` bytes (all of it for None) of the regular file
        ``parts`` names, read through one descriptor; :class:`Unreachable` as
        :meth:`opened_file`."""
        with self.opened_file(parts) as (_, descriptor, status):
            return status, read_up_to(descriptor, status.st_size if size is None else size)

    def remove_if_refused(
        self, parts: Sequence[str], size: int | None, problem: Callable[[bytes], str | None]
    ) -> RemovalOutcome:
        """Remove the file ``parts`` names if its first ``size`` bytes (all for None), as
        read, fail ``problem`` (which returns why, or None for a good chunk); see the
        module docstring for the guarantees. OSError from the file system propagates."""
        try:
            with self.opened_file(parts) as (folder, descriptor, judged):
                data = read_up_to(descriptor, judged.st_size if size is None else size)
                if problem(data) is None:
                    return RemovalOutcome.GOOD
                name = parts[-1]
                aside = f"{name}{REFUSED_INFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
                try:
                    os.rename(name, aside, src_dir_fd=folder, dst_dir_fd=folder)
                except FileNotFoundError:
                    return RemovalOutcome.ABSENT  # removed by someone else meanwhile
                if _same_file(os.stat(aside, dir_fd=folder, follow_symlinks=False), judged):
                    os.unlink(aside, dir_fd=folder)
                    return RemovalOutcome.REMOVED
                _put_back(folder, aside, name)
                return RemovalOutcome.REPLACED
        except Unreachable as unreachable:
            return unreachable.outcome


def _check_names(parts: Sequence[str]) -> None:
    for part in parts:
        if not isinstance(part, str) or part in ("", ".", "..") or "/" in part:
            raise ValueError(f"{part!r} is not a name of an entry inside a tier folder")


def remove_refused_file(
    path: str, folder: str, size: int, problem: Callable[[bytes], str | None]
) -> RemovalOutcome:
    """Remove the chunk file ``path`` (inside ``folder``) if its first ``size`` bytes, as
    read, fail ``problem`` (which returns why, or None for a good chunk); see the module
    docstring for the guarantees. OSError from the file system propagates, except a
    tier folder that is missing (ABSENT) or a link (LINK_ON_THE_WAY)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"size must be positive, got {size!r}")
    parts = entry_parts(path, folder)
    try:
        tier = TierFolder(folder)
    except FileNotFoundError:
        return RemovalOutcome.ABSENT
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            return RemovalOutcome.LINK_ON_THE_WAY
        raise
    with tier:
        return tier.remove_if_refused(parts, size, problem)


__all__ = [
    "REFUSED_INFIX",
    "RemovalOutcome",
    "TierFolder",
    "Unreachable",
    "entry_parts",
    "fs_chunk_file",
    "fs_chunk_folder",
    "read_up_to",
    "remove_refused_file",
]
