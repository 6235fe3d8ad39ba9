"""What the real-engine suites share (``tests/system/test_vllm_*_real.py``): whether vLLM's
real CPU engine can run here, the rule that skips or fails a suite without it, and the
``vllm.LLM`` arguments of a tiny engine."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.helpers.engine_models import MODELS

#: A missing engine fails instead of skipping (CI's real-engine step sets it).
REQUIRE = os.environ.get("TRITON_OFFLOAD_REQUIRE_ENGINE") == "1"
MiB = 1 << 20


def engine_problem() -> str | None:
    """Why vLLM's real engine cannot run here, or None."""
    try:
        import importlib.metadata

        version = importlib.metadata.version("vllm")
        import vllm._C  # noqa: F401  (the compiled kernels; a CUDA build fails here)
    except Exception as error:
        return f"vLLM's compiled CPU kernels are not importable ({type(error).__name__}: {error})"
    if "cpu" not in version:
        return f"vllm {version} is not a CPU build (ci/engine_env.sh builds one)"
    return None


def skip_or_fail(problem: str | None) -> None:
    """Nothing without a problem; else skip, or fail under ``REQUIRE``."""
    if problem is None:
        return
    if REQUIRE:
        pytest.fail(f"TRITON_OFFLOAD_REQUIRE_ENGINE=1: {problem}")
    pytest.skip(f"{problem}; build the engine with `bash ci/engine_env.sh VENV`")


def engine_args(model: str, kv: dict[str, Any], tp: int) -> dict[str, Any]:
    """``vllm.LLM`` arguments: tiny ``model`` (a folder named after its ``MODELS`` entry,
    absolute or relative to the engine's working folder), token ids in and out, a 64 MiB
    device cache; ``tp`` 0 runs vLLM's single-process executor."""
    name = os.path.basename(model.rstrip("/"))
    args: dict[str, Any] = {
        "model": model,
        "dtype": MODELS[name].dtype,
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 64 * MiB,
        "max_model_len": 2048,
        "disable_log_stats": False,
        "seed": 0,
        "kv_transfer_config": kv,
    }
    if tp:
        args["tensor_parallel_size"] = tp
    else:
        args["distributed_executor_backend"] = "uni"
    return args
