"""A missing Triton is one line, as a missing vLLM is: which command needs it and how to
install it, no traceback. Triton is hidden from a real subprocess with
``sys.modules['triton'] = None`` (every ``import triton`` then fails as if absent)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SHIM = (
    "import sys; sys.modules['triton'] = None\n"
    "from triton_offload.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _without_triton(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, "-c", SHIM, *argv], capture_output=True, text=True, env=env, check=False
    )


@pytest.mark.parametrize("command", ["bench"])
def test_missing_triton_is_one_line_naming_the_command(command: str, tmp_path: Path) -> None:
    argv = [command, "--quick", "--out", str(tmp_path / "out")]
    done = _without_triton(*argv)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(f"triton-offload {command}: error: {command} needs triton"), lines
    assert "pip install 'triton>=3.4'" in lines[-1]
    assert [line for line in lines if "error" in line] == [lines[-1]]


def test_plan_needs_no_triton() -> None:
    done = _without_triton("plan", "--preset", "llama3.1-8b-tp1")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_info_runs_without_triton_and_says_so() -> None:
    """``info`` is the diagnostic: it must run where Triton is missing (it used to stop
    with "info needs triton") and say what is missing and how to install it."""
    done = _without_triton("info")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    (triton,) = [line for line in lines if line.startswith("triton ")]
    assert "not importable" in triton and "pip install 'triton>=3.4'" in triton, triton
    assert any(line.startswith("torch ") for line in lines)
    assert any(line.startswith("cuda available") for line in lines)
