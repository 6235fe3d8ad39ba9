"""Temporary names for vLLM's fs tier writes that no other engine draws.

vLLM's fs tier writes a chunk into ``<chunk file><suffix>`` (opened with ``O_EXCL``)
and renames it over the chunk's name once it is whole. It draws the suffix once per
writer thread from Python's ``random`` module (``_get_tmp_suffix`` in
``vllm/v1/kv_offload/tiering/fs/io.py``), which vLLM seeds with the engine's ``seed``
(0 unless set) in every process that runs a worker: with one worker (vLLM's ``uni``
executor, ``vllm serve`` of one device) that is the scheduler's process, where the tier
writes. Engines of one seed sharing a tier therefore draw the same suffixes:

- two of them writing one chunk at the same time open the same temporary file: one
  store fails (and vLLM's Python writer, cleaning up, removes the other's file);
- the temporary file of an engine killed in the middle of a write (a crash, the OOM
  killer) is hit by every later write of that chunk by an engine of that seed
  (``EEXIST``): the chunk is never stored again, and no prefix through it is served
  from the tier.

:func:`use_unique_temporary_names` draws each writer thread's suffix from the operating
system's randomness (``secrets``), which no seed decides, in vLLM's shape (``_<a number
below 2**63>.tmp``, as ``triton-offload tier`` recognises it). The chunk names and the
write-then-rename stay vLLM's: a reader only ever opens a whole file. A killed
writer's temporary file stays behind, never read (its name is no chunk's); remove
``*.tmp`` files below the tier's root that are older than any write in progress.
"""

from __future__ import annotations

import secrets
import threading

_writers = threading.local()


def unique_temporary_suffix() -> str:
    """This thread's suffix for vLLM's fs temporary files, drawn on first use from the
    operating system's randomness."""
    suffix: str | None = getattr(_writers, "suffix", None)
    if suffix is None:
        suffix = _writers.suffix = f"_{secrets.randbits(63)}.tmp"
    return suffix


def use_unique_temporary_names() -> None:
    """Make vLLM's fs tier (in this process) name its temporary files by
    :func:`unique_temporary_suffix` (idempotent)."""
    from vllm.v1.kv_offload.tiering.fs import io

    io._get_tmp_suffix = unique_temporary_suffix


__all__ = ["unique_temporary_suffix", "use_unique_temporary_names"]
