"""The private vLLM names this package relies on hold on the installed release (run on
each supported release), and a name a release moved or changed is reported in one line."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path
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


# ------------------------------------------------------------------ the registry is complete

PACKAGE_DIR = Path(internals.__file__).parent


def _vllm_bases_source(module_name: str, class_name: str) -> str | None:
    """The source of every vLLM class a package class inherits from (None: it inherits
    from no vLLM class, or its module is another release's adapter, which imports on
    that release only: the run on that release judges it)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        return None
    sources = []
    for base in cls.__mro__:
        if base.__module__.split(".")[0] == "vllm":
            try:
                sources.append(inspect.getsource(base))
            except (OSError, TypeError):
                sources.append(" ".join(vars(base)))
    return "\n".join(sources) if sources else None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_name_problems() -> list[str]:
    """Private names the package touches that are neither its own nor in the registry.

    The package's own: functions and classes it defines, attributes its own classes set,
    and attributes its subclasses of vLLM's classes set or define that no vLLM class
    they inherit from mentions (judged on those classes' source: a name vLLM's class
    uses is an override, even where it looks new). Everything else with a leading
    underscore is vLLM's: read, called, overridden, imported or set on a vLLM object, it
    must be a registry entry (any dotted part of an entry's name)."""
    registry = {part for reliance in internals.RELIANCES for part in reliance.name.split(".")}
    trees = {p: ast.parse(p.read_text()) for p in sorted(PACKAGE_DIR.rglob("*.py"))}
    own: set[str] = set()
    set_on_vllm: list[tuple[str, str]] = []
    for path, tree in trees.items():
        module_name = ".".join(
            ("triton_offload", "vllm", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        ).removesuffix(".__init__")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                own.add(node.name)
            if not isinstance(node, ast.ClassDef):
                continue
            own.add(node.name)
            vllm_source = _vllm_bases_source(module_name, node.name)
            for inner in ast.walk(node):
                name = None
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = inner.name
                elif isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
                    name = inner.target.id  # a class attribute
                elif isinstance(inner, ast.Assign) and inner in node.body:
                    targets = [t.id for t in inner.targets if isinstance(t, ast.Name)]
                    name = targets[0] if targets else None
                elif (
                    isinstance(inner, ast.Attribute)
                    and isinstance(inner.ctx, ast.Store)
                    and isinstance(inner.value, ast.Name)
                    and inner.value.id == "self"
                ):
                    name = inner.attr
                if name is None or not _private(name):
                    continue
                if vllm_source is not None and re.search(rf"\b{name}\b", vllm_source):
                    set_on_vllm.append((name, f"{path.name}:{inner.lineno}"))
                else:
                    own.add(name)
    problems = [
        f"{where}: sets or overrides vLLM's {name}"
        for name, where in set_on_vllm
        if name not in registry
    ]
    for path, tree in trees.items():
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and _private(node.attr):
                names = [node.attr]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
                names = [a.name for a in node.names if _private(a.name)]
            for name in names:
                if name not in registry and name not in own:
                    problems.append(f"{path.name}:{node.lineno}: uses vLLM's {name}")
    return sorted(set(problems))


def test_every_private_vllm_name_the_package_touches_is_registered() -> None:
    assert private_name_problems() == []


def test_the_scan_sees_an_unregistered_private_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The judge above can fail: without the registry's entry for a name the package
    overrides, the scan names it."""
    kept = tuple(r for r in internals.RELIANCES if not r.name.endswith("._reserve_sync_load"))
    assert len(kept) < len(internals.RELIANCES)
    monkeypatch.setattr(internals, "RELIANCES", kept)
    problems = private_name_problems()
    assert any("_reserve_sync_load" in line for line in problems), problems


def test_a_field_vllm_renamed_is_named() -> None:
    """A 'reads field' entry holds only while vLLM's record has that field: the check
    names a field it lacks (here one that never existed) and passes a real one."""
    scheduler = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
    real = internals.Reliance(scheduler, "RequestOffloadState.req", "reads field", "x")
    gone = internals.Reliance(scheduler, "RequestOffloadState.num_computed", "reads field", "x")
    assert internals._problem(real) is None
    assert internals._problem(gone) == "RequestOffloadState has no field num_computed"
    fields = [r for r in internals.RELIANCES if r.use == "reads field"]
    assert {r.name.split(".")[0] for r in fields} >= {
        "RequestOffloadState",
        "RequestGroupState",
        "TransferJobStatus",
        "TransferJob",
        "OffloadingConnectorMetadata",
    }
