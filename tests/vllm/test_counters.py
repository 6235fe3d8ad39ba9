"""This backend's counters in vLLM's metrics (``vllm:triton_offload_*``).

The stats object is vLLM's own ``OffloadingConnectorStats`` payload, so its semantics are
checked as vLLM's code calls them: a worker with nothing counted returns None (vLLM's
``KVConnectorOutput.is_empty`` takes any stats object as news), workers aggregate by
summing per label tuple, the scheduler's payload merges into the workers', ``reduce``
feeds vLLM's log line, ``reset`` empties. Through vLLM's real core scheduler (the
stand-in model of ``tests/helpers/vllm_engine.py``), a corrupt host chunk is counted where it is
decided: refused by the worker that verified it (reason and tier), a failed load and a
quarantined key by the scheduler, and the payloads reach Prometheus under these names.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import numpy as np
import pytest
import torch

try:
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as PromCounter
    from prometheus_client import Gauge as PromGauge
    from prometheus_client import Histogram as PromHistogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    import triton_offload.vllm as tv
    from tests.helpers.vllm_engine import (
        Engine,
        _corrupt_host_chunk,
        _offload_first_request,
        assert_prompt_kv,
    )
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    pytest.skip(f"vllm cannot be imported: {error}", allow_module_level=True)

from triton_offload.transfer.engine import TransferEngine
from triton_offload.transfer.seal import (
    SEAL_BYTES,
    SEAL_NAME,
    SealFormat,
    digest8,
    seal_problem,
    write_seal,
)
from triton_offload.vllm import counters as c

# ------------------------------------------------------------------ the counters


def test_every_counter_is_named_in_one_place_with_vllms_prefix() -> None:
    assert set(c.COUNTERS) == {
        c.CHUNKS_REFUSED,
        c.KEYS_QUARANTINED,
        c.LOADS_FAILED,
        c.STORES_FAILED,
        c.JOBS,
        c.BYTES,
        c.VERIFY_SECONDS,
    }
    for name, spec in c.COUNTERS.items():
        # LLM.get_metrics() reads only vllm: metrics; Prometheus adds _total itself.
        assert name.startswith("vllm:triton_offload_") and not name.endswith("_total")
        assert spec.name == name and spec.documentation
    assert c.COUNTERS[c.CHUNKS_REFUSED].labelnames == ("reason", "tier")
    assert c.COUNTERS[c.JOBS].labelnames == ("path", "direction")
    assert c.COUNTERS[c.BYTES].labelnames == ("path", "direction")


def test_counts_add_per_label_tuple_and_drain_once() -> None:
    counters = c.Counters()
    counters.add(c.CHUNKS_REFUSED, reason="checksum", tier="host")
    counters.add(c.CHUNKS_REFUSED, 2, reason="checksum", tier="host")
    counters.add(c.CHUNKS_REFUSED, reason="key", tier="fs")
    counters.add(c.JOBS, path="dma+triton", direction="load")
    counters.add(c.VERIFY_SECONDS, 0.25, direction="store")
    counters.add(c.LOADS_FAILED)
    assert counters.drain() == {
        c.CHUNKS_REFUSED: {("checksum", "host"): 3, ("key", "fs"): 1},
        c.JOBS: {("dma+triton", "load"): 1},
        c.VERIFY_SECONDS: {("store",): 0.25},
        c.LOADS_FAILED: {(): 1},
    }
    assert counters.drain() == {}


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda k: k.add("vllm:triton_offload_nothing"), "vllm:triton_offload_nothing"),
        (lambda k: k.add(c.CHUNKS_REFUSED, reason="checksum"), "tier"),
        (lambda k: k.add(c.LOADS_FAILED, tier="host"), "tier"),
        (lambda k: k.add(c.CHUNKS_REFUSED, reason="bitrot", tier="host"), "bitrot"),
        (lambda k: k.add(c.JOBS, path="cuda", direction="load"), "cuda"),
        (lambda k: k.add(c.JOBS, path="torch", direction="both"), "both"),
        (lambda k: k.add(c.BYTES, -1, path="torch", direction="load"), "-1"),
        (lambda k: k.add(c.VERIFY_SECONDS, math.nan, direction="load"), "nan"),
        (lambda k: k.add(c.CHUNKS_REFUSED, reason="key", tier=""), "tier"),
    ],
)
def test_a_bad_count_is_refused_naming_it(call: Any, match: str) -> None:
    counters = c.Counters()
    with pytest.raises(ValueError, match=match):
        call(counters)
    assert counters.drain() == {}


def test_a_count_that_is_not_a_number_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="True"):
        c.Counters().add(c.LOADS_FAILED, True)
    with pytest.raises(TypeError, match="'3'"):
        c.Counters().add(c.LOADS_FAILED, "3")  # type: ignore[arg-type]


def test_numpy_counts_become_python_numbers() -> None:
    counters = c.Counters()
    counters.add(c.BYTES, np.int64(4096), path="torch", direction="store")
    counters.add(c.VERIFY_SECONDS, np.float32(0.5), direction="load")
    drained = counters.drain()
    assert type(drained[c.BYTES][("torch", "store")]) is int
    assert type(drained[c.VERIFY_SECONDS][("load",)]) is float


# ------------------------------------------------------------- the stats object


def _worker_payload(refused: int, store_bytes: int) -> Any:
    counters = c.Counters()
    counters.add(c.CHUNKS_REFUSED, refused, reason="checksum", tier="host")
    counters.add(c.BYTES, store_bytes, path="torch", direction="store")
    return c.stats_of(counters.drain())


def test_nothing_counted_is_no_stats_object() -> None:
    # vLLM's KVConnectorOutput.is_empty() takes any stats object as news.
    assert c.stats_of({}) is None
    vllm_stats = OffloadingConnectorStats()
    assert c.stats_of({}, vllm_stats) is vllm_stats


def test_workers_aggregate_by_summing_per_label_tuple() -> None:
    first, second = _worker_payload(1, 100), _worker_payload(2, 50)
    assert not first.is_empty()
    merged = first.aggregate(second)  # as vLLM's KVOutputAggregator merges workers
    assert merged.reduce() == {
        f"{c.CHUNKS_REFUSED}:('checksum', 'host')": 3,
        f"{c.BYTES}:('torch', 'store')": 150,
    }


def test_the_schedulers_payload_merges_with_vllms_own_counters() -> None:
    # The scheduler: vLLM's stats for this step plus the scheduler's own counts.
    scheduler = OffloadingConnectorStats()
    scheduler.increase_counter("vllm:kv_offload_store_bytes", 150)
    counters = c.Counters()
    counters.add(c.KEYS_QUARANTINED, tier="host")
    counters.add(c.LOADS_FAILED)
    assert c.stats_of(counters.drain(), scheduler) is scheduler
    worker = _worker_payload(1, 150)
    merged = worker.aggregate(scheduler)  # vLLM's core scheduler, worker side first
    assert merged.reduce() == {
        f"{c.CHUNKS_REFUSED}:('checksum', 'host')": 1,
        f"{c.BYTES}:('torch', 'store')": 150,
        "vllm:kv_offload_store_bytes": 150,
        f"{c.KEYS_QUARANTINED}:('host',)": 1,
        c.LOADS_FAILED: 1,
    }
    merged.reset()
    assert merged.is_empty() and merged.reduce() == {}


def test_the_payload_survives_vllms_serialization_and_rebuild() -> None:
    payload = _worker_payload(1, 4096).to_dict()
    encoded = MsgpackEncoder().encode(SchedulerStats(kv_connector_stats=payload))
    decoded = MsgpackDecoder(SchedulerStats).decode(encoded).kv_connector_stats
    rebuilt = tv.TritonOffloadingConnector.build_kv_connector_stats(decoded)
    assert rebuilt.reduce() == _worker_payload(1, 4096).reduce()


class _Prom:
    """vLLM's metric classes, on a registry of the test's own (no global names taken)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def types(self) -> dict[Any, Any]:
        registry = self.registry

        def bind(cls: Any) -> Any:
            def make(*args: Any, multiprocess_mode: str = "", **kwargs: Any) -> Any:
                return cls(*args, registry=registry, **kwargs)

            return make

        return {PromGauge: bind(PromGauge), PromCounter: bind(PromCounter),
                PromHistogram: bind(PromHistogram)}  # fmt: skip

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(f"{name}_total", {"model_name": "m", **labels})


def _prom_metrics(prom: _Prom, vllm_config: Any) -> Any:
    return tv.TritonOffloadingConnector.build_prom_metrics(
        vllm_config, prom.types(), ["model_name", "engine"], {0: ["m", "0"]}
    )


# ------------------------------------------------------------- through vLLM's scheduler


def _totals(payloads: list[dict[str, Any]]) -> dict[str, float]:
    """Every payload of the run as vLLM's log line sums them (KVConnectorLogging)."""
    logging = KVConnectorLogging(None)
    logging.connector_cls = tv.TritonOffloadingConnector
    for payload in payloads:
        logging.observe(payload)
    accumulated = logging.transfer_stats_accumulator
    return {} if accumulated is None else accumulated.reduce()


@pytest.fixture
def engine(tmp_path: Any) -> Any:
    made = Engine(tmp_path, "recompute")
    yield made
    made.close()


def test_a_corrupt_chunk_is_counted_where_it_is_decided(engine: Any) -> None:
    tokens = _offload_first_request(engine)
    stored = _totals(engine.connector_stats)
    assert stored[f"{c.JOBS}:('torch', 'store')"] >= 1
    # The same copies vLLM counts: every store succeeded, byte for byte the same total.
    assert stored[f"{c.BYTES}:('torch', 'store')"] == stored["vllm:kv_offload_store_bytes"]
    assert stored[f"{c.VERIFY_SECONDS}:('store',)"] > 0
    assert not any(key.startswith((c.CHUNKS_REFUSED, c.LOADS_FAILED)) for key in stored)

    engine.connector_stats.clear()
    _corrupt_host_chunk(engine, 3)
    second_tokens = tokens + [5] * 8
    assert_prompt_kv(engine, engine.run(engine.add("B", second_tokens)), second_tokens)
    totals = _totals(engine.connector_stats)
    refused = {k: v for k, v in totals.items() if k.startswith(c.CHUNKS_REFUSED)}
    assert refused == {f"{c.CHUNKS_REFUSED}:('checksum', 'host')": 1}
    assert totals[c.LOADS_FAILED] == 1
    assert totals[f"{c.KEYS_QUARANTINED}:('host',)"] == 1
    assert c.STORES_FAILED not in totals
    assert totals[f"{c.JOBS}:('torch', 'load')"] >= 1
    assert totals[f"{c.BYTES}:('torch', 'load')"] > 0
    assert totals[f"{c.VERIFY_SECONDS}:('load',)"] > 0

    # The same payloads in Prometheus, beside vLLM's own offload counters.
    prom = _Prom()
    metrics = _prom_metrics(prom, engine.vllm_config)
    for payload in engine.connector_stats:
        metrics.observe(payload, 0)
    name = c.CHUNKS_REFUSED
    assert prom.value(name, engine="0", reason="checksum", tier="host") == 1
    assert prom.value(c.LOADS_FAILED, engine="0") == 1
    assert prom.value(c.KEYS_QUARANTINED, engine="0", tier="host") == 1
    assert prom.value("vllm:kv_offload_load_bytes", engine="0") == totals.get(
        "vllm:kv_offload_load_bytes"
    )
    # Observing left the payloads whole for vLLM's log line, which reads them too.
    assert _totals(engine.connector_stats) == totals


def test_health_counters_are_zero_from_the_first_scrape_and_the_rest_absent(
    engine: Any,
) -> None:
    """What a healthy fleet charts exists before anything happened, at 0: refused chunks
    for every reason and tier (the host region and each configured secondary tier),
    quarantined keys per tier, failed loads and stores. Copy traffic appears once counted."""
    prom = _Prom()
    config = copy.deepcopy(engine.vllm_config)
    extra = config.kv_transfer_config.kv_connector_extra_config
    extra["secondary_tiers"] = [{"type": "fs", "root": "/nowhere"}, {"type": "obj"}]
    _prom_metrics(prom, config)
    for tier in ("host", "fs", "obj"):
        for reason in c.REASONS:
            assert prom.value(c.CHUNKS_REFUSED, engine="0", reason=reason, tier=tier) == 0
        assert prom.value(c.KEYS_QUARANTINED, engine="0", tier=tier) == 0
    assert prom.value(c.LOADS_FAILED, engine="0") == 0
    assert prom.value(c.STORES_FAILED, engine="0") == 0
    assert prom.value(c.CHUNKS_REFUSED, engine="0", reason="checksum", tier="p2p") is None
    assert prom.value(c.BYTES, engine="0", path="torch", direction="store") is None


def test_observed_counts_add_to_the_series_made_at_start_up(engine: Any) -> None:
    prom = _Prom()
    metrics = _prom_metrics(prom, engine.vllm_config)
    metrics.observe(OffloadingConnectorStats().to_dict(), 0)
    metrics.observe(_worker_payload(0, 10).to_dict(), 0)
    assert prom.value(c.BYTES, engine="0", path="torch", direction="store") == 10
    assert prom.value(c.LOADS_FAILED, engine="0") == 0


# ------------------------------------------------------------------- reasons and paths


def _page(payload: int = 192) -> tuple[np.ndarray, SealFormat, bytes]:
    page = np.arange(payload + SEAL_BYTES, dtype=np.uint8)
    fmt = SealFormat(digest8("config"), digest8("layout"), 0, 1)
    key = digest8("key")
    write_seal(page, payload, fmt, key)
    return page, fmt, key


def _problem(change: Any, **check: Any) -> str:
    page, fmt, key = _page()
    fmt, key = change(page, fmt, key)
    problem = seal_problem(page, fmt, key, **check)
    assert problem is not None
    return problem


def _flip_payload(page: np.ndarray, fmt: Any, key: Any) -> Any:
    page[5] ^= 0x40
    return fmt, key


def _zero_seal(page: np.ndarray, fmt: Any, key: Any) -> Any:
    page[-SEAL_BYTES:] = 0
    return fmt, key


def _junk_seal(page: np.ndarray, fmt: Any, key: Any) -> Any:
    page[-SEAL_BYTES:] = 0x33
    return fmt, key


def _damaged_header(page: np.ndarray, fmt: Any, key: Any) -> Any:
    page[-SEAL_BYTES + 20] ^= 1
    return fmt, key


def _old_format(page: np.ndarray, fmt: Any, key: Any) -> Any:
    page[-SEAL_BYTES : -SEAL_BYTES + 8] = np.frombuffer(SEAL_NAME + b"\x00\x01", np.uint8)
    return fmt, key


@pytest.mark.parametrize(
    ("change", "check", "reason"),
    [
        (_flip_payload, {}, "checksum"),
        (_zero_seal, {}, "empty"),
        (_junk_seal, {}, "garbage"),
        (_damaged_header, {}, "garbage"),
        (_old_format, {}, "format"),
        (lambda p, f, k: (f, digest8("other key")), {}, "key"),
        (lambda p, f, k: (SealFormat(digest8("other"), f.layout_digest, 0, 1), k), {}, "config"),
        (lambda p, f, k: (SealFormat(f.config_digest, digest8("other"), 0, 1), k), {}, "layout"),
        (lambda p, f, k: (SealFormat(f.config_digest, f.layout_digest, 1, 2), k), {}, "layout"),
        (lambda p, f, k: (f, k), {"expected_payload": 256}, "short"),
    ],
)
def test_each_seal_problem_has_its_reason(change: Any, check: Any, reason: str) -> None:
    assert c.refusal_reason(_problem(change, **check)) == reason


def test_a_tier_read_failure_and_an_unknown_problem_have_reasons() -> None:
    assert c.refusal_reason("the tier failed to read it") == "read"
    assert c.refusal_reason("the tier failed to read it (page 0: no seal (...))") == "read"
    assert c.refusal_reason("something new") == "other"
    assert set(c.REASONS) >= {"checksum", "short", "empty", "garbage", "key", "config"}


def test_the_engine_names_each_jobs_copy_path_in_its_result() -> None:
    from triton_offload import GroupSpec, ParallelSpec, plan_offload

    plan = plan_offload([GroupSpec("full_attention", 16)], ParallelSpec())
    engine = TransferEngine(plan, [[torch.zeros(8, 16, 2, 8)]], 4, backend="torch")
    try:
        engine.submit_store("s", gpu_blocks=[[0, 1]], host_blocks=[[2, 0]])
        (result,) = engine.get_finished()
        assert result.success and result.path == "torch"
    finally:
        engine.shutdown()


# ------------------------------------------------------------- promotions from a tier


@pytest.mark.parametrize(
    ("how", "reason"),
    [("same-size garbage", "garbage"), ("another key's file", "key"), ("truncated", "read")],
)
def test_a_refused_promotion_is_counted_by_the_scheduler_with_its_tier(
    tmp_path: Any, how: str, reason: str
) -> None:
    from tests.helpers.tiered_spec import Tiered, _evict_to_fs, _tamper, key

    tiered = Tiered(tmp_path / "fs")
    try:
        _evict_to_fs(tiered)
        guard = tiered.manager.triton_guard
        guard.counters.drain()
        _tamper(tiered, how, tmp_path)
        tiered.lookup_until_settled(key(0))
        assert guard.counters.drain() == {
            c.CHUNKS_REFUSED: {(reason, "fs"): 1},
            c.KEYS_QUARANTINED: {("fs",): 1},
        }
        tiered.lookup_until_settled(key(0))  # a miss at once: nothing counted again
        assert guard.counters.drain() == {}
    finally:
        tiered.close()


# ------------------------------------------------------------------ the start-up line


def test_one_start_up_line_per_worker_says_what_was_chosen(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tests.helpers.spec_geometry import Caches, _config

    with caplog.at_level(logging.INFO, logger="vllm.triton_offload"):
        spec = tv.TritonOffloadingSpec(_config({"verify_chunks": True, "backend": "torch"}))
        worker = spec.get_worker(Caches().canonical)
    try:
        fits = [r.getMessage() for r in caplog.records if "chunks fit" in r.getMessage()]
        # The seals' cost is in the worker's line, not in a line of its own.
        assert len(fits) == 1
        (line,) = fits
        assert "worker rank 0" in line and "8 host chunks" in line
        assert "backend=torch (every plane by torch)" in line
        assert "seals on (64 B per worker page): 8 chunks fit instead of 8 (0.0% fewer" in line
    finally:
        worker.shutdown()
    # Their cost where it costs chunks: test_the_seals_capacity_cost_is_stated_...
    off = tv.TritonOffloadingSpec(_config({"verify_chunks": False}))
    assert off.seal_note() == "seals off (verify_chunks=false)"


def test_the_copy_paths_are_described_per_page_size() -> None:
    from triton_offload import GroupSpec, ParallelSpec, plan_offload
    from triton_offload.transfer.selection import (
        CrossoverPath,
        FixedPath,
        describe_paths,
        parse_crossover,
    )

    plan = plan_offload([GroupSpec("full_attention", 16)], ParallelSpec())
    small, large = torch.zeros(8, 4, 2, 8), torch.zeros(8, 16, 32, 8)  # 256 B, 16 KiB pages
    engine = TransferEngine(plan, [[(small, small.clone(), large)]], 4, backend="torch")
    try:
        layout = engine.layout
        assert describe_paths(engine.policy, layout) == "every plane by torch"
        assert describe_paths(FixedPath("dma"), layout) == "every plane by dma"
        crossover = parse_crossover({"store": 1024, "load": 1 << 20})
        assert crossover is not None
        assert describe_paths(CrossoverPath(layout, crossover, "plane"), layout) == (
            "2 planes of 256 B: store triton, load triton; "
            "1 planes of 16384 B: store dma, load triton"
        )
        assert "per job" in describe_paths(CrossoverPath(layout, crossover, "job"), layout)
    finally:
        engine.shutdown()
