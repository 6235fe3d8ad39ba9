"""A failed store inside vLLM 0.33's real core scheduler (CPU): never published.

The store's copy fails on the worker; vLLM's scheduler completes the job with
``success=False`` (the chunks' keys are released, no lookup can hit them), the engine
keeps serving, and a later request stores the same chunks for good.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm cannot be imported")

from tests.helpers.vllm_engine import PROMPT, Engine, assert_prompt_kv, prompt
from triton_offload.transfer import cpu_copy


@pytest.fixture
def engine(tmp_path: Any) -> Any:
    made = Engine(tmp_path, "recompute")
    yield made
    made.close()


def _fail_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(dst: int, src: int, size: int) -> int:
        raise RuntimeError("injected copy failure during a store")

    monkeypatch.setattr(cpu_copy, "_memmove", failing)


def test_a_failed_store_is_never_published_and_its_keys_are_free(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = prompt()
    _fail_copies(monkeypatch)
    first = engine.add("A", tokens)
    assert_prompt_kv(engine, engine.run(first), tokens)  # the request itself is served
    monkeypatch.undo()
    scheduler = engine.connector_scheduler
    assert scheduler.triton_failed_stores >= 1
    # Nothing of A's prompt is in the host tier: B computes everything.
    second = engine.add("B", tokens)
    assert_prompt_kv(engine, engine.run(second), tokens)
    assert engine.computed["B"] == list(range(PROMPT))
    # B's stores succeeded: C loads the whole prompt but its last token.
    third = engine.add("C", tokens)
    assert_prompt_kv(engine, engine.run(third), tokens)
    assert engine.computed["C"] == [PROMPT - 1]
