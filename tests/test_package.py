"""The package's public surface: every exported name resolves lazily to its module."""

from __future__ import annotations

import importlib

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
