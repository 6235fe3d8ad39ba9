"""`triton-offload tier`: an fs tier folder written by vLLM's real fs tier, described,
its chunks' seals checked offline, refused files listed and removed the safe way; a
folder that is no tier refused naming why; the scan beside a live writer.

The tiers are written by vLLM's core scheduler with this connector, vLLM's tiering
manager and its fs tier (``tests/helpers/fault_workload.py``): one sealed model folder
(this backend's default) and one whose rows carry no seal (``verify_chunks`` false).
The expected counts, sizes and times come from walking the folder here, and the expected
refusals from how each file was damaged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# Imported before anything that needs vLLM: where vLLM cannot be imported, fault_workload
# skips (its module-level skip, with the import error as the reason) and this module with it.
from tests.helpers.fault_workload import (
    TOKENS,
    Row,
    fs_file,
    fs_tier,
    keys_of,
    make_engine,
    serve,
)
from tests.helpers.vllm_engine import Engine
from triton_offload.cli import main
from triton_offload.cli import tier as tier_cli
from triton_offload.transfer.seal import SealFormat, key_digest, read_seal, write_seal
from triton_offload.transfer.seal_key import SealKey
from triton_offload.vllm.tier_repair import TierFolder

#: Every chunk of the first request's prompt goes to the tier (one block per chunk).
CHUNKS = len(TOKENS) // 16


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One fs tier root written by two engines (sealed rows; rows without seals), and
    the file of each chunk key of the sealed engine (from vLLM's own FileMapper)."""
    root = tmp_path_factory.mktemp("tier") / "fs"
    engines: list[Engine] = []
    try:
        sealed = _tiered(engines, tmp_path_factory.mktemp("sealed"), root)
        unsealed = _tiered(engines, tmp_path_factory.mktemp("unsealed"), root, verify_chunks=False)
        for engine in (sealed, unsealed):
            serve(engine, Row("tier"), "A", TOKENS)
            engine.settle()
        files = {bytes(key): fs_file(sealed, key) for key in keys_of(sealed, TOKENS)}
        models = {
            str(engine.offloading_manager.secondary_tiers[0].file_mapper.base_path): engine
            for engine in (sealed, unsealed)
        }
        page = int(sealed.connector_scheduler.triton_guard.page_bytes)
        yield {"root": root, "files": files, "models": models, "page": page}
    finally:
        for engine in engines:
            engine.close()


def _tiered(engines: list[Engine], tmp_path: Path, root: Path, **extra: Any) -> Engine:
    return make_engine(
        engines,
        tmp_path,
        spec_name="TritonTieringOffloadingSpec",
        spec_module_path="triton_offload.vllm",
        cpu_bytes_to_use=8 * 4096,
        secondary_tiers=[fs_tier(root)],
        **extra,
    )


@pytest.fixture
def tier(written: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """A copy of the written tier this test may damage (files keep their times)."""
    root = tmp_path / "fs"
    shutil.copytree(written["root"], root, symlinks=True)
    base = written["root"]
    files = {key: root / path.relative_to(base) for key, path in written["files"].items()}
    return {**written, "root": root, "files": files}


def run_tier(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["tier", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def report_of(capsys: pytest.CaptureFixture[str], root: Path, *flags: str) -> tuple[int, Any]:
    code, out, err = run_tier(capsys, str(root), "--json", *flags)
    assert err == ""
    return code, json.loads(out)


def chunk_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.bin") if p.is_file() and not p.is_symlink())


# ------------------------------------------------------------------ what a tier holds


def test_the_tier_vllm_wrote_is_described_model_by_model(
    tier: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    root: Path = tier["root"]
    code, report = report_of(capsys, root)
    assert code == 0 and report["refused"] == []
    assert set(report["models"]) == {Path(base).name for base in tier["models"]}
    for base, engine in tier["models"].items():
        model = report["models"][Path(base).name]
        files = chunk_files(root / f"{Path(base).name}_r0")
        assert len(files) == CHUNKS
        times = [p.stat().st_mtime_ns for p in files]
        assert model["model"] == str(engine.scheduler.vllm_config.model_config.model)
        assert model["chunks"] == CHUNKS and model["bytes"] == sum(p.stat().st_size for p in files)
        rank = model["ranks"]["0"]
        assert (rank["oldest_ns"], rank["newest_ns"]) == (min(times), max(times))
        assert model["config_problem"] is None
        assert model["layout"].startswith("triton_offload rows v1, pages of ")
        assert model["checkpoint"].startswith("none (no checkpoint identity")
        assert model["groups"] == [16] and model["dtype"] == "float32"
        digest = engine.connector_scheduler.triton_guard.digest
        verified = digest is not None
        assert model["config_digests"] == ([digest.hex()] if verified else [])
        assert model["sealed"] is verified
        assert rank["good"] == (CHUNKS if verified else 0)
    assert stat_mode(root) == report["mode"] == 0o700  # the spec created the root private
    code, out, _ = run_tier(capsys, str(root))
    assert code == 0
    assert f"rank 0      {CHUNKS} chunks, " in out
    assert f"seals       {CHUNKS} good, 0 refused; 1 configuration digest" in out
    assert "seals       not checked: no chunk carries a seal" in out
    assert out.splitlines()[-1].startswith(f"total: 2 models, {2 * CHUNKS} chunks, ")
    assert "no other local user may enter it" in out.splitlines()[0]


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


def test_chunk_names_are_read_as_vllm_names_them(tier: dict[str, Any]) -> None:
    """The key the command derives from a file's name is the key vLLM filed it under."""
    for key, path in tier["files"].items():
        group = int(path.parent.name.split("_g")[1])
        assert tier_cli.chunk_key(path.stem, group) == key


# ------------------------------------------------------------------ refused files


def reseal(data: bytes, key: bytes, page: int) -> bytes:
    """``data``'s one-page chunk sealed as ``key``'s (a valid chunk of that key, as an
    engine would have written it)."""
    row = np.frombuffer(data, dtype=np.uint8).copy()
    seal = read_seal(row[:page])
    assert not isinstance(seal, str) and seal.page_count == 1, seal
    fmt = SealFormat(seal.config_digest, seal.layout_digest, seal.page_index, seal.page_count)
    write_seal(row[:page], seal.payload_bytes, fmt, key_digest(key))
    return row.tobytes()


#: How each damaged file is made, and the reason the command must give.
DAMAGE = {
    "flipped payload byte": r"page 0: payload checksum mismatch",
    "another key's file": r"page 0: another key's chunk \(key digest differs\)",
    "truncated": r"^100 bytes, shorter than one page of \d+ bytes$",
    "garbage": r"page 0: no seal",
    "damaged seal": r"page 0: damaged seal",
}


def damage(files: list[Path], page: int) -> dict[Path, str]:
    """Damage one file per entry of DAMAGE; the reason expected for each."""
    good = files[-1].read_bytes()
    made = {}
    for path, how in zip(files, DAMAGE, strict=False):
        data = bytearray(path.read_bytes())
        if how == "flipped payload byte":
            data[100] ^= 0x01
        elif how == "another key's file":
            data = bytearray(good)
        elif how == "truncated":
            data = data[:100]
        elif how == "garbage":
            data = bytearray(os.urandom(len(data)))
        else:
            data[page - 20] ^= 0x10  # inside the seal's record: its header check fails
        path.write_bytes(bytes(data))
        made[path] = DAMAGE[how]
    return made


def test_damaged_chunks_are_refused_then_removed_and_nothing_else_is(
    tier: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Five damaged files are refused, each for its reason, as the serving engine's own
    judge refuses them; --remove-refused removes exactly those (a link under a chunk's
    name is neither followed nor removed) and a second scan finds nothing refused."""
    root: Path = tier["root"]
    files = sorted(tier["files"].values())
    damaged = damage(files, tier["page"])
    kept = {p: p.read_bytes() for p in chunk_files(root) if p not in damaged}
    engine = next(e for e in tier["models"].values() if e.connector_scheduler.triton_guard.digest)
    for key, path in tier["files"].items():
        verdict = engine.connector_scheduler.triton_guard.tier_file_problem(key)(path.read_bytes())
        assert (verdict is not None) == (path in damaged), (path.name, verdict)
    # A link under a chunk's name to an outside file of garbage: never followed.
    outside = tmp_path / "outside.bin"
    outside.write_bytes(os.urandom(4096))
    folder = files[-1].parent  # <hhh>/<hh>_g0: a name the command reads as a chunk's
    link = folder / f"{folder.parent.name}{folder.name[:2]}{'0' * 59}.bin"
    link.symlink_to(outside)
    code, report = report_of(capsys, root)
    assert code == 1
    refused = {root / entry["path"]: entry["problem"] for entry in report["refused"]}
    assert set(refused) == set(damaged)
    for path, pattern in damaged.items():
        assert re.search(pattern, refused[path]), (path.name, refused[path])
    assert report["links"] == 1
    code, out, _ = run_tier(capsys, str(root))
    assert code == 1 and f"refused files still there: {len(damaged)} (--remove-refused" in out
    code, report = report_of(capsys, root, "--remove-refused")
    assert code == 0
    assert [entry["outcome"] for entry in report["refused"]] == ["removed"] * len(damaged)
    assert not [path for path in damaged if path.exists()]
    assert {p: p.read_bytes() for p in chunk_files(root)} == kept
    assert link.is_symlink() and outside.exists()
    code, report = report_of(capsys, root)
    assert (code, report["refused"]) == (0, [])


def test_a_good_chunk_published_before_the_removal_is_kept(
    tier: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live engine stores a good file at a refused file's name between the scan and the
    removal (its write-then-rename): the removal judges the file it finds and keeps it."""
    path = sorted(tier["files"].values())[0]
    good = path.read_bytes()
    broken = bytearray(good)
    broken[100] ^= 0x01
    path.write_bytes(bytes(broken))
    remove = TierFolder.remove_if_refused

    def store_then_remove(self: TierFolder, *args: Any, **kwargs: Any) -> Any:
        fresh = path.with_name(f"{path.name}_{uuid.uuid4().int % 10**9}.tmp")
        fresh.write_bytes(good)
        os.replace(fresh, path)
        return remove(self, *args, **kwargs)

    monkeypatch.setattr(TierFolder, "remove_if_refused", store_then_remove)
    code, report = report_of(capsys, tier["root"], "--remove-refused")
    (entry,) = report["refused"]
    assert entry["outcome"] == "kept: its bytes pass the check"
    assert code == 1 and path.read_bytes() == good


# ------------------------------------------------------------------ not a tier


def test_a_folder_that_is_no_tier_is_refused_naming_why(
    tier: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root: Path = tier["root"]
    model = next(p for p in root.iterdir() if (p / "config.json").exists())
    rank = root / f"{model.name}_r0"
    empty = tmp_path / "empty"
    empty.mkdir()
    documents = tmp_path / "documents"
    documents.mkdir()
    (documents / "notes.txt").write_text("x")
    (documents / "photos").mkdir()
    link = tmp_path / "link"
    link.symlink_to(root)
    cases = {
        empty: r"not an fs tier: no <model>_<12 hex digits> folder .* \(it is empty",
        documents: r"not an fs tier: no <model>_<12 hex digits> folder .* chunk folder in it$",
        model: rf"one model's folder\? give the tier's root, {root}$",
        rank: rf"one rank's chunk folder: give the tier's root, {root}$",
        tmp_path / "absent": "no such folder$",
        documents / "notes.txt": "not a folder$",
        link: r"a symbolic link \(to .*\); give the folder itself",
    }
    for path, pattern in cases.items():
        code, out, err = run_tier(capsys, str(path))
        assert (code, out) == (2, ""), path
        assert err.count("\n") == 1, err
        assert re.search(rf"^triton-offload tier: error: {re.escape(str(path))}: .*{pattern}", err)


# ------------------------------------------------------------------ beside a live writer


def test_files_vanishing_or_being_written_mid_scan_are_counted_not_refused(
    tier: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file removed between the listing and its read (vLLM removes a short file on its
    own read; another repair) is counted as vanished; a store's temporary file, half
    written, is counted as in flight; neither is refused."""
    files = sorted(tier["files"].values())
    files[0].with_name(files[0].name + "_123.tmp").write_bytes(b"\x00" * 100)
    read = TierFolder.read

    def removed_first(self: TierFolder, parts: Any, size: Any = None) -> Any:
        if parts[-1] == files[1].name and files[1].exists():
            files[1].unlink()
        return read(self, parts, size)

    monkeypatch.setattr(TierFolder, "read", removed_first)
    code, report = report_of(capsys, tier["root"])
    assert code == 0 and report["refused"] == []
    assert (report["vanished"], report["in_flight"]) == (1, 1)
    assert sum(model["chunks"] for model in report["models"].values()) == 2 * CHUNKS - 1


class PausedHalfway:
    """The ``os`` of vLLM's fs writer, pausing after the first half of each write: each
    store's file stays half written for a while, a window the scans can land in."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, descriptor: int, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = os.write(descriptor, view[: len(view) // 2])
        time.sleep(0.002)
        return written + os.write(descriptor, view[len(view) // 2 :])


def test_the_scan_beside_a_writer_and_a_remover_refuses_no_good_chunk(
    tier: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own writer (a temporary file, then a rename), paused halfway through each
    file, stores 300 new good chunks and a remover deletes the old ones while scans run:
    no scan refuses a file or fails, and the last one counts exactly the files there. (A
    writer that wrote the chunk's own name in place, paused the same way, is caught here
    in most runs.)"""
    from vllm.v1.kv_offload.tiering.fs import io as vllm_fs_io

    monkeypatch.setattr(vllm_fs_io, "os", PausedHalfway())
    files = sorted(tier["files"].values())
    good = files[0].read_bytes()
    folder = files[0].parents[2]
    done = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for index in range(300):
                digest = uuid.UUID(int=index + 1).hex * 2
                key = tier_cli.chunk_key(digest, 0)
                data = bytearray(reseal(good, key, tier["page"]))
                path = folder / digest[:3] / f"{digest[3:5]}_g0" / f"{digest}.bin"
                # vLLM's Python writer (its compiled one writes the same way: a temporary
                # name, then a rename).
                vllm_fs_io._store_block(str(path), memoryview(data), 0, len(data), False)
        except BaseException as error:  # reported by the test's thread
            errors.append(error)
        finally:
            done.set()

    def remover() -> None:
        for path in files:
            path.unlink()

    threads = [threading.Thread(target=writer), threading.Thread(target=remover)]
    for thread in threads:
        thread.start()
    scans = 0
    try:
        while not done.is_set() or scans == 0:
            report = tier_cli.scan_tier(str(tier["root"]))
            scans += 1
            assert report.refused == [], [entry.problem for entry in report.refused]
            assert scans < 10_000  # a hang guard: the writer ends after 300 stores
    finally:
        for thread in threads:
            thread.join(timeout=120)
    assert not errors and not any(thread.is_alive() for thread in threads)
    report = tier_cli.scan_tier(str(tier["root"]))
    sealed = report.models[folder.name.removesuffix("_r0")]
    assert report.refused == [] and sealed.ranks[0].good == 300
    assert sealed.chunks == len(chunk_files(folder)) == 300


def test_the_command_never_imports_vllm(tier: dict[str, Any]) -> None:
    """Only the vLLM integration's modules that need vLLM import it; the command reads
    vLLM's names from the files, so it starts without importing vLLM."""
    code = (
        "import sys; from triton_offload.cli import main; rc = main(['tier', sys.argv[1]]); "
        "print('vllm imported:', 'vllm' in sys.modules); sys.exit(rc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tier["root"])], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "vllm imported: False"


def rekey(path: Path, key: bytes, page: int, seal_key: SealKey) -> None:
    """Seal the one-page chunk file at ``path`` under ``seal_key`` (as an engine with that
    ``seal_key_file`` writes it)."""
    row = np.frombuffer(path.read_bytes(), dtype=np.uint8).copy()
    seal = read_seal(row[:page])
    assert not isinstance(seal, str) and seal.page_count == 1, seal
    fmt = SealFormat(seal.config_digest, seal.layout_digest, seal.page_index, seal.page_count)
    write_seal(
        row[:page],
        seal.payload_bytes,
        fmt,
        key_digest(key, seal_key),
        algorithm="keyed_ghash64",
        seal_key=seal_key,
    )
    path.write_bytes(row.tobytes())


def test_keyed_chunks_are_judged_only_under_their_key(
    tier: dict[str, Any], seal_key_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --seal-key-file a keyed chunk is counted, never refused or removed; under
    the engines' key it is good and an unkeyed chunk is a forgery; under another key
    every keyed chunk is refused; a bad key file is named."""
    root: Path = tier["root"]
    page = tier["page"]
    items = sorted(tier["files"].items(), key=lambda item: item[1])
    keyed = dict(items[: len(items) // 2])
    unkeyed = dict(items[len(items) // 2 :])
    seal_key = SealKey.from_file(seal_key_file)
    for key, path in keyed.items():
        rekey(path, key, page, seal_key)
    before = {p: p.read_bytes() for p in chunk_files(root)}

    code, report = report_of(capsys, root, "--remove-refused")
    assert (code, report["refused"]) == (0, [])
    assert {p: p.read_bytes() for p in chunk_files(root)} == before
    code, out, _ = run_tier(capsys, str(root))
    assert f"{len(unkeyed)} good, 0 refused, {len(keyed)} keyed (not checked" in out

    code, report = report_of(capsys, root, "--seal-key-file", str(seal_key_file))
    assert code == 1
    refused = {root / entry["path"]: entry["problem"] for entry in report["refused"]}
    assert set(refused) == set(unkeyed.values())
    assert all("forgery" in problem for problem in refused.values())

    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32))
    other.chmod(0o600)
    code, report = report_of(capsys, root, "--seal-key-file", str(other))
    refused = {root / entry["path"]: entry["problem"] for entry in report["refused"]}
    assert set(refused) == set(tier["files"].values())
    assert all("another seal key" in refused[path] for path in keyed.values())

    other.chmod(0o644)
    code, out, err = run_tier(capsys, str(root), "--seal-key-file", str(other))
    assert code != 0 and f"'{other}' has mode 0644" in err
