"""Randomized differential test: random hybrid layouts, random store/load jobs, every byte.

Each round builds a random set of cache groups (plain tensors, K/V halves of one
``(2, blocks, ...)`` tensor, K/V interleaved in ``(blocks, 2, ...)``, padded block
strides, odd page sizes, several dtypes, groups aliasing an earlier group's memory,
groups with no layers), a random ``blocks_per_chunk`` and pool size, then runs random
stores and loads (partial first chunks, repeated source blocks, unused trailing host
rows, groups with no blocks) through ``TransferEngine`` on both CPU backends, the
torch path also with its multi-threaded copy forced. After every job the whole cache
memory and the whole pool are compared with ``torch.equal`` against a model kept
here in plain numpy.

The model is written from the rules, not from the engine, ``layout.py`` or
``reference.py``:

- a plane is ``(storage, byte offset of block 0, block stride, page bytes)``, known
  from how this file cut it out of its storage (not from the tensor's strides);
- inside a pool row of group ``g``, the planes of ``g`` follow in layer order (tuple
  order inside a layer); each starts at the next multiple of 16 bytes after the one
  before and owns ``blocks_per_chunk`` consecutive pages; the row length is the
  largest group's, rounded up to 16;
- the k-th GPU block of group ``g`` in a job sits at position ``p = (s_g mod bpc) + k``:
  host row ``H_g[p // bpc]``, slot ``p mod bpc``.

CI runs a few seconds per backend; ``TRITON_OFFLOAD_FUZZ_SECONDS=600`` runs longer (the
seed of a failing round is in the assertion message; ``TRITON_OFFLOAD_FUZZ_SEED`` picks
the first seed).
"""

from __future__ import annotations

import itertools
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from triton_offload import GroupSpec, plan_offload
from triton_offload.transfer import cpu_copy
from triton_offload.transfer.engine import TransferEngine

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FUZZ_SECONDS = float(os.environ.get("TRITON_OFFLOAD_FUZZ_SECONDS", "2"))
FIRST_SEED = int(os.environ.get("TRITON_OFFLOAD_FUZZ_SEED", "0"))
DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64)


@dataclass
class ModelPlane:
    storage: int  # index into Layout.storages
    offset: int  # bytes from the storage start to block 0
    stride: int  # bytes between blocks
    page: int  # bytes copied per block


@dataclass
class Layout:
    storages: list[torch.Tensor]
    caches: list[list[object]]  # what the engine is given
    planes: list[list[ModelPlane]]  # per group, in pool order
    num_blocks: list[int]  # per group (for a group without layers: ids to draw from)
    # Plain tensors a later group may alias: storage index -> page bytes.
    plain: dict[int, int] = field(default_factory=dict)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())


def _random_storage(rng: random.Random, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of a random dtype filled with random bytes (NaN patterns included)."""
    tensor = torch.empty(shape, dtype=rng.choice(DTYPES))
    raw = _raw(tensor)
    noise = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, raw.numel(), np.uint8)
    raw.copy_(torch.from_numpy(noise))
    return tensor


def _inner(rng: random.Random) -> tuple[int, ...]:
    """A small per-block shape; products are often odd (odd page sizes)."""
    return tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))


def _layer(rng: random.Random, layout: Layout, num_blocks: int) -> object:
    """One layer: a tensor (one plane) or a tuple of tensors, with its model planes."""
    kind = rng.choice(("plain", "kv", "kv_interleaved", "padded", "pair"))
    add = layout.storages.append

    def plane(storage: torch.Tensor, offset_elems: int, stride_elems: int, page_elems: int):
        size = storage.element_size()
        return ModelPlane(
            len(layout.storages) - 1, offset_elems * size, stride_elems * size, page_elems * size
        )

    inner = _inner(rng)
    page = int(np.prod(inner))
    if kind == "plain":
        storage = _random_storage(rng, (num_blocks, *inner))
        add(storage)
        layout.plain[len(layout.storages) - 1] = page * storage.element_size()
        return storage, [plane(storage, 0, page, page)]
    if kind == "kv":
        storage = _random_storage(rng, (2, num_blocks, *inner))
        add(storage)
        return (storage[0], storage[1]), [
            plane(storage, 0, page, page),
            plane(storage, num_blocks * page, page, page),
        ]
    if kind == "kv_interleaved":
        storage = _random_storage(rng, (num_blocks, 2, *inner))
        add(storage)
        return (storage[:, 0], storage[:, 1]), [
            plane(storage, 0, 2 * page, page),
            plane(storage, page, 2 * page, page),
        ]
    if kind == "padded":
        lead, tail = rng.randint(0, 4), rng.randint(0, 4)
        storage = _random_storage(rng, (num_blocks, lead + page + tail))
        add(storage)
        view = storage[:, lead : lead + page].unflatten(1, inner)
        return view, [plane(storage, lead, lead + page + tail, page)]
    # Two states of different sizes in separate tensors (a Mamba layer: conv, ssm).
    first = _random_storage(rng, (num_blocks, *inner))
    add(first)
    first_plane = plane(first, 0, page, page)
    inner2 = _inner(rng)
    page2 = int(np.prod(inner2))
    second = _random_storage(rng, (num_blocks, *inner2))
    add(second)
    return (first, second), [first_plane, plane(second, 0, page2, page2)]


def _alias_layer(rng: random.Random, layout: Layout) -> tuple[torch.Tensor, ModelPlane, int] | None:
    """A view of an earlier group's plain tensor, as a hybrid allocator shares memory:
    the same blocks, shifted by whole blocks (``x[k:]``), or cut into blocks of half or
    twice the size. Returns (view, its model plane, its block count)."""
    if not layout.plain:
        return None
    index = rng.choice(sorted(layout.plain))
    raw = _raw(layout.storages[index])
    page = layout.plain[index]
    blocks = raw.numel() // page
    grid = raw.view(blocks, page)
    choices = ["same", "shifted"] if blocks > 1 else ["same"]
    if page % 2 == 0:
        choices.append("halves")
    if blocks % 2 == 0:
        choices.append("doubles")
    kind = rng.choice(choices)
    if kind == "same":
        return grid, ModelPlane(index, 0, page, page), blocks
    if kind == "shifted":
        shift = rng.randint(1, blocks - 1)
        return grid[shift:], ModelPlane(index, shift * page, page, page), blocks - shift
    if kind == "halves":
        half = page // 2
        return raw.view(2 * blocks, half), ModelPlane(index, 0, half, half), 2 * blocks
    return raw.view(blocks // 2, 2 * page), ModelPlane(index, 0, 2 * page, 2 * page), blocks // 2


def random_layout(rng: random.Random, num_groups: int) -> Layout:
    """Random groups; some alias earlier groups' memory, some hold no layer (a pipeline
    stage without that group's layers), at least one holds layers."""
    layout = Layout(storages=[], caches=[], planes=[], num_blocks=[])
    empty = [rng.random() < 0.15 for _ in range(num_groups)]
    if all(empty):
        empty[rng.randrange(num_groups)] = False
    for group in range(num_groups):
        layers: list[object] = []
        planes: list[ModelPlane] = []
        num_blocks = rng.randint(1, 10)
        if empty[group]:
            num_blocks = rng.randint(1, 20)  # ids of blocks that live on other stages
        else:
            alias = _alias_layer(rng, layout) if group and rng.random() < 0.4 else None
            if alias is not None:
                view, alias_plane, num_blocks = alias
                layers.append(view)
                planes.append(alias_plane)
            for _ in range(rng.randint(0 if layers else 1, 2)):
                layer, layer_planes = _layer(rng, layout, num_blocks)
                layers.append(layer)
                planes += layer_planes
        layout.caches.append(layers)
        layout.planes.append(planes)
        layout.num_blocks.append(num_blocks)
    return layout


def _round16(value: int) -> int:
    return -(-value // 16) * 16


def pool_geometry(layout: Layout, bpc: int) -> tuple[list[list[int]], int]:
    """(per group, each plane's byte offset in a pool row; the row length)."""
    offsets, ends = [], []
    for planes in layout.planes:
        at, group_offsets = 0, []
        for plane in planes:
            at = _round16(at)
            group_offsets.append(at)
            at += bpc * plane.page
        offsets.append(group_offsets)
        ends.append(at)
    return offsets, _round16(max(ends))


class Model:
    """The expected bytes of every storage and of the pool."""

    def __init__(self, layout: Layout, pool: torch.Tensor, bpc: int) -> None:
        self.layout = layout
        self.bpc = bpc
        self.storages = [_raw(t).numpy().copy() for t in layout.storages]
        self.pool = pool.numpy().copy()
        self.offsets, self.row_bytes = pool_geometry(layout, bpc)

    def place(self, group: int, k: int, first: int, hosts: list[int]) -> tuple[int, int]:
        position = first % self.bpc + k
        return hosts[position // self.bpc], position % self.bpc

    def store(self, blocks: list[list[int]], hosts: list[list[int]], first: list[int]) -> None:
        for group, group_blocks in enumerate(blocks):
            for k, block in enumerate(group_blocks):
                row, slot = self.place(group, k, first[group], hosts[group])
                for plane, offset in zip(
                    self.layout.planes[group], self.offsets[group], strict=True
                ):
                    src = self.storages[plane.storage]
                    start = plane.offset + block * plane.stride
                    at = offset + slot * plane.page
                    self.pool[row, at : at + plane.page] = src[start : start + plane.page]

    def load(self, hosts: list[list[int]], blocks: list[list[int]], first: list[int]) -> None:
        for group, group_blocks in enumerate(blocks):
            for k, block in enumerate(group_blocks):
                row, slot = self.place(group, k, first[group], hosts[group])
                for plane, offset in zip(
                    self.layout.planes[group], self.offsets[group], strict=True
                ):
                    dst = self.storages[plane.storage]
                    start = plane.offset + block * plane.stride
                    at = offset + slot * plane.page
                    dst[start : start + plane.page] = self.pool[row, at : at + plane.page]

    def load_overlaps(self, blocks: list[list[int]]) -> bool:
        """Whether two pages a load writes share a byte (groups may alias memory)."""
        pages = sorted(
            (plane.storage, plane.offset + block * plane.stride, plane.page)
            for group_blocks, planes in zip(blocks, self.layout.planes, strict=True)
            for plane in planes
            for block in group_blocks
        )
        return any(a[0] == b[0] and b[1] < a[1] + a[2] for a, b in itertools.pairwise(pages))

    def job_bytes(self, blocks: list[list[int]]) -> int:
        return sum(
            len(b) * sum(p.page for p in planes)
            for b, planes in zip(blocks, self.layout.planes, strict=True)
        )

    def check(self, engine: TransferEngine, where: str) -> None:
        for index, (tensor, expected) in enumerate(
            zip(self.layout.storages, self.storages, strict=True)
        ):
            actual = _raw(tensor)
            if not torch.equal(actual, torch.from_numpy(expected)):
                bad = np.flatnonzero(actual.numpy() != expected)
                raise AssertionError(f"{where}: storage {index} differs at bytes {bad[:8]}")
        if not torch.equal(engine.pool, torch.from_numpy(self.pool)):
            rows, cols = np.nonzero(engine.pool.numpy() != self.pool)
            raise AssertionError(
                f"{where}: pool differs at (row, byte) {list(zip(rows[:8], cols[:8], strict=True))}"
            )


def random_job(
    rng: random.Random, layout: Layout, bpc: int, num_rows: int, store: bool
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """GPU blocks, host rows and first indices of a random job the engine must accept.

    Stores: host rows are distinct across the whole job (one row holds one chunk of one
    group, and every group's row starts at byte 0), GPU blocks may repeat (a source
    read twice). Loads: GPU blocks distinct per group (destinations), host rows may
    repeat. Sometimes a group moves nothing, sometimes one unused host row trails.
    """
    free_rows = list(range(num_rows))
    rng.shuffle(free_rows)
    blocks, hosts, first = [], [], []
    for num_blocks in layout.num_blocks:
        start = rng.randrange(3 * bpc)
        count = 0 if rng.random() < 0.2 else rng.randint(1, num_blocks)
        needed = -(-(start % bpc + count) // bpc) if count else 0
        if store and needed > len(free_rows):
            count, needed = 0, 0
        if store:
            if rng.random() < 0.3:
                group_blocks = [rng.randrange(num_blocks) for _ in range(count)]
            else:
                group_blocks = rng.sample(range(num_blocks), count)
            extra = int(rng.random() < 0.3 and len(free_rows) > needed)
            group_hosts = [free_rows.pop() for _ in range(needed + extra)]
        else:
            group_blocks = rng.sample(range(num_blocks), count)
            group_hosts = [rng.randrange(num_rows) for _ in range(needed + rng.randint(0, 1))]
        blocks.append(group_blocks)
        hosts.append(group_hosts)
        first.append(start)
    return blocks, hosts, first


def _run_round(seed: int, backend: str) -> tuple[int, int]:
    rng = random.Random(seed)
    num_groups = rng.randint(1, 3)
    layout = random_layout(rng, num_groups)
    bpc = rng.randint(1, 3)
    num_rows = rng.randint(1, 12)
    kinds = [GroupSpec("full_attention", 16) for _ in range(num_groups)]
    plan = plan_offload(kinds, blocks_per_chunk=bpc)
    engine = TransferEngine(plan, layout.caches, num_rows, backend=backend)
    poison = np.random.default_rng(seed).integers(0, 256, tuple(engine.pool.shape), np.uint8)
    engine.pool.copy_(torch.from_numpy(poison))
    model = Model(layout, engine.pool, bpc)
    assert tuple(engine.pool.shape) == (num_rows, model.row_bytes), seed
    jobs = refused = 0
    for step in range(rng.randint(2, 8)):
        store = rng.random() < 0.5
        blocks, hosts, first = random_job(rng, layout, bpc, num_rows, store)
        job_id = (seed, step)
        where = f"seed {seed} step {step} ({'store' if store else 'load'})"
        if store:
            accepted = engine.submit_store(
                job_id, gpu_blocks=blocks, host_blocks=hosts, first_block_index=first
            )
            model.store(blocks, hosts, first)
        elif model.load_overlaps(blocks):
            # Two groups' destination pages share bytes: refused before any byte moves.
            with pytest.raises(ValueError, match=r"same bytes|share those bytes"):
                engine.submit_load(
                    job_id, host_blocks=hosts, gpu_blocks=blocks, first_block_index=first
                )
            assert engine.get_finished() == [], where
            model.check(engine, where)
            refused += 1
            continue
        else:
            accepted = engine.submit_load(
                job_id, host_blocks=hosts, gpu_blocks=blocks, first_block_index=first
            )
            model.load(hosts, blocks, first)
        assert accepted, (seed, step)
        engine.wait([job_id])
        results = engine.get_finished()
        assert [r.job_id for r in results] == [job_id], (seed, step, results)
        assert results[0].success, (seed, step)
        assert results[0].transfer_size == model.job_bytes(blocks), (seed, step)
        model.check(engine, where)
        jobs += 1
    engine.shutdown()
    return jobs, refused


BACKENDS = [
    "torch",
    "torch-threads",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1"),
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_layouts_match_an_independent_model(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "torch-threads":
        # The CPU path's multi-threaded copy, which real jobs take only from 4 MiB on:
        # every job here is split over three threads (small jobs included: they would
        # otherwise take the one-thread path for a few pages).
        monkeypatch.setattr(cpu_copy, "SMALL_JOB_PAGES", 0)
        monkeypatch.setattr(cpu_copy, "PARALLEL_MIN_JOB_BYTES", 0)
        monkeypatch.setattr(cpu_copy, "PARALLEL_MIN_RUN_BYTES", 0)
        monkeypatch.setattr(cpu_copy, "copy_threads", lambda: 3)
        backend = "torch"
    deadline = time.monotonic() + FUZZ_SECONDS
    seed = FIRST_SEED
    rounds = jobs = refused = 0
    # At least a few rounds however slow the machine; then until the time is up.
    while rounds < 3 or time.monotonic() < deadline:
        done, refusals = _run_round(seed, backend)
        jobs, refused = jobs + done, refused + refusals
        seed += 1
        rounds += 1
    assert jobs >= rounds
