"""Test set-up only: let vLLM >= 0.34 build a ``VllmConfig`` on an x86 CPU without triton-cpu.

vLLM 0.34's ``CpuPlatform.check_and_update_config`` raises "vLLM on x86 CPUs requires
Triton (triton-cpu)" when ``vllm.triton_utils.HAS_TRITON`` is false (0.33 only warned).
It is false on the machines these tests run on: the triton wheel installed has no CPU
backend. The tests never run a vLLM model, so they need the config, not triton-cpu.

:func:`allow_x86_cpu_without_triton` wraps that one method so that it reads ``HAS_TRITON``
as true while it runs and restores the real value after. The flag is not set for the
whole process on purpose: other vLLM modules copy it at import time
(``from vllm.triton_utils import HAS_TRITON``) to pick Triton kernels, e.g. the CPU
offloading worker's ``swap_blocks`` path and the sampler, and would then call Triton
placeholders. The library never does this; the root ``conftest.py`` and
``ci/vllm_suite_plugin.py`` call it before any test builds a config.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

#: The first release whose CPU platform refuses x86 without Triton.
REFUSES_SINCE = (0, 34)


def _installed_release() -> tuple[int, int] | None:
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        major, minor = (int(part) for part in version.lstrip("v").split(".")[:2])
    except ValueError:
        return None
    return major, minor


def allow_x86_cpu_without_triton() -> bool:
    """Wrap ``CpuPlatform.check_and_update_config`` (vLLM >= 0.34); True if it did.

    Does nothing (False) without vLLM, on older releases, when vLLM's CPU platform does not
    import (the tests then report the broken install), or when already wrapped.
    """
    release = _installed_release()
    if release is None or release < REFUSES_SINCE:
        return False
    try:
        from vllm.platforms.cpu import CpuPlatform
    except Exception:
        return False
    original = CpuPlatform.__dict__.get("check_and_update_config")
    if not isinstance(original, classmethod) or getattr(original, "_without_triton", False):
        return False
    method = original.__func__

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        import vllm.triton_utils as triton_utils

        real = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            return method(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = real

    wrapped = classmethod(check_and_update_config)
    wrapped._without_triton = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = wrapped  # type: ignore[method-assign]
    return True
