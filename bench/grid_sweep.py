"""Launch-grid sweep: ``num_programs`` x tile size on the hybrid presets, and the per-plane
against the per-job path choice; prints the grid the measurement would pick.

The default grid (``kernels.copy_blocks.grid_size``) is an estimate from the bytes PCIe
needs in flight; this is the measurement meant to replace it. Every point is a real job
of the preset through the engine (its tables, staging and events), store and load,
median of ``--repeats``; GB/s are job bytes over the engine's own device time.

    python -m triton_offload.bench.grid_sweep --out DIR [--quick] [--max-seconds S]

Without CUDA the kernel runs interpreted on a one-layer case: the sweep then only checks
that every point runs and copies (``--quick``; no GB/s are claimed), and the per-plane
comparison, which needs the copy engines, is reported as not run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from triton_offload.bench import cases
from triton_offload.bench.paths import build_workspace, plan_for

from triton_offload.transfer.jobs import FROM_POOL, TO_POOL

HYBRID_PRESETS = ("mamba-hybrid", "swa-hybrid")
#: Tile sizes tried (bytes per item); the tables are cut with each.
TILE_SIZES = (4096, 8192, 16384)
QUICK_TILE_SIZES = (4096, 8192)


def _small(group: cases.GroupShape, cuda: bool) -> cases.GroupShape:
    if cuda:
        return replace(group, layers=1)
    pages = tuple(min(p, 1024) for p in group.plane_bytes)
    return replace(group, layers=1, blocks_per_job=2, plane_bytes=pages)


def _programs(sm_count: int) -> list[int]:
    """16 .. 4 x SMs: below, at and above one program per SM."""
    return sorted({16, 32, 64, sm_count // 2, sm_count, 2 * sm_count, 4 * sm_count})


def _engine(case: cases.Case, device: torch.device, **options: Any) -> tuple[Any, Any]:
    from triton_offload.transfer.engine import TransferEngine

    ws = build_workspace(case, device, seed=3)
    engine = TransferEngine(plan_for(case), ws.caches, ws.num_host_blocks, **options)
    return ws, engine


def _time_jobs(engine: Any, spec: Any, repeats: int) -> dict[str, float]:
    """Median seconds per direction of ``repeats`` jobs (after one warm-up job each)."""
    seconds: dict[str, list[float]] = {"store": [], "load": []}
    for direction, name in ((TO_POOL, "store"), (FROM_POOL, "load")):
        for repeat in range(repeats + 1):
            result = engine._run_now(
                spec,
                direction,
                engine.policy.assign(direction, [blocks.size for blocks in spec.gpu_blocks]),
            )
            if repeat:
                seconds[name].append(result.transfer_time)
    return {name: statistics.median(values) for name, values in seconds.items()}


def _store_is_exact(ws: Any, engine: Any) -> bool:
    from triton_offload.bench.paths import POISON

    engine.pool.fill_(POISON)
    engine._run_now(ws.spec, TO_POOL, engine.policy.assign(TO_POOL, [1] * engine.num_groups))
    return bool(torch.equal(engine.pool.cpu(), ws.expected_pool(engine.row_bytes)))


def sweep_grid(
    case: cases.Case,
    device: torch.device,
    programs: list[int],
    tiles: tuple[int, ...],
    repeats: int,
    deadline: float,
) -> list[dict[str, Any]]:
    """One row per (num_programs, tile bytes): store/load seconds and GB/s."""
    from triton_offload.kernels import copy_blocks

    from triton_offload.transfer.copiers import TritonCopier

    ws, engine = _engine(case, device, backend="triton")
    rows = []
    default_tile = copy_blocks.TILE_BYTES
    try:
        for tile in tiles:
            # The launcher reads TILE_BYTES at each launch; the copier cuts its tables
            # with the same value, so both sides of the contract agree.
            copy_blocks.TILE_BYTES = tile
            for count in programs:
                if time.monotonic() > deadline:
                    return rows
                engine.copiers["triton"] = TritonCopier(
                    engine.layout,
                    engine.pool_address,
                    engine.row_stride,
                    device=engine.device,
                    cuda=engine.cuda,
                    num_programs=count,
                )
                times = _time_jobs(engine, ws.spec, repeats)
                # Every point must copy right, not only fast (on a GPU once per tile size:
                # the check reads the whole pool).
                first_of_tile = count == programs[0]
                exact = _store_is_exact(ws, engine) if first_of_tile or not engine.cuda else None
                if exact is False:
                    raise RuntimeError(f"{case.name}: store with {count} programs x {tile} B wrong")
                rows.append(
                    {
                        "case": case.name,
                        "num_programs": count,
                        "tile_bytes": tile,
                        "store_s": times["store"],
                        "load_s": times["load"],
                        "store_GBps": ws.job_bytes / times["store"] / 1e9,
                        "load_GBps": ws.job_bytes / times["load"] / 1e9,
                    }
                )
    finally:
        copy_blocks.TILE_BYTES = default_tile
        engine.shutdown()
    return rows


def compare_choice(case: cases.Case, device: torch.device, repeats: int) -> list[dict[str, Any]]:
    """The ``auto`` engine with per-plane and with per-job choice (each calibrated)."""
    rows = []
    for choice in ("plane", "job"):
        ws, engine = _engine(case, device, backend="auto", path_choice=choice)
        try:
            times = _time_jobs(engine, ws.spec, repeats)
            counts = [blocks.size for blocks in ws.spec.gpu_blocks]
            paths = {
                name: "+".join(n for n, _ in engine.policy.assign(d, counts))
                for d, name in ((TO_POOL, "store"), (FROM_POOL, "load"))
            }
        finally:
            engine.shutdown()
        rows.append(
            {
                "case": case.name,
                "choice": choice,
                "store_s": times["store"],
                "load_s": times["load"],
                "store_GBps": ws.job_bytes / times["store"] / 1e9,
                "load_GBps": ws.job_bytes / times["load"] / 1e9,
                "store_path": paths["store"],
                "load_path": paths["load"],
            }
        )
    return rows


def pick(rows: list[dict[str, Any]]) -> tuple[int, int] | None:
    """(num_programs, tile bytes) with the least total time over every case and direction."""
    totals: dict[tuple[int, int], float] = {}
    cases = {row["case"] for row in rows}
    for row in rows:
        key = (row["num_programs"], row["tile_bytes"])
        totals[key] = totals.get(key, 0.0) + row["store_s"] + row["load_s"]
    complete = {
        key: total
        for key, total in totals.items()
        if sum(1 for r in rows if (r["num_programs"], r["tile_bytes"]) == key) == len(cases)
    }
    return min(complete, key=complete.__getitem__) if complete else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="one-layer cases, few points")
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.max_seconds
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        # CPU tensors need the interpreter, set before the kernels are first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton_offload.kernels import copy_blocks

    if cuda:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs, tiles = _programs(sms), TILE_SIZES
    else:
        sms, programs, tiles = 0, [2, 4], QUICK_TILE_SIZES
    names = HYBRID_PRESETS if cuda and not args.quick else ("swa-hybrid",)
    swept = [cases.CASES[name] for name in names]
    if args.quick or not cuda:
        # One layer per group; without CUDA also two blocks of pages cut to 1 KiB at
        # most: the interpreter runs each program's items one by one.
        swept = [replace(c, groups=tuple(_small(g, cuda) for g in c.groups)) for c in swept]
    repeats = args.repeats if cuda else 1
    grid_rows: list[dict[str, Any]] = []
    for case in swept:
        grid_rows += sweep_grid(case, device, programs, tiles, repeats, deadline)
    choice_rows: list[dict[str, Any]] = []
    if cuda:
        for case in swept:
            if time.monotonic() > deadline:
                break
            choice_rows += compare_choice(case, device, repeats)
    best = pick(grid_rows)
    lines = []
    for row in grid_rows:
        lines.append(
            f"grid {row['case']} programs {row['num_programs']:>4} tile {row['tile_bytes']:>5}: "
            + (
                f"store {row['store_GBps']:.1f} GB/s, load {row['load_GBps']:.1f} GB/s"
                if cuda
                else "ran (interpreted; no GB/s)"
            )
        )
    for row in choice_rows:
        lines.append(
            f"choice {row['case']} per-{row['choice']}: store {row['store_GBps']:.1f} GB/s "
            f"({row['store_path']}), load {row['load_GBps']:.1f} GB/s ({row['load_path']})"
        )
    if not cuda:
        lines.append("choice per-plane vs per-job: not run (needs CUDA copy engines)")
    default = copy_blocks.grid_size(sms, copy_blocks.TILE_BYTES) if cuda else "n/a (interpreter)"
    if best is None:
        lines.append("grid sweep picks: nothing (no complete point within the time limit)")
    else:
        lines.append(
            f"grid sweep picks num_programs={best[0]} tile_bytes={best[1]} "
            f"(default grid for full tiles: {default}; SMs {sms or 'n/a'})"
            + ("" if cuda else " -- interpreted, so this pick means nothing")
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grid-sweep.json").write_text(
        json.dumps({"grid": grid_rows, "choice": choice_rows, "pick": best}, indent=1)
    )
    (args.out / "grid-sweep.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if grid_rows else 1


if __name__ == "__main__":
    sys.exit(main())
