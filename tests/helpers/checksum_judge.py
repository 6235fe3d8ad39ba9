"""The page checksum wsum64, written from its definition alone (numpy, no kernel code).

A page is one pool row. The byte at page offset ``o`` with value ``b`` contributes
``b * 2**(8 * (o % 4)) * h(o // 4)`` mod 2**64, with ``h(j) = ((2j + 1) * 0x9E3779B1)
mod 2**32``; the page's checksum is the sum of the contributions mod 2**64. Equivalently
the sum over its little-endian 32-bit words ``w_j`` of ``w_j * h(j)``: :func:`wsum64`
follows the byte form, :func:`wsum64_words` the word form, and the tests check that the
two agree, so that neither carries a slip of the kernel's.
"""

from __future__ import annotations

import numpy as np

MULTIPLIER = 0x9E3779B1
_LOW32 = np.uint64(0xFFFF_FFFF)


def weights(word_index: np.ndarray) -> np.ndarray:
    """``h(j) = ((2j + 1) * 0x9E3779B1) mod 2**32`` as uint64 (no product exceeds 2**64:
    ``(2j + 1) mod 2**32`` is taken first)."""
    j = np.asarray(word_index, dtype=np.uint64)
    odd = (j * np.uint64(2) + np.uint64(1)) & _LOW32
    return (odd * np.uint64(MULTIPLIER)) & _LOW32


def wsum64(page_bytes: np.ndarray) -> int:
    """wsum64 of a page given as its bytes (uint8, 1-D; offset 0 is the row's first byte)."""
    data = np.ascontiguousarray(page_bytes, dtype=np.uint8).reshape(-1)
    offsets = np.arange(data.size, dtype=np.uint64)
    shifted = data.astype(np.uint64) << ((offsets % np.uint64(4)) * np.uint64(8))
    # shifted < 2**32 and the weight < 2**32: the product fits; the sum wraps mod 2**64.
    with np.errstate(over="ignore"):
        return int(np.sum(shifted * weights(offsets // np.uint64(4)), dtype=np.uint64))


def wsum64_words(page_bytes: np.ndarray) -> int:
    """wsum64 in its word form: little-endian 32-bit words (the last one zero-padded)."""
    data = np.ascontiguousarray(page_bytes, dtype=np.uint8).reshape(-1)
    padded = np.zeros(-(-data.size // 4) * 4, dtype=np.uint8)
    padded[: data.size] = data
    words = padded.view("<u4").astype(np.uint64)
    with np.errstate(over="ignore"):
        return int(np.sum(words * weights(np.arange(words.size)), dtype=np.uint64))
