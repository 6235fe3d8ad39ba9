"""Test recipe shared by tests/ and bench/.

Without CUDA the Triton kernels run under the interpreter on CPU tensors. The
variable must be set before any ``@triton.jit`` function is defined, hence here,
at the root, before test modules import ``triton_offload.kernels``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

CUDA_AVAILABLE = torch.cuda.is_available()
if not CUDA_AVAILABLE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _allow_vllm_cpu_without_triton() -> None:
    """vLLM >= 0.34 refuses to build a VllmConfig on an x86 CPU without triton-cpu, which
    these machines lack (their triton has no CPU backend); the tests build configs but run
    no model. ci/vllm_cpu_platform.py lifts that check for the tests only, never in the
    library (its docstring says how and why)."""
    # Resolved: bench/gpu_check.sh runs the tests from a tree of symlinks without ci/.
    path = Path(__file__).resolve().with_name("ci") / "vllm_cpu_platform.py"
    if not path.is_file():
        return
    spec = importlib.util.spec_from_file_location("_vllm_cpu_platform", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.allow_x86_cpu_without_triton()


_allow_vllm_cpu_without_triton()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CUDA_AVAILABLE and not INTERPRETED:
        return
    reason = (
        "needs a CUDA GPU (pinned host memory, real streams); none is available"
        if not CUDA_AVAILABLE
        else "needs compiled kernels on CUDA; TRITON_INTERPRET=1 is set"
    )
    skip_cuda = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests put their tensors: CPU under the interpreter, else the GPU."""
    if INTERPRETED or not CUDA_AVAILABLE:
        return torch.device("cpu")
    return torch.device("cuda")
