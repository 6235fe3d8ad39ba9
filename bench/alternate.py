"""Alternated rounds of two (or more) runs, and the ratio report the verification
benches share (``bench/suites/bench_seal.py``, ``bench/suites/bench_seal_worker.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def alternate(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median seconds of each run over ``rounds`` alternated rounds (after one warm-up)."""
    for run in runs.values():
        run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def report(
    benchmark: Any,
    what: str,
    nbytes: int,
    times: dict[str, float],
    *,
    names: tuple[str, str] = ("unverified", "verified"),
    **extra: Any,
) -> float:
    """Print and store (``extra_info``) the GB/s of both ``names`` in ``times`` and
    ``ratio`` = the second's speed / the first's; returns the ratio."""
    base, measured = names
    ratio = times[base] / times[measured]
    gbps = {name: round(nbytes / seconds / 1e9, 3) for name, seconds in times.items()}
    benchmark.extra_info.update(
        {f"{name}_GBps": gbps[name] for name in names},
        bytes=nbytes,
        ratio=round(ratio, 3),
        **extra,
    )
    notes = "".join(f", {key} {value}" for key, value in extra.items())
    print(
        f"\n{what}: {gbps[base]} GB/s {base}, {gbps[measured]} GB/s {measured}, "
        f"ratio {ratio:.2f}{notes}"
    )
    return ratio


__all__ = ["alternate", "report"]
