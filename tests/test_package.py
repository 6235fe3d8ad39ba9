"""The package's public surface: every exported name resolves lazily to its module."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import subprocess
import sys

import pytest

import triton_offload


def test_exports_and_all_agree() -> None:
    assert set(triton_offload.__all__) == {*triton_offload._EXPORTS, "__version__"}
    assert dir(triton_offload) == sorted(triton_offload.__all__)


@pytest.mark.parametrize("name", sorted(triton_offload._EXPORTS))
def test_export_is_the_defining_modules_object(name: str) -> None:
    module = importlib.import_module(triton_offload._EXPORTS[name])
    assert name in module.__all__
    assert getattr(triton_offload, name) is getattr(module, name)


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        triton_offload.nope  # noqa: B018


def test_info_reports_vllm_without_importing_it() -> None:
    """Only triton_offload.vllm imports vllm; `info` reads its version from metadata."""
    code = (
        "import sys; from triton_offload.cli import main; rc = main(['info']); "
        "print('vllm imported:', 'vllm' in sys.modules); sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "vllm imported: False" in result.stdout
    try:
        expected = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        expected = "not installed"
    assert re.search(rf"^vllm +{re.escape(expected)}$", result.stdout, re.MULTILINE)
