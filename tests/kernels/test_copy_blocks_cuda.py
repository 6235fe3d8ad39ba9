"""The compiled copy kernel on a real GPU: pinned host pool, side stream, misaligned pools.

Skipped (with a reason, by the root conftest) without CUDA. Expected results come from the
torch reference run on CPU copies, compared byte-exactly.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from triton_offload.kernels.copy_blocks import (
    PCIE_IN_FLIGHT_TARGET_BYTES,
    TILE_BYTES,
    default_num_programs,
    launch_copy,
)

from triton_offload.transfer.copiers import copy_blocks, kernel_tables
from triton_offload.transfer.jobs import Direction
from triton_offload.transfer.layout import CacheLayout, Plane
from triton_offload.transfer.reference import byte_plane, reference_copy

pytestmark = pytest.mark.cuda


def device_pointer(host: torch.Tensor) -> int:
    """Device-visible address of pinned host memory (cuMemHostGetDevicePointer)."""
    driver = ctypes.CDLL("libcuda.so.1")
    pointer = ctypes.c_uint64()
    status = driver.cuMemHostGetDevicePointer_v2(
        ctypes.byref(pointer), ctypes.c_void_p(host.data_ptr()), 0
    )
    assert status == 0, f"cuMemHostGetDevicePointer failed with {status}"
    return pointer.value


def make_cache(
    pages: list[tuple[int, int, torch.dtype]], num_blocks: int, blocks_per_chunk: int
) -> tuple[list[torch.Tensor], list[Plane], int]:
    """One CUDA tensor per plane ``(group, page_bytes, dtype)``; returns row bytes too."""
    tensors, planes, used = [], [], {}
    generator = torch.Generator().manual_seed(0)
    for group, page, dtype in pages:
        element = torch.empty((), dtype=dtype).element_size()
        data = torch.randint(
            0, 256, (num_blocks, page + 16), dtype=torch.uint8, generator=generator
        )
        tensor = data.cuda().view(dtype)[:, : page // element]
        tensors.append(tensor)
        offset = used.get(group, 0)
        planes.append(Plane.of_view(byte_plane(tensor), group=group, pool_offset=offset))
        used[group] = offset + blocks_per_chunk * page
    return tensors, planes, max(used.values())


def pairs_for(
    num_groups: int, count: int, num_blocks: int, blocks_per_chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    rows, offsets = [], [0]
    rows_per_group = -(-count // blocks_per_chunk)
    for group in range(num_groups):
        blocks = torch.randperm(num_blocks, generator=generator)[:count]
        pages = torch.randperm(rows_per_group * blocks_per_chunk, generator=generator)[:count]
        for block, page in zip(blocks.tolist(), pages.tolist(), strict=True):
            row = group * rows_per_group + page // blocks_per_chunk
            rows.append((block, row, page % blocks_per_chunk))
        offsets.append(len(rows))
    return torch.tensor(rows), torch.tensor(offsets)


PAGES = [
    (0, 4096, torch.bfloat16),
    (0, 4096, torch.bfloat16),
    (1, 1536, torch.float32),
    (1, 65536, torch.float32),
    (2, 1000, torch.float8_e4m3fn),
]


@pytest.mark.parametrize("pool_shift", [0, 3, 8])
@pytest.mark.parametrize("pool_kind", ["pinned", "device"])
def test_store_then_load_through_the_pool(pool_kind: str, pool_shift: int) -> None:
    num_blocks, bpc, count = 64, 3, 20
    tensors, planes, row_bytes = make_cache(PAGES, num_blocks, bpc)
    rows = 3 * -(-count // bpc)
    layout = CacheLayout.from_planes(
        planes, num_groups=3, blocks_per_chunk=bpc, row_bytes=row_bytes, device="cuda"
    )
    tables = kernel_tables(layout, row_bytes, TILE_BYTES, torch.device("cuda"))
    pairs, offsets = pairs_for(3, count, num_blocks, bpc)
    # The pool is a slice of a larger buffer: shifts 3 and 8 take the byte / 8-byte paths.
    size = rows * row_bytes
    if pool_kind == "pinned":
        buffer = torch.empty(size + 64, dtype=torch.uint8, pin_memory=True)
    else:
        buffer = torch.empty(size + 64, dtype=torch.uint8, device="cuda")
    buffer.fill_(0xA5)
    pool = buffer[pool_shift : pool_shift + size].view(rows, row_bytes)
    views_cpu = [byte_plane(t.cpu()) for t in tensors]
    expected_pool = pool.cpu().clone()
    reference_copy(views_cpu, layout, pairs, offsets, expected_pool, Direction.TO_POOL)
    cache_before = [t.clone() for t in tensors]

    stream = torch.cuda.Stream()
    table, group_offsets = pairs.cuda(), offsets.cuda()
    address = device_pointer(buffer) + pool_shift if pool_kind == "pinned" else pool.data_ptr()
    with torch.cuda.stream(stream):
        launch_copy(tables, table, group_offsets, address, Direction.TO_POOL)
    stream.synchronize()
    assert torch.equal(pool.cpu(), expected_pool)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(tensors, cache_before, strict=True)
    )
    assert bool((buffer[:pool_shift].cpu() == 0xA5).all())
    assert bool((buffer[pool_shift + size :].cpu() == 0xA5).all())

    # Load back into poisoned caches.
    whole_blocks = []
    for t in tensors:
        block_bytes = t.stride(0) * t.element_size()
        whole = byte_plane(t).as_strided((num_blocks, block_bytes), (block_bytes, 1))
        whole.fill_(0x3C)  # the page and the 16 spare bytes after it
        whole_blocks.append(whole)
    expected_cache = [v.clone() for v in (byte_plane(t.cpu()) for t in tensors)]
    reference_copy(expected_cache, layout, pairs, offsets, expected_pool, Direction.FROM_POOL)
    with torch.cuda.stream(stream):
        launch_copy(tables, table, group_offsets, address, Direction.FROM_POOL)
    stream.synchronize()
    for tensor, whole, want in zip(tensors, whole_blocks, expected_cache, strict=True):
        assert torch.equal(byte_plane(tensor).cpu(), want)
        # The 16 spare bytes after each page are never written.
        assert bool((whole[:, want.shape[1] :].cpu() == 0x3C).all())


def test_copy_blocks_device_to_device_many_layers() -> None:
    # 32 layers x (K, V) of 8 KiB pages (Llama-8B at TP=4) in one group.
    num_blocks, bpc = 128, 1
    pages = [(0, 8192, torch.bfloat16)] * 64
    tensors, planes, row_bytes = make_cache(pages, num_blocks, bpc)
    layout = CacheLayout.from_planes(
        planes, num_groups=1, blocks_per_chunk=bpc, row_bytes=row_bytes, device="cuda"
    )
    pool = torch.full((48, row_bytes), 7, dtype=torch.uint8, device="cuda")
    pairs, offsets = pairs_for(1, 48, num_blocks, bpc)
    expected = pool.cpu()
    reference_copy([byte_plane(t.cpu()) for t in tensors], layout, pairs, offsets, expected, 0)
    copy_blocks(layout, pairs.cuda(), offsets.cuda(), pool, Direction.TO_POOL)
    torch.cuda.synchronize()
    assert torch.equal(pool.cpu(), expected)


def test_default_grid_on_cuda() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    full_tiles = PCIE_IN_FLIGHT_TARGET_BYTES // TILE_BYTES
    assert default_num_programs(torch.device("cuda")) == min(2 * sms, full_tiles)
    # Smaller items: more programs to keep the same bytes in flight, at most two per SM.
    assert default_num_programs("cuda", TILE_BYTES // 2) == min(2 * sms, 2 * full_tiles)
    assert default_num_programs("cuda", 1) == 2 * sms


def test_warm_up_compiles_the_kernel_real_jobs_run() -> None:
    # A job's pair table is often a slice: rows from `skip` on are 16-byte aligned only for
    # even skips. After warm_up, jobs at every skip, both directions, must find the kernel
    # warm_up compiled: none may compile another (~1 s mid-serving).
    from triton_offload.kernels import copy_blocks as module

    num_blocks, bpc, count = 64, 3, 20
    tensors, planes, row_bytes = make_cache(PAGES, num_blocks, bpc)
    rows = 3 * -(-count // bpc)
    layout = CacheLayout.from_planes(
        planes, num_groups=3, blocks_per_chunk=bpc, row_bytes=row_bytes, device="cuda"
    )
    tables = kernel_tables(layout, row_bytes, TILE_BYTES, torch.device("cuda"))
    pairs, offsets = pairs_for(3, count, num_blocks, bpc)
    expected = torch.zeros((rows, row_bytes), dtype=torch.uint8)
    reference_copy([byte_plane(t.cpu()) for t in tensors], layout, pairs, offsets, expected, 0)
    cache = module._copy_blocks_kernel.device_caches[torch.cuda.current_device()][0]
    cache.clear()  # kernels compiled by earlier tests of this process
    module.warm_up(torch.device("cuda"))
    torch.cuda.synchronize()
    assert len(cache) == 1
    for skip in (0, 1, 2, 3):
        table = torch.zeros((skip + pairs.shape[0], 3), dtype=torch.int64, device="cuda")
        table[skip:] = pairs.cuda()
        starts = torch.zeros(skip + offsets.shape[0], dtype=torch.int64, device="cuda")
        starts[skip:] = offsets.cuda()
        pool = torch.zeros((rows, row_bytes), dtype=torch.uint8, device="cuda")
        launch_copy(tables, table[skip:], starts[skip:], pool.data_ptr(), Direction.TO_POOL)
        launch_copy(tables, table[skip:], starts[skip:], pool.data_ptr(), Direction.FROM_POOL)
        torch.cuda.synchronize()
        assert torch.equal(pool.cpu(), expected)
    assert len(cache) == 1


@pytest.mark.parametrize("tile", [4096, 8192, 16384])
def test_every_grid_sweep_tile_is_byte_exact_on_the_device(tile: int) -> None:
    """The grid sweep's point at each tile size it offers: tables cut at ``tile`` and
    launches compiled for it, store and load checked over the whole pool against random
    cache bytes (pages over 16 KiB, 16-byte and odd)."""
    from triton_offload.bench import grid_sweep
    from triton_offload.bench.paths import build_workspace

    from tests.helpers.grid_case import CASE

    assert tile in grid_sweep.TILE_SIZES
    ws = build_workspace(CASE, torch.device("cuda"), seed=3)
    engine = grid_sweep.make_engine(ws, tile, num_programs=7)
    try:
        assert engine.copiers["triton"].tables.tile_bytes == tile
        assert grid_sweep.point_problem(ws, engine, seed=tile) is None
    finally:
        engine.shutdown()
