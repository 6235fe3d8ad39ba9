"""The Grafana dashboard in ``dashboards/`` queries only metrics that exist: every name in
its PromQL is a family that this backend's connector registers through vLLM's metric
classes (its own counters and vLLM's offloading metrics), exposed with the suffix the
query uses (``_total`` for a counter, ``_bucket``/``_sum``/``_count`` for a histogram),
and every label it groups or filters by is one that family carries."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge
from prometheus_client import Histogram as PromHistogram

try:
    import triton_offload.vllm as tv
except ImportError as error:  # a supported vLLM that does not import here
    pytest.skip(f"triton_offload.vllm does not import: {error}", allow_module_level=True)

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "triton_offload.json"
METRIC = re.compile(r"\bvllm:[a-z_:]+")
SUFFIXES = {"_total": "counter", "_bucket": "histogram", "_sum": "histogram", "_count": "histogram"}
#: Labels vLLM puts on every metric of an engine (``model_name``, ``engine``) and the
#: histogram's bucket label.
ENGINE_LABELS = {"model_name", "engine", "le"}


def registered_families() -> dict[str, tuple[str, set[str]]]:
    """family name -> (type, label names) of what the connector registers, built as
    vLLM's stat logger builds it, in a registry of this test's own."""
    registry = CollectorRegistry()
    families: dict[str, tuple[str, set[str]]] = {}
    kinds = {PromCounter: "counter", PromGauge: "gauge", PromHistogram: "histogram"}

    def bind(cls: Any) -> Any:
        def make(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("registry", None)
            metric = cls(*args, registry=registry, **kwargs)
            name = kwargs.get("name", args[0] if args else None)
            labels = set(kwargs.get("labelnames", args[2] if len(args) > 2 else ()))
            families[str(name).removesuffix("_total")] = (kinds[cls], labels)
            return metric

        return make

    types = {PromGauge: bind(PromGauge), PromCounter: bind(PromCounter),
             PromHistogram: bind(PromHistogram)}  # fmt: skip
    config = _Config({"secondary_tiers": [{"type": "fs", "root_dir": "/nowhere"}]})
    tv.TritonOffloadingConnector.build_prom_metrics(
        config, types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    # What the registry exposes has the same names (the scrape the dashboard reads).
    exposed = {family.name for family in registry.collect()}
    assert set(families) <= exposed, sorted(set(families) - exposed)
    return families


class _Config:
    """The parts of vLLM's config the metrics read."""

    def __init__(self, extra: dict[str, Any]) -> None:
        self.kv_transfer_config = type(
            "KVTransferConfig",
            (),
            {"kv_connector_extra_config": extra, "kv_connector": "TritonOffloadingConnector"},
        )()


def queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_the_dashboard_queries_this_backends_counters_and_vllms_offload_metrics() -> None:
    names = {name for expr in queries() for name in METRIC.findall(expr)}
    assert {f"vllm:triton_offload_{n}_total" for n in (
        "chunks_refused", "keys_quarantined", "loads_failed", "stores_failed", "jobs",
        "bytes", "verify_seconds")} <= names  # fmt: skip
    assert any(name.startswith("vllm:kv_offload_") for name in names)


def test_every_metric_and_label_the_dashboard_queries_exists() -> None:
    families = registered_families()
    problems = []
    for expr in queries():
        for name in METRIC.findall(expr):
            suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
            family = name[: -len(suffix)] if suffix else name
            if family not in families:
                problems.append(f"{name}: no metric family {family}")
                continue
            kind, labels = families[family]
            if suffix and SUFFIXES[suffix] != kind:
                problems.append(f"{name}: {family} is a {kind}, not a {SUFFIXES[suffix]}")
            for group in re.findall(r"by \(([^)]*)\)", expr):
                for label in (part.strip() for part in group.split(",")):
                    if label not in labels | ENGINE_LABELS:
                        problems.append(f"{expr}: {family} has no label {label!r}")
    assert problems == []
