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


def report(benchmark: Any, what: str, nbytes: int, times: dict[str, float], **extra: Any) -> float:
    plain, verified = times["unverified"], times["verified"]
    ratio = plain / verified
    gbps = {name: round(nbytes / seconds / 1e9, 3) for name, seconds in times.items()}
    benchmark.extra_info.update(
        bytes=nbytes,
        unverified_GBps=gbps["unverified"],
        verified_GBps=gbps["verified"],
        ratio=round(ratio, 3),
        **extra,
    )
    notes = "".join(f", {key} {value}" for key, value in extra.items())
    print(
        f"\n{what}: {gbps['unverified']} GB/s unverified, {gbps['verified']} GB/s verified, "
        f"ratio {ratio:.2f}{notes}"
    )
    return ratio


__all__ = ["alternate", "report"]
