"""One engine of a fleet, in a process of its own, driven by commands:
``python tests/helpers/fleet_runner.py SPEC.json REPLY_FD``.

tests/helpers/fleet_engines.py starts this script once per engine, so that engines of one
test live side by side, each in its own process, as a fleet's engines do on their
nodes. ``SPEC.json`` holds the ``vllm.LLM`` arguments (``engine``). The script builds
the engine, then reads one JSON command per line on stdin and answers each with one
JSON line on the descriptor ``REPLY_FD`` (stdout and stderr are the engine's log):
``{"ok": true, "value": ...}`` or ``{"ok": false, "error": TRACEBACK}``. The first
answer comes unasked, once the engine is built (or failed to build).

Commands (``{"command": NAME, ...arguments}``):

- ``generate``: greedy generation of ``prompts`` (token ids) in one batch; each
  output's tokens, logprobs and finish reason, and the engine's metrics after the step
  (:func:`metrics`). With ``source`` (a p2p port), every request names that engine as
  its ``remote_kv_source`` (vLLM's symmetric p2p: the request's blocks are looked up
  at that peer);
- ``settle``: step the engine until it has nothing in flight (stores into the host
  tier, cascades into secondary tiers), as vLLM's engine loop would, then answer;
- ``reset``: ``reset_prefix_cache(reset_connector=True)``: the device prefix cache and
  the host tier emptied (the secondary tiers keep their chunks), so the next request
  finds a prompt's chunks in the secondary tiers only;
- ``metrics``: the metrics now;
- ``chunk_files``: the files of ``prompt``'s whole chunks in the engine's ``fs`` tier,
  in prompt order, named as the tier names them (its ``FileMapper``, the engine's block
  hashes); whether each exists is the test's to check;
- ``stall_fs_store``: from now on, when this engine's ``fs`` tier writes
  ``chunk_file``, it writes half of it into the temporary file vLLM's writer publishes
  with ``os.replace``, and that writer thread stops there; ``marker`` (a JSON file)
  then names the temporary file and the chunk files written whole before it. The test
  kills the process (SIGKILL): a process killed in the middle of a store;
- ``shutdown``: shuts the engine down, answers and exits.

Between commands the engine steps whenever vLLM's own engine loop would (its scheduler
has requests, or its connector work in flight: vLLM's p2p tier asks for a step
forever, to serve its peers). With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the EngineCore
lives in this process and nothing steps it unless this script does; with an EngineCore
process (tensor parallel), vLLM's busy loop steps it.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
import traceback
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
#: Labels every metric of an engine carries (left out of the names :func:`metrics` gives).
ENGINE_LABELS = ("engine", "model_name")
#: How often an idle engine whose loop must keep stepping is stepped (seconds).
IDLE_STEP_S = 0.005
#: Longest ``settle`` (a hang guard; it ends as soon as nothing is in flight).
SETTLE_TIMEOUT_S = 120.0


def metrics(llm: Any) -> dict[str, float]:
    """Every counter and gauge of ``LLM.get_metrics()``, one entry per label set,
    named ``name{label=value,...}`` (labels sorted, the engine's own left out; no
    braces without labels); histograms by their sum."""
    found: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if value is None:
            value = getattr(metric, "sum", None)
        if value is None:
            continue
        labels = ",".join(
            f"{k}={v}" for k, v in sorted(metric.labels.items()) if k not in ENGINE_LABELS
        )
        name = f"{metric.name}{{{labels}}}" if labels else metric.name
        found[name] = found.get(name, 0.0) + float(value)
    return found


class Runner:
    """The engine and the commands on it."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(**spec["engine"])
        client = self.llm.llm_engine.engine_core
        #: The EngineCore when it lives in this process (vLLM's InprocClient), else None.
        self.core = getattr(client, "engine_core", None)
        config = self.llm.llm_engine.vllm_config
        self.started = {
            "pid": os.getpid(),
            "block_size": int(config.cache_config.block_size),
            "model": config.model_config.model,
            "engine_id": config.kv_transfer_config.engine_id,
            "in_process": self.core is not None,
        }

    # ------------------------------------------------------------------ stepping

    def _loop_would_step(self) -> bool:
        """Whether vLLM's engine loop would step now (``EngineCoreProc.has_work``: the
        scheduler has requests, or its connector has work in flight)."""
        assert self.core is not None
        return bool(self.core.scheduler.has_requests())

    def step_if_due(self) -> None:
        if self.core is not None and self._loop_would_step():
            self.llm.llm_engine.step()

    def _in_flight(self) -> bool:
        """Whether this engine still moves KV: a request not yet released (its store
        into the host tier runs), a connector job, a tier job or a cascade waiting.

        vLLM's p2p tier reports pending work for its whole life (it must be polled), so
        the tiers are asked one by one and p2p is judged by the manager's own books.
        """
        assert self.core is not None
        scheduler = self.core.scheduler
        if scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
            return True
        offloading = scheduler.connector.connector_scheduler
        if offloading._jobs or offloading._reset_fence:
            return True
        manager = offloading.manager  # vLLM's TieringOffloadingManager
        if manager._jobs or any(s.pending_cascade_keys for s in manager._req_state.values()):
            return True
        return any(t.has_pending_work() for t in manager.secondary_tiers if t.tier_type != "p2p")

    def settle(self) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        quiet = 0
        # Two quiet looks in a row, a step between: a job finishing in one step may
        # queue the next (a cascade) in the same step.
        while quiet < 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine still moved KV after {SETTLE_TIMEOUT_S} s")
            if self.core is not None:
                busy = self._in_flight()
                self.step_if_due()
            else:
                busy = bool(self.llm.llm_engine.engine_core.call_utility("has_work"))
                time.sleep(0.05)
            quiet = 0 if busy else quiet + 1

    # ------------------------------------------------------------------ commands

    def generate(
        self, prompts: list[list[int]], max_tokens: int = 8, source: int | None = None
    ) -> dict[str, Any]:
        from vllm import SamplingParams

        params = []
        for _ in prompts:
            extra = None
            if source is not None:
                remote = {
                    "kv_request_id": f"fleet-{uuid.uuid4().hex}",
                    "remote_host": "127.0.0.1",
                    "remote_port": source,
                }
                extra = {"kv_transfer_params": {"remote_kv_source": remote}}
            params.append(
                SamplingParams(
                    temperature=0.0,
                    max_tokens=max_tokens,
                    logprobs=1,
                    detokenize=False,
                    ignore_eos=True,
                    extra_args=extra,
                )
            )
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False
        )
        from engine_runner import completion_of

        results = [
            {**completion_of(output), "cached_tokens": output.num_cached_tokens}
            for output in outputs
        ]
        return {"outputs": results, "metrics": metrics(self.llm)}

    def reset(self) -> bool:
        return bool(self.llm.reset_prefix_cache(reset_connector=True))

    def metrics(self) -> dict[str, float]:
        return metrics(self.llm)

    def chunk_files(self, prompt: list[int]) -> list[str]:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.kv_offload.base import make_offload_key
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        assert self.core is not None, "chunk_files needs the EngineCore in this process"
        manager = self.core.scheduler.connector.connector_scheduler.manager
        (tier,) = (t for t in manager.secondary_tiers if isinstance(t, FileSystemTierManager))
        config = self.llm.llm_engine.vllm_config.cache_config
        hash_fn = get_hash_fn_by_name(config.prefix_caching_hash_algo)
        tokens = int(config.block_size)
        files, parent = [], None
        for start in range(0, len(prompt) - tokens + 1, tokens):
            # vLLM's own block hash, chained from the engine's NONE_HASH.
            parent = kv_cache_utils.hash_block_tokens(
                hash_fn, parent, prompt[start : start + tokens]
            )
            files.append(tier.file_mapper.get_file_name(make_offload_key(parent, 0)))
        return files

    def stall_fs_store(self, chunk_file: str, marker: str) -> None:
        stall_fs_store(chunk_file, marker)

    def shutdown(self) -> None:
        if hasattr(self.llm, "shutdown"):
            self.llm.shutdown()
        else:
            self.llm.llm_engine.engine_core.shutdown()


def stall_fs_store(chunk_file: str, marker: str) -> None:
    """Make vLLM's fs tier write half of ``chunk_file`` into its temporary file and stop
    that writer thread for good, after writing the other chunk files of the same batch
    whole, as vLLM writes them (see the module's docstring). vLLM's writer publishes a
    chunk with ``os.replace`` from the temporary file once it is whole: the half file is
    what a kill in the middle of that store leaves.
    """
    from vllm.v1.kv_offload.tiering.fs import io, manager

    whole: list[str] = []
    write_whole = manager.batch_store_block

    def store(
        paths: list[str],
        view: memoryview,
        offsets: list[int],
        block_size: int,
        use_o_direct: bool = True,
    ) -> None:
        # The batch's other chunks first (vLLM's order inside a batch is not the
        # prompt's), then the stall.
        batch = sorted(zip(paths, offsets, strict=True), key=lambda item: item[0] == chunk_file)
        for path, offset in batch:
            if path != chunk_file:
                write_whole([path], view, [offset], block_size, use_o_direct)
                whole.append(path)
                continue
            partial = path + io._get_tmp_suffix()
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(partial, "wb") as f:
                f.write(view.cast("B")[offset : offset + block_size // 2])
                f.flush()
                os.fsync(f.fileno())
            note = {"whole": whole, "partial": partial, "chunk_bytes": block_size}
            with open(marker + ".tmp", "w") as f:
                json.dump(note, f)
            os.replace(marker + ".tmp", marker)
            while True:  # this writer never finishes: the process is killed here
                time.sleep(3600)

    manager.batch_store_block = store


def _answer(reply: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(reply, data) :]


def main(spec_path: str, reply: int) -> None:
    sys.path.insert(0, HERE)
    from tier_peers import prefer_cuda12_nixl

    prefer_cuda12_nixl()
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        runner = Runner(spec)
    except BaseException:
        _answer(reply, {"ok": False, "error": traceback.format_exc()})
        sys.stdout.flush()
        os._exit(1)
    _answer(reply, {"ok": True, "value": runner.started})
    stdin = sys.stdin.fileno()
    pending = b""
    while True:
        wait = IDLE_STEP_S if runner.core is not None else None
        ready, _, _ = select.select([stdin], [], [], wait)
        if not ready:
            runner.step_if_due()
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:  # the test process is gone: leave as a killed engine would not
            runner.shutdown()
            os._exit(0)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            command = json.loads(line)
            name = command.pop("command")
            try:
                value = getattr(runner, name)(**command)
            except BaseException:
                _answer(reply, {"ok": False, "error": traceback.format_exc()})
                continue
            _answer(reply, {"ok": True, "value": value})
            if name == "shutdown":
                sys.stdout.flush()
                # Skip interpreter teardown: the engine is shut down.
                os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
