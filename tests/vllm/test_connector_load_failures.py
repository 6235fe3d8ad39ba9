"""Failed and refused loads inside vLLM 0.33's real core scheduler (CPU).

vLLM's ``Scheduler`` runs with ``TritonOffloadingConnector`` in both roles: the worker
side registers real CPU caches and moves bytes with the engine, a stand-in model
"computes" each scheduled token's KV as a pure function of (token, position), so a
request's blocks after it finished must equal a cold run's whatever was loaded. A
load made to fail (an injected copy error) and a load of a corrupted host row lead to
vLLM's ``kv_load_failure_policy``: ``recompute`` recomputes from the first failed
block and the request's KV equals the cold run; ``fail`` ends the request with an
error. No AssertionError anywhere, and the engine keeps serving.
"""

from __future__ import annotations

from typing import Any

import pytest

try:
    from vllm.v1.request import RequestStatus

    from tests.helpers.vllm_engine import (
        BLOCK,
        PROMPT,
        Engine,
        _corrupt_host_chunk,
        _offload_first_request,
        assert_prompt_kv,
        prompt,
    )
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    pytest.skip(f"vllm cannot be imported: {error}", allow_module_level=True)

from triton_offload.transfer import cpu_copy


def _engine(engines: list[Engine], tmp_path: Any, policy: str, groups: int = 1) -> Engine:
    engine = Engine(tmp_path, policy, groups)
    engines.append(engine)
    return engine


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("fault", ["copy error", "corrupt row"])
def test_a_failed_load_goes_to_vllms_policy(
    engines: list[Engine], tmp_path: Any, policy: str, fault: str, monkeypatch: Any
) -> None:
    engine = _engine(engines, tmp_path, policy)
    tokens = _offload_first_request(engine)
    bad_block = 3
    if fault == "corrupt row":
        _corrupt_host_chunk(engine, bad_block)
    else:
        real = cpu_copy._memmove

        def failing(dst: int, src: int, size: int) -> int:
            raise RuntimeError("injected copy failure")

        monkeypatch.setattr(cpu_copy, "_memmove", failing)
    second_tokens = tokens + [5] * 8
    second = engine.add("B", second_tokens)
    engine.step()  # lookup and load (the copy fails, or the row is refused)
    if fault == "copy error":
        monkeypatch.setattr(cpu_copy, "_memmove", real)
    if policy == "fail":
        for _ in range(10):
            if "B" in engine.finished:
                break
            engine.step()
        assert str(engine.finished["B"]) == "error"
        assert second.status == RequestStatus.FINISHED_ERROR
        # The engine keeps serving: a new request runs to the end.
        third = engine.add("C", prompt(seed=9))
        assert_prompt_kv(engine, engine.run(third), prompt(seed=9))
        return
    kv = engine.run(second)
    assert str(engine.finished["B"]) == "length"
    assert_prompt_kv(engine, kv, second_tokens)
    # Recomputed exactly from the first block that did not load (vLLM's prefix rule).
    first_failed = bad_block if fault == "corrupt row" else 0
    assert engine.computed["B"] == list(range(first_failed * BLOCK, len(second_tokens)))
    if fault == "corrupt row":
        # The refused chunk was dropped (B's hits stay counted as stored, so vLLM does
        # not store it again for B): C loads up to it, recomputes it and stores it; the
        # quarantine is lifted by that store and D loads every chunk, all exact.
        guard = engine.connector_scheduler.triton_guard
        assert len(guard.quarantined) == 1
        third = engine.add("C", second_tokens)
        assert_prompt_kv(engine, engine.run(third), second_tokens)
        assert engine.computed["C"] == list(range(bad_block * BLOCK, len(second_tokens)))
        assert not guard.quarantined
        fourth = engine.add("D", second_tokens)
        assert_prompt_kv(engine, engine.run(fourth), second_tokens)
        assert engine.computed["D"] == list(range(PROMPT, len(second_tokens)))


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_hybrid_models_failed_load_is_reported_per_request(
    engines: list[Engine], tmp_path: Any, policy: str
) -> None:
    """Two cache groups: vLLM refuses block-level errors, the request fails as a whole."""
    engine = _engine(engines, tmp_path, policy, groups=2)
    tokens = _offload_first_request(engine)
    _corrupt_host_chunk(engine, 2)
    second_tokens = tokens + [5] * 8
    second = engine.add("B", second_tokens)
    if policy == "fail":
        for _ in range(10):
            if "B" in engine.finished:
                break
            engine.step()
        assert str(engine.finished["B"]) == "error"
        assert second.status == RequestStatus.FINISHED_ERROR
        return
    kv = engine.run(second)
    assert_prompt_kv(engine, kv, second_tokens)
    # The request-level path recomputes the whole request.
    assert engine.computed["B"] == list(range(len(second_tokens)))


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("fault", ["copy error", "corrupt row"])
def test_a_failed_layerwise_sync_load_goes_to_vllms_policy(
    engines: list[Engine], tmp_path: Any, policy: str, fault: str, monkeypatch: Any
) -> None:
    """A sync load copied layer by layer whose copy fails or whose row fails its seal
    (the verdict joins the job before the step's report): no wait hangs, the failed
    blocks are reported in the same step, and vLLM's policy recomputes (the KV equals a
    cold run's) or fails the request; the engine keeps serving."""
    engine = Engine(
        tmp_path,
        policy,
        extra_config={"sync_load_budget_bytes": 1 << 20, "layerwise_loads": True},
    )
    engines.append(engine)
    layered = engine.worker.connector_worker._triton_layerwise
    assert layered is not None and layered.active
    tokens = _offload_first_request(engine)
    real = cpu_copy._memmove
    if fault == "corrupt row":
        _corrupt_host_chunk(engine, 3)
    else:

        def failing(dst: int, src: int, size: int) -> int:
            raise RuntimeError("injected copy failure")

        monkeypatch.setattr(cpu_copy, "_memmove", failing)
    second_tokens = tokens + [5] * 8
    second = engine.add("B", second_tokens)
    engine.step()  # lookup, a sync load (fails) and the rest of the prompt, one step
    monkeypatch.setattr(cpu_copy, "_memmove", real)
    assert layered.started and layered.active
    if policy == "fail":
        for _ in range(10):
            if "B" in engine.finished:
                break
            engine.step()
        assert str(engine.finished["B"]) == "error"
        assert second.status == RequestStatus.FINISHED_ERROR
        third = engine.add("C", prompt(seed=9))
        assert_prompt_kv(engine, engine.run(third), prompt(seed=9))
        return
    kv = engine.run(second)
    assert str(engine.finished["B"]) == "length"
    assert_prompt_kv(engine, kv, second_tokens)
    # The step of the failed load computed the prompt's rest; vLLM then recomputed every
    # position from the first failed block (block 0 when the copy failed, the corrupt
    # row's first block when its seal failed).
    first_failed = 3 * BLOCK if fault == "corrupt row" else 0
    assert set(range(first_failed, len(second_tokens))) <= set(engine.computed["B"])
    assert not set(range(first_failed)) & set(engine.computed["B"])
    if fault == "corrupt row":
        return  # the refused chunk's quarantine and re-store: test_a_failed_load_goes...
    # A layer-wise load that succeeds: C hits every stored chunk and loads them exactly.
    third = engine.add("C", second_tokens)
    assert_prompt_kv(engine, engine.run(third), second_tokens)
    assert engine.computed["C"] == list(range(PROMPT, len(second_tokens)))
