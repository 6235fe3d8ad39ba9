"""Two checkpoints served under one model name never share a chunk.

vLLM names an offloaded chunk by the model name it was given (a path or a hub id), the
KV dtype, the geometry and the block hash of its tokens: nothing of the weights. A
checkpoint re-saved under the same path would load the old checkpoint's KV from a
shared fs tier. Here two tiny random Llama checkpoints (``save_pretrained``, seeds 0 and
1) are served in turn from one folder, each by a sealed ``TritonTieringOffloadingSpec``
with vLLM's real fs tier in one shared root:

- the second never sees the first's chunks: its storage names are its own, and a chunk
  that reaches its name anyway is refused by its seal ("another configuration") before
  it counts as a hit;
- the same checkpoint served twice shares its chunks, byte-exactly;
- ``checkpoint_id`` is the operator's word: it overrides the files, and bad values are
  refused naming the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    pytest.skip(f"vllm cannot be imported: {error}", allow_module_level=True)

from tests.helpers.engine_models import write_model
from tests.helpers.tiered_spec import Tiered, key


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Two tiny random Llama checkpoints (same config, weights from seeds 0 and 1)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        seed: Path(write_model("llama", str(root / f"seed{seed}"), seed=seed)) for seed in (0, 1)
    }


def serve(checkpoint: Path, folder: Path) -> str:
    """Put ``checkpoint`` at ``folder`` (replacing what was there, as a re-save does) and
    return the model name vLLM would be given: the folder's path."""
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(checkpoint, folder)
    return str(folder)


def load(tiered: Tiered, job: int) -> Any:
    """Load ``key(0)`` into poisoned blocks 12 and 13; the worker's result."""
    for plane in tiered.planes:
        plane[[12, 13]] = 0x55
    spec = tiered.manager.prepare_load([key(0)], tiered.context)
    assert tiered.worker.submit_load(job, spec, GPULoadStoreSpec([12, 13], [2], [0]))
    tiered.worker.wait({job})
    (result,) = tiered.worker.get_finished()
    tiered.manager.complete_load([key(0)], tiered.context)
    return result


@contextlib.contextmanager
def stored_then_re_saved(
    checkpoints: dict[int, Path], tmp_path: Path, then: int, **extra: Any
) -> Iterator[tuple[Tiered, str]]:
    """Checkpoint 0 served from one folder by a producer (``extra``: its extra config)
    that stores ``key(0)`` from blocks 3 and 8 into the fs tier at ``tmp_path / "fs"``;
    then checkpoint ``then`` saved in that folder. Yields the producer and the model
    name (the folder's path); the producer is closed after."""
    folder = tmp_path / "served" / "llama"
    name = serve(checkpoints[0], folder)
    producer = Tiered(tmp_path / "fs", model=name, **extra)
    try:
        producer.store([key(0)], [3, 8])
        serve(checkpoints[then], folder)
        yield producer, name
    finally:
        producer.close()


def test_a_re_saved_checkpoint_gets_storage_names_of_its_own(
    checkpoints: dict[int, Path], tmp_path: Path
) -> None:
    # Checkpoint 1 updated under the same name.
    with stored_then_re_saved(checkpoints, tmp_path, then=1) as (producer, name):
        assert os.path.exists(producer.file(key(0)))
        with contextlib.closing(Tiered(tmp_path / "fs", model=name)) as consumer:
            assert consumer.spec.config.model.name == producer.spec.config.model.name
            assert consumer.spec.seal_config_digest() != producer.spec.seal_config_digest()
            assert consumer.file(key(0)) != producer.file(key(0))
            seen = consumer.lookup_until_settled(key(0))
            assert seen[-1] is LookupResult.MISS and LookupResult.HIT_PENDING not in seen


def test_a_chunk_of_another_checkpoint_at_a_colliding_name_is_refused_by_its_seal(
    checkpoints: dict[int, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Where a name collides anyway (an fs folder copied, a tier that names chunks by
    block hash alone), the seal's configuration digest carries the checkpoint: the
    promotion is refused, the key quarantined, nothing loaded."""
    with (
        stored_then_re_saved(checkpoints, tmp_path, then=1) as (producer, name),
        contextlib.closing(Tiered(tmp_path / "fs", model=name)) as consumer,
    ):
        theirs, ours = producer.file(key(0)), consumer.file(key(0))
        if theirs != ours:
            os.makedirs(os.path.dirname(ours), exist_ok=True)
            shutil.copyfile(theirs, ours)
        with caplog.at_level("WARNING", logger="vllm.triton_offload"):
            seen = consumer.lookup_until_settled(key(0))
        assert seen[-1] is LookupResult.MISS
        guard = consumer.manager.triton_guard
        assert guard.promotions_refused == 1
        assert bytes(key(0)) in guard.quarantined
        assert "another configuration's chunk" in caplog.text
        assert consumer.lookup_until_settled(key(0)) == [LookupResult.MISS]


def test_the_same_checkpoint_served_twice_shares_its_chunks(
    checkpoints: dict[int, Path], tmp_path: Path
) -> None:
    # Saved again, the same weights: a new copy of the files, the same identity.
    with (
        stored_then_re_saved(checkpoints, tmp_path, then=0) as (producer, name),
        contextlib.closing(Tiered(tmp_path / "fs", model=name)) as consumer,
    ):
        assert consumer.spec.seal_config_digest() == producer.spec.seal_config_digest()
        assert consumer.file(key(0)) == producer.file(key(0))
        assert consumer.lookup_until_settled(key(0))[-1] is LookupResult.HIT
        result = load(consumer, 5)
        assert result.success, result
        for theirs, ours in zip(producer.planes, consumer.planes, strict=True):
            assert torch.equal(ours[12], theirs[3]) and torch.equal(ours[13], theirs[8])


def test_checkpoint_id_overrides_the_files(checkpoints: dict[int, Path], tmp_path: Path) -> None:
    """The operator's ``checkpoint_id`` is the identity: two weight files under one id
    share (the operator says they are one checkpoint); one file under two ids do not."""
    stored = stored_then_re_saved(checkpoints, tmp_path, then=1, checkpoint_id="tiny-llama-r1")
    with stored as (producer, name):
        same_id = Tiered(tmp_path / "fs", model=name, checkpoint_id="tiny-llama-r1")
        with contextlib.closing(same_id):
            assert same_id.file(key(0)) == producer.file(key(0))
            assert same_id.lookup_until_settled(key(0))[-1] is LookupResult.HIT
        other_id = Tiered(tmp_path / "fs", model=name, checkpoint_id="tiny-llama-r2")
        with contextlib.closing(other_id):
            assert other_id.file(key(0)) != producer.file(key(0))
            assert other_id.lookup_until_settled(key(0))[-1] is LookupResult.MISS


@pytest.mark.parametrize("bad", ["", "   ", " padded", "padded\n", 7, True, None, ["r1"]])
def test_a_bad_checkpoint_id_is_refused_naming_the_key(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(
        ValueError, match=r"kv_connector_extra_config\['checkpoint_id'\] must be a non-empty"
    ):
        Tiered(tmp_path / "fs", checkpoint_id=bad)


# ------------------------------------------------------------------ where the identity comes from

from triton_offload.vllm.checkpoint import (  # noqa: E402
    HEAD_BYTES,
    SAMPLE_BYTES,
    SAMPLES,
    ModelRevision,
    checkpoint_files,
    checkpoint_identity,
    files_fingerprint,
    sample_windows,
)

COMMIT_A = "a" * 40
COMMIT_B = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo: str, snapshots: dict[str, Path], refs: dict[str, str]) -> Path:
    """A hub cache as huggingface_hub lays it out: ``models--ORG--NAME/snapshots/<commit>``
    holding a checkpoint's files, ``refs/<revision>`` the commit a revision resolved to."""
    folder = root / ("models--" + repo.replace("/", "--"))
    for commit, checkpoint in snapshots.items():
        shutil.copytree(checkpoint, folder / "snapshots" / commit)
    for revision, commit in refs.items():
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / revision).write_text(commit)
    return root


def test_a_local_checkpoint_is_known_by_its_files(
    checkpoints: dict[int, Path], tmp_path: Path
) -> None:
    first = checkpoint_identity(str(checkpoints[0]))
    assert first.source == "weight files" and first.value and first.value.startswith("files:")
    # The same files elsewhere (a copy on another node): the same identity (the detail
    # names the folder and the time the read took, so it is left out).
    copy = checkpoint_identity(serve(checkpoints[0], tmp_path / "copy"))
    assert copy == dataclasses.replace(first, detail=copy.detail)
    assert checkpoint_identity(str(checkpoints[1])).value != first.value
    # A revision vLLM was given means nothing for a local path (vLLM loads the folder).
    handed = ModelRevision(str(checkpoints[0]), "main", COMMIT_A)
    assert checkpoint_identity(str(checkpoints[0]), revision=handed).value == first.value
    # The operator's id overrides the files.
    named = checkpoint_identity(str(checkpoints[0]), "tiny-llama-r1")
    assert (named.value, named.source) == ("id:tiny-llama-r1", "checkpoint_id")


def test_a_folder_without_weights_has_no_identity(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    identity = checkpoint_identity(str(tmp_path))
    assert identity.value is None and "no weight file" in identity.detail
    assert identity.tag == "ckpt-none"


def test_a_change_in_the_config_alone_changes_the_identity(
    checkpoints: dict[int, Path], tmp_path: Path
) -> None:
    """The same weights under another config (rope, head geometry) compute other KV."""
    folder = Path(serve(checkpoints[0], tmp_path / "llama"))
    before = checkpoint_identity(str(folder)).value
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = 1234.0
    (folder / "config.json").write_text(json.dumps(config))
    assert checkpoint_identity(str(folder)).value != before


def test_a_large_file_is_sampled_in_bounded_reads_and_a_sampled_change_is_seen(
    tmp_path: Path,
) -> None:
    """A 256 MiB weights file (sparse: no disk) is read 5 MiB deep, not whole; a byte
    changed in a sampled window, or the file's size, changes the fingerprint."""
    big = tmp_path / "model.safetensors"
    size = 256 << 20
    with open(big, "wb") as handle:
        handle.truncate(size)
    files = checkpoint_files(tmp_path)
    first = files_fingerprint(files)
    assert first.total_bytes == size
    assert first.read_bytes == HEAD_BYTES + SAMPLES * SAMPLE_BYTES == 5 << 20
    middle = sample_windows(size)[SAMPLES // 2][0] + 7
    for offset in (10, middle, size - 1):  # in the head, a middle window, the tail
        with open(big, "r+b") as handle:
            handle.seek(offset)
            handle.write(b"\x01")
        changed = files_fingerprint(files)
        assert changed.digest != first.digest, offset
        with open(big, "r+b") as handle:
            handle.seek(offset)
            handle.write(b"\x00")
        assert files_fingerprint(files).digest == first.digest
    with open(big, "r+b") as handle:
        handle.truncate(size + 4096)
    assert files_fingerprint(files).digest != first.digest


def test_a_hub_checkpoint_is_known_by_its_commit(
    checkpoints: dict[int, Path], tmp_path: Path
) -> None:
    repo = "org/tiny-llama"
    cache = hub_cache(tmp_path / "hub", repo, {COMMIT_A: checkpoints[0]}, {"main": COMMIT_A})
    snapshot = cache / "models--org--tiny-llama" / "snapshots" / COMMIT_A
    # A path inside a snapshot: its commit.
    by_path = checkpoint_identity(str(snapshot))
    assert (by_path.value, by_path.source) == (f"commit:{COMMIT_A}", "hub snapshot")
    # A hub id without a revision handed over (vLLM's plain connector): the only snapshot.
    only = checkpoint_identity(repo, hub_cache=cache)
    assert (only.value, only.source) == (f"commit:{COMMIT_A}", "hub cache")
    # The commit vLLM resolved: used as is, whatever the cache holds.
    resolved = ModelRevision(repo, "main", COMMIT_B)
    assert checkpoint_identity(repo, revision=resolved, hub_cache=cache).value == (
        f"commit:{COMMIT_B}"
    )
    # Remote code of another revision computes the KV too: it is part of the identity.
    with_code = ModelRevision(repo, "main", COMMIT_B, code_revision="v2")
    assert checkpoint_identity(repo, revision=with_code, hub_cache=cache).value == (
        f"commit:{COMMIT_B}+code:v2"
    )
    # A second snapshot: the requested revision's ref picks one; without one, none.
    hub_cache(cache, repo, {COMMIT_B: checkpoints[1]}, {"v2": COMMIT_B})
    by_ref = checkpoint_identity(repo, revision=ModelRevision(repo, "v2"), hub_cache=cache)
    assert (by_ref.value, by_ref.source) == (f"commit:{COMMIT_B}", "hub cache")
    default = checkpoint_identity(repo, revision=ModelRevision(repo), hub_cache=cache)
    assert default.value == f"commit:{COMMIT_A}"  # refs/main
    ambiguous = checkpoint_identity(repo, hub_cache=cache)
    assert ambiguous.value is None and "2 snapshots" in ambiguous.detail
    # A branch name is never an identity: a ref the cache does not hold gives none.
    missing = checkpoint_identity(repo, revision=ModelRevision(repo, "dev"), hub_cache=cache)
    assert missing.value is None
    # A revision handed over for another model is not this one's.
    other = ModelRevision("org/other", "main", COMMIT_B)
    assert checkpoint_identity(repo, revision=other, hub_cache=cache).value is None
    assert checkpoint_identity("org/not-cached", hub_cache=cache).value is None


def test_the_revision_vllm_resolved_is_read_from_its_model_config() -> None:
    from huggingface_hub._revision import ResolvedRevision

    config = types.SimpleNamespace(
        model="org/tiny-llama",
        revision=ResolvedRevision(resolved=COMMIT_A, initial=None, repo_id="org/tiny-llama"),
        code_revision=None,
    )
    assert ModelRevision.from_model_config(config) == ModelRevision(
        "org/tiny-llama", "main", COMMIT_A, None
    )
    config.revision = COMMIT_B  # a commit given as the revision
    assert ModelRevision.from_model_config(config).commit == COMMIT_B
    config.revision = "main"  # a branch vLLM could not resolve: a ref to look up, no commit
    assert ModelRevision.from_model_config(config) == ModelRevision("org/tiny-llama", "main")


def test_a_spec_without_an_identity_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="vllm.triton_offload"):
        unnamed = Tiered(tmp_path / "fs", model="not-a-path-nor-cached")
    try:
        assert unnamed.spec.checkpoint.value is None
        assert "no identity for the checkpoint of model 'not-a-path-nor-cached'" in caplog.text
        assert "set kv_connector_extra_config['checkpoint_id']" in caplog.text
    finally:
        unnamed.close()


def test_scheduler_and_worker_agree_under_the_connector(tmp_path: Path) -> None:
    """TritonOffloadingConnector hands vLLM's ModelConfig revision to the spec on both
    sides; both derive one identity (the seals' digest the scheduler checks promotions
    with is the one the worker seals with)."""
    from safetensors.torch import save_file

    from tests.helpers import vllm_engine

    (tmp_path / "model").mkdir()
    save_file({"weight": torch.arange(4.0)}, str(tmp_path / "model" / "model.safetensors"))
    engine = vllm_engine.Engine(tmp_path, "recompute")
    try:
        worker_spec = engine.worker.connector_worker.spec
        assert worker_spec.model_revision == ModelRevision(str(tmp_path / "model"))
        assert worker_spec.checkpoint.source == "weight files"
        guard = engine.offloading_manager.triton_guard
        assert guard.digest == worker_spec.seal_config_digest()
    finally:
        engine.close()
