"""No request waits forever under vLLM's real scheduler when interrupts land in this
backend's worker, engine and layer-staged loads.

vLLM's core ``Scheduler`` and ``TritonOffloadingConnector`` (``tests/helpers/vllm_engine.py``)
serve a stream of requests over a few shared prompts (stores, then hits loaded back, seals
on). In random steps a ``KeyboardInterrupt`` is raised at a random line of this project's
worker-side modules while vLLM's connector submits the step's transfers (``start``) or
collects their reports (``get_transfer_results``). The driver carries on as a caller that
survives the interrupt would: it binds the step's metadata and starts its loads again (vLLM
re-submits a deferred store it did not finish submitting), or asks for the reports again.
Asserted: every request finishes within a bounded number of steps, every block of every
request equals the cold run's (no corrupt load), and nothing is left in flight.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

try:
    from tests.helpers.interrupter import Interrupter
    from tests.helpers.vllm_engine import Engine, assert_prompt_kv, prompt
    from triton_offload.transfer import engine as engine_module
    from triton_offload.transfer import layered as layered_module
    from triton_offload.vllm import worker as worker_module
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    pytest.skip(f"vllm cannot be imported: {error}", allow_module_level=True)

#: Requests served (each over a few steps): about 20 s on one core.
REQUESTS = int(os.environ.get("TRITON_OFFLOAD_SCHEDULER_REQUESTS", "40"))
SEED = int(os.environ.get("TRITON_OFFLOAD_FUZZ_SEED", "20250107"))
#: A request needs a handful of steps; far more means it waits for something that never
#: comes.
MAX_STEPS = 60
#: Line events of one call the interrupt is drawn from: a step's submits or reports run
#: tens to a few hundred lines of the traced modules (a draw past the call's last line
#: interrupts nothing).
MAX_LINE = 150
#: Share of calls armed with an interrupt.
ARMED = 0.6


def _idle(engine: Engine, req_id: str) -> bool:
    return (
        req_id in engine.finished
        and not engine.connector_scheduler._jobs
        and not engine.scheduler.requests
    )


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_no_request_waits_forever_when_the_worker_is_interrupted(
    tmp_path: Path, layerwise: bool
) -> None:
    rng = random.Random(SEED + layerwise)
    extra: dict[str, Any] = {}
    if layerwise:
        extra = {"layerwise_loads": True, "sync_load_budget_bytes": 1 << 30}
    engine = Engine(tmp_path, "recompute", num_groups=1, extra_config=extra)
    tracer = Interrupter({worker_module.__file__, engine_module.__file__, layered_module.__file__})
    collect = engine.worker.get_transfer_results
    interrupted = {"start": 0, "results": 0}

    def results_interrupted(*args: Any) -> Any:
        at = rng.randint(1, MAX_LINE) if rng.random() < ARMED else 0
        try:
            return tracer.call(lambda: collect(*args), at, KeyboardInterrupt)
        except KeyboardInterrupt:
            interrupted["results"] += 1
            return collect(*args)  # asked again: the reports of the interrupted call

    engine.worker.get_transfer_results = results_interrupted
    prompts = [prompt(extra=i * 5, seed=seed) for i, seed in enumerate((3, 5, 7))]
    try:
        for number in range(REQUESTS):
            req_id = f"r{number}"
            tokens = rng.choice(prompts)
            engine.add(req_id, tokens)
            for _ in range(MAX_STEPS):
                if _idle(engine, req_id):
                    break
                output = engine.scheduler.schedule()
                at = rng.randint(1, MAX_LINE) if rng.random() < ARMED else 0
                try:
                    tracer.call(lambda: engine.start(output), at, KeyboardInterrupt)  # noqa: B023
                except KeyboardInterrupt:
                    interrupted["start"] += 1
                    engine.worker.bind_connector_metadata(output.kv_connector_metadata)
                    engine.worker.start_load_kv(engine.context)
                engine.finish(output)
            assert _idle(engine, req_id), f"{req_id} waits after {MAX_STEPS} steps"
            assert_prompt_kv(engine, engine.snapshots[req_id], tokens)
        engine.settle()
        assert not engine.transfer_worker._engine_jobs
        hits = sum(map(bool, engine.hits.values()))
        print(f"interrupts: {interrupted}, requests with a hit: {hits}")
        assert interrupted["start"] > REQUESTS // 4 and interrupted["results"] > REQUESTS // 4
        assert any(engine.hits.values())  # hits were loaded back, not only stored
    finally:
        engine.close()
