"""Argument types shared by the ``triton-offload`` sub-commands.

Every integer flag of every command is parsed here, so a bad value gets the same
message everywhere: the flag's meaning and the value, from argparse (exit status 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["int_at_least"]


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
