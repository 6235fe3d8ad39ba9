"""Import what this project and its tests take from vLLM, on a CPU-only machine.

``python ci/vllm_imports.py`` exits 0 when every module below imports, else it names the
first one that fails and why. ``ci/venv.sh`` runs it last; it is also how the pins of
``ci/vllm-*cpu.txt`` were checked (remove a pin, watch an import here fail).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

MODULES = (
    "vllm.config",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.kv_offload.base",
    "vllm.v1.kv_offload.factory",
    "vllm.v1.kv_offload.config",
    "vllm.v1.kv_offload.cpu.spec",
    "vllm.v1.kv_offload.cpu.manager",
    "vllm.v1.kv_offload.cpu.gpu_worker",
    "vllm.v1.kv_offload.cpu.shared_offload_region",
    "vllm.v1.kv_offload.tiering.spec",
    "vllm.v1.kv_offload.tiering.fs.manager",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "vllm.v1.core.sched.scheduler",
    # What the tests take besides (tests/helpers/vllm_engine.py, tier_peers.py and others).
    "vllm.sampling_params",
    "vllm.forward_context",
    "vllm.plugins",
    "vllm.utils.hashing",
    "vllm.v1.request",
    "vllm.v1.outputs",
    "vllm.v1.structured_output",
    "vllm.v1.core.block_pool",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.sched.output",
    "vllm.v1.kv_cache_spec_registry",
    "vllm.v1.kv_hints.protocol",
    "vllm.v1.kv_offload.cpu.common",
    "vllm.v1.kv_offload.file_mapper",
    "vllm.v1.kv_offload.tiering.manager",
    "vllm.distributed.kv_transfer.kv_connector.factory",
)
# Modules that a release added.
SINCE = {"vllm.v1.kv_offload.pointer_utils": (0, 34)}


def main() -> int:
    version = importlib.metadata.version("vllm")
    release = tuple(int(part) for part in version.split(".")[:2])
    names = list(MODULES) + [name for name, since in SINCE.items() if release >= since]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:  # any failure is the answer
            print(f"vllm {version}: import {name} failed: {type(error).__name__}: {error}")
            return 1
    print(f"vllm {version}: {len(names)} modules import")
    return 0


if __name__ == "__main__":
    sys.exit(main())
