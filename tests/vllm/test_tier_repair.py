"""A chunk a secondary tier returned corrupt is repaired by the next store of its key.

vLLM's fs tier never overwrites a chunk file that exists, so a file refused once (by the
scheduler's seal check at the promotion or by a worker's check at the load) would be
promoted, refused and recomputed again every time its chunk leaves host memory. Here a
refused fs file is removed (only when its own bytes fail the check, and only the inode
that was judged), so the next store of the key writes a good file and the promotion after
it is accepted: one refusal in all rounds. A good file is never removed. vLLM's obj tier
overwrites an object on every store, so the next store repairs it without a removal.

The rounds run through vLLM's real scheduler, this connector, vLLM's tiering manager
and its fs (or obj, against a local moto S3 server) tier (``tests/helpers/vllm_engine.py``).

The removal never leaves the tier: a folder on a chunk's path swapped for a symbolic link
to an outside folder, before each of the removal's file-system calls in turn or from a
thread racing thousands of removals, never costs an outside file.
"""

from __future__ import annotations

import collections
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Imported before anything that needs vLLM: where vLLM cannot be imported, fault_workload
# skips (its module-level skip, with the import error as the reason) and this module with it.
from tests.helpers.fault_workload import (
    BAD,
    CHUNKS,
    SECOND,
    TOKENS,
    Row,
    first_computed_block,
    fs_file,
    fs_tier,
    host_row,
    keys_of,
    load_cuda12_nixl,
    make_engine,
    reseal_as_another_layout,
    serve,
    tiered_engine,
)
from tests.helpers.tier_peers import S3Server, require
from tests.helpers.vllm_engine import BLOCK, PROMPT, Engine, prompt
from triton_offload.vllm.tier_repair import RemovalOutcome, remove_refused_file

#: Rounds of "push the chunks out of host memory, serve the prompt again".
ROUNDS = 4


def evict_host_chunks(engine: Engine, row: Row, round_index: int) -> None:
    """A new eight-chunk prompt fills every host chunk: the earlier chunks now live in the
    secondary tier only."""
    serve(engine, row, f"X{round_index}", prompt(extra=2 * BLOCK, seed=11 + round_index))
    engine.settle()


def run_rounds(engine: Engine, row: Row) -> list[int]:
    """Serve the second prompt ROUNDS times, each after an eviction; the chunks refused
    after each round (a running count)."""
    guard = engine.connector_scheduler.triton_guard
    refused = []
    for round_index in range(ROUNDS):
        evict_host_chunks(engine, row, round_index)
        serve(engine, row, f"R{round_index}", SECOND)  # asserts no block loaded wrong
        engine.settle()
        refused.append(guard.chunks_refused)
    return refused


def stored_on_fs(engines: list[Engine], tmp_path: Path, row: Row) -> tuple[Engine, list[Any], Path]:
    """An engine over vLLM's fs tier once request A stored TOKENS and the tier wrote the
    chunks: the engine, the chunks' keys and the fs file of chunk BAD."""
    engine = tiered_engine(engines, tmp_path, fs_tier(tmp_path / "fs"))
    serve(engine, row, "A", TOKENS)
    engine.settle()
    keys = keys_of(engine, TOKENS)
    return engine, keys, fs_file(engine, keys[BAD])


FS_FAULTS = ["same-size garbage", "another key's file", "flipped byte", "truncated"]


@pytest.mark.parametrize("how", FS_FAULTS)
def test_a_refused_fs_file_is_repaired_by_the_next_store(
    engines: list[Engine], tmp_path: Path, how: str
) -> None:
    """Refused once (at the promotion: garbage, another key's file, a short file; at the
    worker's load: a flipped payload byte), then the next store writes a good file and
    every later promotion of the chunk is accepted and loads byte-exactly."""
    row = Row(f"fs repair: {how}")
    engine, keys, path = stored_on_fs(engines, tmp_path, row)
    good = path.read_bytes()
    if how == "same-size garbage":
        path.write_bytes(os.urandom(len(good)))
    elif how == "another key's file":
        path.write_bytes(fs_file(engine, keys[BAD + 1]).read_bytes())
    elif how == "flipped byte":
        changed = bytearray(good)
        changed[100] ^= 0x01  # a payload byte: the seal's header is whole
        path.write_bytes(bytes(changed))
    else:
        path.write_bytes(good[: len(good) // 8])
    refused = run_rounds(engine, row)
    # Refused in the first round only. A short file also fails the tier's read of the
    # chunks after it in the same promotion (rows never written: refused too, their
    # files kept, promoted fine in the next round).
    assert refused == [refused[0]] * ROUNDS, f"refusals after each round: {refused}"
    assert refused[0] == 1 or how == "truncated"
    # The last round loaded every whole chunk of the prompt from the tier and computed
    # only the tokens after them (serve() compared every block with a cold run).
    last = f"R{ROUNDS - 1}"
    assert engine.hits[last] == PROMPT
    assert first_computed_block(engine, last) == CHUNKS
    # The repaired file holds, byte for byte, the sealed page the first store wrote (the
    # row's alignment padding after it is whatever the host row held).
    page_bytes = engine.connector_scheduler.triton_guard.page_bytes
    assert path.read_bytes()[:page_bytes] == good[:page_bytes]
    assert engine.connector_scheduler.triton_guard.tier_files_removed == (
        0 if how == "truncated" else 1  # vLLM's fs tier removes a short file itself
    )


@pytest.mark.parametrize("how", ["host byte flipped", "another layout's file"])
def test_a_good_fs_file_is_never_removed(engines: list[Engine], tmp_path: Path, how: str) -> None:
    """The refused bytes are not the file's: a host row flipped after the chunk went to
    fs (the file is the good chunk), or a valid chunk of another row layout that shares
    the folder (good for its writer; only the worker's layout digest refuses it). The file
    stays, the same inode with the same bytes."""
    row = Row(f"fs keep: {how}")
    engine, keys, path = stored_on_fs(engines, tmp_path, row)
    if how == "host byte flipped":
        engine.transfer_worker.engine.pool[host_row(engine, keys[BAD]), 5] ^= 0x40
    else:
        page_bytes = engine.connector_scheduler.triton_guard.page_bytes
        path.write_bytes(reseal_as_another_layout(path.read_bytes(), page_bytes))
        evict_host_chunks(engine, row, 100)
    before, content = os.stat(path), path.read_bytes()
    serve(engine, row, "B", SECOND)
    engine.settle()
    guard = engine.connector_scheduler.triton_guard
    assert guard.chunks_refused == 1 and first_computed_block(engine, "B") == BAD
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert path.read_bytes() == content
    assert guard.tier_files_removed == 0
    if how == "host byte flipped":
        # C recomputes the chunk (its store lifts the quarantine; fs keeps its good file)
        # and, once the host copies are gone, D promotes the good file and loads it.
        serve(engine, row, "C", SECOND)
        engine.settle()
        evict_host_chunks(engine, row, 101)
        serve(engine, row, "D", SECOND)
        assert engine.hits["D"] == PROMPT and guard.chunks_refused == 1
        assert os.stat(path).st_ino == before.st_ino


# ------------------------------------------------------------------ the removal itself


def chunk_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "tier_r0" / "abc" / "de_g0"
    folder.mkdir(parents=True)
    return folder


def refuse_all(data: bytes) -> str | None:
    return "refused"


def test_a_refused_file_is_removed_and_a_good_one_kept(tmp_path: Path) -> None:
    folder = chunk_folder(tmp_path)
    bad, good = folder / "bad.bin", folder / "good.bin"
    bad.write_bytes(b"\x00" * 64)
    good.write_bytes(b"\x01" * 64)

    def judge(data: bytes) -> str | None:
        return None if data == b"\x01" * 64 else "zeros"

    root = str(tmp_path / "tier_r0")
    assert remove_refused_file(str(bad), root, 64, judge) is RemovalOutcome.REMOVED
    assert not bad.exists()
    assert remove_refused_file(str(good), root, 64, judge) is RemovalOutcome.GOOD
    assert good.read_bytes() == b"\x01" * 64
    assert remove_refused_file(str(bad), root, 64, judge) is RemovalOutcome.ABSENT
    assert sorted(p.name for p in folder.iterdir()) == ["good.bin"]  # no stray file left


def test_a_good_file_published_while_the_refused_one_is_judged_is_kept(tmp_path: Path) -> None:
    """Another engine publishes a good file for the key (write, then rename over the
    path, as vLLM's fs tier does) after the refused file was read and before it is
    removed: the good file stays."""
    folder = chunk_folder(tmp_path)
    path = folder / "chunk.bin"
    path.write_bytes(b"\x00" * 64)

    def judge_while_another_engine_writes(data: bytes) -> str | None:
        assert data == b"\x00" * 64  # the refused bytes were read
        fresh = folder / "chunk.bin_123.tmp"
        fresh.write_bytes(b"\x01" * 64)
        os.replace(fresh, path)  # the other engine's store
        return "refused"

    outcome = remove_refused_file(
        str(path), str(tmp_path / "tier_r0"), 64, judge_while_another_engine_writes
    )
    assert outcome is RemovalOutcome.REPLACED
    assert path.read_bytes() == b"\x01" * 64
    assert sorted(p.name for p in folder.iterdir()) == ["chunk.bin"]


def test_nothing_outside_the_tier_folder_or_behind_a_link_is_touched(tmp_path: Path) -> None:
    folder = chunk_folder(tmp_path)
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"\x00" * 64)
    root = str(tmp_path / "tier_r0")
    with pytest.raises(ValueError, match=r"elsewhere\.bin.* is not inside the tier folder"):
        remove_refused_file(str(outside), root, 64, refuse_all)
    escaping = str(folder / ".." / ".." / ".." / "elsewhere.bin")
    with pytest.raises(ValueError, match="is not inside the tier folder"):
        remove_refused_file(escaping, root, 64, refuse_all)
    link = folder / "link.bin"
    link.symlink_to(outside)
    assert remove_refused_file(str(link), root, 64, refuse_all) is RemovalOutcome.NOT_A_FILE
    assert link.is_symlink() and outside.read_bytes() == b"\x00" * 64
    with pytest.raises(ValueError, match="size must be positive, got 0"):
        remove_refused_file(str(folder / "x.bin"), root, 0, refuse_all)


# ------------------------------------------------------------------ vLLM's obj tier


@pytest.fixture(scope="module")
def s3_server() -> Any:
    require("obj")
    with S3Server.running() as server:
        yield server


def test_a_refused_obj_object_is_repaired_by_the_next_store(
    engines: list[Engine], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """vLLM's obj tier writes every store (an S3 put replaces the object): the store
    after the refusal repairs it, with no removal (NIXL's OBJ backend has none)."""
    server: S3Server = request.getfixturevalue("s3_server")
    load_cuda12_nixl()
    row = Row("obj repair")
    engine = tiered_engine(engines, tmp_path, server.tier(prefix=uuid.uuid4().hex))
    tier = engine.offloading_manager.secondary_tiers[0]
    s3 = server.client()
    serve(engine, row, "A", TOKENS)
    engine.settle()
    keys = keys_of(engine, TOKENS)
    name = server.object_name(tier._file_mapper.get_file_name(keys[BAD]))
    good = s3.get_object(Bucket=server.BUCKET, Key=name)["Body"].read()
    s3.put_object(Bucket=server.BUCKET, Key=name, Body=os.urandom(len(good)))
    refused = run_rounds(engine, row)
    assert refused == [1] * ROUNDS, f"refusals after each round: {refused}"
    assert engine.hits[f"R{ROUNDS - 1}"] == PROMPT
    page_bytes = engine.connector_scheduler.triton_guard.page_bytes
    repaired = s3.get_object(Bucket=server.BUCKET, Key=name)["Body"].read()
    assert repaired[:page_bytes] == good[:page_bytes]


def test_the_cpu_spec_alone_has_no_tier_to_repair(engines: list[Engine], tmp_path: Path) -> None:
    """Without secondary tiers a refused host chunk removes nothing (no tier watched)."""
    row = Row("cpu only")
    engine = make_engine(engines, tmp_path)
    serve(engine, row, "A", TOKENS)
    keys = keys_of(engine, TOKENS)
    engine.transfer_worker.engine.pool[host_row(engine, keys[BAD]), 5] ^= 0x40
    serve(engine, row, "B", SECOND)
    guard = engine.connector_scheduler.triton_guard
    assert guard.chunks_refused == 1 and guard.tier_files_removed == 0


def test_a_link_where_a_refused_fs_file_belongs_is_kept_and_named(
    engines: list[Engine], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused chunk's file replaced by a link to garbage outside the tier: the link
    is followed by no removal (the garbage stays), and the log names what was found."""
    row = Row("fs link")
    engine, _, path = stored_on_fs(engines, tmp_path, row)
    outside = tmp_path / "outside-garbage"
    outside.write_bytes(os.urandom(path.stat().st_size))
    path.unlink()
    path.symlink_to(outside)
    with caplog.at_level("WARNING", logger="vllm.triton_offload"):
        refused = run_rounds(engine, row)
    assert refused[0] >= 1
    assert path.is_symlink() and outside.exists()
    assert engine.connector_scheduler.triton_guard.tier_files_removed == 0
    named = [
        r.getMessage() for r in caplog.records if RemovalOutcome.NOT_A_FILE.value in r.getMessage()
    ]
    assert named and str(path) in named[0], [r.getMessage() for r in caplog.records]


# ------------------------------------------------------------------ folders swapped for links

#: Entries of os the removal may call; a swap is planted before the n-th call of any.
FILE_SYSTEM_CALLS = ("open", "rename", "replace", "link", "unlink", "stat", "lstat")


def swap_for_link(folder: Path, outside: Path) -> None:
    """Another writer of the tier moves ``folder`` aside and puts a symbolic link to
    ``outside`` (a folder of the engine's user, out of the tier) in its place."""
    folder.rename(folder.with_name(folder.name + ".moved"))
    folder.symlink_to(outside, target_is_directory=True)


def tier_with_twin_outside(tmp_path: Path, swapped: str) -> tuple[Path, Path, Path, Path]:
    """A refused chunk file in the tier and a file of the same name in an outside folder
    shaped like the tier below ``swapped``: (tier folder, chunk file, the folder that is
    swapped, the outside folder its link points to)."""
    root = tmp_path / "tier_r0"
    chunk = root / "abc" / "de_g0" / "chunk.bin"
    chunk.parent.mkdir(parents=True)
    chunk.write_bytes(b"\x00" * 64)
    swapped_folder = root / swapped
    outside = tmp_path / "outside"
    twin = outside / chunk.relative_to(swapped_folder)
    twin.parent.mkdir(parents=True)
    twin.write_bytes(b"\x00" * 64)
    return root, chunk, swapped_folder, outside


def count_calls(monkeypatch: pytest.MonkeyPatch, before: Callable[[int], None]) -> None:
    """Run ``before(n)`` ahead of the n-th call (from 1) of any FILE_SYSTEM_CALLS."""
    calls = [0]
    for name in FILE_SYSTEM_CALLS:
        real = getattr(os, name)

        def hooked(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            calls[0] += 1
            before(calls[0])
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, hooked)


@pytest.mark.parametrize("swapped", ["abc", "abc/de_g0"])
def test_a_folder_swapped_for_a_link_never_leads_the_removal_out_of_the_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swapped: str
) -> None:
    """A folder on the chunk's path becomes a symbolic link to an outside folder at any
    moment of the removal: before each of its file-system calls in turn, and while the
    judge reads. The outside file of the same name is never touched."""
    _, dry_chunk, _, _ = tier_with_twin_outside(tmp_path / "dry-run", swapped)
    calls: list[int] = []
    with monkeypatch.context() as patch:
        count_calls(patch, calls.append)
        remove_refused_file(str(dry_chunk), str(tmp_path / "dry-run" / "tier_r0"), 64, refuse_all)
    assert not dry_chunk.exists() and calls, "the dry run removes the refused file"
    for moment in [*range(1, len(calls) + 1), "judge"]:
        case = tmp_path / f"case-{moment}"
        root, chunk, swapped_folder, outside = tier_with_twin_outside(case, swapped)
        twin = outside / chunk.relative_to(swapped_folder)
        inode = twin.stat().st_ino

        def swap_at(call: int, _moment: Any = moment, _folder: Path = swapped_folder,
                    _outside: Path = outside) -> None:  # fmt: skip
            if call == _moment:
                swap_for_link(_folder, _outside)

        def judge(data: bytes, _moment: Any = moment, _folder: Path = swapped_folder,
                  _outside: Path = outside) -> str:  # fmt: skip
            if _moment == "judge":
                swap_for_link(_folder, _outside)
            return "refused"

        with monkeypatch.context() as patch:
            count_calls(patch, swap_at)
            try:
                outcome: Any = remove_refused_file(str(chunk), str(root), 64, judge)
            except (OSError, ValueError) as error:  # refused: the engine logs it, keeps all
                outcome = error
        assert twin.exists() and twin.stat().st_ino == inode, (
            f"swap before call {moment}: {outcome}, the outside file {twin} was removed"
        )
        assert twin.read_bytes() == b"\x00" * 64
        assert sorted(p.name for p in twin.parent.iterdir()) == ["chunk.bin"]


def test_folders_swapped_for_links_while_repairs_run_never_lose_an_outside_file(
    tmp_path: Path,
) -> None:
    """A writer of the tier swaps a folder for a link to an outside folder and back, as
    fast as it can, while 3,000 refused chunk files are removed one by one: every outside
    file of the same name is still there afterwards (the tier's own files may go or
    stay; none leaves the tier)."""
    count = 3000
    root = tmp_path / "tier_r0"
    leaf = root / "abc" / "de_g0"
    outside = tmp_path / "outside"
    (outside / "de_g0").mkdir(parents=True)
    leaf.mkdir(parents=True)
    names = [f"c{index:05d}.bin" for index in range(count)]
    for name in names:
        (leaf / name).write_bytes(b"\x00" * 64)
        (outside / "de_g0" / name).write_bytes(b"\x00" * 64)
    folder, aside = root / "abc", root / "abc.real"
    stop = threading.Event()
    swaps = [0]

    def swapper() -> None:
        while not stop.is_set():
            folder.rename(aside)
            folder.symlink_to(outside, target_is_directory=True)
            folder.unlink()
            aside.rename(folder)
            swaps[0] += 1

    thread = threading.Thread(target=swapper, daemon=True)
    thread.start()
    outcomes: collections.Counter[str] = collections.Counter()
    try:
        for name in names:
            try:
                outcome = remove_refused_file(str(leaf / name), str(root), 64, refuse_all)
                outcomes[outcome.name] += 1
            except (OSError, ValueError) as error:  # refused, as the engine's caller logs it
                outcomes[type(error).__name__] += 1
    finally:
        stop.set()
        thread.join(timeout=120)
    assert not thread.is_alive()
    assert swaps[0] > 0
    lost = [name for name in names if not (outside / "de_g0" / name).exists()]
    assert lost == [], f"{len(lost)} outside files removed ({dict(outcomes)}, {swaps[0]} swaps)"
    assert sorted(p.name for p in (outside / "de_g0").iterdir()) == names
