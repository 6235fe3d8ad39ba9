"""``vllm serve`` with this backend, as a user runs it: vLLM's OpenAI server (API server
process, EngineCore process, worker process) started with the README's
``--kv-transfer-config`` line on a tiny Llama written locally (byte-level tokenizer,
``--dtype float32``), queried with the ``openai`` client, stopped with Ctrl-C (SIGINT to
its process group) and, in a second run, SIGTERM; then configurations with a mistake,
refused before the model loads.

The only change to the README's line: ``cpu_bytes_to_use`` is 64 MiB instead of 16 GiB.
vLLM writes every page of the host region when the worker maps it (``MADV_POPULATE_WRITE``
into /dev/shm), so the README's 16 GiB takes 16 GiB of RAM at start-up; beside vLLM's CPU
KV cache it got the worker killed for memory on the 23 GiB machine CI runs on. The
server flags beyond the README's are the test's own: a local model, 127.0.0.1 and a free
port, ``--enforce-eager`` (no compilation warm-up: about 20 s less per start on 2 cores),
a 64 MiB device KV cache, and ``VLLM_SERVER_DEV_MODE=1`` for ``POST /reset_prefix_cache``.

Needs vLLM's compiled CPU kernels and its OpenAI server's dependencies (``bash
ci/engine_env.sh VENV`` builds such an environment); skipped without them, unless
``TRITON_OFFLOAD_REQUIRE_ENGINE=1``, where a missing engine fails.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.helpers.engine_models import write_model
from tests.helpers.real_engine import engine_problem, skip_or_fail
from tests.helpers.vllm_serve import (
    EXIT_GUARD_S,
    Server,
    alive,
    logging_config,
    readme_serve_config,
    write_byte_tokenizer,
)

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
MODEL_NAME = "tiny-llama"
#: One prompt of 1,000 tokens (one byte each): several chunks, and a tail that is not one.
PROMPT = "".join(random.Random(7).choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(1000))
MAX_TOKENS = 16
#: The scheduler's start-up line (README, "How to tell it works"): tokens per GPU block.
SPANS_LINE = r"TritonOffloadingConnector \(triton_offload\): spans \[(\d+)\] tokens per block"
#: Labels vLLM adds to every sample of an engine.
ENGINE_LABELS = ("engine", "model_name")
#: The health counters, exported at 0 from the first scrape (docs/vllm.md#counters).
REFUSAL_REASONS = (
    "checksum",
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


def _server_problem() -> str | None:
    """Why ``vllm serve`` cannot run on vLLM's real CPU engine here, or None."""
    problem = engine_problem()
    if problem is not None:
        return problem
    try:
        # What `vllm serve` imports (its OpenAI server's dependencies: orjson, fastapi,
        # ...), and the client the tests ask with.
        import openai  # noqa: F401
        import vllm.entrypoints.cli.serve  # noqa: F401
    except Exception as error:
        return f"vLLM's OpenAI server or the openai client does not import ({error})"
    return None


@pytest.fixture(scope="module")
def engine_ready() -> None:
    skip_or_fail(_server_problem())


def served_config(**extra: Any) -> dict[str, Any]:
    """The README's ``--kv-transfer-config``, ``cpu_bytes_to_use`` lowered (module
    docstring), ``extra`` keys added to its extra config."""
    config = readme_serve_config()
    config["kv_connector_extra_config"]["cpu_bytes_to_use"] = 64 * MiB
    config["kv_connector_extra_config"].update(extra)
    return config


class Runs:
    """The module's ``vllm serve`` runs, each started once when a test first needs it."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.model = write_model("llama", os.path.join(root, "models"))
        if not os.path.exists(os.path.join(self.model, "tokenizer.json")):
            write_byte_tokenizer(self.model)
        self.env = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_SERVER_DEV_MODE": "1",
        }
        self.records: dict[str, dict[str, Any] | AssertionError] = {}

    def server(self, name: str, config: dict[str, Any], *more: str) -> Server:
        args = [
            self.model,
            "--served-model-name",
            MODEL_NAME,
            "--enable-prefix-caching",
            "--kv-transfer-config",
            json.dumps(config),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(64 * MiB),
            "--max-model-len",
            "2048",
            "--seed",
            "0",
            *more,
        ]
        return Server(self.root, name, args, self.env)

    def served(self, stop: str) -> dict[str, Any]:
        """Start the README's configuration, ask the prompt cold, reset vLLM's device prefix
        cache, ask it again (served from the host tier), then stop with ``stop``
        (``"SIGINT"`` to the process group, or ``"SIGTERM"`` to the server). Run once;
        a run that failed fails every test that reads it, without running again."""
        if stop not in self.records:
            try:
                self.records[stop] = self._serve(stop)
            except AssertionError as error:
                self.records[stop] = error
        record = self.records[stop]
        if isinstance(record, AssertionError):
            raise record
        return record

    def _serve(self, stop: str) -> dict[str, Any]:
        server = self.server(f"serve-{stop}", served_config())
        record: dict[str, Any] = {"server": server}
        try:
            server.start().wait_ready()
            record["metrics_at_start"] = metrics(server)
            record["cold"] = complete(server)
            record["reset"] = reset_prefix_cache(server)
            record["hit"] = complete(server)
            record["metrics"] = metrics(server)
            record["metrics_text"] = server.get("/metrics")[1]
            record["children"] = server.child_pids()
            record["engine_id"] = server.engine_id()
            stopped = time.monotonic()
            server.interrupt() if stop == "SIGINT" else server.terminate()
            record["status"] = server.wait_exit()
            record["exit_s"] = time.monotonic() - stopped
            record["children_left"] = wait_gone(record["children"])
        finally:
            server.kill_tree()
        record["log"] = server.log()
        record["project_warnings"] = server.project_warnings()
        record["region_files"] = glob.glob(f"/dev/shm/vllm_offload_{record['engine_id']}*")
        return record


@pytest.fixture(scope="module")
def runs(engine_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(str(tmp_path_factory.mktemp("serve")))


def complete(server: Server) -> Any:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )


def reset_prefix_cache(server: Server) -> str:
    """``POST /reset_prefix_cache`` (vLLM's device prefix cache only), repeated while vLLM
    answers ``success: false`` (blocks still held by a store in flight); hang guard 60 s."""
    deadline = time.monotonic() + 60
    while True:
        status, body = server.get("/reset_prefix_cache", method="POST")
        assert status == 200, f"POST /reset_prefix_cache: {status} {body}"
        if json.loads(body).get("success") or time.monotonic() > deadline:
            return body
        time.sleep(0.2)


def metrics(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as {(sample name, labels without the engine's own): value}, summed
    over engines."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = server.get("/metrics")
    assert status == 200, f"/metrics: {status}"
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in sample.labels.items() if k not in ENGINE_LABELS)
            )
            key = (sample.name, labels)
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def wait_gone(pids: list[int]) -> list[int]:
    """The processes of ``pids`` still running once they end or the hang guard runs out."""
    deadline = time.monotonic() + EXIT_GUARD_S
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.2)
    return [pid for pid in pids if alive(pid)]


def tokens_of(completion: Any) -> list[str]:
    return list(completion.choices[0].logprobs.tokens)


# ------------------------------------------------------------------------- a served hit


@pytest.mark.slow
def test_the_readmes_line_serves_a_hit_from_the_host_tier_with_the_cold_text(runs: Runs) -> None:
    record = runs.served("SIGINT")
    cold, hit = record["cold"], record["hit"]
    assert json.loads(record["reset"]) == {"success": True}
    assert cold.usage.prompt_tokens == len(PROMPT) == hit.usage.prompt_tokens
    assert len(tokens_of(cold)) == MAX_TOKENS
    # float32 on both rounds: the hit's KV is the cold round's bytes, so greedy decoding
    # gives the same text token for token.
    assert hit.choices[0].text == cold.choices[0].text
    assert tokens_of(hit) == tokens_of(cold)
    # vLLM's own books: the hit's prefix came from the connector, whole chunks of the
    # prompt short of its last token (spans and chunk size as the start-up line says).
    spans = re.search(SPANS_LINE, record["log"])
    assert spans, "the scheduler's start-up line (README, How to tell it works) is missing"
    blocks_per_chunk = readme_serve_config()["kv_connector_extra_config"]["blocks_per_chunk"]
    chunk_tokens = int(spans.group(1)) * blocks_per_chunk
    expected_hit = (len(PROMPT) - 1) // chunk_tokens * chunk_tokens
    samples = record["metrics"]
    assert samples[("vllm:external_prefix_cache_hits_total", ())] == expected_hit
    assert samples[("vllm:prefix_cache_hits_total", ())] == 0  # the device cache was reset


@pytest.mark.slow
def test_the_start_up_lines_the_readme_quotes_are_logged(runs: Runs) -> None:
    log = runs.served("SIGINT")["log"]
    for line in (
        r"TritonOffloadingSpec \(triton_offload\): scheduler uses vLLM's CPUOffloadingManager, "
        r"\d+ host chunks of 2 blocks",
        r"TritonOffloadingConnector \(triton_offload\): spans \[\d+\] tokens per block match",
        r"TritonOffloadingSpec \(triton_offload\): checkpoint files:[0-9a-f]+",
        r"TritonOffloadingSpec \(triton_offload [^)]+\): worker rank 0 owns page 0 of each chunk; "
        r"shared region /dev/shm/vllm_offload_\S+\.mmap",
    ):
        assert re.search(line, log), f"no start-up line matching {line!r}"


@pytest.mark.slow
def test_the_counters_are_on_metrics_from_the_first_scrape_and_count_the_copies(
    runs: Runs,
) -> None:
    record = runs.served("SIGINT")
    health = [
        *(
            ("vllm:triton_offload_chunks_refused_total", (("reason", r), ("tier", "host")))
            for r in REFUSAL_REASONS
        ),
        ("vllm:triton_offload_keys_quarantined_total", (("tier", "host"),)),
        ("vllm:triton_offload_loads_failed_total", ()),
        ("vllm:triton_offload_stores_failed_total", ()),
    ]
    for when in ("metrics_at_start", "metrics"):
        for key in health:
            assert record[when].get(key) == 0, f"{key} at {when}: {record[when].get(key)}"
    samples = record["metrics"]
    store = (("direction", "store"), ("path", "torch"))
    load = (("direction", "load"), ("path", "torch"))
    assert samples[("vllm:triton_offload_jobs_total", store)] >= 1
    assert samples[("vllm:triton_offload_jobs_total", load)] >= 1
    # The hit loaded the chunks it was served from: the bytes of that many rows.
    rows = re.search(r"(\d+)-byte rows on cpu", record["log"])
    assert rows, "the worker's start-up line names no row size"
    spans = re.search(SPANS_LINE, record["log"])
    assert spans
    chunk_tokens = int(spans.group(1)) * 2
    loaded_chunks = (len(PROMPT) - 1) // chunk_tokens
    assert samples[("vllm:triton_offload_bytes_total", load)] == loaded_chunks * int(rows.group(1))
    assert samples[("vllm:triton_offload_bytes_total", store)] >= loaded_chunks * int(rows.group(1))


# ---------------------------------------------------------------------------- stopping


def test_the_warning_judge_sees_this_backends_warnings_and_only_those(
    engine_ready: None, tmp_path: Any
) -> None:
    """The servers' logging configuration (vLLM's own plus one file) files a WARNING of
    either logger of this project, and no line of vLLM's own loggers."""
    warnings_path = tmp_path / "warnings.log"
    config_path = tmp_path / "logging.json"
    config_path.write_text(json.dumps(logging_config(str(warnings_path))))
    # vLLM applies VLLM_LOGGING_CONFIG_PATH as `vllm serve` does, from its (empty) args.
    code = (
        "import argparse, logging\n"
        "import vllm.logger\n"
        "vllm.logger.configure_logging_from_args(argparse.Namespace())\n"
        "logging.getLogger('vllm.triton_offload').warning('connector warns')\n"
        "logging.getLogger('vllm.triton_offload').info('connector informs')\n"
        "logging.getLogger('triton_offload.transfer.engine').error('engine errs')\n"
        "logging.getLogger('vllm.v1.engine.core').warning('vllm warns')\n"
    )
    env = {**os.environ, "VLLM_LOGGING_CONFIG_PATH": str(config_path)}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)
    filed = warnings_path.read_text()
    assert "connector warns" in filed and "engine errs" in filed
    assert "connector informs" not in filed and "vllm warns" not in filed


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_a_signal_stops_every_process_and_leaves_no_region(runs: Runs, stop: str) -> None:
    record = runs.served(stop)
    assert record["children"], "the log names no EngineCore or worker process"
    assert record["children_left"] == [], f"still running after {stop}: {record['children_left']}"
    assert record["region_files"] == [], f"host region files left: {record['region_files']}"


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_no_warning_from_this_backend_from_start_to_stop(runs: Runs, stop: str) -> None:
    record = runs.served(stop)
    assert record["project_warnings"] == "", record["project_warnings"]


# ------------------------------------------------------------ mistakes, before the model


def _tail(text: str, lines: int) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-lines:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mistake", "refusal"),
    [
        (
            {"verify_chunk": False},
            "'verify_chunk' is not a key of triton_offload or of vLLM ",
        ),
        (
            {
                "spec_name": "TritonTieringOffloadingSpec",
                "secondary_tiers": [{"type": "fs", "root_dir": "{root}/a-file/kv"}],
            },
            "cannot be used as the fs tier's folder: {root}/a-file is a file, not a folder",
        ),
    ],
    ids=["misspelt-key", "tier-folder-under-a-file"],
)
def test_a_mistake_is_refused_before_the_model_loads_in_the_last_lines(
    runs: Runs, mistake: dict[str, Any], refusal: str, request: pytest.FixtureRequest
) -> None:
    root = os.path.join(runs.root, "mistakes")
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "a-file"), "w") as f:
        f.write("not a folder")
    config = served_config(**json.loads(json.dumps(mistake).replace("{root}", root)))
    server = runs.server(f"mistake-{request.node.callspec.id}", config)
    try:
        status = server.start().wait_exit()
    finally:
        server.kill_tree()
    log = server.log()
    assert status != 0
    assert "Starting to load model" not in log
    refusal = refusal.replace("{root}", root)
    tail = _tail(log, 5)
    assert any(refusal in line for line in tail), "\n".join(tail)


def test_every_metric_the_dashboard_queries_is_on_the_servers_metrics(runs: Runs) -> None:
    """dashboards/triton_offload.json's PromQL names only what the real server exposes:
    each counter's ``_total``, each histogram's ``_bucket``/``_sum``/``_count`` (families
    without a labelled child yet are exposed by their type line and count too)."""
    from prometheus_client.parser import text_string_to_metric_families

    record = runs.served("SIGINT")
    exposed: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    for family in text_string_to_metric_families(record["metrics_text"]):
        exposed |= {sample.name for sample in family.samples}
        exposed |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    dashboard = os.path.join(os.path.dirname(os.path.dirname(HERE)), "dashboards")
    with open(os.path.join(dashboard, "triton_offload.json")) as file:
        board = json.load(file)
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    queried = {name for expr in exprs for name in re.findall(r"\bvllm:[a-z_:]+", expr)}
    assert queried, "the dashboard queries no vllm: metric"
    assert sorted(queried - exposed) == []


@pytest.mark.slow
def test_a_capacity_that_holds_no_chunk_is_refused_before_the_model_loads(runs: Runs) -> None:
    """A ``cpu_bytes_to_use`` below the least one chunk of this (plain attention) model can
    take is refused from its configuration while vLLM builds it, before ``Starting to load
    model``, naming that floor; the spec's exact figure after the model loaded is never
    below it (with ``--disable-hybrid-kv-cache-manager`` vLLM 0.33 looks no connector
    class up before the model loads, so only the spec's check runs there)."""
    config = served_config(cpu_bytes_to_use=1000)
    least = {}
    for name, more in (("early", ()), ("late", ("--disable-hybrid-kv-cache-manager",))):
        server = runs.server(f"capacity-{name}", config, *more)
        try:
            status = server.start().wait_exit()
        finally:
            server.kill_tree()
        log = server.log()
        assert status != 0
        found = re.findall(
            r"'cpu_bytes_to_use'\] 1000 holds no chunk: one chunk takes (at least )?(\d+) bytes",
            log,
        )
        assert found, "\n".join(_tail(log, 20))
        floor, figure = found[-1]
        least[name] = int(figure)
        if name == "early":
            assert floor and "Starting to load model" not in log
            assert any("holds no chunk" in line for line in _tail(log, 5))
        else:
            assert not floor and "Starting to load model" in log
    assert 1000 < least["early"] <= least["late"], least
