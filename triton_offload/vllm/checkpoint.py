"""The checkpoint a spec serves, as an identity: two checkpoints under one model name never
share a chunk.

vLLM names an offloaded chunk by the model name it was given (``OffloadingConfig.model
.name``: the path or hub id of ``ModelConfig.model``), the KV dtype, the geometry and the
block hash of its tokens; nothing of the weights. A checkpoint re-saved or updated under
the same name would be handed the old checkpoint's KV by a shared fs or obj tier. The
identity computed here goes into the seals' configuration digest (a chunk of another
checkpoint is refused as "another configuration") and into the tiers' storage names
(:mod:`triton_offload.vllm.spec`), so the chunks never even meet.

Where it comes from, first match wins:

1. ``checkpoint_id`` in ``kv_connector_extra_config``: the operator's word, over all else
   (a non-empty string; checked by :mod:`triton_offload.vllm.options`);
2. a hub commit, for a hub id: the commit vLLM resolved ``ModelConfig.revision`` to
   (``TritonOffloadingConnector`` hands the ModelConfig's revision to the spec, in the
   scheduler and in every worker alike), else the local hub cache's record: the
   ``refs/<revision>`` file of the requested revision, or, with no revision handed over
   (vLLM's plain ``OffloadingConnector``), the repository's only snapshot. A model path
   inside a hub cache snapshot (``.../snapshots/<commit>``) is that commit. A branch or
   tag name is never the identity: it moves. ``ModelConfig.code_revision``, when set,
   is added (remote code computes the KV too);
3. for a local folder (or a single weights file, as GGUF is given), a fingerprint of its
   files (:func:`files_fingerprint`): vLLM loads a local path whatever the revision;
4. none of these: no identity. Chunks are then named by model name only, as stock vLLM
   names them, and a WARNING says to set ``checkpoint_id``.

Scheduler and workers must agree: each derives the identity from what all of them see
alike (the model name, the extra config, the revision the connector hands over on both
sides or on neither, the files and the hub cache of the node). vLLM's current config
(``get_current_vllm_config``) is not used: the worker builds its spec inside it, the
scheduler does not. A worker on a node whose files differ derives another identity and
its chunks are refused, never mixed.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import os
import re
import time
from pathlib import Path
from typing import Any

#: A git commit id as the hub writes it (SHA-1; SHA-256 repositories use 64 digits).
COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
#: Files of a local checkpoint that the fingerprint covers: the weight formats vLLM's
#: loaders read, and the JSON and Python files beside them (the config, which sets rope
#: and head geometry, and remote code: both change the KV of the same weights).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".msgpack")
SIDE_SUFFIXES = (".json", ".py")
#: Files up to this size are hashed whole (configs, small models).
WHOLE_FILE_BYTES = 32 << 20
#: A larger file is hashed from its first HEAD_BYTES (a safetensors header: every tensor's
#: name, dtype, shape and offset) and SAMPLES windows of SAMPLE_BYTES spread evenly over
#: the rest, the last ending at the file's end: 5 MiB read per file whatever its size
#: (a 100 GB checkpoint in 5 GB shards: 100 MiB). A fine-tune or a re-quantization
#: changes values everywhere and is seen; an edit confined to less than 1/64 of a file
#: between two windows can be missed: name such a checkpoint with ``checkpoint_id``.
HEAD_BYTES = 1 << 20
SAMPLES = 64
SAMPLE_BYTES = 64 << 10
_READ_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class ModelRevision:
    """What vLLM's ``ModelConfig`` says about the checkpoint of a hub id: the revision
    requested (None: the default branch), the commit vLLM resolved it to (None when it did
    not), and the remote code's revision (None: the checkpoint's)."""

    model: str
    revision: str | None = None
    commit: str | None = None
    code_revision: str | None = None

    @classmethod
    def from_model_config(cls, model_config: Any) -> ModelRevision:
        revision = getattr(model_config, "revision", None)
        # huggingface_hub's ResolvedRevision (vLLM resolves ModelConfig.revision once at
        # start-up): a str of the requested revision that carries the commit it resolved.
        resolved = getattr(revision, "resolved", None)
        requested = None if revision is None else str(revision)
        commit = next(
            (c for c in (resolved, requested) if isinstance(c, str) and COMMIT.fullmatch(c)),
            None,
        )
        code = getattr(model_config, "code_revision", None)
        return cls(
            model=str(getattr(model_config, "model", "")),
            revision=requested,
            commit=commit,
            code_revision=None if code is None else str(code),
        )


#: Set while TritonOffloadingConnector builds vLLM's connector (scheduler and workers
#: alike): the revision of the ModelConfig, which the spec's OffloadingConfig lacks.
SERVED_REVISION: contextvars.ContextVar[ModelRevision | None] = contextvars.ContextVar(
    "triton_offload_served_revision", default=None
)


@dataclasses.dataclass(frozen=True)
class CheckpointIdentity:
    """``value``: the identity (None: none found); ``source``: where it came from;
    ``detail``: what was read, for the start-up log."""

    value: str | None
    source: str
    detail: str

    @property
    def tag(self) -> str:
        """The identity's part of a storage name: a digest (bounded, any characters)."""
        if self.value is None:
            return "ckpt-none"
        return "ckpt-" + hashlib.sha256(self.value.encode()).hexdigest()[:16]

    @property
    def description(self) -> str:
        """The identity's part of the seals' configuration description."""
        return "none" if self.value is None else self.value


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """A digest of a checkpoint's files and what it cost."""

    digest: str
    files: int
    total_bytes: int
    read_bytes: int
    seconds: float


def checkpoint_identity(
    model: str,
    checkpoint_id: str | None = None,
    revision: ModelRevision | None = None,
    *,
    hub_cache: str | os.PathLike[str] | None = None,
) -> CheckpointIdentity:
    """The identity of the checkpoint vLLM serves as ``model`` (see the module's text)."""
    if checkpoint_id is not None:
        return CheckpointIdentity(
            f"id:{checkpoint_id}", "checkpoint_id", "kv_connector_extra_config['checkpoint_id']"
        )
    path = Path(model)
    if path.exists():
        commit = snapshot_commit(path)
        if commit is not None:
            return CheckpointIdentity(
                f"commit:{commit}", "hub snapshot", f"the hub cache snapshot {model}"
            )
        return local_identity(path)
    if revision is not None and revision.model != model:
        revision = None  # handed over for another model: not this one's
    return hub_identity(model, revision, hub_cache)


def snapshot_commit(path: Path) -> str | None:
    """The commit of a path inside a hub cache snapshot (``models--*/snapshots/<commit>``)."""
    for folder in (path, *path.parents):
        parent = folder.parent
        if (
            COMMIT.fullmatch(folder.name)
            and parent.name == "snapshots"
            and parent.parent.name.startswith("models--")
        ):
            return folder.name
    return None


def local_identity(path: Path) -> CheckpointIdentity:
    files = checkpoint_files(path)
    if not any(name.endswith(WEIGHT_SUFFIXES) for name, _ in files):
        # The weights come from elsewhere (a dummy load, a streamed URI): a digest of the
        # config alone would name two checkpoints alike.
        return CheckpointIdentity(None, "none", f"no weight file in {path}")
    fingerprint = files_fingerprint(files)
    return CheckpointIdentity(
        f"files:{fingerprint.digest}",
        "weight files",
        f"{fingerprint.files} files of {path}, {fingerprint.total_bytes} bytes, "
        f"{fingerprint.read_bytes} read in {fingerprint.seconds:.3f} s",
    )


def checkpoint_files(path: Path) -> list[tuple[str, Path]]:
    """(name, path) of each file the fingerprint covers, by name: a single file as given,
    or a folder's top-level weight, JSON and Python files (vLLM's loaders read the top
    level; symbolic links, as in a hub snapshot, are followed)."""
    if path.is_file():
        return [(path.name, path)]
    found = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name.endswith(WEIGHT_SUFFIXES + SIDE_SUFFIXES) and entry.is_file():
            found.append((entry.name, Path(entry.path)))
    return found


def sample_windows(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the bytes read from a file of ``size`` bytes."""
    if size <= WHOLE_FILE_BYTES:
        return [(0, size)]
    windows = [(0, HEAD_BYTES)]
    span = size - HEAD_BYTES - SAMPLE_BYTES
    for index in range(SAMPLES):
        windows.append((HEAD_BYTES + span * index // (SAMPLES - 1), SAMPLE_BYTES))
    return windows


def files_fingerprint(files: list[tuple[str, Path]]) -> Fingerprint:
    """A digest over each file's name, size and the bytes of :func:`sample_windows`
    (BLAKE2b). Modification times are left out: a copy of the same checkpoint on another
    node, or a re-save of the same weights, has the same identity and shares chunks."""
    started = time.perf_counter()
    digest = hashlib.blake2b(digest_size=16)
    total = read = 0
    for name, file in files:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            digest.update(f"{len(name)}:{name}:{size}:".encode())
            for offset, length in sample_windows(size):
                handle.seek(offset)
                left = length
                while left > 0:
                    block = handle.read(min(left, _READ_BYTES))
                    if not block:
                        break  # the file shrank while read: what was read counts
                    digest.update(block)
                    left -= len(block)
                read += length - left
        total += size
    return Fingerprint(digest.hexdigest(), len(files), total, read, time.perf_counter() - started)


def default_hub_cache() -> str | None:
    """The hub cache folder vLLM downloads into (huggingface_hub's, from its settings)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return str(constants.HF_HUB_CACHE)


def hub_identity(
    model: str, revision: ModelRevision | None, hub_cache: str | os.PathLike[str] | None
) -> CheckpointIdentity:
    """The commit of hub id ``model`` (see the module's text, step 2)."""
    code = "" if revision is None or not revision.code_revision else revision.code_revision
    suffix = f"+code:{code}" if code else ""
    if revision is not None and revision.commit is not None:
        return CheckpointIdentity(
            f"commit:{revision.commit}{suffix}", "revision", f"vLLM's revision of {model}"
        )
    cache = hub_cache if hub_cache is not None else default_hub_cache()
    repo = Path(cache) / ("models--" + model.replace("/", "--")) if cache else None
    if repo is None or not repo.is_dir():
        return CheckpointIdentity(None, "none", f"{model!r} is no local path nor in a hub cache")
    if revision is not None:
        ref = repo / "refs" / (revision.revision or "main")
        commit = ref.read_text().strip() if ref.is_file() else ""
        if COMMIT.fullmatch(commit):
            return CheckpointIdentity(
                f"commit:{commit}{suffix}", "hub cache", f"the hub cache's {ref}"
            )
        return CheckpointIdentity(None, "none", f"no commit recorded in {ref}")
    snapshots = repo / "snapshots"
    commits = (
        sorted(entry.name for entry in snapshots.iterdir() if COMMIT.fullmatch(entry.name))
        if snapshots.is_dir()
        else []
    )
    if len(commits) == 1:
        return CheckpointIdentity(
            f"commit:{commits[0]}", "hub cache", f"the only snapshot of {model} in {repo}"
        )
    return CheckpointIdentity(
        None,
        "none",
        f"{len(commits)} snapshots of {model} in {repo} and no revision handed over "
        "(TritonOffloadingConnector hands it over)",
    )


__all__ = [
    "SERVED_REVISION",
    "CheckpointIdentity",
    "Fingerprint",
    "ModelRevision",
    "checkpoint_files",
    "checkpoint_identity",
    "files_fingerprint",
    "sample_windows",
    "snapshot_commit",
]
