"""The DMA path's descriptor build against vLLM's own pointer build, same job, same run.

A job of ``B`` GPU blocks of a 32-layer K/V cache (64 planes of 16 KiB pages) into pool
rows of 16 slots, ``B`` = 256 and 1,024, random blocks (so no run merges: one
descriptor per page on both sides, ``B x 64``):

- ``ours``: ``DmaCopier.prepare`` (writer split, the runs written into a reused
  descriptor set) and the set given back, without the driver call;
- ``vllm``: the descriptor part of vLLM's ``SingleDirectionOffloadingHandler.
  transfer_async`` for the same job: its size estimate, a pooled buffer set, and one
  ``_fill_direct_ops`` per group (per ref: ``compute_sub_block_ptrs`` on each side and
  the sizes), vLLM's own code imported from the installed release. vLLM 0.33 takes
  block ids on both sides; 0.34 resolves the GPU side first (``resolve_device_pointers``,
  counted in) and fills from those pointers. The handler's constructor asserts CUDA
  tensors, so it is made with ``object.__new__`` and the attributes its fill reads; the
  tensors are CPU tensors at the same addresses and strides as the job's (nothing is
  copied: both sides only compute addresses).

Before timing, both builds are checked to name the same pages (our runs cut back into
pages equal vLLM's descriptors as sets of (target, source, bytes)).

``test_descriptor_build_ratios`` alternates the four builds for ``ROUNDS`` rounds (load
from other processes hits them alike) and records, from the fastest runs (medians in
``_median``), ``ours_1024_over_256`` (goal <= 4.6: linear in blocks; 4.0 is exact
proportionality), ``vllm_1024_over_256``, and ``ours_over_vllm_256`` /
``ours_over_vllm_1024`` (goal <= 1), with the load average. Caches and pool are
``torch.empty`` and never touched.

Run: ``python -m pytest bench/suites/bench_descriptors.py --benchmark-enable -s``;
without ``--benchmark-enable`` each build runs a few rounds as a smoke test (the page
check included).
"""

from __future__ import annotations

import inspect
import os
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from triton_offload.transfer import batch_copy
from triton_offload.transfer.copiers import DmaCopier, JobHolds
from triton_offload.transfer.jobs import FROM_POOL, TO_POOL, JobSpec, pair_table
from triton_offload.transfer.layout import build_layout

LAYERS = 32  # x (K, V) = 64 planes
PAGE_BYTES = 16 << 10
BLOCKS_PER_CHUNK = 16
GPU_BLOCKS = 2048
JOB_BLOCKS = (256, 1024)
ROUNDS = 200
SMOKE_ROUNDS = 3


class Job(SimpleNamespace):
    """One job both ways: ``ours()`` and ``vllm()`` build its descriptors; ``pages_*``
    return them cut into (target, source, bytes) pages for the check."""


def _vllm_handler_fill() -> tuple[Any, bool]:
    """vLLM's worker module and whether its fill takes device pointers (0.34)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.v1.kv_offload.cpu import gpu_worker

    takes_pointers = (
        "device_ptrs"
        in inspect.signature(
            gpu_worker.SingleDirectionOffloadingHandler._fill_direct_ops
        ).parameters
    )
    return gpu_worker, takes_pointers


def make_job(blocks: int, direction: int, seed: int = 0) -> Job:
    rng = np.random.default_rng(seed)
    caches = [torch.empty(2, GPU_BLOCKS, PAGE_BYTES, dtype=torch.uint8) for _ in range(LAYERS)]
    layout = build_layout(
        [[(kv[0], kv[1]) for kv in caches]], num_groups=1, blocks_per_chunk=BLOCKS_PER_CHUNK
    )
    rows = blocks // BLOCKS_PER_CHUNK
    pool = torch.empty(rows, layout.row_bytes, dtype=torch.uint8)
    gpu = rng.permutation(GPU_BLOCKS)[:blocks].astype(np.int64)
    host = rng.permutation(rows).astype(np.int64)
    table = pair_table(layout, rows, JobSpec([gpu], [host]), direction)
    copier = DmaCopier(
        layout,
        pool.data_ptr(),
        int(pool.stride(0)),
        api=None,
        batch=batch_copy.stand_in(lambda *args: 0),
    )

    def ours() -> None:
        holds = JobHolds()
        copier.prepare(table, direction, None, holds, None)
        holds.release_after(None)

    def pages_ours() -> set[tuple[int, int, int]]:
        pages = set()
        for target, source, length in zip(
            *(a.tolist() for a in copier.descriptors(table, direction, None)), strict=True
        ):
            pages.update((target + k, source + k, PAGE_BYTES) for k in range(0, length, PAGE_BYTES))
        return pages

    vllm, pages_vllm, impl = _vllm_build(layout, pool, gpu, host, direction)
    return Job(
        ours=ours,
        vllm=vllm,
        pages_ours=pages_ours,
        pages_vllm=pages_vllm,
        impl=impl,
        descriptors=blocks * 2 * LAYERS,
    )


def _vllm_build(
    layout: Any, pool: torch.Tensor, gpu: np.ndarray, host: np.ndarray, direction: int
) -> tuple[Callable[[], None], Callable[[], set[tuple[int, int, int]]], str]:
    gpu_worker, takes_pointers = _vllm_handler_fill()
    store = direction == TO_POOL
    # vLLM's tensors: one int8 [blocks, page] GPU tensor and one [chunks, bpc x page] CPU
    # tensor per plane (ref); the CPU one is this pool's slots of that plane, rows apart.
    gpu_tensors = [plane.view.view(torch.int8) for plane in layout.planes]
    cpu_tensors = [
        pool.view(torch.int8).as_strided(
            (pool.size(0), BLOCKS_PER_CHUNK * plane.page_bytes),
            (pool.stride(0), 1),
            plane.pool_offset,
        )
        for plane in layout.planes
    ]
    refs = [
        [
            SimpleNamespace(tensor_idx=i, page_size_bytes=plane.page_bytes)
            for i, plane in enumerate(layout.planes)
        ]
    ]
    handler = object.__new__(gpu_worker.SingleDirectionOffloadingHandler)
    handler.gpu_to_cpu = store
    handler.layer_refs_per_group = refs
    handler._canonical_copy_plans = None
    handler._buffer_pool = []
    group_sizes, block_indices = [gpu.size], [0]
    if takes_pointers:
        from vllm.v1.kv_offload.pointer_utils import iter_pointer_groups, resolve_device_pointers

        handler.blocks_per_chunk = BLOCKS_PER_CHUNK
        handler.cpu_tensors = cpu_tensors
        kv_caches = SimpleNamespace(
            tensors=[SimpleNamespace(tensor=t) for t in gpu_tensors], group_data_refs=refs
        )
        gpu_spec = SimpleNamespace(
            block_ids=gpu, group_sizes=group_sizes, block_indices=block_indices
        )
        impl = "vllm 0.34: resolve_device_pointers + _fill_direct_ops (imported)"
    else:
        handler.src_tensors, handler.dst_tensors = (
            (gpu_tensors, cpu_tensors) if store else (cpu_tensors, gpu_tensors)
        )
        handler.src_blocks_per_chunk = 1 if store else BLOCKS_PER_CHUNK
        handler.dst_blocks_per_chunk = BLOCKS_PER_CHUNK if store else 1
        src_blocks, dst_blocks = (gpu, host) if store else (host, gpu)
        impl = "vllm 0.33: _fill_direct_ops (imported)"
    result: list[np.ndarray] = []

    def build() -> None:
        # transfer_async's descriptor part (pinned buffers need CUDA: plain ones here).
        if takes_pointers:
            device_ptrs = resolve_device_pointers(gpu_spec, kv_caches)
            count = handler._estimate_max_copy_ops(device_ptrs.group_block_counts)
        else:
            count = handler._estimate_max_copy_ops(group_sizes)
        buffers = handler._buffer_pool.pop() if handler._buffer_pool else None
        if buffers is None or buffers[0].numel() < count:
            buffers = tuple(torch.empty(count, dtype=torch.int64) for _ in range(3))
        src, dst, sizes = (b[:count].numpy() for b in buffers)
        op = 0
        if takes_pointers:
            cpu_offset = 0
            for group in iter_pointer_groups(device_ptrs, BLOCKS_PER_CHUNK):
                end = cpu_offset + group.n_chunks
                op, _ = handler._fill_direct_ops(
                    group.group_idx,
                    device_ptrs=device_ptrs,
                    dev_ptr_offset=group.dev_ptr_offset,
                    cpu_block_ids=host[cpu_offset:end],
                    group_size=group.group_size,
                    cpu_skip_count=group.skip,
                    all_src=src,
                    all_dst=dst,
                    all_sizes=sizes,
                    op_idx=op,
                )
                cpu_offset = end
        else:
            op, _ = handler._fill_direct_ops(
                0,
                group_src=src_blocks,
                group_dst=dst_blocks,
                group_size=gpu.size,
                src_skip_count=0,
                dst_skip_count=0,
                all_src=src,
                all_dst=dst,
                all_sizes=sizes,
                op_idx=0,
            )
        result[:] = [src[:op], dst[:op], sizes[:op]]
        handler._buffer_pool.append(buffers)

    def pages() -> set[tuple[int, int, int]]:
        build()
        src, dst, sizes = (a.tolist() for a in result)
        return set(zip(dst, src, sizes, strict=True))

    return build, pages, impl


def _load() -> str:
    return " / ".join(f"{v:.2f}" for v in os.getloadavg())


@pytest.mark.parametrize("direction", [TO_POOL, FROM_POOL], ids=["store", "load"])
def test_descriptor_build_ratios(benchmark: Any, direction: int) -> None:
    jobs = {blocks: make_job(blocks, direction) for blocks in JOB_BLOCKS}
    for job in jobs.values():  # the same pages both ways
        assert job.pages_ours() == job.pages_vllm()
    small, large = (jobs[b] for b in JOB_BLOCKS)
    builds = {
        "ours_256": small.ours,
        "ours_1024": large.ours,
        "vllm_256": small.vllm,
        "vllm_1024": large.vllm,
    }
    times: dict[str, list[float]] = {name: [] for name in builds}
    for build in builds.values():  # warm: the reused sets reach their size
        build()
    for _ in range(SMOKE_ROUNDS if benchmark.disabled else ROUNDS):
        for name, build in builds.items():
            start = time.perf_counter()
            build()
            times[name].append(time.perf_counter() - start)
    fast = {name: min(t) for name, t in times.items()}
    median = {name: statistics.median(t) for name, t in times.items()}
    name = "store" if direction == TO_POOL else "load"
    benchmark.group = f"descriptor build, {LAYERS * 2} planes: {name}"
    benchmark(large.ours)
    ratios = {
        "ours_1024_over_256": fast["ours_1024"] / fast["ours_256"],
        "vllm_1024_over_256": fast["vllm_1024"] / fast["vllm_256"],
        "ours_over_vllm_256": fast["ours_256"] / fast["vllm_256"],
        "ours_over_vllm_1024": fast["ours_1024"] / fast["vllm_1024"],
    }
    ratios_median = {
        "ours_1024_over_256": median["ours_1024"] / median["ours_256"],
        "vllm_1024_over_256": median["vllm_1024"] / median["vllm_256"],
        "ours_over_vllm_256": median["ours_256"] / median["vllm_256"],
        "ours_over_vllm_1024": median["ours_1024"] / median["vllm_1024"],
    }
    benchmark.extra_info.update(
        {f"{k}_us": round(v * 1e6, 1) for k, v in fast.items()},
        **{k: round(v, 3) for k, v in ratios.items()},
        **{f"{k}_median": round(v, 3) for k, v in ratios_median.items()},
        descriptors_1024=large.descriptors,
        vllm=large.impl,
        load=_load(),
    )
    print(
        f"\n{name}, 64 planes ({large.impl}; load {_load()}):\n"
        + "".join(
            f"  {k:<10} {fast[k] * 1e6:8.1f} us (median {median[k] * 1e6:8.1f})\n" for k in fast
        )
        + "".join(
            f"  {k:<20} {v:6.2f} (medians {ratios_median[k]:6.2f})\n" for k, v in ratios.items()
        )
    )
