"""One adapter per supported vLLM release: every release module defines the same
interface with the same signatures, the installed release's is the one in use, and no
module outside the adapters and the per-release tables asks which release runs."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

import triton_offload.vllm as package
from triton_offload.vllm import compat, releases

PACKAGE_DIR = Path(package.__file__).parent
RELEASES_DIR = PACKAGE_DIR / "releases"
#: Where the installed release may be asked for: the adapters' loader, and the tables
#: keyed by release (vLLM's extra-config keys; the registry of private names).
MAY_ASK_THE_RELEASE = {"compat.py", "internals.py", "releases/__init__.py"}


def release_modules() -> dict[tuple[int, int], Path]:
    found = {}
    for path in sorted(RELEASES_DIR.glob("v*_*.py")):
        match = re.fullmatch(r"v(\d+)_(\d+)\.py", path.name)
        assert match, f"{path.name}: a release module is named v<major>_<minor>.py"
        found[(int(match.group(1)), int(match.group(2)))] = path
    return found


def top_level_definitions(path: Path) -> dict[str, ast.AST]:
    """Names bound at a module's top level (def, class, assignment, import) -> node."""
    names: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.With):  # `with supported_vllm_api(): from vllm... import`
            for inner in node.body:
                if isinstance(inner, ast.ImportFrom):
                    for alias in inner.names:
                        names[alias.asname or alias.name] = inner
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def parameters(node: ast.AST) -> list[str] | None:
    if isinstance(node, ast.FunctionDef):
        return [a.arg for a in node.args.args]
    return None


def test_every_supported_release_has_an_adapter_and_no_other() -> None:
    supported = {
        (0, minor) for minor in range(compat.SUPPORTED_VLLM_MIN[1], compat.SUPPORTED_VLLM_MAX[1])
    }
    assert compat.SUPPORTED_VLLM_MIN[0] == compat.SUPPORTED_VLLM_MAX[0] == 0
    assert set(release_modules()) == supported
    assert set(compat.VLLM_EXTRA_CONFIG_KEYS) == supported


@pytest.mark.parametrize("release", sorted(release_modules()))
def test_each_release_module_defines_the_interface_alike(release: tuple[int, int]) -> None:
    modules = release_modules()
    mine = top_level_definitions(modules[release])
    missing = [name for name in releases.INTERFACE if name not in mine]
    assert not missing, f"{modules[release].name} lacks {missing}"
    for other_release, path in modules.items():
        theirs = top_level_definitions(path)
        for name in releases.INTERFACE:
            assert parameters(mine[name]) == parameters(theirs[name]), (
                f"{name}: {modules[release].name} and {path.name} differ in parameters"
            )
        del other_release


def test_the_installed_release_adapter_is_in_use() -> None:
    assert compat.vllm_release() == releases.RELEASE.RELEASE
    assert releases.RELEASE is releases.adapter_for(compat.vllm_release())
    hit, boundary = 48, 32
    answer = releases.RELEASE.lookup_answer(hit, boundary)
    split_hit, split_boundary = releases.RELEASE.split_lookup(answer)
    assert split_hit == hit and split_boundary in (None, boundary)


def test_an_unsupported_release_has_no_adapter() -> None:
    with pytest.raises(ImportError):
        releases.adapter_for((0, 32))


def test_no_module_outside_the_adapters_asks_which_release_runs() -> None:
    """A release test (the version, a release constant, a feature probe of vLLM's
    classes) outside the adapters forks the code by release again."""
    asking = re.compile(
        r"vllm_release\(|installed_vllm_version\(\)\s*[<>=]|VLLM_0_3\d|vllm\.__version__"
        r"|hasattr\(\s*(OffloadingWorkerMetadata|DevicePointers)"
    )
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR).as_posix()
        if relative in MAY_ASK_THE_RELEASE or relative.startswith("releases/v"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if asking.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert found == []
