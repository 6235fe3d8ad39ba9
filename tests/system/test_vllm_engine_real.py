"""This backend in vLLM's real engine on a CPU: ``vllm.LLM`` -> EngineCore -> worker ->
model runner -> attention layers calling the connector, with tiny random models.

Needs vLLM's compiled CPU kernels (``bash ci/engine_env.sh VENV`` builds an environment
with them); skipped without them, unless ``TRITON_OFFLOAD_REQUIRE_ENGINE=1``, where a
missing engine fails. Each engine runs in a fresh process (tests/helpers/engine_runner.py): a
cold round, ``reset_prefix_cache()`` (the device prefix cache only), then a hit round that
must be served from the host tier with the cold round's tokens and logprobs. Most
engines run with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and vLLM's single-process executor
(engine start-up is seconds instead of most of a minute on 2 cores, and the runner can
reach the region's mapping); two Llama engines run the way ``vllm serve`` does, with an
EngineCore process and worker processes (one; two under tensor parallel 2).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers.engine_models import prompt_ids, write_model
from tests.helpers.real_engine import engine_args, engine_problem, skip_or_fail

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(os.path.dirname(HERE), "helpers", "engine_runner.py")
#: One engine, start to shutdown; a hung engine fails its tests instead of the run.
ENGINE_TIMEOUT_S = 600
MiB = 1 << 20

#: Prompts of every hit round: several chunks each, and a shorter one sharing nothing.
LONG = prompt_ids(300, seed=1)
SHORT = prompt_ids(200, seed=2)
KEEPING = "mapped: buffers are still exported"


@pytest.fixture(scope="module")
def engine_ready() -> None:
    skip_or_fail(engine_problem())


def _extra(**more: Any) -> dict[str, Any]:
    return {"cpu_bytes_to_use": 64 * MiB, "backend": "torch", **more}


def _connector(**extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "TritonOffloadingConnector",
        "kv_connector_module_path": "triton_offload.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": _extra(**extra),
    }


def _offloading(spec_name: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": _extra(
            spec_name=spec_name, spec_module_path="triton_offload.vllm", **extra
        ),
    }


def _rounds(prompts: list[Any]) -> list[dict[str, Any]]:
    return [
        {"generate": "cold", "prompts": prompts},
        {"reset": True},
        {"generate": "hit", "prompts": prompts},
        {"shutdown": True},
    ]


QWEN_PROMPTS = [
    LONG,
    # Ending exactly on a block boundary, and mid-block (blocks of the engine's size).
    {"blocks": 2, "plus": 0, "seed": 3},
    {"blocks": 2, "plus": 7, "seed": 4},
]

#: name -> (model, kv_transfer_config, steps, tp): ``tp`` 0 runs everything in the
#: runner's process; ``tp`` >= 1 runs an EngineCore process and ``tp`` worker processes
#: (tensor parallel over gloo), as ``vllm serve`` does.
ENGINES: dict[str, tuple[str, Any, list[dict[str, Any]], int]] = {
    "llama-connector": ("llama", _connector(), _rounds([LONG, SHORT]), 1),
    "llama-tp2": ("llama", _connector(), _rounds([LONG, SHORT]), 2),
    "llama-spec": (
        "llama",
        _offloading("TritonOffloadingSpec"),
        _rounds([LONG, SHORT]),
        0,
    ),
    "mistral-swa": ("mistral-swa", _connector(), _rounds([LONG, SHORT]), 0),
    "gpt-oss": ("gpt-oss", _connector(), _rounds([LONG, SHORT]), 0),
    "qwen3-next": ("qwen3-next", _connector(), _rounds(QWEN_PROMPTS), 0),
}
HIT_ENGINES = list(ENGINES)

#: Sync loads (the hit's chunks load in the step that computes the rest of the prompt)
#: copied layer by layer; gpt-oss and Qwen3-Next have two groups: no sync loads.
LAYERWISE = {"sync_load_budget_bytes": 64 * MiB, "layerwise_loads": True}
LAYERWISE_ENGINES = {
    "llama-layerwise": ("llama", _connector(**LAYERWISE), _rounds([LONG, SHORT]), 0),
    "gpt-oss-layerwise": ("gpt-oss", _connector(**LAYERWISE), _rounds([LONG, SHORT]), 0),
    "qwen3-next-layerwise": ("qwen3-next", _connector(**LAYERWISE), _rounds(QWEN_PROMPTS), 0),
}
ENGINES.update(LAYERWISE_ENGINES)


def _failure_steps(policy: str) -> list[dict[str, Any]]:
    if policy == "recompute":
        return [
            {"generate": "cold", "prompts": [LONG, SHORT]},
            {"reset": True},
            {"corrupt": True},
            {"generate": "corrupt", "prompts": [LONG, SHORT]},
            {"reset": True},
            {"fail_copies": True},
            {"generate": "copy", "prompts": [LONG, SHORT]},
            {"shutdown": True},
        ]
    # Each failing request shares its batch with a new prompt (nothing to load).
    other = prompt_ids(300, seed=5)
    return [
        {"generate": "cold", "prompts": [LONG]},
        {"reset": True},
        {"corrupt": True},
        {"generate": "corrupt", "prompts": [LONG, prompt_ids(150, seed=7)]},
        {"generate": "after_corrupt", "prompts": [SHORT]},
        {"generate": "cold_other", "prompts": [other]},
        {"reset": True},
        {"fail_copies": True},
        {"generate": "copy", "prompts": [other, prompt_ids(150, seed=8)]},
        {"generate": "after_copy", "prompts": [prompt_ids(250, seed=6)]},
        {"shutdown": True},
    ]


for _policy in ("recompute", "fail"):
    ENGINES[f"llama-{_policy}"] = (
        "llama",
        {**_connector(), "kv_load_failure_policy": _policy},
        _failure_steps(_policy),
        0,
    )


class Engines:
    """Runs each engine of :data:`ENGINES` once (when a test first needs it)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.models = os.path.join(root, "models")

    def env(self, tp: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_ENABLE_V1_MULTIPROCESSING="1" if tp else "0",
        )
        if tp > 1:
            # vLLM binds each CPU worker's threads to a NUMA node of its own and refuses
            # more workers than nodes ("Not enough allowed NUMA nodes to bind threads of
            # 2 local CPUWorkers"): give each worker its share of this machine's CPUs.
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < tp:
                pytest.skip(f"tensor parallel {tp} needs {tp} CPUs, {len(cpus)} here")
            share = len(cpus) // tp
            groups = [cpus[i * share : (i + 1) * share] for i in range(tp)]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        return env

    def run(
        self,
        name: str,
        model: str,
        kv_config: Any,
        steps: list[dict[str, Any]],
        tp: int,
    ) -> dict[str, Any]:
        folder = write_model(model, self.models)
        engine = engine_args(folder, kv_config, tp)
        out = os.path.join(self.root, f"{name}.json")
        spec_path = os.path.join(self.root, f"{name}.spec.json")
        with open(spec_path, "w") as f:
            json.dump({"engine": engine, "steps": steps, "out": out}, f)
        log_path = os.path.join(self.root, f"{name}.log")
        with open(log_path, "w") as log:
            subprocess.run(
                [sys.executable, RUNNER, spec_path],
                env=self.env(tp),
                cwd=self.root,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=ENGINE_TIMEOUT_S,
                check=False,
            )
        with open(log_path) as f:
            log_text = f.read()
        if not os.path.exists(out):
            pytest.fail(f"engine {name} wrote no report; its log ends:\n{log_text[-4000:]}")
        with open(out) as f:
            report = json.load(f)
        report["log"] = log_text
        report["name"] = name
        return report

    @functools.cache  # noqa: B019  (one instance per module)
    def get(self, name: str) -> dict[str, Any]:
        report = self.run(name, *ENGINES[name])
        if report["error"]:
            pytest.fail(f"engine {name} failed:\n{report['error']}\nlog:\n{report['log'][-3000:]}")
        return report


@pytest.fixture(scope="module")
def engines(engine_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Engines:
    return Engines(str(tmp_path_factory.mktemp("engine")))


def _delta(report: dict[str, Any], step: str, before: str | None, counter: str) -> float:
    value = report["steps"][step]["metrics"][f"vllm:{counter}"]
    if before is not None:
        value -= report["steps"][before]["metrics"][f"vllm:{counter}"]
    return value


def _outputs(report: dict[str, Any], step: str) -> list[dict[str, Any]]:
    return report["steps"][step]["outputs"]


#: Logprobs of a hit and a cold round agree to float32 rounding, not always bit for bit:
#: the CPU kernels' reductions are not bitwise reproducible from run to run (one logprob
#: of the Llama engine was seen 7e-7 apart, with its EngineCore in a process of its own,
#: and between two processes); a wrong byte loaded moves them by far more.
LOGPROB_TOLERANCE = 1e-5


def _assert_same(report: dict[str, Any], step: str, reference: str = "cold") -> None:
    """``step``'s outputs are ``reference``'s: the same tokens and logprobs."""
    for index, (cold, hit) in enumerate(
        zip(_outputs(report, reference), _outputs(report, step), strict=True)
    ):
        where = f"{report['name']} prompt {index}: {step} vs {reference}"
        assert hit["tokens"] == cold["tokens"], where
        assert None not in hit["logprobs"], f"{where}: no logprobs"
        assert hit["logprobs"] == pytest.approx(cold["logprobs"], abs=LOGPROB_TOLERANCE), where


def _assert_served_from_host(report: dict[str, Any], step: str, before: str | None) -> None:
    hits = _delta(report, step, before, "external_prefix_cache_hits")
    loaded = _delta(report, step, before, "kv_offload_load_bytes")
    assert hits > 0, f"{report['name']}: {step} had no external prefix-cache hit"
    assert loaded > 0, f"{report['name']}: {step} loaded no bytes from the host tier"


@pytest.mark.slow
@pytest.mark.parametrize("name", HIT_ENGINES)
def test_hit_round_matches_cold_round(engines: Engines, name: str) -> None:
    report = engines.get(name)
    assert report["reset"], "reset_prefix_cache() refused"
    assert _delta(report, "cold", None, "external_prefix_cache_hits") == 0
    assert _delta(report, "cold", None, "kv_offload_store_bytes") > 0
    _assert_served_from_host(report, "hit", "cold")
    # The device prefix cache was reset: every hit token came from the host tier.
    assert _delta(report, "hit", "cold", "prefix_cache_hits") == 0
    _assert_same(report, "hit")
    for output in _outputs(report, "hit"):
        assert output["finish_reason"] == "length"


@pytest.mark.slow
def test_mamba_align_hit_on_and_off_a_block_boundary(engines: Engines) -> None:
    """Qwen3-Next (a gated delta net in Mamba cache mode ``align`` + full attention):
    a prompt ending on a block boundary and one ending mid-block get the cold round's
    output from a hit (the Mamba state restored is the one at the hit's end)."""
    report = engines.get("qwen3-next")
    cold, hit = _outputs(report, "cold"), _outputs(report, "hit")
    assert report["block_size"] > 0
    for index in (1, 2):
        where = f"prompt {index} (block {report['block_size']})"
        assert hit[index]["tokens"] == cold[index]["tokens"], where
        assert hit[index]["logprobs"] == pytest.approx(
            cold[index]["logprobs"], abs=LOGPROB_TOLERANCE
        ), where
    _assert_served_from_host(report, "hit", "cold")


@pytest.mark.slow
@pytest.mark.parametrize("name", [*HIT_ENGINES, "llama-recompute", "llama-fail"])
def test_shutdown_releases_the_host_region(engines: Engines, name: str) -> None:
    report = engines.get(name)
    after = report["after_shutdown"]
    assert after["files"] == [], f"{name}: region files left in /dev/shm"
    assert KEEPING not in report["log"], f"{name}: the region stayed mapped at shutdown"
    if ENGINES[name][3] == 0:
        # The workers ran in the runner's process: their mapping is seen there.
        assert report["mapped_at_start"], f"{name}: no region mapping while running"
        assert after["mapped"] == [], f"{name}: the region is still mapped after shutdown"


@pytest.mark.slow
def test_failed_loads_recompute(engines: Engines) -> None:
    """``kv_load_failure_policy="recompute"``: a host chunk with a flipped byte, then a
    copy that raises, are recomputed: the same tokens and logprobs as the cold round."""
    report = engines.get("llama-recompute")
    assert report["corrupted"] > 0
    _assert_same(report, "corrupt")
    _assert_same(report, "copy")
    assert "failed verification" in report["log"]  # the worker refused the chunk
    assert "test: the copy from the host pool failed" in report["log"]
    for step in ("corrupt", "copy"):
        assert _delta(report, step, None, "external_prefix_cache_queries") > 0


@pytest.mark.slow
def test_failed_loads_fail_the_request_only(engines: Engines) -> None:
    """``kv_load_failure_policy="fail"``: the request whose load failed (a corrupted
    chunk; a copy that raised) finishes with an error; the request in the same batch
    and the next one are served."""
    report = engines.get("llama-fail")
    assert report["corrupted"] > 0
    cold = _outputs(report, "cold")[0]
    assert cold["finish_reason"] == "length"
    for step in ("corrupt", "copy"):
        failed, beside = _outputs(report, step)
        assert failed["finish_reason"] == "error", step
        assert beside["finish_reason"] == "length", step
        assert len(beside["tokens"]) == 8
    assert "failed verification" in report["log"]  # the worker refused the chunk
    assert "test: the copy from the host pool failed" in report["log"]
    for step in ("after_corrupt", "after_copy"):
        (served,) = _outputs(report, step)
        assert served["finish_reason"] == "length", step
        assert len(served["tokens"]) == 8


def _triton(report: dict[str, Any], step: str, name: str, **labels: str) -> float:
    """A triton_offload counter in ``LLM.get_metrics()`` after ``step`` (0: not there)."""
    text = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return report["steps"][step]["triton_counters"].get(f"vllm:triton_offload_{name}{{{text}}}", 0)


@pytest.mark.slow
def test_this_backends_counters_reach_get_metrics(engines: Engines) -> None:
    """``LLM.get_metrics()`` (stats logging on) shows the ``vllm:triton_offload_*``
    counters: each copy path's jobs and bytes; the health counters at 0 from start-up;
    after a corrupted host region, the chunks refused (reason, tier), the keys
    quarantined and the failed loads. In this process
    (llama-recompute) and from an EngineCore process (llama-connector)."""
    report = engines.get("llama-recompute")
    assert report["corrupted"] > 0
    assert _triton(report, "cold", "jobs", path="torch", direction="store") > 0
    assert _triton(report, "cold", "bytes", path="torch", direction="store") > 0
    assert _triton(report, "cold", "chunks_refused", reason="checksum", tier="host") == 0
    assert _triton(report, "cold", "loads_failed") == 0
    assert _triton(report, "corrupt", "chunks_refused", reason="checksum", tier="host") > 0
    assert _triton(report, "corrupt", "keys_quarantined", tier="host") > 0
    assert _triton(report, "corrupt", "loads_failed") > 0
    assert _triton(report, "corrupt", "jobs", path="torch", direction="load") > 0
    served = engines.get("llama-connector")
    assert _triton(served, "hit", "jobs", path="torch", direction="load") > 0
    assert _triton(served, "hit", "bytes", path="torch", direction="load") > 0
    # The health counters are there from start-up, at 0 until something goes wrong.
    hit_counters = served["steps"]["hit"]["triton_counters"]
    assert "vllm:triton_offload_loads_failed{}" in hit_counters
    assert "vllm:triton_offload_chunks_refused{reason=checksum,tier=host}" in hit_counters
    assert not any(value for name, value in hit_counters.items() if "chunks_refused" in name)
    # One start-up line per worker says what it chose: path, seals and what fits.
    for run in (report, served):
        lines = [line for line in run["log"].splitlines() if "chunks fit" in line]
        assert len(lines) == 2, lines  # the scheduler's line and the worker's
        (worker,) = [line for line in lines if "worker rank 0" in line]
        assert "backend=torch (every plane by torch)" in worker and "host chunks" in worker


@pytest.fixture(scope="module")
def tier_runs(
    engines: Engines, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Two engines with ``TritonTieringOffloadingSpec`` and an ``fs`` tier, one after
    the other in new processes: the first stores, the second must be served."""
    root = str(tmp_path_factory.mktemp("fs-tier"))
    kv = _offloading(
        "TritonTieringOffloadingSpec", secondary_tiers=[{"type": "fs", "root_dir": root}]
    )
    prompts = [LONG, SHORT]
    first = engines.run(
        "tier-first",
        "llama",
        kv,
        [{"generate": "cold", "prompts": prompts}, {"shutdown": True}],
        0,
    )
    second = engines.run(
        "tier-second",
        "llama",
        kv,
        [{"generate": "hit", "prompts": prompts}, {"shutdown": True}],
        0,
    )
    return first, second, root


@pytest.mark.slow
def test_fs_tier_serves_a_restarted_engine(
    tier_runs: tuple[dict[str, Any], dict[str, Any], str],
) -> None:
    """``TritonTieringOffloadingSpec`` with an ``fs`` tier: a second engine, in a new
    process, is served from the files the first one wrote."""
    first, second, root = tier_runs
    assert first["error"] is None, first["error"]
    assert any(files for _, _, files in os.walk(root)), "the fs tier wrote no file"
    assert second["error"] is None, second["error"]
    _assert_served_from_host(second, "hit", None)
    first["steps"]["hit"] = second["steps"]["hit"]
    _assert_same(first, "hit")
    for report in (first, second):
        assert report["after_shutdown"] == {"files": [], "mapped": []}, report["name"]


@pytest.fixture(scope="module")
def checkpoint_runs(
    engine_ready: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Two checkpoints saved in turn at one path (so one model name: vLLM's names carry
    the path, not the weights), each served by an engine with
    ``TritonTieringOffloadingSpec`` and one shared ``fs`` tier: the first stores, the
    second, a re-saved checkpoint with other weights, runs the same prompts."""
    runs = Engines(str(tmp_path_factory.mktemp("checkpoints")))
    root = os.path.join(runs.root, "fs")
    kv = _offloading(
        "TritonTieringOffloadingSpec", secondary_tiers=[{"type": "fs", "root_dir": root}]
    )
    steps = [{"generate": "cold", "prompts": [LONG, SHORT]}, {"shutdown": True}]
    first = runs.run("checkpoint-seed0", "llama", kv, steps, 0)
    shutil.rmtree(write_model("llama", runs.models))
    write_model("llama", runs.models, seed=1)
    second = runs.run("checkpoint-seed1", "llama", kv, steps, 0)
    return first, second, root


@pytest.mark.slow
def test_a_re_saved_checkpoint_is_never_served_the_old_ones_chunks(
    checkpoint_runs: tuple[dict[str, Any], dict[str, Any], str],
) -> None:
    first, second, root = checkpoint_runs
    for report in (first, second):
        assert report["error"] is None, report["error"]
    # The second engine found none of the first's chunks: no hit, no byte loaded.
    assert _delta(second, "cold", None, "external_prefix_cache_hits") == 0
    assert _delta(second, "cold", None, "kv_offload_load_bytes") == 0
    for report in (first, second):
        assert _delta(report, "cold", None, "kv_offload_store_bytes") > 0, report["name"]
    # The weights differ (else this test proves nothing): so do the greedy tokens.
    assert [o["tokens"] for o in _outputs(first, "cold")] != [
        o["tokens"] for o in _outputs(second, "cold")
    ]
    # Each checkpoint's chunks under a storage name of its own (vLLM's fs tier writes a
    # folder per name for its config.json, and one per rank for the chunks).
    names = [entry for entry in os.listdir(root) if not entry.endswith("_r0")]
    assert len(names) == 2, os.listdir(root)


@pytest.mark.slow
def test_tiering_shutdown_leaves_no_region_mapped(
    tier_runs: tuple[dict[str, Any], dict[str, Any], str],
) -> None:
    for report in tier_runs[:2]:
        assert KEEPING not in report["log"], f"{report['name']}: the region stayed mapped"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYERWISE_ENGINES))
def test_layerwise_sync_loads_give_the_cold_rounds_tokens(engines: Engines, name: str) -> None:
    report = engines.get(name)
    _assert_served_from_host(report, "hit", "cold")
    assert _delta(report, "hit", "cold", "prefix_cache_hits") == 0
    _assert_same(report, "hit")
    log = report["log"]
    assert "layer-wise sync loads on" in log, log[-2000:]
    assert "layer-wise loads off from now on" not in log
    if name.startswith("llama"):
        assert "first layer-wise sync load" in log
    else:
        # Two cache groups (sliding window + full; GDN + full): vLLM's scheduler cannot
        # hear of a failed sync load per group, so the connector gives no sync loads.
        assert "first layer-wise sync load" not in log
