"""Argument types and checks shared by the ``triton-offload`` sub-commands.

Every integer flag of every command is parsed here, so a bad value gets the same
message everywhere: the flag's meaning and the value. A user error ends the command
with exit status 2 and exactly one line on stderr, ``triton-offload CMD: error: ...``,
naming the flag and the value; never a usage block, never a traceback. Checks that
need more than one flag (or the machine) run in the command's ``run`` before any
work and raise :class:`UsageError`, which ``triton_offload.cli.main`` prints the same
way.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

__all__ = [
    "OneLineErrorParser",
    "UsageError",
    "available_memory_bytes",
    "check_fits_in_memory",
    "check_output_dir",
    "folder",
    "format_bytes",
    "int_at_least",
    "int_between",
]


class UsageError(Exception):
    """A user error found after parsing: the message names the flag and its value."""


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``PROG: error: MESSAGE``.

    argparse's default prints the whole usage block first; with a dozen flags the
    one line that says what was wrong scrolls away. ``--help`` still shows the usage.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers >= ``minimum``; errors name ``what``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{what} {value} must be >= {minimum}")
        return value

    # argparse names the type in its generic messages.
    parse.__name__ = what
    return parse


def int_between(minimum: int, maximum: int, what: str, why: str) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers in ``[minimum, maximum]``.

    ``why`` says where the upper bound comes from (time or memory) and ends the
    message: ``argument --repeats: repeats 1000000000 must be <= 1,000 (time: ...)``.
    """
    at_least = int_at_least(minimum, what)

    def parse(text: str) -> int:
        value = at_least(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{what} {value} must be <= {maximum:,} ({why})")
        return value

    parse.__name__ = what
    return parse


def folder(text: str) -> Path:
    """An argparse ``type`` for an output folder: an empty name is refused (``Path('')``
    is the current folder, so ``--out ''`` wrote the results there)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"empty folder name {text!r}: give a folder, e.g. --out results"
        )
    return Path(text)


def format_bytes(size: int) -> str:
    """``3221225472 -> '3.0 GiB'`` (binary units, one decimal)."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def available_memory_bytes() -> int | None:
    """Memory the kernel says a new allocation can get without swapping, or None.

    ``MemAvailable`` from ``/proc/meminfo`` (free memory plus reclaimable caches); on
    systems without it, free physical pages.
    """
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_fits_in_memory(flag: str, needed: int, what: str) -> None:
    """UsageError if ``needed`` bytes exceed the memory available now.

    ``flag`` is the flag and value that decided the size (``--prompt-tokens 10``),
    ``what`` says what the bytes are for.
    """
    available = available_memory_bytes()
    if available is not None and needed > available:
        raise UsageError(
            f"{flag}: {what} would need {format_bytes(needed)} ({needed:,} bytes), more than "
            f"the {format_bytes(available)} of memory available"
        )


def check_output_dir(flag: str, path: Path, files: Iterable[str]) -> None:
    """Make sure the results can be written to folder ``path`` before any work starts.

    Creates the folder (and its parents) and writes then removes a probe file in it,
    so a path below a file, a read-only file system or a missing permission fails
    now, not after the measurements. An existing file at ``path``, or a folder where
    one of ``files`` will be written, is refused: nothing already there is replaced
    by something of another kind.
    """
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a folder (give a folder path)")
    for name in files:
        target = path / name
        if target.is_dir():
            raise UsageError(
                f"{flag} {path}: {name} in it is a folder, but the run writes a file there"
            )
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise UsageError(f"{flag} {path}: cannot write there ({reason})") from None
