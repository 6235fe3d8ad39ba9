"""The vLLM integration: this project's planner and data path as vLLM plugins (vllm 0.33).

Select a backend with ``"spec_name": "TritonOffloadingSpec"`` (or
``"TritonTieringOffloadingSpec"``) and ``"spec_module_path": "triton_offload.vllm"``
under vLLM's ``OffloadingConnector``, or the connector itself with ``"kv_connector":
"TritonOffloadingConnector", "kv_connector_module_path": "triton_offload.vllm"``.

One module per concern, each an ordinary module whose classes subclass vLLM's at module
level:

- ``compat``: the supported vLLM releases and the names registered (no vllm import);
- ``plugin``: the ``vllm.general_plugins`` entry point (registers by module path);
- ``options``: this backend's extra-config keys; ``convert``: vLLM's config, caches and
  job specs in this project's terms; ``tiers``: secondary tiers and their storage tag;
  ``checkpoint``: the served checkpoint's identity (in seals and storage names);
- ``region``: vLLM's ``SharedOffloadRegion`` as the host pool, and the store ledger;
- ``worker``: ``TritonOffloadingWorker``; ``spec``: ``TritonOffloadingSpec`` and
  ``TritonTieringOffloadingSpec``;
- ``planning``: the planner built from vLLM's cache specs; ``connector``:
  ``TritonOffloadingConnector`` and its scheduler;
- ``counters``: this backend's counters in vLLM's metrics (``vllm:triton_offload_*``),
  counted by the worker, the integrity guard and the connector.

Imports point one way: connector -> planning; spec -> worker -> region, convert; all
of them -> compat; nothing here is imported by the planner or the data path. This
package resolves its public names lazily (vLLM's factories import ``triton_offload.vllm``
and read one name), so the plugin and a lookup of one class load only what they need.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if importlib.util.find_spec("vllm") is None:
    raise ImportError(
        "triton_offload.vllm needs vLLM, which is not installed: "
        "pip install 'triton-offload[vllm]' (supported: vllm>=0.33,<0.35)"
    )

# Public name -> module of this package that defines it.
_EXPORTS: dict[str, str] = {
    "SPEC_NAME": "compat",
    "TIERING_SPEC_NAME": "compat",
    "CONNECTOR_NAME": "compat",
    "SUPPORTED_VLLM": "compat",
    "UnsupportedVLLMError": "compat",
    "BrokenVLLMError": "compat",
    "check_vllm_version": "compat",
    "installed_vllm_version": "compat",
    "register": "plugin",
    "BACKENDS": "options",
    "EXTRA_CONFIG_KEYS": "options",
    "EngineOptions": "options",
    "caches_from_canonical": "convert",
    "plan_from_offloading_config": "convert",
    "split_job": "convert",
    "TAGGED_TIERS": "tiers",
    "UNTAGGABLE_TIERS": "tiers",
    "check_secondary_tiers": "tiers",
    "storage_layout_tag": "tiers",
    "TritonOffloadingWorker": "worker",
    "TritonOffloadingSpec": "spec",
    "TritonTieringOffloadingSpec": "spec",
    "TritonOffloadingConnector": "connector",
    "TritonOffloadingConnectorScheduler": "connector",
}

__all__ = [
    "BACKENDS",
    "CONNECTOR_NAME",
    "EXTRA_CONFIG_KEYS",
    "SPEC_NAME",
    "SUPPORTED_VLLM",
    "TAGGED_TIERS",
    "TIERING_SPEC_NAME",
    "UNTAGGABLE_TIERS",
    "BrokenVLLMError",
    "EngineOptions",
    "TritonOffloadingConnector",
    "TritonOffloadingConnectorScheduler",
    "TritonOffloadingSpec",
    "TritonOffloadingWorker",
    "TritonTieringOffloadingSpec",
    "UnsupportedVLLMError",
    "caches_from_canonical",
    "check_secondary_tiers",
    "check_vllm_version",
    "installed_vllm_version",
    "plan_from_offloading_config",
    "register",
    "split_job",
    "storage_layout_tag",
]

if TYPE_CHECKING:
    from triton_offload.vllm.compat import (
        CONNECTOR_NAME,
        SPEC_NAME,
        SUPPORTED_VLLM,
        TIERING_SPEC_NAME,
        BrokenVLLMError,
        UnsupportedVLLMError,
        check_vllm_version,
        installed_vllm_version,
    )
    from triton_offload.vllm.connector import (
        TritonOffloadingConnector,
        TritonOffloadingConnectorScheduler,
    )
    from triton_offload.vllm.convert import (
        caches_from_canonical,
        plan_from_offloading_config,
        split_job,
    )
    from triton_offload.vllm.options import BACKENDS, EXTRA_CONFIG_KEYS, EngineOptions
    from triton_offload.vllm.plugin import register
    from triton_offload.vllm.spec import TritonOffloadingSpec, TritonTieringOffloadingSpec
    from triton_offload.vllm.tiers import (
        TAGGED_TIERS,
        UNTAGGABLE_TIERS,
        check_secondary_tiers,
        storage_layout_tag,
    )
    from triton_offload.vllm.worker import TritonOffloadingWorker


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        # vLLM reports a misspelt kv_connector as "Class ... not found in" this module,
        # with this error as its cause: name the class meant.
        close = difflib.get_close_matches(name, list(_EXPORTS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}{hint}")
    # Not cached in this module's namespace: the defining module stays the one source
    # (a test or a re-import that replaces it is seen at once).
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    if name == "TritonOffloadingConnector":
        # vLLM's connector factory looks the class up here, from the front-end process
        # while it builds its config: the earliest point a bad configuration can be
        # refused, before any model loads.
        value.on_class_lookup()
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
