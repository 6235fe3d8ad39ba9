"""The vLLM version check names the real cause: an unsupported release, an API that
lacks a name, or a supported release that does not import (a dependency missing)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="triton_offload.vllm needs vllm installed")

from triton_offload.vllm import compat


@pytest.fixture
def vllm_0_33(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.33.0")


def test_supported_vllm_missing_a_dependency_is_not_called_unsupported(vllm_0_33: None) -> None:
    """A vLLM in range whose import fails on a module outside vLLM (pillow not
    installed) is a broken install, not an unsupported release."""
    with pytest.raises(compat.BrokenVLLMError) as info, compat.supported_vllm_api():
        raise ModuleNotFoundError("No module named 'PIL'", name="PIL")
    message = str(info.value)
    assert message.startswith(
        "vllm 0.33.0 is supported but does not import: No module named 'PIL'"
    ), message
    assert "pillow" in message  # the distribution to install, not the module name
    assert "lacks" not in message and "supports vllm>=" not in message
    # Still an UnsupportedVLLMError (an ImportError): callers that catch it keep working.
    assert isinstance(info.value, compat.UnsupportedVLLMError)


def test_supported_vllm_lacking_its_own_name_is_an_api_mismatch(vllm_0_33: None) -> None:
    with pytest.raises(compat.UnsupportedVLLMError) as info, compat.supported_vllm_api():
        raise ImportError(
            "cannot import name 'CanonicalKVCaches' from 'vllm.v1.kv_offload.base'",
            name="vllm.v1.kv_offload.base",
        )
    assert not isinstance(info.value, compat.BrokenVLLMError)
    assert "lacks a name" in str(info.value)


def test_release_out_of_range_is_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.35.1")
    with pytest.raises(compat.UnsupportedVLLMError, match=r"found vllm 0\.35\.1"):
        compat.check_vllm_version()
