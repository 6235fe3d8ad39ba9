"""The package's public surface (lazy exports, the `info` command) and its layering rules."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton_offload.kernels

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
    """Only the vLLM modules import vllm; `info` reads its version from metadata."""
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


def test_info_names_the_calibration_it_can_run() -> None:
    """`info --calibrate` runs the engine's calibration on CUDA; without it, it says why."""
    code = (
        "import sys; from triton_offload.cli import main; sys.exit(main(['info', '--calibrate']))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    if "cuda available  False" in result.stdout:
        assert "calibration     not run: needs CUDA" in result.stdout
    else:
        assert "dma path        " in result.stdout
        assert re.search(
            r"^calibration     (store|load) page \d+ B x \d+ blocks \(\d+ planes, \d+ pages\): ",
            result.stdout,
            re.M,
        )


LIBRARY = Path(triton_offload.__file__).parent
KERNELS = Path(triton_offload.kernels.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every absolute module an import statement of ``path`` names (``from a import b``
    names ``a`` and ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def offenders(folder: Path, banned: str, *, allowed: tuple[str, ...] = ()) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        relative = path.relative_to(folder).as_posix()
        if relative in allowed:
            continue
        hits = [m for m in imported_modules(path) if m == banned or m.startswith(banned + ".")]
        found += [f"{relative}: {m}" for m in sorted(hits)]
    return found


def test_library_never_imports_triton_language() -> None:
    """Kernels live in kernels/; the library validates, plans and decides."""
    assert offenders(LIBRARY, "triton.language") == []


def test_kernels_import_nothing_of_the_library() -> None:
    """Data flows plan -> job spec -> launch tables -> kernel; kernels never see a plan."""
    assert offenders(KERNELS, "triton_offload") == []


def _classes_with_fields(path: Path, fields: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef):
            names = {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }
            if fields <= names:
                found.append(f"{path.name}:{node.name}")
    return found


def test_one_plane_geometry_type() -> None:
    """Plane geometry is described once (layout.Plane): validation, copiers and kernel
    tables all read it, so two descriptions cannot drift apart."""
    fields = {"base_address", "block_stride", "page_bytes"}
    found = [
        hit
        for folder in (LIBRARY, KERNELS)
        for path in sorted(folder.rglob("*.py"))
        for hit in _classes_with_fields(path, fields)
    ]
    assert found == ["layout.py:Plane"]


def test_kernels_hold_only_jit_code_launchers_and_grid_functions() -> None:
    """No validation or geometry in kernels/: its functions are @triton.jit kernels, the
    launcher and the grid settings; its one class is the launcher's argument protocol."""
    allowed = {
        "launch_copy",
        "default_num_programs",
        "grid_size",
        "_sm_count",
        "warm_up",
        "_empty_job",  # warm_up's launch arguments
        "_launch_options",  # the launch settings of a tile size
    }
    for path in sorted(KERNELS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                jit = any("jit" in ast.unparse(d) for d in node.decorator_list)
                assert jit or node.name in allowed, f"{path.name}: {node.name}"
            elif isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert bases == {"Protocol"}, f"{path.name}: class {node.name}"


def test_only_the_engine_reads_its_own_books() -> None:
    """The engine owns its jobs' books (in flight, queues, finished, locks): no other
    module reaches into a ``TransferEngine``'s private members; what others need is a
    public method (layer-staged loads, unreported calibration jobs, the lane's stream)."""
    reaching = re.compile(r"\bengine\._[a-z]")
    found = []
    bench = Path(importlib.import_module("triton_offload.bench").__file__).parent
    for path in sorted([*LIBRARY.rglob("*.py"), *bench.rglob("*.py")]):
        if path.name == "engine.py" and path.parent.name == "transfer":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if reaching.search(line):
                found.append(f"{path}:{number}: {line.strip()}")
    assert found == []
