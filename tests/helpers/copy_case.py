"""A copy-kernel test case with page sums: planes on backing tensors, a pool, its tables.

Shared by the kernel's page-sum tests (``tests/kernels/test_copy_blocks_checksum.py``,
``tests/kernels/test_copy_blocks_keyed.py``): the layouts mix the kernel's paths (pages
of 270 and 1,540 bytes whose slots sit at row offsets 0, 4 and 8 mod 16 and odd ones,
fragment planes with slot stride > page), pools at odd addresses or with odd row
strides, tiles cut small so pages span several items. Every tensor is filled with
random bytes ("poison") before a copy, so bytes a copy must not touch are checked too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tests.helpers.checksum_judge import wsum64
from triton_offload.transfer import layout as layout_module
from triton_offload.transfer.copiers import KernelTables, kernel_tables, load_kernels
from triton_offload.transfer.jobs import Direction
from triton_offload.transfer.layout import CacheLayout

BLOCKS_PER_CHUNK = 3
NUM_BLOCKS = 8
POOL_ROWS = 10
U64 = 1 << 64


@dataclass(frozen=True)
class PlaneSpec:
    """A plane of the test layout; all sizes in bytes."""

    group: int
    page: int
    pool_offset: int
    backing: int
    #: offset of block 0's page in its backing tensor
    lead: int
    block_stride: int
    slot_stride: int | None = None


# Group 0: a 270-byte page (odd slots at odd-even offsets: byte path) and a 1,540-byte
# page whose slots sit at row offsets 0, 4 and 8 mod 16 (16-, 4- and 8-byte paths).
# Group 1: two fragments of one 272-byte block page, interleaved in the row (slot stride
# 272 > their pages). Group 2: a plane the job moves nothing of (an empty group).
PLANES = (
    PlaneSpec(0, 270, 0, backing=0, lead=3, block_stride=275),
    PlaneSpec(0, 1540, 816, backing=1, lead=0, block_stride=1552),
    PlaneSpec(1, 112, 0, backing=2, lead=0, block_stride=288, slot_stride=272),
    PlaneSpec(1, 160, 112, backing=2, lead=112, block_stride=288, slot_stride=272),
    PlaneSpec(2, 64, 0, backing=3, lead=0, block_stride=64),
)
NUM_GROUPS = 3


@dataclass
class Case:
    """Backings, pool, layout and kernel tables of ``planes`` on ``device``."""

    device: torch.device
    pool_shift: int
    row_gap: int
    tile_bytes: int
    planes: tuple[PlaneSpec, ...] = PLANES
    num_groups: int = NUM_GROUPS
    backings: list[torch.Tensor] = field(init=False)
    pool_buffer: torch.Tensor = field(init=False)
    pool: torch.Tensor = field(init=False)
    row_bytes: int = field(init=False)
    row_stride: int = field(init=False)
    layout: CacheLayout = field(init=False)
    tables: KernelTables = field(init=False)

    def __post_init__(self) -> None:
        sizes: dict[int, int] = {}
        for p in self.planes:
            end = p.lead + (NUM_BLOCKS - 1) * p.block_stride + p.page
            sizes[p.backing] = max(sizes.get(p.backing, 0), end + 16)
        self.backings = [
            torch.empty(sizes[i], dtype=torch.uint8, device=self.device) for i in sorted(sizes)
        ]
        spans = [
            p.pool_offset + (BLOCKS_PER_CHUNK - 1) * (p.slot_stride or p.page) + p.page
            for p in self.planes
        ]
        self.row_bytes = -(-max(spans) // 16) * 16
        self.row_stride = self.row_bytes + self.row_gap
        self.pool_buffer = torch.empty(
            self.pool_shift + POOL_ROWS * self.row_stride + 64,
            dtype=torch.uint8,
            device=self.device,
        )
        self.pool = self.pool_buffer.as_strided(
            (POOL_ROWS, self.row_bytes), (self.row_stride, 1), self.pool_shift
        )
        planes = [
            layout_module.Plane(
                group=p.group,
                base_address=self.backings[p.backing].data_ptr() + p.lead,
                block_stride=p.block_stride,
                page_bytes=p.page,
                num_blocks=NUM_BLOCKS,
                pool_offset=p.pool_offset,
                slot_stride=p.slot_stride,
            )
            for p in self.planes
        ]
        self.layout = CacheLayout.from_planes(
            planes,
            num_groups=self.num_groups,
            blocks_per_chunk=BLOCKS_PER_CHUNK,
            row_bytes=self.row_bytes,
            device=self.device,
        )
        self.tables = kernel_tables(self.layout, self.row_stride, self.tile_bytes, self.device)

    def fill(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for tensor in [*self.backings, self.pool_buffer]:
            tensor.copy_(
                torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=generator)
            )

    def snapshot(self) -> list[torch.Tensor]:
        return [t.cpu().clone() for t in [*self.backings, self.pool_buffer]]

    def masks(self, pairs: torch.Tensor, offsets: torch.Tensor) -> list[torch.Tensor]:
        """Bool masks (CPU) of the bytes the job addresses: one per backing, then the pool
        buffer."""
        masks = [torch.zeros(t.numel(), dtype=torch.bool) for t in self.backings]
        pool_mask = torch.zeros(self.pool_buffer.numel(), dtype=torch.bool)
        for group in range(self.num_groups):
            for block, row, slot in pairs[int(offsets[group]) : int(offsets[group + 1])].tolist():
                for p in self.planes:
                    if p.group != group:
                        continue
                    start = p.lead + block * p.block_stride
                    masks[p.backing][start : start + p.page] = True
                    at = self.pool_shift + row * self.row_stride + p.pool_offset
                    at += slot * (p.slot_stride or p.page)
                    pool_mask[at : at + p.page] = True
        return [*masks, pool_mask]

    def expected_copy(
        self, pairs: torch.Tensor, offsets: torch.Tensor, direction: Direction
    ) -> list[torch.Tensor]:
        """Every tensor (CPU) after the copy, computed with plain slicing."""
        result = self.snapshot()
        backings, pool = result[:-1], result[-1]
        for group in range(self.num_groups):
            for block, row, slot in pairs[int(offsets[group]) : int(offsets[group + 1])].tolist():
                for p in self.planes:
                    if p.group != group:
                        continue
                    start = p.lead + block * p.block_stride
                    at = self.pool_shift + row * self.row_stride + p.pool_offset
                    at += slot * (p.slot_stride or p.page)
                    if direction == Direction.TO_POOL:
                        pool[at : at + p.page] = backings[p.backing][start : start + p.page]
                    else:
                        backings[p.backing][start : start + p.page] = pool[at : at + p.page]
        return result

    def rows(self, pool_buffer: torch.Tensor, pool_mask: torch.Tensor) -> list[np.ndarray]:
        """Each pool row's bytes (uint8; offset 0 is the row's first byte), its bytes
        outside ``pool_mask`` zeroed."""
        data = (pool_buffer * pool_mask).numpy()
        return [
            data[self.pool_shift + r * self.row_stride :][: self.row_bytes]
            for r in range(POOL_ROWS)
        ]

    def row_sums(self, pool_buffer: torch.Tensor, pool_mask: torch.Tensor) -> list[int]:
        """The judge's wsum64 of each pool row, its unaddressed bytes zeroed."""
        return [wsum64(row) for row in self.rows(pool_buffer, pool_mask)]


def job(seed: int, counts: tuple[int, ...] = (5, 4, 0)) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs of ``counts[g]`` blocks of group g (default: 5, 4 and none of group 2).

    Distinct random GPU blocks and pool rows (one chunk of one group per row); each group
    starts at position 1 of its first chunk (a partial first chunk: slot 0 of it is not
    moved).
    """
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randperm(POOL_ROWS, generator=generator).tolist()
    table = []
    offsets = [0]
    for count in counts:
        blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
        chunks = [rows.pop() for _ in range(-(-(count + 1) // BLOCKS_PER_CHUNK))]
        for k in range(count):
            position = 1 + k
            chunk = chunks[position // BLOCKS_PER_CHUNK]
            table.append((blocks[k], chunk, position % BLOCKS_PER_CHUNK))
        offsets.append(len(table))
    return (
        torch.tensor(table, dtype=torch.int64).reshape(-1, 3),
        torch.tensor(offsets, dtype=torch.int64),
    )


def page_of_row(seed: int) -> torch.Tensor:
    """A page index for each pool row (a permutation: page_sums index != row)."""
    return torch.randperm(POOL_ROWS, generator=torch.Generator().manual_seed(seed + 100))


def launch(
    case: Case,
    pairs: torch.Tensor,
    offsets: torch.Tensor,
    direction: Direction,
    *,
    pages: torch.Tensor | None,
    write: bool = True,
    num_programs: int | None = None,
    page_weights: torch.Tensor | None = None,
) -> list[int] | None:
    """One launch of the job; the page sums by pool row (uint64 ints) when ``pages``
    (keyed with ``page_weights``; the argument is passed only then)."""
    kernels = load_kernels("triton", case.device.type == "cuda")
    device = case.device
    page_sums = pair_pages = None
    if pages is not None:
        page_sums = torch.zeros(POOL_ROWS, dtype=torch.int64, device=device)
        pair_pages = pages[pairs[:, 1]].contiguous().to(device)
    keyed = {} if page_weights is None else {"page_weights": page_weights}
    kernels.launch_copy(
        case.tables,
        pairs.to(device),
        offsets.to(device),
        case.pool.data_ptr(),
        int(direction),
        num_programs=num_programs,
        page_sums=page_sums,
        pair_pages=pair_pages,
        write=write,
        **keyed,
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if page_sums is None or pages is None:
        return None
    by_page = [int(s) % U64 for s in page_sums.cpu().tolist()]  # the uint64 bits
    return [by_page[int(pages[r])] for r in range(POOL_ROWS)]


def check_copy(
    case: Case,
    before: list[torch.Tensor],
    expected: list[torch.Tensor],
    masks: list[torch.Tensor],
    direction: Direction,
) -> None:
    """Byte-exact: source unchanged, addressed destination equal, unaddressed unchanged."""
    now = case.snapshot()
    pool_side = direction == Direction.TO_POOL
    for index, (old, want, got, mask) in enumerate(zip(before, expected, now, masks, strict=True)):
        is_pool = index == len(now) - 1
        if is_pool != pool_side:
            assert torch.equal(got, old), f"source tensor {index} changed"
            continue
        assert torch.equal(got[mask], want[mask]), f"addressed bytes of {index} differ"
        assert torch.equal(got[~mask], old[~mask]), f"unaddressed bytes of {index} changed"
