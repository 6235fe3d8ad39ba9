"""Launch-grid sweep: ``num_programs`` x tile size on the hybrid presets, and the per-plane
against the per-job path choice; prints the grid the measurement would pick.

The default grid (``kernels.copy_blocks.grid_size``) is an estimate from the bytes PCIe
needs in flight; this is the measurement meant to replace it. Every point is a real job
of the preset through the engine (its tables, staging and events), store and load,
median of ``--repeats``; GB/s are job bytes over the engine's own device time.

    python -m triton_offload.bench.grid_sweep --out DIR [--quick] [--max-seconds S]

Every point is written to ``grid-sweep.jsonl`` as soon as it is measured; the summary
(``grid-sweep.json``, ``grid-sweep.txt``) follows at the end, also when the run is
interrupted. Without CUDA the kernel runs interpreted on a one-layer case: the sweep then
only checks that every point copies every byte (no GB/s are claimed), and the per-plane
comparison, which needs the copy engines, is reported as not run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from triton_offload.bench import cases
from triton_offload.bench.paths import build_workspace, plan_for

from triton_offload.transfer.jobs import FROM_POOL, TO_POOL
from triton_offload.transfer.selection import GatedTimer

HYBRID_PRESETS = ("mamba-hybrid", "swa-hybrid")
#: Tile sizes tried (bytes per item): the tables are cut with each and every launch runs
#: the kernel compiled for it (``KernelTables.tile_bytes``).
TILE_SIZES = (4096, 8192, 16384)
#: Without CUDA, pages are cut to at most this: over the largest tile (so every tile size
#: splits a page into several items) and a 16-byte multiple (the 16-byte path, where a
#: launch at the wrong tile size drops bytes), yet small enough for the interpreter.
CPU_PAGE_LIMIT = 20 * 1024 + 48


def _small(group: cases.GroupShape, cuda: bool) -> cases.GroupShape:
    if cuda:
        return replace(group, layers=1)
    pages = tuple(min(p, CPU_PAGE_LIMIT) for p in group.plane_bytes)
    return replace(group, layers=1, blocks_per_job=2, plane_bytes=pages)


def _programs(sm_count: int) -> list[int]:
    """16 .. 4 x SMs: below, at and above one program per SM."""
    return sorted({16, 32, 64, sm_count // 2, sm_count, 2 * sm_count, 4 * sm_count})


def _engine(case: cases.Case, device: torch.device, **options: Any) -> tuple[Any, Any]:
    from triton_offload.transfer.engine import TransferEngine

    ws = build_workspace(case, device, seed=3)
    engine = TransferEngine(plan_for(case), ws.caches, ws.num_host_blocks, **options)
    return ws, engine


def use_grid(engine: Any, tile: int, num_programs: int | None) -> None:
    """Give ``engine`` a kernel copier cut at ``tile`` bytes launching ``num_programs``.

    The tables and the launches carry the same tile size (the copier passes it per
    launch). ValueError naming ``tile_bytes`` for a size the kernel cannot run.
    """
    from triton_offload.transfer.copiers import TritonCopier

    copier = TritonCopier(
        engine.layout,
        engine.pool_address,
        engine.row_stride,
        device=engine.device,
        cuda=engine.cuda,
        num_programs=num_programs,
        tile_bytes=tile,
    )
    if engine.cuda:
        copier.warm_up()  # this tile's kernel compiles here, not in a timed job
        # The copier uploaded its tables on the current stream; jobs run on the
        # engine's transfer streams, which do not wait for it by themselves.
        torch.cuda.synchronize(engine.device)
    engine.copiers["triton"] = copier


def make_engine(ws: Any, tile: int, num_programs: int | None = None) -> Any:
    """A ``triton`` engine on ``ws``'s caches whose kernel copier runs ``tile``-byte items."""
    from triton_offload.transfer.copiers import check_tile_bytes
    from triton_offload.transfer.engine import TransferEngine

    check_tile_bytes(tile)  # before the pool is allocated
    engine = TransferEngine(
        plan_for(ws.case), ws.caches, ws.num_host_blocks, device=ws.device, backend="triton"
    )
    try:
        use_grid(engine, tile, num_programs)
    except BaseException:
        engine.shutdown()
        raise
    return engine


def _time_jobs(engine: Any, spec: Any, repeats: int) -> dict[str, float]:
    """Median device seconds per direction of ``repeats`` jobs (after one warm-up job
    each), each behind the engine's gate: the lane is held until the job is enqueued,
    so no host enqueue time is counted."""
    seconds: dict[str, list[float]] = {"store": [], "load": []}
    timer = GatedTimer(engine)
    for direction, name in ((TO_POOL, "store"), (FROM_POOL, "load")):
        for repeat in range(repeats + 1):
            run = timer.run(
                spec,
                direction,
                engine.policy.assign(direction, [blocks.size for blocks in spec.gpu_blocks]),
            )
            if repeat:
                seconds[name].append(run.device_s)
    return {name: statistics.median(values) for name, values in seconds.items()}


def point_problem(ws: Any, engine: Any, seed: int) -> str | None:
    """Store and load the workspace's job once, checked byte by byte; None when exact.

    The caches are filled with random bytes first (a check against never-written caches
    can pass by accident), the whole pool is poisoned: after the store every pool byte
    must equal the image the caches give (addressed slots) or the poison (all others),
    and the caches must be unchanged; after poisoning the addressed cache blocks, the
    load must restore them, touch no other cache byte and leave the pool as it was.
    """
    from triton_offload.bench.paths import POISON

    counts = [blocks.size for blocks in ws.spec.gpu_blocks]
    ws.fill_random(seed)
    original = ws.snapshot()
    engine.pool.fill_(POISON)
    engine.run_unreported(ws.spec, TO_POOL, engine.policy.assign(TO_POOL, counts))
    expected = ws.expected_pool(engine.row_bytes)
    pool = engine.pool.cpu()
    if not torch.equal(pool, expected):
        wrong = int((pool != expected).sum())
        return f"store: {wrong} of {expected.numel()} pool bytes wrong"
    if not ws.caches_equal(original):
        return "store changed the source caches"
    ws.poison_addressed_blocks()
    engine.run_unreported(ws.spec, FROM_POOL, engine.policy.assign(FROM_POOL, counts))
    if not torch.equal(engine.pool.cpu(), expected):
        return "load changed the pool"
    if not ws.caches_equal(original):
        return "load did not restore the addressed blocks (or touched others)"
    return None


def sweep_grid(
    case: cases.Case,
    device: torch.device,
    programs: list[int],
    tiles: tuple[int, ...],
    repeats: int,
    deadline: float,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per (tile bytes, num_programs): store/load seconds and GB/s, exactness.

    ``on_row`` gets each row as soon as it is measured (the caller writes it out, so a
    sweep cut short keeps its points). Every point is checked byte by byte without
    CUDA; on a GPU the first point of each tile size is (the check reads the whole pool;
    the tile size decides which bytes a launch moves, the grid only who moves them).
    RuntimeError after the row of a point that copied wrong.
    """
    ws = build_workspace(case, device, seed=3)
    engine = make_engine(ws, tiles[0])
    pool_bytes = int(engine.pool.numel())
    rows: list[dict[str, Any]] = []
    try:
        for tile in tiles:
            for count in programs:
                if time.monotonic() > deadline:
                    return rows
                use_grid(engine, tile, count)
                times = _time_jobs(engine, ws.spec, repeats)
                checked = count == programs[0] or not engine.cuda
                problem = point_problem(ws, engine, seed=tile + count) if checked else None
                row = {
                    "case": case.name,
                    "num_programs": count,
                    "tile_bytes": tile,
                    "store_s": times["store"],
                    "load_s": times["load"],
                    "store_GBps": ws.job_bytes / times["store"] / 1e9,
                    "load_GBps": ws.job_bytes / times["load"] / 1e9,
                    "exact": (problem is None) if checked else None,
                    "pool_bytes": pool_bytes,
                    "checked_pool_bytes": pool_bytes if checked else 0,
                    "problem": problem,
                }
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                if problem is not None:
                    raise RuntimeError(f"{case.name}: {count} programs x {tile} B tiles: {problem}")
    finally:
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


def _lines(
    grid_rows: list[dict[str, Any]],
    choice_rows: list[dict[str, Any]],
    cuda: bool,
    sms: int,
    errors: list[str],
) -> list[str]:
    from triton_offload.kernels import copy_blocks

    lines = []
    for row in grid_rows:
        exact = {True: "exact", False: "WRONG BYTES", None: "not checked"}[row["exact"]]
        lines.append(
            f"grid {row['case']} programs {row['num_programs']:>4} tile {row['tile_bytes']:>5}: "
            + (
                f"store {row['store_GBps']:.1f} GB/s, load {row['load_GBps']:.1f} GB/s"
                if cuda
                else "ran (interpreted; no GB/s)"
            )
            + f"; {exact}"
        )
    for row in choice_rows:
        lines.append(
            f"choice {row['case']} per-{row['choice']}: store {row['store_GBps']:.1f} GB/s "
            f"({row['store_path']}), load {row['load_GBps']:.1f} GB/s ({row['load_path']})"
        )
    if not cuda:
        lines.append("choice per-plane vs per-job: not run (needs CUDA copy engines)")
    lines += [f"grid sweep error: {error}" for error in errors]
    best = pick(grid_rows)
    default = copy_blocks.grid_size(sms, copy_blocks.TILE_BYTES) if cuda else "n/a (interpreter)"
    if best is None:
        lines.append("grid sweep picks: nothing (no complete point within the time limit)")
    else:
        lines.append(
            f"grid sweep picks num_programs={best[0]} tile_bytes={best[1]} "
            f"(default grid for full tiles: {default}; SMs {sms or 'n/a'})"
            + ("" if cuda else " -- interpreted, so this pick means nothing")
        )
    return lines


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
    if cuda:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = _programs(sms)
    else:
        sms, programs = 0, [2, 4]
    names = HYBRID_PRESETS if cuda and not args.quick else ("swa-hybrid",)
    swept = [cases.CASES[name] for name in names]
    if args.quick or not cuda:
        # One layer per group; without CUDA also two blocks of pages cut to
        # CPU_PAGE_LIMIT: the interpreter runs each program's items one by one.
        swept = [replace(c, groups=tuple(_small(g, cuda) for g in c.groups)) for c in swept]
    repeats = args.repeats if cuda else 1
    args.out.mkdir(parents=True, exist_ok=True)
    points = args.out / "grid-sweep.jsonl"
    points.write_text("")
    grid_rows: list[dict[str, Any]] = []
    choice_rows: list[dict[str, Any]] = []
    errors: list[str] = []

    def write_point(row: dict[str, Any]) -> None:
        # One line per point as it is measured: a sweep stopped from outside keeps them.
        with points.open("a") as out:
            out.write(json.dumps(row) + "\n")
        grid_rows.append(row)

    try:
        for case in swept:
            try:
                sweep_grid(case, device, programs, TILE_SIZES, repeats, deadline, write_point)
            except Exception as error:  # noted; the summary below still gets written
                errors.append(f"{case.name}: {type(error).__name__}: {error}")
        for case in swept if cuda else ():
            if time.monotonic() > deadline:
                break
            choice_rows += compare_choice(case, device, repeats)
    except KeyboardInterrupt:  # `timeout -s INT`: keep what was measured
        errors.append("interrupted (time limit); the points above were measured")
    lines = _lines(grid_rows, choice_rows, cuda, sms, errors)
    summary = {"grid": grid_rows, "choice": choice_rows, "pick": pick(grid_rows), "errors": errors}
    (args.out / "grid-sweep.json").write_text(json.dumps(summary, indent=1))
    (args.out / "grid-sweep.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    exact = all(row["exact"] is not False for row in grid_rows)
    return 0 if grid_rows and exact and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
