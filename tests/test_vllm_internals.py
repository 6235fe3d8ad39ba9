"""The private vLLM names this package relies on hold on the installed release (run on
each supported release), and a name a release moved or changed is reported in one line."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from triton_offload.vllm import compat, internals


def test_every_relied_on_name_holds_on_the_installed_release() -> None:
    assert internals.internals_problems() == []


def test_each_supported_release_has_its_entries() -> None:
    for release in ((0, 33), (0, 34)):
        names = {r.name for r in internals.RELIANCES if release in r.releases}
        assert "OffloadingConnectorScheduler._lookup_complete_chunks" in names
        assert "CPUOffloadingManager._get_load_store_spec" in names
    only_034 = {r.name for r in internals.RELIANCES if r.releases == internals.ONLY_0_34}
    assert "OffloadingConnectorWorker.start_kv_transfers" in only_034


def _problems_without(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[str]:
    monkeypatch.delattr(owner, name)
    return internals.internals_problems()


def test_a_missing_method_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    problems = _problems_without(monkeypatch, CPUOffloadingManager, "_free_chunk")
    assert len(problems) == 1
    assert "CPUOffloadingManager._free_chunk" in problems[0] and "missing" in problems[0]


def test_a_changed_signature_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )

    def renamed(self: Any, req_status: Any, limit: Any = None) -> int | None:
        return None

    monkeypatch.setattr(OffloadingConnectorScheduler, "_lookup_complete_chunks", renamed)
    [problem] = internals.internals_problems()
    assert "_lookup_complete_chunks" in problem and "parameters changed" in problem


def test_the_import_check_names_the_range_and_every_problem(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(internals, "internals_problems", lambda: ["a: missing", "b: missing"])
    internals.check_vllm_internals.cache_clear()
    try:
        with pytest.raises(compat.UnsupportedVLLMError) as info:
            internals.check_vllm_internals()
    finally:
        internals.check_vllm_internals.cache_clear()
    message = str(info.value)
    assert compat.SUPPORTED_VLLM in message and "a: missing\nb: missing" in message
