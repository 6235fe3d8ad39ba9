"""This backend's own ``kv_connector_extra_config`` keys, validated before anything is built.

vLLM's own keys (``cpu_bytes_to_use``, ``blocks_per_chunk`` ...) are read by vLLM's spec;
:func:`validate_cpu_bytes` and :func:`check_chunk_size` only check the ones whose wrong
value would otherwise be reported far from its cause. Every error names the key and the
value. A key that neither this backend nor the installed vLLM reads is an error naming
the closest known key (:func:`check_known_keys`): a misspelt ``verify_chunks`` silently
left sealing on.

:func:`check_extra_config` runs every check that needs nothing but the configuration
(:data:`START_UP_CHECKS`). ``TritonOffloadingConnector`` calls it while vLLM builds its
config in the front-end process, before any engine process starts or any model loads
(where each release calls in: :mod:`triton_offload.vllm.releases`); the specs call it
again when they are built, so vLLM's plain ``OffloadingConnector`` gets the same checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from triton_offload.transfer.copiers import check_num_programs
from triton_offload.transfer.engine import Backend
from triton_offload.transfer.jobs import FROM_POOL, TO_POOL
from triton_offload.transfer.seal_key import SealKey
from triton_offload.transfer.selection import parse_crossover
from triton_offload.vllm.compat import (
    SPEC_NAME,
    TIERING_SPEC_NAME,
    installed_vllm_version,
    vllm_extra_config_keys,
)
from triton_offload.vllm.tiers import check_secondary_tiers

#: Extra-config keys read by this backend on top of vLLM's CPU spec keys.
EXTRA_CONFIG_KEYS = (
    "backend",
    "num_programs",
    "crossover",
    "replicated_store_timeout_s",
    "verify_chunks",
    "layerwise_loads",
    "checkpoint_id",
    "seal_key_file",
)
BACKENDS = ("auto", "triton", "dma", "torch")


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"kv_connector_extra_config[{key!r}] must be a positive integer, got {value!r}"
        )
    return value


def _crossover_option(value: Any) -> int | dict[str, int] | None:
    """The ``crossover`` key, checked by the engine's own validator (``parse_crossover``).

    One rule for both entry points (page bytes >= 0, an int or exactly ``store`` and
    ``load``); its message is renamed to the extra-config key.
    """
    try:
        parsed = parse_crossover(value)
    except (TypeError, ValueError) as error:
        message = str(error)
        if message.startswith("crossover"):
            message = message[len("crossover") :]
        if not isinstance(value, Mapping) and message.startswith("['store']"):
            message = message[len("['store']") :]  # one value was given, not a mapping
        raise ValueError(f"kv_connector_extra_config['crossover']{message}") from error
    if parsed is None:
        return None
    if isinstance(value, Mapping):
        return {"store": parsed.threshold[TO_POOL], "load": parsed.threshold[FROM_POOL]}
    return parsed.threshold[TO_POOL]


def _checkpoint_id_option(extra: Mapping[str, Any]) -> str | None:
    """``checkpoint_id``: absent, or a non-empty string without surrounding whitespace (a
    value pasted with a newline would split a fleet that means one checkpoint)."""
    if "checkpoint_id" not in extra:
        return None
    value = extra["checkpoint_id"]
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        raise ValueError(
            "kv_connector_extra_config['checkpoint_id'] must be a non-empty string without "
            f"leading or trailing whitespace (the served checkpoint's identity), got {value!r}"
        )
    return value


def _seal_key_file_option(extra: Mapping[str, Any], verify: bool) -> str | None:
    """``seal_key_file``: absent, or the path of a usable key (read and checked here, so
    a missing, short or group/world-accessible file is refused before the model loads)."""
    if "seal_key_file" not in extra:
        return None
    value = extra["seal_key_file"]
    if not isinstance(value, str) or not value:
        raise ValueError(
            f"kv_connector_extra_config['seal_key_file'] must be a file path, got {value!r}"
        )
    if not verify:
        raise ValueError(
            "kv_connector_extra_config['seal_key_file'] keys the chunk seals, and "
            "verify_chunks=false turns them off: drop one of the two"
        )
    if extra.get("canonical_layout"):
        raise ValueError(
            "kv_connector_extra_config['seal_key_file'] keys the chunk seals, and "
            "canonical_layout rows are stock vLLM's, without seals: drop one of the two"
        )
    SealKey.from_file(value, "kv_connector_extra_config['seal_key_file']")
    return value


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """This spec's own extra-config keys, validated (docs/vllm.md describes each).

    ``backend``: "auto" (on CUDA the copy kernel for some planes and DMA for others,
    chosen per plane from the crossover, so one job may use both; the CPU path without
    CUDA), "triton", "dma" or "torch" (CPU caches only). ``num_programs``: Triton grid
    size (None = the launcher's default). ``crossover``: page bytes at or above which
    "auto" uses DMA for a plane, an int >= 0 or ``{"store": int, "load": int}``; None =
    measured when the worker starts. ``replicated_store_timeout_s``: under the
    replicated layout, how long a rank that copies nothing waits for rank 0 to publish
    a store before reporting it failed (rank 0 may have died). ``verify_chunks``: seal
    every stored page and check it before it is loaded or promoted (see
    :mod:`triton_offload.vllm.integrity`); False gives rows without seals.
    ``layerwise_loads``: a step's sync loads copied layer by layer, the forward waiting
    for each layer's stage only (:mod:`triton_offload.vllm.layerwise`; needs
    ``TritonOffloadingConnector``). Off by default. ``checkpoint_id``: the identity of
    the checkpoint served, over the one derived from its revision or files (see
    :mod:`triton_offload.vllm.checkpoint`); None = derived. ``seal_key_file``: a file of
    at least 32 random bytes readable by the engine's user only; every page's seal then
    carries a keyed tag and only pages sealed under that key load
    (:mod:`triton_offload.transfer.seal_key`); needs ``verify_chunks``. None = unkeyed
    seals.
    """

    backend: Backend = "auto"
    num_programs: int | None = None
    crossover: int | Mapping[str, int] | None = None
    #: Rank 0 publishes a store once its copy finished: a copy of a whole job is far
    #: below a second at PCIe speed, so a minute means the writer is gone, not slow.
    replicated_store_timeout_s: float = 60.0
    verify_chunks: bool = True
    layerwise_loads: bool = False
    checkpoint_id: str | None = None
    seal_key_file: str | None = None

    def seal_key(self) -> SealKey | None:
        """The seal key read from ``seal_key_file`` (None without one); ValueError names
        the file and what is wrong with it."""
        if self.seal_key_file is None:
            return None
        return SealKey.from_file(self.seal_key_file, "kv_connector_extra_config['seal_key_file']")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> EngineOptions:
        backend = extra.get("backend", "auto")
        if backend not in BACKENDS:
            raise ValueError(
                f"kv_connector_extra_config['backend'] {backend!r} is not one of {BACKENDS}"
            )
        num_programs = extra.get("num_programs")
        if num_programs is not None:
            _positive_int("num_programs", num_programs)
            num_programs = check_num_programs(
                num_programs, "kv_connector_extra_config['num_programs']"
            )
        crossover = _crossover_option(extra.get("crossover"))
        timeout = extra.get("replicated_store_timeout_s", cls.replicated_store_timeout_s)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(
                "kv_connector_extra_config['replicated_store_timeout_s'] must be a positive "
                f"number of seconds, got {timeout!r}"
            )
        verify = extra.get("verify_chunks", True)
        if not isinstance(verify, bool):
            raise ValueError(
                f"kv_connector_extra_config['verify_chunks'] must be true or false, got {verify!r}"
            )
        layerwise = extra.get("layerwise_loads", False)
        if not isinstance(layerwise, bool):
            raise ValueError(
                "kv_connector_extra_config['layerwise_loads'] must be true or false, got "
                f"{layerwise!r}"
            )
        return cls(
            backend=backend,
            num_programs=num_programs,
            crossover=crossover,
            replicated_store_timeout_s=float(timeout),
            verify_chunks=verify,
            layerwise_loads=layerwise,
            checkpoint_id=_checkpoint_id_option(extra),
            seal_key_file=_seal_key_file_option(extra, verify),
        )


def validate_cpu_bytes(extra: Mapping[str, Any]) -> None:
    """``cpu_bytes_to_use``: required (vLLM's own words when missing), a positive integer."""
    if "cpu_bytes_to_use" not in extra:
        # vLLM's CPU spec says exactly this; a user switching backends sees the same line.
        raise ValueError(
            "cpu_bytes_to_use must be specified in kv_connector_extra_config (host bytes "
            "for all workers of the engine together)"
        )
    cpu_bytes = extra.get("cpu_bytes_to_use")
    if isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, (int, float, str)):
        raise ValueError(
            "kv_connector_extra_config['cpu_bytes_to_use'] (host bytes for all "
            f"workers together) must be given as a positive integer, got {cpu_bytes!r}"
        )
    if isinstance(cpu_bytes, float) and not math.isfinite(cpu_bytes):
        value = 0  # JSON's Infinity: int() raised an OverflowError naming no key
    else:
        try:
            value = int(cpu_bytes)
        except ValueError:
            value = 0
    if value < 1:
        raise ValueError(
            "kv_connector_extra_config['cpu_bytes_to_use'] must be a positive "
            f"integer, got {cpu_bytes!r}"
        )


def check_known_keys(extra: Mapping[str, Any], vllm_keys: Iterable[str], release: str) -> None:
    """ValueError naming the first key of ``extra`` that neither this backend
    (``EXTRA_CONFIG_KEYS``) nor vLLM ``release`` (``vllm_keys``) reads, and the closest
    known key, or every known key when none is close."""
    known = sorted({*EXTRA_CONFIG_KEYS, *vllm_keys})
    for key in extra:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else "known keys: " + ", ".join(known)
        raise ValueError(
            f"kv_connector_extra_config[{key!r}]: {key!r} is not a key of triton_offload "
            f"or of vLLM {release}'s offloading; {hint}"
        )


def check_chunk_size(extra: Mapping[str, Any]) -> None:
    """vLLM's chunk-size keys as vLLM's offloading config reads them: at most one of
    ``blocks_per_chunk`` and ``block_size``, each a positive integer (vLLM takes
    ``int(value)``, so an integer written as a string is accepted; a fraction, which vLLM
    would cut down without a word, is not)."""
    given = [key for key in ("blocks_per_chunk", "block_size") if extra.get(key) is not None]
    if len(given) == 2:
        raise ValueError(
            "Specify only one of 'block_size' or 'blocks_per_chunk' in "
            f"kv_connector_extra_config (got block_size={extra['block_size']!r}, "
            f"blocks_per_chunk={extra['blocks_per_chunk']!r})"
        )
    for key in given:
        value = extra[key]
        whole = isinstance(value, int) and not isinstance(value, bool)
        if isinstance(value, str) and value.strip().isdigit():
            whole, value = True, int(value)
        if not whole or value < 1:
            unit = "GPU blocks per chunk" if key == "blocks_per_chunk" else "tokens per chunk"
            raise ValueError(
                f"kv_connector_extra_config[{key!r}] ({unit}) must be a positive integer, "
                f"got {extra[key]!r}"
            )


def check_canonical_layout(extra: Mapping[str, Any], spec_name: str) -> None:
    """``canonical_layout`` only where the spec honours it (the tiering spec)."""
    if extra.get("canonical_layout") and spec_name != TIERING_SPEC_NAME:
        raise ValueError(
            "kv_connector_extra_config['canonical_layout'] is not supported by "
            f"{spec_name}: its host rows hold each worker's own pages in this project's "
            "row layout, not vLLM's canonical pages (vLLM's CPU spec ignores the flag; "
            f"use {TIERING_SPEC_NAME}, which honours it)"
        )


def _known_keys(extra: Mapping[str, Any], spec_name: str) -> None:
    check_known_keys(extra, vllm_extra_config_keys(), installed_vllm_version())


def _cpu_bytes(extra: Mapping[str, Any], spec_name: str) -> None:
    validate_cpu_bytes(extra)


def _chunk_size(extra: Mapping[str, Any], spec_name: str) -> None:
    check_chunk_size(extra)


def _engine_options(extra: Mapping[str, Any], spec_name: str) -> None:
    EngineOptions.from_extra_config(extra)


def _folder_problem(root: str) -> str | None:
    """Why folder ``root`` cannot be created or used, or None. Judged on the nearest
    part of the path that exists; ownership and modes are the tiers' own check's."""
    path = os.path.abspath(root)
    if os.path.lexists(path):
        return None if os.path.isdir(path) else f"{path} exists and is not a folder"
    existing = os.path.dirname(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a folder, so nothing can be created under it"
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"{existing} is on a read-only file system"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user (uid {os.geteuid()})"
    return None


def check_tier_folders(extra: Mapping[str, Any]) -> None:
    """Every ``fs`` secondary tier's ``root_dir`` is a folder, or can be created: a
    ValueError names the key, the folder and what is wrong with it."""
    tiers = extra.get("secondary_tiers", [])
    if not isinstance(tiers, list):
        return  # vLLM's tiering spec refuses a non-list in its own words
    for index, tier in enumerate(tiers):
        if not isinstance(tier, Mapping) or tier.get("type") != "fs":
            continue
        root = tier.get("root_dir")
        if not isinstance(root, str) or not root:
            continue  # vLLM's fs tier and the tiers' check name these
        problem = _folder_problem(root)
        if problem is not None:
            raise ValueError(
                f"kv_connector_extra_config['secondary_tiers'][{index}]['root_dir'] "
                f"{root!r} cannot be used as the fs tier's folder: {problem}"
            )


def _secondary_tiers(extra: Mapping[str, Any], spec_name: str) -> None:
    if spec_name == TIERING_SPEC_NAME:
        check_tier_folders(extra)
        check_secondary_tiers(
            extra.get("secondary_tiers", []),
            spec_name,
            canonical=bool(extra.get("canonical_layout")),
        )


#: A check of one spec's extra config: ``check(extra, spec_name)`` raises ValueError (or
#: TypeError) naming the key, the value and what is wrong, and changes nothing else
#: unless the engine would do the same moments later (an fs tier's root is created
#: private, as the tiering spec creates it).
ConfigCheck = Callable[[Mapping[str, Any], str], None]

#: What :func:`check_extra_config` runs, in this order; the first failure is the one
#: reported. A check appended here runs before the model loads (through the connector)
#: and again when either spec is built.
START_UP_CHECKS: list[ConfigCheck] = [
    _known_keys,
    _cpu_bytes,
    _chunk_size,
    _engine_options,
    check_canonical_layout,
    _secondary_tiers,
]

#: The specs of this backend, whose extra config :func:`check_extra_config` judges.
OWN_SPECS = (SPEC_NAME, TIERING_SPEC_NAME)


def check_extra_config(extra: Any, spec_name: str) -> None:
    """Run :data:`START_UP_CHECKS` on ``extra``, the ``kv_connector_extra_config`` of spec
    ``spec_name`` (one of :data:`OWN_SPECS`); ValueError or TypeError names the first
    mistake."""
    if not isinstance(extra, Mapping):
        raise TypeError(f"kv_connector_extra_config must be a JSON object (a dict), got {extra!r}")
    if spec_name not in OWN_SPECS:
        raise ValueError(f"{spec_name!r} is not one of this backend's specs {OWN_SPECS}")
    for check in START_UP_CHECKS:
        check(extra, spec_name)


__all__ = [
    "BACKENDS",
    "EXTRA_CONFIG_KEYS",
    "OWN_SPECS",
    "START_UP_CHECKS",
    "ConfigCheck",
    "EngineOptions",
    "check_canonical_layout",
    "check_chunk_size",
    "check_extra_config",
    "check_known_keys",
    "check_tier_folders",
    "validate_cpu_bytes",
]
