"""``TritonCopier``'s keyed page sums: the weights table it takes, and the launches and
warm-up that use it. No kernel runs: a stand-in kernels module records what the copier
asks of it (the kernel's keyed sums themselves: tests/kernels/test_copy_blocks_keyed.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from triton_offload.transfer.copiers import JobHolds, PageSums, TritonCopier
from triton_offload.transfer.jobs import FROM_POOL, TO_POOL, PairTable
from triton_offload.transfer.layout import CacheLayout, Plane

# Group 0 spans 3 slots of 100 bytes 112 apart (gaps between them): a row payload of
# 324 bytes; group 1 one 64-byte plane. The longest payload has 81 words.
WORDS = 81


def layout() -> CacheLayout:
    planes = [
        Plane(
            group=0,
            base_address=1 << 36,
            block_stride=128,
            page_bytes=100,
            num_blocks=8,
            pool_offset=0,
            slot_stride=112,
        ),
        Plane(
            group=1,
            base_address=1 << 37,
            block_stride=64,
            page_bytes=64,
            num_blocks=8,
            pool_offset=0,
        ),
    ]
    return CacheLayout.from_planes(
        planes, num_groups=2, blocks_per_chunk=3, row_bytes=336, device=torch.device("cpu")
    )


class Kernels:
    """A kernels module that records launches and warm-ups."""

    TILE_BYTES = 64

    def __init__(self) -> None:
        self.launches: list[dict[str, Any]] = []
        self.warm_ups: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def launch_copy(self, *args: Any, **kwargs: Any) -> None:
        self.launches.append(kwargs)

    def warm_up(self, *args: Any, **kwargs: Any) -> None:
        self.warm_ups.append((args, kwargs))


def copier(kernels: Kernels) -> TritonCopier:
    made = layout()
    assert -(-max(made.group_row_bytes) // 4) == WORDS
    return TritonCopier(
        made,
        1 << 40,
        336,
        device=torch.device("cpu"),
        cuda=False,
        num_programs=2,
        kernels=kernels,  # type: ignore[arg-type]
    )


def weights(words: int = WORDS) -> torch.Tensor:
    generator = np.random.default_rng(words)
    return torch.from_numpy(generator.integers(0, 2**64, words, dtype=np.uint64).view(np.int64))


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ([1, 2, 3], TypeError, "must be a torch.Tensor, got list"),
        (torch.zeros(WORDS, dtype=torch.int32), ValueError, "must be int64.*torch.int32"),
        (torch.zeros(WORDS, dtype=torch.uint8), ValueError, "must be int64.*torch.uint8"),
        (torch.zeros(2, WORDS, dtype=torch.int64), ValueError, r"1-D, got 2-D \(2, 81\)"),
        (torch.zeros(2 * WORDS, dtype=torch.int64)[::2], ValueError, "contiguous.*stride 2"),
        (torch.zeros(WORDS, dtype=torch.int64, device="meta"), ValueError, "on meta.*on cpu"),
        (torch.zeros(WORDS - 1, dtype=torch.int64), ValueError, "hold 80 words.*81.*324 bytes"),
    ],
)
def test_set_page_weights_rejects_a_bad_table_and_stays_unkeyed(
    value: Any, error: type[Exception], match: str
) -> None:
    made = copier(Kernels())
    with pytest.raises(error, match=match):
        made.set_page_weights(value)
    assert made.page_weights is None


def test_a_longer_table_is_taken_as_given() -> None:
    made = copier(Kernels())
    table = weights(WORDS + 7)
    made.set_page_weights(table)
    assert made.page_weights is table


def run_every_kind_of_launch(made: TritonCopier) -> None:
    """A plain store, a store with sums, a read-only load pass and a gap pass."""
    pairs = np.array([[1, 0, 1], [2, 0, 2], [3, 1, 0]], dtype=np.int64)
    table = PairTable(pairs, np.array([0, 2, 3], dtype=np.int64))
    sums = torch.zeros(2, dtype=torch.int64)
    pages = np.array([0, 0, 1], dtype=np.int64)
    holds = JobHolds()
    made.prepare(table, TO_POOL, None, holds, None)()
    made.prepare(table, TO_POOL, None, holds, None, sums=PageSums(sums, pages))()
    read_only = PageSums(sums, pages, write=False)
    made.prepare(table, FROM_POOL, None, holds, None, sums=read_only)()
    whole = PairTable(
        np.array([[0, 0, 0], [0, 1, 0]], dtype=np.int64), np.array([0, 1, 2], dtype=np.int64)
    )
    gaps = made.prepare_gaps(whole, holds, None, PageSums(sums, np.arange(2), write=False))
    assert gaps is not None
    gaps()


def test_every_summing_launch_is_keyed_once_weights_are_set() -> None:
    kernels = Kernels()
    made = copier(kernels)
    run_every_kind_of_launch(made)
    # Unkeyed: no launch names page_weights (the launcher's call is what it was).
    assert len(kernels.launches) == 4
    assert all("page_weights" not in launch for launch in kernels.launches)

    table = weights()
    made.set_page_weights(table)
    kernels.launches.clear()
    run_every_kind_of_launch(made)

    plain, fused, read_only, gaps = kernels.launches
    assert "page_sums" not in plain and "page_weights" not in plain
    for launch in (fused, read_only, gaps):
        assert launch["page_sums"] is not None
        assert launch["page_weights"] is table
    assert [fused["write"], read_only["write"], gaps["write"]] == [True, False, False]


def test_warm_up_compiles_the_keyed_variants_once_weights_are_set() -> None:
    kernels = Kernels()
    made = copier(kernels)
    made.warm_up()
    made.warm_up(checksum=True)
    made.set_page_weights(weights())
    made.warm_up(checksum=True)
    made.warm_up()
    device, tile = torch.device("cpu"), Kernels.TILE_BYTES
    assert kernels.warm_ups == [
        ((device, tile), {}),
        ((device, tile), {"checksum": True}),
        ((device, tile), {"checksum": True, "keyed": True}),
        ((device, tile), {}),
    ]
