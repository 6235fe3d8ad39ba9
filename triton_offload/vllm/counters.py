"""This backend's counters in vLLM's metrics: their names, labels and how they travel.

Every counter is named here (:data:`COUNTERS`), under vLLM's prefix so that
``LLM.get_metrics()`` (which reads ``vllm:`` metrics only) and ``/metrics`` show them
next to vLLM's own ``vllm:kv_offload_*``. Each is counted where its event is decided:

- by each worker, for its own pages and jobs (vLLM sums the workers): a chunk refused at a
  load because its page failed its seal (``chunks_refused``, tier ``host``), the jobs and
  bytes each copy path moved per direction (``jobs``, ``bytes``: copies that completed,
  whatever the verdict on their bytes), the host seconds spent sealing stores and
  verifying loads (``verify_seconds``);
- by the scheduler, once per job or key: a chunk refused when a secondary tier promoted
  it (``chunks_refused``, tier: the tier's type), a key quarantined, a load or a store
  that failed on any worker.

They travel as vLLM's own offloading stats do: a :class:`Counters` accumulates in each
process; ``TritonOffloadingConnector.get_kv_connector_stats`` drains it into vLLM's
``OffloadingConnectorStats`` payload (None when nothing was counted: vLLM takes any stats
object as news), which vLLM sums over workers, merges with the scheduler's, logs with
``reduce()`` and hands to :class:`TritonPromMetrics` (the connector's
``build_prom_metrics``), which publishes these counters and passes the rest to vLLM's
own offloading metrics. No private vLLM name is read: the payload's sections are reached
through ``OffloadingConnectorStats.metric_sections()``, and the vLLM releases supported
(0.33, 0.34) share this whole path.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from triton_offload.vllm.compat import supported_vllm_api

with supported_vllm_api():
    from prometheus_client import Counter
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

PREFIX = "vllm:triton_offload_"
CHUNKS_REFUSED = PREFIX + "chunks_refused"
KEYS_QUARANTINED = PREFIX + "keys_quarantined"
LOADS_FAILED = PREFIX + "loads_failed"
STORES_FAILED = PREFIX + "stores_failed"
JOBS = PREFIX + "jobs"
BYTES = PREFIX + "bytes"
VERIFY_SECONDS = PREFIX + "verify_seconds"

#: Why a chunk was refused: the seal's verdict in one word (``read``: a secondary tier
#: failed to read it back; ``forgery``: not sealed under the engine's seal key, unkeyed
#: seals included (a forged keyed seal that copies the key id fails its tag, and counts
#: as ``checksum``, as damaged bytes do); ``keyed``: sealed under a key, and this engine
#: has none; ``other``: a problem this list does not know yet).
REASONS = (
    "checksum",
    "forgery",
    "keyed",
    "short",
    "empty",
    "garbage",
    "key",
    "config",
    "layout",
    "format",
    "read",
    "other",
)
DIRECTIONS = ("store", "load")
#: The copiers a job's path is made of (the engine names a mixed job ``dma+triton``).
PATH_PARTS = ("triton", "dma", "torch")
#: The ``tier`` of a chunk refused from the host region (a secondary tier: its type).
HOST_TIER = "host"


@dataclasses.dataclass(frozen=True)
class CounterSpec:
    """One counter: its metric name, what it counts and its label names."""

    name: str
    documentation: str
    labelnames: tuple[str, ...] = ()


COUNTERS: dict[str, CounterSpec] = {
    spec.name: spec
    for spec in (
        CounterSpec(
            CHUNKS_REFUSED,
            "Chunks refused because their seal did not verify (each worker counts its own "
            "pages at a load, tier host; the scheduler counts promotions from a "
            "secondary tier), by reason and tier.",
            ("reason", "tier"),
        ),
        CounterSpec(
            KEYS_QUARANTINED,
            "Offload keys quarantined (a miss in every tier until stored again), by the "
            "tier their bad chunk came from.",
            ("tier",),
        ),
        CounterSpec(LOADS_FAILED, "Load jobs that failed on any worker (copy or seal)."),
        CounterSpec(STORES_FAILED, "Store jobs that failed on any worker (copy or seal)."),
        CounterSpec(
            JOBS,
            "Copy jobs completed per copy path and direction, summed over workers.",
            ("path", "direction"),
        ),
        CounterSpec(
            BYTES,
            "Bytes moved by completed copy jobs per copy path and direction, summed over workers.",
            ("path", "direction"),
        ),
        CounterSpec(
            VERIFY_SECONDS,
            "Host seconds spent sealing stores and verifying loads, summed over workers.",
            ("direction",),
        ),
    )
}


def _check_path(path: str) -> bool:
    parts = path.split("+")
    return all(part in PATH_PARTS for part in parts) and len(set(parts)) == len(parts)


#: The values a label may take (a label not here takes any non-empty string).
_LABEL_VALUES: dict[str, Any] = {
    "reason": REASONS.__contains__,
    "direction": DIRECTIONS.__contains__,
    "path": _check_path,
}

#: Seal problems (``triton_offload.transfer.seal``) by reason: the first phrase found in
#: the problem's text names it. ``tests/vllm/test_counters.py`` makes each problem.
_REASON_PHRASES = (
    ("forgery", "forgery"),  # an unkeyed seal or another key's where a key is required
    ("no seal key", "keyed"),  # a keyed seal an engine without the key cannot check
    ("failed to read", "read"),
    ("payload checksum mismatch", "checksum"),
    ("all zero bytes", "empty"),
    ("seal format v", "format"),
    ("no seal", "garbage"),
    ("damaged seal", "garbage"),
    ("unknown checksum algorithm", "garbage"),
    ("configuration's chunk", "config"),
    ("row layout's chunk", "layout"),
    ("belongs", "layout"),  # a page of another place in the row
    ("key's chunk", "key"),
    ("payload of", "short"),
)


def refusal_reason(problem: str) -> str:
    """The ``reason`` label of a refused chunk's problem text."""
    for phrase, reason in _REASON_PHRASES:
        if phrase in problem:
            return reason
    return "other"


def _count_value(value: Any, name: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: a count must be a number, got {value!r}")
    number: int | float = int(value) if isinstance(value, (int, np.integer)) else float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name}: a counter only grows; {value!r} is not a count")
    return number


def _checked_count(name: str, value: Any, labels: dict[str, str]) -> tuple[tuple[str, ...], Any]:
    """(label values in the counter's order, the count) of one addition; ValueError or
    TypeError naming the bad name, label or value."""
    spec = COUNTERS.get(name)
    if spec is None:
        raise ValueError(f"{name!r} is not a counter of this backend; known: {list(COUNTERS)}")
    if set(labels) != set(spec.labelnames):
        raise ValueError(
            f"{name}: labels {sorted(labels)} given, its labels are {list(spec.labelnames)}"
        )
    for label, label_value in labels.items():
        allowed = _LABEL_VALUES.get(label)
        if not isinstance(label_value, str) or not label_value:
            raise ValueError(f"{name}: label {label}={label_value!r} must be a non-empty str")
        if allowed is not None and not allowed(label_value):
            raise ValueError(f"{name}: label {label}={label_value!r} is not a known value")
    number = _count_value(value, name)
    return tuple(labels[label] for label in spec.labelnames), number


class CountBatch:
    """The counts of one event (a finished job judged by a worker), gathered before they
    count: :meth:`Counters.add_batch` adds them all at once, and only the first time.

    Why: a worker judges a finished job (seal, verify) in steps that an interrupt may cut,
    and judges it again after; counts added as each step went were counted twice. Gathered
    here, an interrupted judgement leaves nothing counted, and a batch given again (an
    interrupt after it was added, before the job left the worker's books) adds nothing.
    ``add`` checks like :meth:`Counters.add`.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[str, tuple[str, ...], int | float]] = []
        #: Set by the one Counters.add_batch that counted it, in the step that counts it.
        self.added = False

    def add(self, name: str, value: Any = 1, **labels: str) -> None:
        key, number = _checked_count(name, value, labels)
        self.entries.append((name, key, number))


class Counters:
    """Counts of one process since they were last drained, per counter and label tuple.

    ``add(name, value=1, **labels)`` checks the name, the label names (those of its
    :data:`COUNTERS` entry, all given) and their values before counting (ValueError
    naming the bad one); ``add_batch(batch)`` adds a :class:`CountBatch` once, however
    often it is given; ``drain()`` hands the counts over and starts again. Thread-safe:
    the scheduler's tier hooks may count from a tiering manager's thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[tuple[str, ...], int | float]] = {}

    def add(self, name: str, value: Any = 1, **labels: str) -> None:
        key, number = _checked_count(name, value, labels)
        with self._lock:
            series = self._counts.setdefault(name, {})
            series[key] = series.get(key, 0) + number

    def add_batch(self, batch: CountBatch) -> None:
        """Add every count of ``batch`` unless it was added before: all or nothing,
        whatever line an interrupt lands on (the sums are built aside and take the place of
        the counts in the same step that marks the batch added)."""
        with self._lock:
            if batch.added:
                return
            counts = dict(self._counts)  # built aside: until the last line nothing counted
            for name in {name for name, _, _ in batch.entries}:
                counts[name] = dict(counts.get(name, {}))
            for name, key, number in batch.entries:
                counts[name][key] = counts[name].get(key, 0) + number
            self._counts, batch.added = counts, True

    def drain(self) -> dict[str, dict[tuple[str, ...], int | float]]:
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts


def stats_of(
    counts: Mapping[str, Mapping[tuple[str, ...], int | float]],
    into: Any = None,
) -> Any:
    """``counts`` (from :meth:`Counters.drain`) added to vLLM's stats payload ``into``
    (a new one when None); None when both are nothing, as vLLM wants an idle worker's
    answer (``KVConnectorOutput.is_empty`` takes any stats object as news)."""
    if not any(counts.values()):
        return into
    stats = OffloadingConnectorStats() if into is None else into
    for name, series in counts.items():
        for labelvalues, value in series.items():
            stats.increase_counter(name, value, labelvalues)
    return stats


def split_payload(
    data: dict[str, Any],
) -> tuple[dict[str, dict[tuple[str, ...], int | float]], dict[str, Any]]:
    """(this backend's counters, the rest of the payload for vLLM's own metrics), from a
    stats payload; ``data`` is left as it was (vLLM's log line reads it too)."""
    rest = OffloadingConnectorStats()
    rest.aggregate(OffloadingConnectorStats(data=data))  # copies every section
    types, values = rest.metric_sections()
    ours = {name: values.pop(name) for name in list(values) if name in COUNTERS}
    for name in ours:
        types.pop(name, None)
    return ours, rest.data


def health_tiers(vllm_config: Any) -> tuple[str, ...]:
    """The ``tier`` labels a refused chunk can carry on this engine: the host region and
    each configured secondary tier's type."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    tiers = [HOST_TIER]
    for tier in extra.get("secondary_tiers") or ():
        kind = tier.get("type") if isinstance(tier, Mapping) else None
        if isinstance(kind, str) and kind and kind not in tiers:
            tiers.append(kind)
    return tuple(tiers)


def health_series(tiers: tuple[str, ...]) -> list[tuple[str, ...]]:
    """``(counter, *label values)`` of every series a healthy fleet keeps at 0: refused
    chunks per reason and tier, quarantined keys per tier, failed loads and stores."""
    series: list[tuple[str, ...]] = [
        (CHUNKS_REFUSED, reason, tier) for reason in REASONS for tier in tiers
    ]
    series += [(KEYS_QUARANTINED, tier) for tier in tiers]
    series += [(LOADS_FAILED,), (STORES_FAILED,)]
    return series


class TritonPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The connector's Prometheus metrics: :data:`COUNTERS` as counters of vLLM's metric
    classes (``engine`` and model labels first, as vLLM's own), and ``inner`` (vLLM's
    offloading metrics, or None) for everything else in the payload."""

    def __init__(
        self,
        inner: Any,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.inner = inner
        self._counters = {
            # The counter class vLLM hands every connector (its multiprocess-aware one).
            spec.name: metric_types[Counter](
                name=spec.name,
                documentation=spec.documentation,
                labelnames=list(labelnames) + list(spec.labelnames),
            )
            for spec in COUNTERS.values()
        }
        self._children: dict[tuple[int, str, tuple[str, ...]], Any] = {}
        # The health counters a fleet charts exist from the first scrape, at 0: a
        # dashboard shows 0, not "no data", until something goes wrong.
        tiers = health_tiers(vllm_config)
        for engine_idx in per_engine_labelvalues:
            for labelvalues in health_series(tiers):
                self._child(engine_idx, labelvalues[0], labelvalues[1:])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        ours, rest = split_payload(transfer_stats_data)
        if self.inner is not None:
            self.inner.observe(rest, engine_idx)
        for name, series in ours.items():
            for labelvalues, value in series.items():
                self._child(engine_idx, name, tuple(labelvalues)).inc(value)

    def _child(self, engine_idx: int, name: str, labelvalues: tuple[str, ...]) -> Any:
        """The counter ``name``'s series for one engine and label values (made at 0)."""
        key = (engine_idx, name, labelvalues)
        child = self._children.get(key)
        if child is None:
            engine_labels = list(self.per_engine_labelvalues[engine_idx])
            child = self._counters[name].labels(*engine_labels, *labelvalues)
            self._children[key] = child
        return child


__all__ = [
    "BYTES",
    "CHUNKS_REFUSED",
    "COUNTERS",
    "DIRECTIONS",
    "HOST_TIER",
    "JOBS",
    "KEYS_QUARANTINED",
    "LOADS_FAILED",
    "PATH_PARTS",
    "PREFIX",
    "REASONS",
    "STORES_FAILED",
    "VERIFY_SECONDS",
    "CountBatch",
    "CounterSpec",
    "Counters",
    "TritonPromMetrics",
    "health_series",
    "health_tiers",
    "refusal_reason",
    "split_payload",
    "stats_of",
]
