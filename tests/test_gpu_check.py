"""bench/gpu_check.sh on a CPU-only machine: its --dry-run runs every step (the CUDA
tests skip, the bench runs one tiny case) through the import shim, with the installed
package hidden, and leaves at most 8 files in the output folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
OUTPUTS = {
    "summary.txt",
    "gpu-tests.xml",
    "gpu-tests.log",
    "presets-report.md",
    "sweep-report.md",
    "presets-bandwidth.png",
    "sweep-bandwidth.png",
    "details.tar.gz",
}


def _run(tmp_path: Path, *args: str, budget: int | None = None) -> subprocess.CompletedProcess:
    # A python that sees the environment's packages but not their .pth files: the
    # editable install of this package is invisible, so only the shim can import it.
    wrapper = tmp_path / "python-without-site"
    site = sysconfig.get_paths()["purelib"]
    wrapper.write_text(
        "#!/bin/sh\n"
        f'export PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site}"\n'
        f'exec "{sys.executable}" -S "$@"\n'
    )
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(PYTHON=str(wrapper), TMPDIR=str(tmp_path))
    if budget is not None:
        env["GPU_CHECK_BUDGET"] = str(budget)
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )


def test_script_parses_and_refuses_bad_arguments(tmp_path: Path) -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert _run(tmp_path).returncode != 0  # no output folder
    refused = _run(tmp_path, str(tmp_path / "out"), "--fast")
    assert refused.returncode == 2 and "usage" in refused.stderr


def test_dry_run_runs_every_step_through_the_shim(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _run(tmp_path, str(out), "--dry-run")
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "using the shim" in summary
    assert f"kernels {tmp_path}" in summary  # the kernels came from the shim's tree
    for name in ("gpu-tests", "presets", "grid-sweep", "sweep"):
        assert f"\n{name:<16} rc=0 " in summary, summary
    # The launch-grid sweep ran (interpreted) and the summary states what it would pick.
    assert "grid sweep picks num_programs=" in summary
    assert "choice per-plane vs per-job: not run (needs CUDA copy engines)" in summary
    files = {p.name for p in out.iterdir()}
    assert files == OUTPUTS and len(files) <= 8
    suite = ET.parse(out / "gpu-tests.xml").getroot().find("testsuite")
    assert suite is not None
    assert int(suite.get("tests", 0)) > 0 and int(suite.get("skipped", 0)) > 0
    assert suite.get("failures") == "0" and suite.get("errors") == "0"
    assert "## " in (out / "presets-report.md").read_text()
    with tarfile.open(out / "details.tar.gz") as archive:
        names = set(archive.getnames())
        assert {"./versions.txt", "./install.log", "./nvidia-smi.txt"} <= names
        assert {"./grid-sweep/grid-sweep.json", "./grid-sweep/grid-sweep.txt"} <= names
        assert not any(name.startswith("./shim") for name in names)
        for bench in ("presets", "sweep"):
            results = json.load(archive.extractfile(f"./{bench}/results.json"))
            assert results["config"]["max_seconds"] >= 1
            assert results["measurements"]
            assert all(m["status"] != "FAILED" for m in results["measurements"])
    assert not any(p.name.startswith("gpu_check.") for p in tmp_path.iterdir())  # cleaned up


@pytest.mark.parametrize("budget", [12])
def test_spent_budget_skips_steps_and_still_reports(tmp_path: Path, budget: int) -> None:
    out = tmp_path / "out"
    done = _run(tmp_path, str(out), "--dry-run", budget=budget)
    assert done.returncode == 1
    summary = (out / "summary.txt").read_text()
    for name in ("gpu-tests", "presets", "grid-sweep", "sweep"):
        assert f"\n{name:<16} skipped " in summary, summary
    assert "budget spent" in summary
    assert (out / "details.tar.gz").stat().st_size > 0
