"""TritonOffloadingConnector inside vLLM 0.33's real scheduler-side connector (CPU).

The connector is built as vLLM builds it (``vllm_config``, role, ``KVCacheConfig``);
requests are vLLM ``Request`` objects with real block hashes; presence lives in the
spec's real ``CPUOffloadingManager`` (stores prepared and completed through it). The
stock ``OffloadingConnector`` with the same spec runs beside it on the same stored
chunks, and both answers are judged by ``hit_judge.hit_is_valid``.

Everything skips, with the import error as the reason, where vLLM cannot be imported.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

try:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import config as offload_config
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec
    from vllm.v1.kv_offload.base import LookupResult

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"
    # Module-level names below call vLLM's classes: skip before they run.
    pytest.skip(VLLM_ERROR, allow_module_level=True)

from tests.helpers.connector_serving import (
    _OPEN_SERVINGS,
    MODULE,
    Engine,
    Serving,
    attention,
    window,
)
from tests.helpers.hit_judge import hit_is_valid, largest_valid_hit

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")


def mamba(block: int) -> Any:
    return MambaSpec(
        block_size=block, shapes=((2, 4),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )


def presence(plan: Any, num_tokens: int, chunks: list[list[int]]) -> list[list[bool]]:
    return [
        [c in group_chunks for c in range(num_tokens // g.tokens_per_chunk)]
        for g, group_chunks in zip(plan.groups, chunks, strict=True)
    ]


def both(specs: list[Any], num_tokens: int, chunks: list[list[int]], **options: Any) -> Any:
    """(ours, stock, plan, present): both connectors' hits on the same stored chunks."""
    ours, stock = Engine(specs, **options), Engine(specs, stock=True, **options)
    answers = []
    for engine in (ours, stock):
        request = engine.request("r", num_tokens)
        engine.store(request, chunks)
        answers.append(engine.hit(request))
    plan = ours.connector.triton_plan
    return answers[0], answers[1], plan, presence(plan, num_tokens, chunks)


# ---------------------------------------------------------------- the stock bug


def test_stock_lookup_ends_inside_a_mamba_chunk_the_connector_does_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM 0.33 accepts full attention block 4 + Mamba block 16 (align) (its own tests
    build it). A 64-token prompt: the bound 63 is rounded down to 48 once; full
    attention chunk 10 (tokens 40-43) is absent, so full attention cuts the hit to 40,
    inside Mamba chunk 2 (32-48). The stock Mamba check accepts that chunk and loads
    40 tokens: the state after token 47 restored at position 40. The connector loads
    32 (the state after token 31, stored in chunk 1)."""
    chunks = [[c for c in range(16) if c != 10], [0, 1, 2]]
    with caplog.at_level(logging.WARNING, logger="vllm.triton_offload"):
        ours, stock, plan, present = both([attention(4), mamba(16)], 64, chunks)
    assert stock == 40
    assert not hit_is_valid(plan, 64, 0, present, stock)
    assert ours == 32
    assert hit_is_valid(plan, 64, 0, present, ours)
    # The plain-spec path warned at start-up, naming the groups; ours logged the case.
    assert "stock OffloadingConnector lookup can end a hit inside a Mamba chunk" in caplog.text
    assert "group 1 (16-token chunks if it is Mamba state) cut by group 0 (4-token" in caplog.text
    assert "vLLM's stock lookup would load 40 tokens after 0, an invalid hit" in caplog.text
    assert "group 1 ('vllm group 1', mamba): hit end 40 is off its 16-token chunk grid" in (
        caplog.text
    )


def test_connector_keeps_a_valid_stock_hit_shorter_than_a_chunk() -> None:
    """Full attention block 64 + sliding window 16 in 16-token blocks, 100 tokens: the
    window cuts the hit to 48, under the full-attention chunk; valid, and both load it."""
    chunks = [[0], [0, 1, 2, 4, 5]]
    ours, stock, plan, present = both([attention(64), window(16, 16)], 100, chunks)
    assert ours == stock == 48
    assert hit_is_valid(plan, 100, 0, present, 48)


@pytest.mark.parametrize("seed", range(6))
def test_dcp_mamba_geometry_agrees_with_stock(seed: int) -> None:
    """TP=2, DCP=2, full attention block 16 + Mamba block 16 align: spans (32, 16); the
    attention grid is a multiple of the Mamba grid, so the stock cuts stay on it and both
    answers agree (and are valid) on random pools."""
    import random

    rng = random.Random(seed)
    num_tokens = rng.choice([64, 97, 160, 223])
    chunks = [
        [c for c in range(num_tokens // 32) if rng.random() < 0.8],
        [c for c in range(num_tokens // 16) if rng.random() < 0.7],
    ]
    ours, stock, plan, present = both([attention(16), mamba(16)], num_tokens, chunks, tp=2, dcp=2)
    assert [g.tokens_per_block for g in plan.groups] == [32, 16]
    assert ours == stock
    if ours:
        assert hit_is_valid(plan, num_tokens, 0, present, ours)


def test_dcp_mamba_worked_example_is_32() -> None:
    ours, stock, _, _ = both([attention(16), mamba(16)], 64, [[0, 1], [1, 3]], tp=2, dcp=2)
    assert ours == stock == 32


def test_pending_store_defers_then_hits() -> None:
    """A chunk whose store is still in flight (HIT_PENDING) defers the lookup, as vLLM's
    does; once the store completes, the planned hit comes back."""
    engine = Engine([attention(4), mamba(16)])
    request = engine.request("r", 64)
    engine.store(request, [list(range(12)), [0, 1, 2]], complete=False)
    assert engine.hit(request) is None
    state = engine.scheduler._req_status["r"]
    keys = [k for g in state.group_states for k in g.offload_keys]
    assert engine.scheduler.manager.lookup(keys[0], state.req_context) is LookupResult.HIT_PENDING
    stored = [g.offload_keys[: (12 if i == 0 else 3)] for i, g in enumerate(state.group_states)]
    engine.scheduler.manager.complete_store([k for g in stored for k in g], state.req_context)
    assert engine.hit(request) == 48


def test_computed_tokens_and_caps_are_honoured() -> None:
    engine = Engine([attention(4), mamba(16)])
    request = engine.request("r", 97)
    engine.store(request, [list(range(24)), [0, 1, 2, 3, 4, 5]])
    assert engine.hit(request) == 96
    assert engine.hit(request, computed=32) == 64
    capped = engine.scheduler.get_num_new_matched_tokens(request, 0, max_num_new_tokens=70)
    engine.scheduler._release_step()
    assert capped == (64, True)  # the cap 70 rounded down to the Mamba grid


# ---------------------------------------------------------------- start-up checks


@pytest.mark.parametrize("role_name", ["SCHEDULER", "WORKER"])
def test_span_mismatch_names_each_group(monkeypatch: pytest.MonkeyPatch, role_name: str) -> None:
    """A vLLM whose spans scale Mamba by DCP (a span bug: the Mamba state is replicated,
    not split over DCP ranks) fails at start-up in the scheduler and in the worker,
    naming the group, its kind and both numbers."""
    monkeypatch.setattr(
        offload_config, "resolve_dcp_kv_block_size", lambda spec, dcp: spec.block_size * dcp
    )
    with pytest.raises(ValueError) as info:
        Engine([attention(16), mamba(16)], tp=2, dcp=2, role=getattr(KVConnectorRole, role_name))
    message = str(info.value)
    assert "group 1 (mamba, block 16, not DCP-scaled): planner 16 tokens per block, vLLM 32" in (
        message
    )
    assert "group 0" not in message  # attention agrees (32 = 16 x DCP 2)


def test_connector_selects_its_spec_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    import triton_offload.vllm as tv

    with caplog.at_level(logging.INFO, logger="vllm.triton_offload"):
        engine = Engine([attention(4), mamba(16)])
    assert isinstance(engine.connector, OffloadingConnector)
    assert isinstance(engine.scheduler, tv.TritonOffloadingConnectorScheduler)
    extra = engine.vllm_config.kv_transfer_config.kv_connector_extra_config
    assert extra["spec_name"] == "TritonOffloadingSpec"
    assert "spans [4, 16] tokens per block match vLLM's OffloadingConfig" in caplog.text
    assert "vLLM's stock lookup could end off the Mamba grid here" in caplog.text
    # The plain-spec warning is for the stock connector only.
    assert "stock OffloadingConnector lookup can end" not in caplog.text
    worker = Engine([attention(4), mamba(16)], role=KVConnectorRole.WORKER)
    assert worker.connector.connector_worker is not None


def test_an_attention_only_model_logs_no_mamba_alignment(caplog: pytest.LogCaptureFixture) -> None:
    """The start-up line names the Mamba alignment only where a Mamba group sets one (an
    operator reading ``mamba_align_tokens=None`` on a Llama would look for a Mamba group)."""
    with caplog.at_level(logging.INFO, logger="vllm.triton_offload"):
        Engine([attention(16)])
    (line,) = [r.getMessage() for r in caplog.records if "lookups planned" in r.getMessage()]
    assert "lookups planned (vllm group 0: full_attention)" in line
    assert "None" not in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.triton_offload"):
        Engine([attention(4), mamba(16)])
    assert "mamba, mamba_align_tokens=16)" in caplog.text


def test_named_spec_is_kept() -> None:
    engine = Engine([attention(16)], extra={"spec_name": "CPUOffloadingSpec"})
    spec_name = engine.vllm_config.kv_transfer_config.kv_connector_extra_config["spec_name"]
    assert spec_name == "CPUOffloadingSpec"


def test_factory_resolves_the_connector_by_module_path() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import triton_offload.vllm as tv

    config = KVTransferConfig(
        kv_connector="TritonOffloadingConnector",
        kv_connector_module_path=MODULE,
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": 1 << 20},
    )
    assert KVConnectorFactory.get_connector_class(config) is tv.TritonOffloadingConnector
    assert KVConnectorFactory.supports_hma_config(config)


# ---------------------------------------------------------------- end to end


@pytest.fixture(autouse=True)
def _close_servings() -> Any:
    """Every Serving a test built is shut down after it (its region leaves /dev/shm)."""
    yield
    while _OPEN_SERVINGS:
        _OPEN_SERVINGS.pop().close()


@pytest.mark.parametrize(
    ("specs", "num_tokens"),
    [
        ([attention(4), mamba(16)], 65),  # attention + Mamba (align)
        ([attention(4), window(4, 8)], 41),  # attention + sliding window
    ],
    ids=["attention+mamba", "attention+sliding-window"],
)
def test_store_lookup_load_through_vllm_connector_bytes_exact(
    specs: list[Any], num_tokens: int
) -> None:
    serving = Serving(specs)
    _, source_ids = serving.store_prompt(num_tokens)
    stored = serving.stored_chunks(num_tokens)
    if any(isinstance(s, SlidingWindowSpec) for s in specs):
        assert stored[1] == [8, 9]  # vLLM stores only the window chunks a hit can read
    else:
        assert stored == [list(range(16)), [0, 1, 2, 3]]  # Mamba: every boundary state
    sources = {name: tensor.clone() for name, tensor in serving.tensors.items()}
    # Poison every block the loading request may get (the pool hands out low ids).
    for tensor in serving.tensors.values():
        tensor[1:128] = 7.0
    before = {name: tensor.clone() for name, tensor in serving.tensors.items()}
    hit, blocks = serving.load_prompt(num_tokens)
    plan = serving.connector.triton_plan
    # The hit is the largest valid one on what vLLM's connector stored.
    present = presence(plan, num_tokens, stored)
    assert hit == largest_valid_hit(plan, num_tokens, 0, present) > 0
    assert hit_is_valid(plan, num_tokens, 0, present, hit)
    moved = 0
    for index, group_blocks in enumerate(blocks):
        name = f"layer.{index}"
        expected = before[name].clone()
        block_size = specs[index].block_size
        for position, block in enumerate(group_blocks[: -(-hit // block_size)]):
            if block.is_null:
                continue
            expected[block.block_id] = sources[name][source_ids[index][position]]
            moved += 1
        assert torch.equal(serving.tensors[name], expected), name
    assert moved > 0
    # Source blocks were left as they were.
    for index, ids in enumerate(source_ids):
        name = f"layer.{index}"
        assert torch.equal(serving.tensors[name][ids], sources[name][ids])
    # Every finished load left the books: the offloading worker holds no load, the
    # fail-soft wrapper no refused result (it keeps nothing else per job).
    fail_soft = serving.worker_side.connector.connector_worker.worker
    assert fail_soft._refused == [] and fail_soft.worker._loads == {}


def test_lazy_presence_asks_the_manager_only_for_what_the_scan_reads() -> None:
    """A 128k-token prompt fully stored: the planned lookup reads a few chunks of the
    windowed groups and the prefix of the unbounded one, memoised."""
    from triton_offload import GroupSpec, plan_offload
    from triton_offload.vllm.planning import LazyPresence

    class Manager:
        calls = 0

        def lookup(self, key: Any, context: Any) -> Any:
            Manager.calls += 1
            return LookupResult.HIT if key != ("full", 3) else LookupResult.HIT_PENDING

    plan = plan_offload(
        [
            GroupSpec("full_attention", 16),
            GroupSpec("sliding_window", 16, sliding_window=1024),
            GroupSpec("mamba", 16, mamba_cache_mode="align"),
        ]
    )
    n = 128 * 1024
    names = ["full", "swa", "mamba"]
    rows = [
        LazyPresence(Manager(), [(names[g], c) for c in range(n // 16)], None, LookupResult.HIT)
        for g in range(3)
    ]
    # Full attention chunk 3 is still being stored (pending): the hit stops before it.
    assert plan.lookup(n, 0, rows) == 48
    assert Manager.calls == sum(row.lookups for row in rows) < 16
    assert rows[0][3] is False and rows[0][-1] is True and rows[0][0:2] == [True, True]


# ------------------------------------------------- fidelity to vLLM's scheduler


class CountingManager:
    """Stands between a scheduler and its real manager and counts lookups per key."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.calls: dict[Any, int] = {}

    def lookup(self, key: Any, req_context: Any) -> Any:
        self.calls[key] = self.calls.get(key, 0) + 1
        return self.manager.lookup(key, req_context)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)


def counted_hit(engine: Engine, request: Any, computed: int = 0) -> tuple[int | None, Any]:
    scheduler = engine.scheduler
    counter = CountingManager(scheduler.manager)
    scheduler.manager = counter
    try:
        return engine.hit(request, computed), counter
    finally:
        scheduler.manager = counter.manager


LOOKUP_CASES = [
    # (specs, tokens, stored chunks per group)
    ([attention(4), mamba(16)], 64, [[c for c in range(16) if c != 10], [0, 1, 2]]),
    ([attention(16), window(16, 32)], 160, [list(range(10)), [0, 1, 2, 5, 6, 7, 8]]),
    ([attention(16), mamba(16)], 96, [list(range(6)), [1, 3, 5]]),
    (
        [attention(8), window(8, 24), mamba(16)],
        130,
        [list(range(16)), [3, 9, 10, 11, 12], [0, 5, 7]],
    ),
]


@pytest.mark.parametrize("case", range(len(LOOKUP_CASES)))
def test_one_manager_lookup_per_key_and_never_more_than_stock(case: int) -> None:
    """The planner reuses what vLLM's own scan asked: each key reaches the manager at
    most once per lookup (with a tiering manager a lookup may start a promotion). Where
    both answer alike the connector asks no key stock vLLM did not; where vLLM's hit is
    invalid (case 0: it ends inside a Mamba chunk) the planner asks what the valid hit
    needs, at most one more key per group."""
    specs, num_tokens, chunks = LOOKUP_CASES[case]
    runs = []
    for stock in (False, True):
        engine = Engine(specs, stock=stock)
        request = engine.request("r", num_tokens)
        engine.store(request, chunks)
        tokens, counter = counted_hit(engine, request)
        runs.append((tokens, counter.calls))
    (ours, our_calls), (stock_hit, stock_calls) = runs
    assert our_calls and max(our_calls.values()) == 1, our_calls
    extra = set(our_calls) - set(stock_calls)
    if ours == stock_hit:
        assert extra == set()
    else:
        assert case == 0 and (ours, stock_hit) == (32, 40)
        assert len(extra) <= len(specs)


@pytest.mark.parametrize(("num_tokens", "computed"), [(40, 28), (40, 4), (30, 20)])
def test_a_hit_of_less_than_a_chunk_of_new_tokens_is_skipped_as_vllm_does(
    num_tokens: int, computed: int
) -> None:
    """vLLM's minimum-load rule: a hit that would add less than one chunk beyond the
    computed tokens loads nothing (12-token chunks: 28 computed of 40 could load 8; 4
    computed could load 8 before chunk 1 is found missing). The connector answers as
    stock vLLM does, with no more manager lookups."""
    answers = []
    for stock in (False, True):
        engine = Engine([attention(12)], stock=stock)
        request = engine.request("r", num_tokens)
        missing = 1 if computed == 4 else None  # chunk 1 absent: the prefix ends at 12
        engine.store(request, [[c for c in range(num_tokens // 12) if c != missing]])
        tokens, counter = counted_hit(engine, request, computed=computed)
        answers.append((tokens, sum(counter.calls.values())))
    (ours, our_calls), (stock_tokens, stock_calls) = answers
    assert ours == stock_tokens == 0
    assert our_calls <= stock_calls


@pytest.mark.parametrize("seed", range(24))
def test_random_hybrids_lookups_once_per_key_valid_and_never_below_stock(seed: int) -> None:
    """Random hybrids on vLLM's real scheduler: each key reaches the manager at most once;
    the connector asks no key stock vLLM did not unless its answer differs; its hit is
    valid, and never below a valid stock hit (both keep vLLM's minimum load)."""
    import random

    rng = random.Random(seed)
    attention_block = rng.choice([4, 8, 16])
    specs = [attention(attention_block)]
    if rng.random() < 0.6:
        specs.append(window(attention_block, rng.choice([8, 24, 40])))
    if rng.random() < 0.6:
        specs.append(mamba(attention_block * rng.choice([1, 2, 4])))
    num_tokens = rng.randrange(24, 200)
    ours_engine, stock_engine = Engine(specs), Engine(specs, stock=True)
    plan = ours_engine.connector.triton_plan
    chunks = [
        [c for c in range(num_tokens // g.tokens_per_chunk) if rng.random() < 0.85]
        for g in plan.groups
    ]
    runs = []
    for engine in (ours_engine, stock_engine):
        request = engine.request("r", num_tokens)
        if any(chunks):
            engine.store(request, chunks)
        tokens, counter = counted_hit(engine, request)
        runs.append((tokens, counter.calls))
    (ours, our_calls), (stock_hit, stock_calls) = runs
    assert not our_calls or max(our_calls.values()) == 1
    if ours == stock_hit:
        assert set(our_calls) <= set(stock_calls)
    present = presence(plan, num_tokens, chunks)
    if ours:
        assert hit_is_valid(plan, num_tokens, 0, present, ours)
    if stock_hit and hit_is_valid(plan, num_tokens, 0, present, stock_hit):
        assert ours >= stock_hit


# ------------------------------------------ vLLM's request flows around a planned load


def _start_load(serving: Serving, req_id: str, num_tokens: int) -> tuple[Any, int, list[Any]]:
    """Request ``req_id`` looks up and vLLM's managers allocate its blocks; the load job
    is scheduled (not yet run by a step). Returns (request, hit, blocks per group)."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    request = serving.scheduler_side.request(req_id, num_tokens)
    hit, load_async = serving.connector.get_num_new_matched_tokens(request, 0)
    serving.scheduler_side.scheduler._release_step()
    assert hit and load_async
    for manager in serving.managers:
        manager.add_local_computed_blocks(req_id, [], 0, hit)
    for manager in serving.managers:
        manager.allocate_external_computed_blocks(req_id, 0, hit)
    blocks = [list(m.req_to_blocks[req_id]) for m in serving.managers]
    serving.connector.update_state_after_alloc(request, KVCacheBlocks(tuple(blocks)), hit)
    return request, hit, blocks


SPECS_WITH_MAMBA = [attention(4), mamba(16)]


def test_a_chunk_being_loaded_defers_a_second_lookup_of_it() -> None:
    """Two requests with one prefix: while the first one's planned load is in flight,
    the second is deferred (no second load of the same chunks); once the load landed,
    the second hits the same tokens."""
    serving = Serving(SPECS_WITH_MAMBA)
    serving.store_prompt(65)
    _, hit, _ = _start_load(serving, "B", 65)
    request = serving.scheduler_side.request("C", 65)
    assert serving.connector.get_num_new_matched_tokens(request, 0) == (None, False)
    serving.scheduler_side.scheduler._release_step()
    assert "B" in serving.step(serving.output())
    again = serving.scheduler_side.request("C2", 65)
    assert serving.connector.get_num_new_matched_tokens(again, 0)[0] == hit


def _run_until_received(serving: Serving, req_id: str, output: Any) -> None:
    received = serving.step(output)
    for _ in range(3):
        if req_id in received:
            return
        received |= serving.step(serving.output())
    assert req_id in received


def test_a_request_aborted_during_its_planned_load_ends_cleanly() -> None:
    """An abort while a planned load is in flight follows vLLM's path: the request is
    finished at once (vLLM's core keeps its blocks until the load is reported), the
    load lands and is reported, no job is left, and the chunks serve the next request."""
    from vllm.v1.request import RequestStatus

    serving = Serving(SPECS_WITH_MAMBA)
    serving.store_prompt(65)
    request, hit, _ = _start_load(serving, "B", 65)
    request.status = RequestStatus.FINISHED_ABORTED
    assert serving.connector.request_finished(request, []) == (False, None)
    _run_until_received(serving, "B", serving.output(finished={"B"}))
    assert not serving.connector.connector_scheduler._jobs
    again = serving.scheduler_side.request("C", 65)
    assert serving.connector.get_num_new_matched_tokens(again, 0)[0] == hit


def test_a_cache_reset_with_a_planned_load_in_flight_discards_the_stale_report() -> None:
    """A prefix-cache reset while a planned load is in flight: vLLM flushes the job to
    the worker, treats its report as stale once it arrives (no error), lifts the reset
    fence, and the next lookup finds nothing."""
    serving = Serving(SPECS_WITH_MAMBA)
    serving.store_prompt(65)
    _start_load(serving, "B", 65)
    scheduler = serving.connector.connector_scheduler
    output = serving.output()
    meta = serving.connector.build_connector_meta(output)  # the load goes to the worker
    serving.connector.reset_cache()  # between steps, with the load in flight
    assert scheduler._reset_fence  # the in-flight job holds the reset open
    received = serving.work(meta, output)
    for _ in range(3):
        if "B" in received and not scheduler._reset_fence:
            break
        received |= serving.step(serving.output())
    assert "B" in received
    assert not scheduler._reset_fence and not scheduler._jobs
    probe = serving.scheduler_side.request("after-reset", 65)
    assert serving.connector.get_num_new_matched_tokens(probe, 0)[0] == 0


def test_a_preempted_request_looks_up_again_and_reloads_the_same_hit() -> None:
    """Preemption after a planned load: vLLM's core frees the request's blocks and looks
    it up again from token 0; the planner answers with the same hit, and the second
    load lands too (no job left from the first)."""
    serving = Serving(SPECS_WITH_MAMBA)
    serving.store_prompt(65)
    request, hit, _ = _start_load(serving, "B", 65)
    _run_until_received(serving, "B", serving.output())
    serving.step(serving.output(preempted={"B"}))
    for manager in serving.managers:
        manager.free("B")
    again, load_async = serving.connector.get_num_new_matched_tokens(request, 0)
    serving.scheduler_side.scheduler._release_step()
    assert (again, load_async) == (hit, True)


def test_a_refused_load_is_reported_once_naming_every_block_it_was_to_fill() -> None:
    """A load the worker refuses (a host chunk past the region) is reported failed once,
    by ``get_finished``, with every GPU block it was to fill; submitted again (as vLLM does
    after an interrupt cut its submit loop) it is in flight, not refused twice. The
    fail-soft wrapper keeps nothing of it: the worker queues the report with its own."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    serving = Serving([attention(4)])
    fail_soft = serving.worker_side.connector.connector_worker.worker
    gpu = GPULoadStoreSpec([3, 5], [2], [0])
    host = CPULoadStoreSpec([10**6])
    assert fail_soft.submit_load(77, host, gpu)
    assert fail_soft.submit_load(77, host, gpu)
    assert fail_soft._refused == []
    reports = fail_soft.get_finished()
    assert [(r.job_id, r.success, r.failed_blocks) for r in reports] == [(77, False, ((3, 5),))]
    assert fail_soft.get_finished() == []
