"""vLLM's fs tier writes under temporary names no other engine draws
(triton_offload/vllm/fs_writes.py).

vLLM writes a chunk file into ``<file><suffix>`` (opened with O_EXCL) and renames it
over the chunk's name; it draws the suffix from Python's ``random`` module, which vLLM
seeds with the engine's seed. Here every writer is a fresh thread of this process whose
``random`` module was seeded alike, as two engines of one seed are: the leftover of a
writer killed half-way must not stop the other from storing the chunk.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.tiering_config import make_config

try:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.fs import io

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")

SEED = 0  # vLLM's default engine seed
CHUNK = 4096


@pytest.fixture
def vllm_names(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's own suffix function and an unseeded ``random`` again after the test."""
    monkeypatch.setattr(io, "_get_tmp_suffix", io._get_tmp_suffix)
    state = random.getstate()
    yield
    random.setstate(state)


def in_seeded_writer(work: Callable[[], Any]) -> Any:
    """``work()`` on a new thread (a new writer thread of vLLM's fs tier: its suffix is
    drawn on first use) after seeding ``random`` as vLLM seeds an engine's process."""
    result: dict[str, Any] = {}

    def run() -> None:
        random.seed(SEED)
        try:
            result["value"] = work()
        except BaseException as error:
            result["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the writer thread hung"
    if "error" in result:
        raise result["error"]
    return result["value"]


def build_tiering_spec(tmp_path: Path) -> Any:
    """TritonTieringOffloadingSpec with an fs tier, as an engine's scheduler builds it."""
    return OffloadingSpecFactory.create_spec(make_config(tmp_path / "tier"))


def test_engines_of_one_seed_draw_different_temporary_names(
    vllm_names: None, tmp_path: Path
) -> None:
    build_tiering_spec(tmp_path)
    first = in_seeded_writer(lambda: io._get_tmp_suffix())
    second = in_seeded_writer(lambda: io._get_tmp_suffix())
    assert first != second
    for suffix in (first, second):  # vLLM's shape: _<number below 2**63>.tmp
        assert re.fullmatch(r"_[0-9]+\.tmp", suffix) and int(suffix[1:-4]) < 2**63, suffix


def test_a_killed_writers_leftover_does_not_stop_the_chunk_being_stored(
    vllm_names: None, tmp_path: Path
) -> None:
    """The killed writer left half of the chunk under its temporary name; a writer of
    another engine with the same seed stores the whole chunk under the chunk's name."""
    build_tiering_spec(tmp_path)
    chunk = tmp_path / "tier" / "model_r0" / "abc" / "de_g0" / "abcdef.bin"
    chunk.parent.mkdir(parents=True)
    payload = bytes(range(256)) * (CHUNK // 256)

    def leave_half() -> str:
        leftover = str(chunk) + io._get_tmp_suffix()
        with open(leftover, "wb") as f:
            f.write(payload[: CHUNK // 2])
        return leftover

    leftover = in_seeded_writer(leave_half)
    view = memoryview(bytearray(payload))
    in_seeded_writer(lambda: io.batch_store_block([str(chunk)], view, [0], CHUNK, False))
    assert chunk.read_bytes() == payload
    assert Path(leftover).read_bytes() == payload[: CHUNK // 2]  # another writer's file


def test_without_the_spec_vllms_names_collide() -> None:
    """The judge can fail: in a process where no spec was built, vLLM's own suffixes of
    two writer threads seeded alike are equal."""
    script = textwrap.dedent(
        """
        import random, sys, threading
        from vllm.v1.kv_offload.tiering.fs import io

        SEED = int(sys.argv[1])

        suffixes = []

        def writer():
            random.seed(SEED)
            suffixes.append(io._get_tmp_suffix())

        for _ in range(2):
            thread = threading.Thread(target=writer)
            thread.start()
            thread.join()
        print(suffixes[0] == suffixes[1], suffixes[0])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(SEED)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    equal, suffix = done.stdout.split()
    assert equal == "True" and suffix.endswith(".tmp"), done.stdout
