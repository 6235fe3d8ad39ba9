"""What this integration promises vLLM: the supported releases and the names it registers.

Cheap to import (no vllm import): the plugin and the package's lazy loader read it in
every vLLM process. :func:`supported_vllm_api` guards the modules that subclass vLLM's
classes: it checks the installed release and turns a missing vLLM name into an
:class:`UnsupportedVLLMError` naming the version found and the supported range.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import re
from collections.abc import Iterator

#: The vLLM releases whose offloading API this package implements (inclusive, exclusive).
SUPPORTED_VLLM_MIN = (0, 33)
SUPPORTED_VLLM_MAX = (0, 35)
SUPPORTED_VLLM = ">=0.33,<0.35"

#: The names under which the plugin registers this package's classes with vLLM.
SPEC_NAME = "TritonOffloadingSpec"
TIERING_SPEC_NAME = "TritonTieringOffloadingSpec"
CONNECTOR_NAME = "TritonOffloadingConnector"
#: The module path every registered name resolves through (docs/vllm.md's configurations
#: name it).
MODULE_PATH = "triton_offload.vllm"

#: The top-level ``kv_connector_extra_config`` keys vLLM's offloading code reads, per
#: supported release (its CPU and tiering specs, the spec factory, the offloading
#: connector's config and scheduler). A secondary tier's own keys sit inside its
#: ``secondary_tiers`` entry and are not listed. ``tests/vllm/test_options.py`` scans the
#: installed vLLM for the keys it reads and fails when a release adds one.
_VLLM_KEYS_0_33 = (
    "backpressure",
    "block_size",
    "blocks_per_chunk",
    "cache_policy_module_path",
    "canonical_layout",
    "cpu_bytes_to_use",
    "eviction_policy",
    "max_tracker_size",
    "offload_prompt_only",
    "secondary_tiers",
    "self_describing_kv_events",
    "spec_module_path",
    "spec_name",
    "store_threshold",
    "sync_load_budget_bytes",
    "tier_poll_interval_s",
)
VLLM_EXTRA_CONFIG_KEYS: dict[tuple[int, int], tuple[str, ...]] = {
    (0, 33): _VLLM_KEYS_0_33,
    (0, 34): _VLLM_KEYS_0_33,  # 0.34.0 reads the same keys (scanned)
}

# vLLM attaches its handler to the "vllm" logger only (and stops propagation there), so
# a message meant for vLLM's log must come from a logger below it.
logger = logging.getLogger("vllm.triton_offload")


class UnsupportedVLLMError(ImportError):
    """The installed vLLM's offloading API is not the one this package implements."""


class BrokenVLLMError(UnsupportedVLLMError):
    """The installed vLLM is a supported release but does not import (a module outside
    vLLM is missing or broken). A subclass so that callers catching
    :class:`UnsupportedVLLMError` keep working; the message names the real cause."""


#: Distributions whose import name differs from their package name, for the hint of
#: a :class:`BrokenVLLMError` (vLLM's imports need them; `ci/vllm-cpu.txt` pins them).
_DISTRIBUTIONS = {"PIL": "pillow", "cpuinfo": "py-cpuinfo", "yaml": "PyYAML", "zmq": "pyzmq"}


def installed_vllm_version() -> str:
    """The installed vLLM distribution's version string (``"unknown"`` without metadata)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def vllm_release(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed vLLM), checked to be in
    ``SUPPORTED_VLLM``. Only :mod:`triton_offload.vllm.releases` (which adapter) and the
    per-release tables (keys, the internals registry) read it."""
    found = check_vllm_version(version)
    match = re.match(r"\s*v?(\d+)\.(\d+)", found)
    assert match is not None  # check_vllm_version refused anything else
    return int(match.group(1)), int(match.group(2))


def vllm_extra_config_keys() -> tuple[str, ...]:
    """The top-level extra-config keys the installed release's offloading code reads."""
    return VLLM_EXTRA_CONFIG_KEYS[vllm_release()]


def check_vllm_version(version: str | None = None) -> str:
    """Raise :class:`UnsupportedVLLMError` unless ``version`` is in ``SUPPORTED_VLLM``.

    ``version`` defaults to the installed one; local and dev suffixes are ignored
    (``0.33.1.dev4+gabc`` is a 0.33 release). Returns the version checked.
    """
    found = installed_vllm_version() if version is None else version
    match = re.match(r"\s*v?(\d+)\.(\d+)", found)
    if match is None:
        raise UnsupportedVLLMError(
            f"triton_offload.vllm supports vllm{SUPPORTED_VLLM}; cannot tell which release "
            f"vllm version {found!r} is"
        )
    release = (int(match.group(1)), int(match.group(2)))
    if not SUPPORTED_VLLM_MIN <= release < SUPPORTED_VLLM_MAX:
        raise UnsupportedVLLMError(
            f"triton_offload.vllm supports vllm{SUPPORTED_VLLM} (the OffloadingSpec API of "
            f"vllm 0.33 and 0.34), found vllm {found}; install a supported vllm or a "
            "triton-offload release made for this one"
        )
    return found


@contextlib.contextmanager
def supported_vllm_api() -> Iterator[None]:
    """Check the vLLM release, then import vLLM names inside the ``with`` block.

    A name the installed vLLM lacks raises :class:`UnsupportedVLLMError` naming it, the
    version found and the supported range, instead of a bare ImportError (or an
    AttributeError later on).
    """
    version = check_vllm_version()
    try:
        yield
    except ImportError as error:
        if isinstance(error, UnsupportedVLLMError):
            raise
        module = error.name or ""
        if module and module != "vllm" and not module.startswith("vllm."):
            # The release is in range and vLLM's own names are not the problem: one of
            # its dependencies is missing. "Unsupported" would send the user after the
            # wrong fix (another vLLM release).
            top = module.split(".")[0]
            distribution = _DISTRIBUTIONS.get(top, top)
            raise BrokenVLLMError(
                f"vllm {version} is supported but does not import: {error} (install "
                f"{distribution!r}, or vLLM's dependencies with `pip install vllm=={version}`; "
                "ci/vllm-cpu.txt lists what a CPU-only install needs)"
            ) from error
        raise UnsupportedVLLMError(
            f"triton_offload.vllm supports vllm{SUPPORTED_VLLM}, found vllm {version} "
            f"whose offloading API lacks a name this package uses ({error}; module "
            f"{error.name}); its offloading API is not the supported one"
        ) from error


__all__ = [
    "CONNECTOR_NAME",
    "MODULE_PATH",
    "SPEC_NAME",
    "SUPPORTED_VLLM",
    "SUPPORTED_VLLM_MAX",
    "SUPPORTED_VLLM_MIN",
    "TIERING_SPEC_NAME",
    "BrokenVLLMError",
    "UnsupportedVLLMError",
    "check_vllm_version",
    "installed_vllm_version",
    "supported_vllm_api",
    "vllm_extra_config_keys",
    "vllm_release",
]
