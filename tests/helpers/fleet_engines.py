"""Engines of a fleet for tests/system/test_vllm_fleet_real.py: each a ``vllm.LLM`` in a
process of its own (tests/helpers/fleet_runner.py), alive until the test stops it, driven
over a pipe.

The test process starts and stops every engine by PID: :meth:`FleetEngine.close` asks
for a clean shutdown and kills the process if it does not come; :meth:`FleetEngine.kill`
is SIGKILL, as a crashed node. Either way the engine's ``/dev/shm`` files (its host
region, this backend's plane notes: every name carries the engine id) are looked for
afterwards and removed, and :meth:`Fleet.close` reports what it had to remove.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

from tests.helpers.real_engine import engine_args

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fleet_runner.py")
MiB = 1 << 20
#: Hang guards: an engine's start, one command, a clean shutdown (generous: the engines
#: share 2 CPUs with each other and with whatever else runs).
START_TIMEOUT_S = 600.0
COMMAND_TIMEOUT_S = 300.0
SHUTDOWN_TIMEOUT_S = 60.0

#: NIXL's UCX backend between two processes of one machine: shared memory and TCP over
#: the loopback device only.
UCX_LOOPBACK_ENV = {"UCX_TLS": "sm,self,tcp", "UCX_NET_DEVICES": "lo"}


def engine_env(tp: int) -> dict[str, str]:
    """The environment of an engine: vLLM's CPU platform, no hub; ``tp`` 0 runs the
    EngineCore and its worker in the runner's process, ``tp`` >= 1 an EngineCore
    process and ``tp`` worker processes, each bound to its share of this machine's CPUs
    (vLLM refuses more CPU workers than NUMA nodes otherwise)."""
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if tp else "0",
        **UCX_LOOPBACK_ENV,
    )
    if tp > 1:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < tp:
            raise RuntimeError(f"tensor parallel {tp} needs {tp} CPUs, {len(cpus)} here")
        share = len(cpus) // tp
        groups = [cpus[i * share : (i + 1) * share] for i in range(tp)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def tiering(
    tiers: list[dict[str, Any]], engine_id: str | None = None, **extra: Any
) -> dict[str, Any]:
    """A ``kv_transfer_config``: this backend's connector with
    ``TritonTieringOffloadingSpec``, a 64 MiB host region and ``tiers``; a load that
    fails (a chunk refused by its seal) is recomputed, as a fleet sharing tiers wants
    (vLLM's default policy, ``fail``, ends the request with an error)."""
    return {
        "kv_connector": "TritonOffloadingConnector",
        "kv_connector_module_path": "triton_offload.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "engine_id": engine_id or f"fleet-{uuid.uuid4().hex[:12]}",
        "kv_connector_extra_config": {
            "spec_name": "TritonTieringOffloadingSpec",
            "spec_module_path": "triton_offload.vllm",
            "cpu_bytes_to_use": 64 * MiB,
            "backend": "torch",
            "secondary_tiers": tiers,
            **extra,
        },
    }


def fs_tier(root: str) -> dict[str, Any]:
    return {"type": "fs", "root_dir": root, "n_read_threads": 1, "n_write_threads": 1}


def p2p_tier(port: int) -> dict[str, Any]:
    return {"type": "p2p", "host": "127.0.0.1", "port": port, "num_threads": 1}


class EngineError(RuntimeError):
    """An engine failed a command (its traceback and the end of its log), or did not
    answer in time."""


class FleetEngine:
    """One engine process, started on construction (:meth:`wait_started` waits for it)."""

    def __init__(self, name: str, folder: str, args: dict[str, Any], tp: int, cwd: str) -> None:
        self.name = name
        self.tp = tp
        self.engine_id: str = args["kv_transfer_config"]["engine_id"]
        spec_path = os.path.join(folder, f"{name}.spec.json")
        with open(spec_path, "w") as f:
            json.dump({"engine": args}, f)
        self.log_path = os.path.join(folder, f"{name}.log")
        read, write = os.pipe()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, RUNNER, spec_path, str(write)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write,),
                env=engine_env(tp),
                cwd=cwd,
            )
        os.close(write)
        self.pid = self.process.pid
        self._replies = read
        self._pending = b""
        self.started: dict[str, Any] | None = None

    # ------------------------------------------------------------------ protocol

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def _fail(self, what: str) -> EngineError:
        return EngineError(
            f"engine {self.name} (pid {self.pid}): {what}\nlog:\n{self.log()[-4000:]}"
        )

    def _reply(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"no answer within {timeout_s} s")
            ready, _, _ = select.select([self._replies], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                self.process.wait(10)
                raise self._fail(f"ended (exit code {self.process.returncode}) without answering")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        message = json.loads(line)
        if not message["ok"]:
            raise self._fail(message["error"])
        return message["value"]

    def wait_started(self) -> dict[str, Any]:
        if self.started is None:
            self.started = self._reply(START_TIMEOUT_S)
        return self.started

    def call(self, command: str, timeout_s: float = COMMAND_TIMEOUT_S, **args: Any) -> Any:
        self.wait_started()
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps({"command": command, **args}) + "\n").encode())
        self.process.stdin.flush()
        return self._reply(timeout_s)

    # ------------------------------------------------------------------ commands

    def generate(
        self, prompts: list[list[int]], source: int | None = None, max_tokens: int = 8
    ) -> dict[str, Any]:
        return self.call("generate", prompts=prompts, source=source, max_tokens=max_tokens)

    def settle(self) -> None:
        self.call("settle")

    def reset(self) -> None:
        """Empty the device prefix cache and the host tier (the secondary tiers stay)."""
        if not self.call("reset"):
            raise self._fail("reset_prefix_cache(reset_connector=True) refused")

    def metrics(self) -> dict[str, float]:
        return self.call("metrics")

    def chunk_files(self, prompt: list[int]) -> list[str]:
        return self.call("chunk_files", prompt=prompt)

    def stall_fs_store(self, chunk_file: str, marker: str) -> None:
        self.call("stall_fs_store", chunk_file=chunk_file, marker=marker)

    # ------------------------------------------------------------------ ending

    def alive(self) -> bool:
        return self.process.poll() is None

    def shm_files(self) -> list[str]:
        """This engine's files in /dev/shm (every name carries the engine id)."""
        return sorted(glob.glob(f"/dev/shm/*{self.engine_id}*"))

    def remove_cpu_communicator_files(self) -> list[str]:
        """Remove what vLLM's CPU tensor-parallel communicator of this (stopped) engine left
        in /dev/shm (``vllm_dist_<id>-tp:...-cpushm_<rank>``, named in its log; vLLM 0.33
        does not always remove them at shutdown); the paths removed."""
        assert not self.alive(), "the engine still runs"
        removed = []
        for name in sorted(set(re.findall(r"vllm_dist_[0-9a-f]{32}", self.log()))):
            for path in glob.glob(f"/dev/shm/{glob.escape(name)}-*"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed.append(path)
        return removed

    def kill(self) -> None:
        """SIGKILL: the engine disappears with no clean-up of its own."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.wait(30)
        self._close_pipes()

    def close(self) -> None:
        """A clean shutdown if the engine still runs; SIGKILL if it does not come."""
        if self.alive():
            try:
                self.started = self.started or {}
                self.call("shutdown", timeout_s=SHUTDOWN_TIMEOUT_S)
                self.process.wait(SHUTDOWN_TIMEOUT_S)
            except (EngineError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def _close_pipes(self) -> None:
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        with contextlib.suppress(OSError):
            os.close(self._replies)
        self._replies = -1


class Fleet:
    """The engines of one test module, closed (and checked gone) together."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.engines: list[FleetEngine] = []
        #: vLLM's CPU tensor-parallel files its engines left (see
        #: :meth:`FleetEngine.remove_cpu_communicator_files`), removed.
        self.vllm_leftovers: list[str] = []

    def start(
        self, name: str, model: str, kv: dict[str, Any], tp: int = 0, cwd: str | None = None
    ) -> FleetEngine:
        """Start engine ``name`` (not awaited: start several, then wait for each)."""
        engine = FleetEngine(name, self.root, engine_args(model, kv, tp), tp, cwd or self.root)
        self.engines.append(engine)
        return engine

    def close(self) -> list[str]:
        """Stop every engine; the /dev/shm files that had to be removed afterwards (a
        killed engine's plane notes, say)."""
        removed: list[str] = []
        for engine in self.engines:
            engine.close()
        for engine in self.engines:
            for path in engine.shm_files():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed.append(path)
            self.vllm_leftovers += engine.remove_cpu_communicator_files()
        return removed


def delta(after: dict[str, Any], before: dict[str, Any] | None, name: str) -> float:
    """How much metric ``name`` (as :func:`fleet_runner.metrics` names it) grew between two
    generate answers (``before`` None: since start-up)."""
    value = after["metrics"].get(name, 0.0)
    if before is not None:
        value -= before["metrics"].get(name, 0.0)
    return value


__all__ = [
    "EngineError",
    "Fleet",
    "FleetEngine",
    "delta",
    "engine_env",
    "fs_tier",
    "p2p_tier",
    "tiering",
]
