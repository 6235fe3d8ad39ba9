"""Two real engines, one cache: ``vllm.LLM`` engines in processes of their own, alive
side by side, sharing vLLM's secondary tiers through this backend
(``TritonTieringOffloadingSpec``). Engine B serves a prompt engine A computed, from the
shared tier, with A's tokens and logprobs:

- through ``fs`` (a shared folder), ``obj`` (S3 through NIXL's OBJ plugin, against a
  local moto server) and ``p2p`` (ZMQ control, NIXL over UCX on 127.0.0.1), A alive
  while B runs; each B has only the one tier, and vLLM's per-source counter says where
  the hit came from;
- a tensor-parallel-2 engine and a one-worker engine under ``canonical_layout`` share
  rows in both directions;
- an engine serving another checkpoint under the same model name gets no hit from any
  of the three tiers;
- a chunk damaged in the ``fs`` tier is refused (counted by reason and tier),
  recomputed, repaired (the next store rewrites it) and never served;
- an engine killed (SIGKILL) in the middle of writing a chunk to ``fs``: another engine
  is served the chunks written whole before it and never the half-written one, and the
  engine restarted on the same tier (and engine id) serves and stores.

Needs vLLM's compiled CPU kernels (``bash ci/engine_env.sh VENV``) and the tiers'
dependencies in that environment (NIXL's CUDA-12 build, moto); skipped without them,
unless ``TRITON_OFFLOAD_REQUIRE_ENGINE=1``, where anything missing fails. Engines run
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (EngineCore and worker in the runner's
process; the runner steps an idle engine as vLLM's engine loop would), except the
tensor-parallel-2 engine (an EngineCore process and two worker processes). Every engine
and the S3 server is started and stopped by PID.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

from tests.helpers.engine_models import prompt_ids, write_model
from tests.helpers.fleet_engines import (
    Fleet,
    FleetEngine,
    delta,
    fs_tier,
    p2p_tier,
    tiering,
)
from tests.helpers.real_engine import engine_problem, skip_or_fail
from tests.helpers.tier_peers import NEEDS, S3Server, free_port, missing_modules

#: Whole chunks of every prompt (one block of the engine's block size each: the tiering
#: spec's default), and the tokens after them (computed, never stored).
CHUNKS = 3
TAIL = 40
#: As in tests/system/test_vllm_engine_real.py: two runs of the CPU kernels agree to
#: float32 rounding, not bit for bit; a wrong byte loaded moves a logprob far more.
LOGPROB_TOLERANCE = 1e-5
#: Hang guard for the killed engine's writer to reach the chunk it stops in.
STALL_TIMEOUT_S = 120.0

HITS = "vllm:external_prefix_cache_hits"
LOCAL_HITS = "vllm:prefix_cache_hits"
LOADED = "vllm:kv_offload_load_bytes"
STORED = "vllm:kv_offload_store_bytes"


def _by_source(source: str) -> str:
    return f"vllm:prompt_tokens_cached_by_source{{source={source}}}"


def _refused(reason: str, tier: str) -> str:
    return f"vllm:triton_offload_chunks_refused{{reason={reason},tier={tier}}}"


def _all_refused(answer: dict[str, Any]) -> float:
    return sum(v for k, v in answer["metrics"].items() if "triton_offload_chunks_refused" in k)


@pytest.fixture(scope="module")
def engine_ready() -> None:
    problem = engine_problem()
    if problem is None:
        missing = missing_modules(*sorted({*NEEDS["p2p"], *NEEDS["obj"]}))
        if missing:
            problem = (
                f"the p2p and obj tiers need {', '.join(missing)} in the engine environment "
                "(bash ci/engine_env.sh VENV installs them)"
            )
    skip_or_fail(problem)


def _prompt(block: int, seed: int) -> list[int]:
    return prompt_ids(CHUNKS * block + TAIL, seed)


def _output(answer: dict[str, Any]) -> dict[str, Any]:
    (output,) = answer["outputs"]
    return output


def _assert_same(served: dict[str, Any], cold: dict[str, Any], where: str) -> None:
    """The served answer's tokens and logprobs are the cold one's."""
    hit, reference = _output(served), _output(cold)
    assert hit["tokens"] == reference["tokens"], where
    assert None not in hit["logprobs"], f"{where}: no logprobs"
    assert hit["logprobs"] == pytest.approx(reference["logprobs"], abs=LOGPROB_TOLERANCE), where
    assert hit["finish_reason"] == "length", where


def _private_folder(root: str, name: str) -> str:
    """A shared fs tier's folder as an operator makes it: its engines' user only."""
    path = os.path.join(root, name)
    os.mkdir(path, 0o700)
    return path


def _damage(path: str) -> bytes:
    """Flip the first 16 bytes of a chunk file (payload bytes: the seal is at the end of
    each page); the file's new bytes."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        for offset in range(16):
            data[offset] ^= 0x5A
        f.seek(0)
        f.write(data)
    return bytes(data)


def _wait_for(path: str, engine: FleetEngine) -> dict[str, Any]:
    """The JSON file ``path``, once the engine wrote it (hang guard: STALL_TIMEOUT_S)."""
    deadline = time.monotonic() + STALL_TIMEOUT_S
    while not os.path.exists(path):
        assert engine.alive(), (
            f"{engine.name} ended before it wrote {path}:\n{engine.log()[-3000:]}"
        )
        assert time.monotonic() < deadline, f"{engine.name} wrote no {path}"
        time.sleep(0.05)
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def fleet_run(engine_ready: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One fleet, its engines in turn and side by side (what each test reads is named in
    the returned dict):

    1. A (fs, obj and p2p tiers) computes P1 and P2 and stays up;
    2. B-p2p, B-obj (one tier each) are served P1 from A, one after the other;
    3. C, another checkpoint saved under the same model name (its node's folder ``llama``)
       with A's three tiers, runs P1;
    4. B-fs is served P1 from A's files; A stops;
    5. one of P2's chunk files is damaged; K (fs) starts beside B-fs, computes P3 and is
       killed while writing P3's second chunk file;
    6. B-fs runs P2 and P3; then, its device cache and host tier emptied each time, P2
       twice more (its stores repair the tier);
    7. K restarts (same engine id) and runs P3 and a new P4.
    """
    root = str(tmp_path_factory.mktemp("fleet"))
    node_a, node_c = os.path.join(root, "node-a"), os.path.join(root, "node-c")
    write_model("llama", node_a)
    write_model("llama", node_c, seed=1)
    fs = fs_tier(_private_folder(root, "fs"))
    fleet = Fleet(root)
    run: dict[str, Any] = {"root": root}
    server = S3Server()
    try:
        obj = server.tier(prefix="fleet")
        port_a = free_port()
        a = fleet.start("a", "llama", tiering([fs, obj, p2p_tier(port_a)]), cwd=node_a)
        run["a_started"] = a.wait_started()
        block = run["block"] = run["a_started"]["block_size"]
        p1, p2, p3, p4 = (_prompt(block, seed) for seed in (11, 12, 13, 14))
        run["a_p1"] = a.generate([p1])
        run["a_p2"] = a.generate([p2])
        a.settle()
        run["p1_files"], run["p2_files"] = a.chunk_files(p1), a.chunk_files(p2)
        run["files_after_a"] = {path: os.path.exists(path) for path in run["p1_files"]}

        b = fleet.start("b-p2p", "llama", tiering([p2p_tier(free_port())]), cwd=node_a)
        run["b_p2p"] = b.generate([p1], source=port_a)
        b.close()
        b = fleet.start("b-obj", "llama", tiering([obj]), cwd=node_a)
        run["b_obj"] = b.generate([p1])
        b.close()
        c = fleet.start(
            "c-other-checkpoint",
            "llama",
            tiering([fs, obj, p2p_tier(free_port())]),
            cwd=node_c,
        )
        run["c_started"] = c.wait_started()
        run["c_p1"] = c.generate([p1], source=port_a)
        c.close()

        b_fs = fleet.start("b-fs", "llama", tiering([fs]), cwd=node_a)
        run["b_fs_p1"] = b_fs.generate([p1])
        run["a_alive_during_b_fs"] = a.alive()
        a.close()

        damaged_path = run["p2_files"][1]
        run["damaged"] = _damage(damaged_path)
        killed_id = f"fleet-killed-{os.getpid()}"
        k = fleet.start("k", "llama", tiering([fs], engine_id=killed_id), cwd=node_a)
        p3_files = run["p3_files"] = k.chunk_files(p3)
        marker = os.path.join(root, "stalled.json")
        k.stall_fs_store(p3_files[1], marker)
        run["k_p3"] = k.generate([p3])
        run["stalled"] = _wait_for(marker, k)
        k.kill()
        run["after_kill"] = {
            "partial": os.path.exists(run["stalled"]["partial"]),
            "partial_bytes": os.path.getsize(run["stalled"]["partial"]),
            "chunk_file": os.path.exists(p3_files[1]),
            "shm": k.shm_files(),
        }

        run["b_fs_p2"] = b_fs.generate([p2])
        run["b_fs_p3"] = b_fs.generate([p3])
        b_fs.settle()
        b_fs.reset()  # the next requests find P2 in the fs tier only
        run["b_fs_p2_second"] = b_fs.generate([p2])
        b_fs.settle()
        with open(damaged_path, "rb") as f:
            run["repaired"] = f.read()
        b_fs.reset()
        run["b_fs_p2_third"] = b_fs.generate([p2])
        b_fs.close()

        k2 = fleet.start("k-restarted", "llama", tiering([fs], engine_id=killed_id), cwd=node_a)
        run["k2_p3"] = k2.generate([p3])
        run["k2_p4"] = k2.generate([p4])
        k2.settle()
        run["p4_files"] = {path: os.path.exists(path) for path in k2.chunk_files(p4)}
        k2.close()
    finally:
        run["left_in_shm"] = fleet.close()
        server.close()
    run["logs"] = {engine.name: engine.log() for engine in fleet.engines}
    run["s3_stopped"] = server.process.poll() is not None
    return run


@pytest.mark.slow
def test_fs_tier_serves_a_running_engines_prompt(fleet_run: dict[str, Any]) -> None:
    """B-fs, started while A runs, is served P1 from the files A wrote: every whole
    chunk, from disk, none from its own device cache; A's tokens and logprobs."""
    block = fleet_run["block"]
    assert all(fleet_run["files_after_a"].values()), fleet_run["files_after_a"]
    assert fleet_run["a_alive_during_b_fs"]
    served = fleet_run["b_fs_p1"]
    assert delta(served, None, HITS) == CHUNKS * block
    assert delta(served, None, _by_source("disk")) == CHUNKS * block
    assert delta(served, None, LOADED) > 0
    assert delta(served, None, LOCAL_HITS) == 0
    assert _all_refused(served) == 0
    _assert_same(served, fleet_run["a_p1"], "b-fs P1 vs a")


@pytest.mark.slow
def test_p2p_tier_serves_a_running_engines_prompt(fleet_run: dict[str, Any]) -> None:
    """B-p2p names A as its requests' ``remote_kv_source``: every whole chunk of P1
    crosses from A's host region to B's (vLLM's p2p tier, NIXL over UCX on 127.0.0.1)."""
    block = fleet_run["block"]
    served = fleet_run["b_p2p"]
    assert delta(served, None, HITS) == CHUNKS * block
    assert delta(served, None, _by_source("p2p")) == CHUNKS * block
    assert delta(served, None, LOADED) > 0
    assert delta(served, None, LOCAL_HITS) == 0
    assert _all_refused(served) == 0
    _assert_same(served, fleet_run["a_p1"], "b-p2p P1 vs a")


@pytest.mark.slow
def test_obj_tier_serves_a_running_engines_prompt(fleet_run: dict[str, Any]) -> None:
    """B-obj (the obj tier only) is served P1 from the objects A put into the local S3
    server (NIXL's OBJ plugin, CUDA-12 build)."""
    block = fleet_run["block"]
    served = fleet_run["b_obj"]
    assert delta(served, None, HITS) == CHUNKS * block
    assert delta(served, None, _by_source("disk")) == CHUNKS * block
    assert delta(served, None, LOADED) > 0
    assert delta(served, None, LOCAL_HITS) == 0
    assert _all_refused(served) == 0
    _assert_same(served, fleet_run["a_p1"], "b-obj P1 vs a")
    assert fleet_run["s3_stopped"]


@pytest.mark.slow
def test_another_checkpoint_under_the_same_name_gets_no_hit(fleet_run: dict[str, Any]) -> None:
    """C serves other weights under A's model name (each node's folder ``llama``) with
    A's fs folder, obj prefix and A as p2p source: no hit, no byte loaded, nothing even
    refused (the chunks never meet), and its own tokens."""
    assert fleet_run["c_started"]["model"] == fleet_run["a_started"]["model"] == "llama"
    other = fleet_run["c_p1"]
    assert delta(other, None, HITS) == 0
    assert delta(other, None, LOADED) == 0
    assert _all_refused(other) == 0
    assert delta(other, None, STORED) > 0
    # The weights differ (else this proves nothing): so do the greedy tokens.
    assert _output(other)["tokens"] != _output(fleet_run["a_p1"])["tokens"]


@pytest.mark.slow
def test_a_damaged_chunk_is_refused_recomputed_repaired_never_served(
    fleet_run: dict[str, Any],
) -> None:
    """P2's second chunk file, damaged on disk: B-fs finds all three chunks in the tier,
    refuses the damaged one when its worker checks the payload (counted once, reason
    ``checksum``), recomputes from there with A's tokens and removes the damaged file.
    vLLM stores no chunk that a failed load made the request recompute (the request's
    store position was moved past the chunks it loads), so the next request that
    computes it (B-fs's second P2, its caches emptied: a miss at the removed file)
    stores it and writes the file again; the third P2 is served all of it from the
    tier, refusing nothing."""
    block = fleet_run["block"]
    served, before = fleet_run["b_fs_p2"], fleet_run["b_fs_p1"]
    assert delta(served, before, HITS) == CHUNKS * block  # found; one refused at the load
    refused = {
        name: delta(served, before, name)
        for name in served["metrics"]
        if "triton_offload_chunks_refused" in name and delta(served, before, name)
    }
    assert sum(refused.values()) == 1 and all("reason=checksum" in n for n in refused), refused
    _assert_same(served, fleet_run["a_p2"], "b-fs P2 (damaged chunk) vs a")
    damaged_file = fleet_run["p2_files"][1]
    removed = [line for line in fleet_run["logs"]["b-fs"].splitlines() if damaged_file in line]
    assert any("removed refused chunk" in line for line in removed), removed

    second, third = fleet_run["b_fs_p2_second"], fleet_run["b_fs_p2_third"]
    assert delta(second, fleet_run["b_fs_p3"], HITS) == block  # the chunk before the hole
    assert delta(second, fleet_run["b_fs_p3"], STORED) > 0
    _assert_same(second, fleet_run["a_p2"], "b-fs P2, second vs a")
    assert len(fleet_run["repaired"]) == len(fleet_run["damaged"])
    assert fleet_run["repaired"] != fleet_run["damaged"]
    assert delta(third, second, HITS) == CHUNKS * block
    assert delta(third, second, _by_source("disk")) == CHUNKS * block
    assert _all_refused(third) == _all_refused(served)
    _assert_same(third, fleet_run["a_p2"], "b-fs P2, third (repaired file) vs a")


@pytest.mark.slow
def test_an_engine_killed_mid_store_leaves_no_partial_chunk(fleet_run: dict[str, Any]) -> None:
    """K, killed while its fs writer had half of P3's second chunk file written: the half
    is in vLLM's temporary file only, never under the chunk's name; B-fs is served P3's
    first chunk and recomputes the rest (K's tokens), refusing nothing (it never read the
    half), and stores the rest; the kill left K's host region nowhere in /dev/shm; K
    restarted on the same tier and engine id is served all of P3 and stores P4."""
    block = fleet_run["block"]
    stalled, after = fleet_run["stalled"], fleet_run["after_kill"]
    p3_files = fleet_run["p3_files"]
    assert p3_files[0] in stalled["whole"] and p3_files[1] not in stalled["whole"]
    assert after["partial"] and after["partial_bytes"] == stalled["chunk_bytes"] // 2
    assert not after["chunk_file"], "the half-written chunk was published under its name"
    # Its host region was unlinked once mapped: the kill left no 64 MiB file behind.
    assert not [path for path in after["shm"] if "vllm_offload_" in path], after["shm"]
    served = fleet_run["b_fs_p3"]
    assert delta(served, fleet_run["b_fs_p2"], HITS) == block
    assert _all_refused(served) == _all_refused(fleet_run["b_fs_p2"])
    _assert_same(served, fleet_run["k_p3"], "b-fs P3 vs the killed engine")
    restarted = fleet_run["k2_p3"]
    assert delta(restarted, None, HITS) == CHUNKS * block
    assert _all_refused(restarted) == 0
    _assert_same(restarted, fleet_run["k_p3"], "restarted engine P3 vs the killed engine")
    stored = fleet_run["k2_p4"]
    assert delta(stored, restarted, HITS) == 0
    assert delta(stored, restarted, STORED) > 0
    assert all(fleet_run["p4_files"].values()), fleet_run["p4_files"]


@pytest.mark.slow
def test_the_fleet_leaves_nothing_behind(fleet_run: dict[str, Any]) -> None:
    """Every engine shut down cleanly removed its /dev/shm files; the killed engine's
    leftovers (its plane note) were taken over by its restart, which removed them."""
    assert fleet_run["left_in_shm"] == []
    for name, log in fleet_run["logs"].items():
        assert "mapped: buffers are still exported" not in log, name


@pytest.fixture(scope="module")
def canonical_run(engine_ready: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A one-worker engine (T1) and a tensor-parallel-2 engine (T2), both with
    ``canonical_layout`` and one fs folder, side by side: T1 computes P6, T2 is served
    it and computes P5, T1 is served P5. The model has 2 KV heads, one per worker under
    tensor parallel 2."""
    root = str(tmp_path_factory.mktemp("canonical"))
    model = write_model("llama-kv2", os.path.join(root, "models"))
    kv = tiering([fs_tier(_private_folder(root, "fs"))], canonical_layout=True)
    fleet = Fleet(root)
    run: dict[str, Any] = {}
    try:
        t1 = fleet.start("t1", model, dict(kv, engine_id="fleet-t1"))
        t2 = fleet.start("t2", model, dict(kv, engine_id="fleet-t2"), tp=2)
        block = run["block"] = t1.wait_started()["block_size"]
        p5, p6 = _prompt(block, 15), _prompt(block, 16)
        run["t1_p6"] = t1.generate([p6])
        t1.settle()
        run["t2_started"] = t2.wait_started()
        run["t2_p6"] = t2.generate([p6])
        run["t2_p5"] = t2.generate([p5])
        t2.settle()
        run["t1_p5"] = t1.generate([p5])
    finally:
        run["left_in_shm"] = fleet.close()
        run["vllm_leftovers"] = fleet.vllm_leftovers  # removed; vLLM's, not this backend's
    return run


@pytest.mark.slow
def test_tp2_and_tp1_engines_share_canonical_rows(canonical_run: dict[str, Any]) -> None:
    block = canonical_run["block"]
    assert not canonical_run["t2_started"]["in_process"]  # EngineCore + 2 workers
    for served, before, cold, where in (
        (canonical_run["t2_p6"], None, canonical_run["t1_p6"], "TP 2 served TP 1's P6"),
        (
            canonical_run["t1_p5"],
            canonical_run["t1_p6"],
            canonical_run["t2_p5"],
            "TP 1 served TP 2's P5",
        ),
    ):
        assert delta(served, before, HITS) == CHUNKS * block, where
        assert delta(served, before, _by_source("disk")) == CHUNKS * block, where
        assert _all_refused(served) == 0, where
        _assert_same(served, cold, where)
    assert canonical_run["left_in_shm"] == []


def _key_file(root: str, name: str) -> str:
    """A seal key as an operator makes one: 32 random bytes, mode 0600."""
    path = os.path.join(root, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as key_file:
        key_file.write(os.urandom(32))
    return path


@pytest.fixture(scope="module")
def keyed_run(engine_ready: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A keyed fleet on one fs folder, its engines one after another: A (the fleet's key)
    computes P7; B (the same key) is served it; N (no key) and O (another key) run it
    with A's files in the folder, in that order."""
    root = str(tmp_path_factory.mktemp("keyed"))
    node = os.path.join(root, "node")
    write_model("llama", node)
    fs = fs_tier(_private_folder(root, "fs"))
    key, other = _key_file(root, "fleet.key"), _key_file(root, "other.key")
    fleet = Fleet(root)
    run: dict[str, Any] = {}
    try:
        a = fleet.start("keyed-a", "llama", tiering([fs], seal_key_file=key), cwd=node)
        block = run["block"] = a.wait_started()["block_size"]
        p7 = _prompt(block, 17)
        run["a_p7"] = a.generate([p7])
        a.settle()
        files = a.chunk_files(p7)
        a.close()
        run["a_files"] = {path: _read(path) for path in files}
        for name, extra in (
            ("b", {"seal_key_file": key}),
            ("n", {}),
            ("o", {"seal_key_file": other}),
        ):
            engine = fleet.start(f"keyed-{name}", "llama", tiering([fs], **extra), cwd=node)
            run[f"{name}_p7"] = engine.generate([p7])
            engine.settle()
            engine.close()
            run[f"files_after_{name}"] = {path: _read(path) for path in files}
    finally:
        run["left_in_shm"] = fleet.close()
    return run


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


@pytest.mark.slow
def test_a_keyed_fleet_shares_its_tier_and_refuses_other_keys(keyed_run: dict[str, Any]) -> None:
    """With one ``seal_key_file``, B is served A's chunks from the fs folder (A's tokens
    and logprobs, nothing refused). N, without a key, refuses every chunk (``keyed``: it
    cannot check a keyed tag), recomputes and leaves A's files as they were. O, under
    another key, refuses them as forgeries, recomputes, and its repair replaces them
    with its own. Every engine's answer is A's."""
    block = keyed_run["block"]
    a_files = keyed_run["a_files"]
    assert a_files and None not in a_files.values()
    served = keyed_run["b_p7"]
    assert delta(served, None, HITS) == CHUNKS * block
    assert delta(served, None, _by_source("disk")) == CHUNKS * block
    assert _all_refused(served) == 0
    _assert_same(served, keyed_run["a_p7"], "b (same key) vs a")
    assert keyed_run["files_after_b"] == a_files

    unkeyed = keyed_run["n_p7"]
    assert delta(unkeyed, None, HITS) == 0
    assert delta(unkeyed, None, _refused("keyed", "fs")) >= 1
    assert _all_refused(unkeyed) == delta(unkeyed, None, _refused("keyed", "fs"))
    _assert_same(unkeyed, keyed_run["a_p7"], "n (no key) vs a")
    assert keyed_run["files_after_n"] == a_files  # never judged, never removed

    other = keyed_run["o_p7"]
    assert delta(other, None, HITS) == 0
    assert delta(other, None, _refused("forgery", "fs")) >= 1
    assert _all_refused(other) == delta(other, None, _refused("forgery", "fs"))
    _assert_same(other, keyed_run["a_p7"], "o (another key) vs a")
    assert keyed_run["files_after_o"] != a_files
    assert keyed_run["left_in_shm"] == []
