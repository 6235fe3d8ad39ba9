"""The `triton-offload` entry point: --version, --help, one-line errors, cheap imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

import triton_offload
from triton_offload.cli import main
from triton_offload.planner.presets import PRESETS


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "triton_offload", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"triton-offload {triton_offload.__version__}\n"


def test_help_lists_every_preset_and_the_commands_taking_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name, preset in PRESETS.items():
        (line,) = [x for x in out.splitlines() if x.startswith(f"  {name} ")]
        assert f"[{', '.join(preset.commands)}]" in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["frobnicate"], "triton-offload: error: argument COMMAND: invalid choice: 'frobnicate'"),
        (["plan", "--tp"], "triton-offload plan: error: argument --tp: expected one argument"),
        (["bench", "--repeats", "0"], "argument --repeats: repeats 0 must be >= 1"),
    ],
)
def test_parse_errors_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1, err


def test_plan_imports_neither_torch_nor_triton() -> None:
    """`plan` is pure Python: the planner, its table and the CLI around it."""
    code = (
        "import sys\n"
        "from triton_offload.cli import main\n"
        "rc = main(['plan', '--preset', 'mamba-hybrid-tiny', '--tp', '2', '--dcp', '2'])\n"
        "roots = {m.split('.')[0] for m in sys.modules}\n"
        "heavy = sorted(roots & {'torch', 'triton', 'numpy'})\n"
        "print('heavy:', heavy)\n"
        "sys.exit(rc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "heavy: []" in result.stdout
    # the same for the help of the tool and of plan
    code = (
        "import sys, contextlib, io\n"
        "from triton_offload.cli import main\n"
        "for argv in (['--help'], ['plan', '--help'], ['--version']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        "roots = {m.split('.')[0] for m in sys.modules}\n"
        "print('heavy:', sorted(roots & {'torch', 'triton'}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "heavy: []" in result.stdout


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["bench", "--out", "README.md"], "--out README.md: exists and is not a folder"),
        (["verify", "--blocks-per-chunk", "100000"], "--blocks-per-chunk 100000: chunks of up"),
        (["plan", "--preset", "swa-hybrid", "--tp", "2", "--dcp", "4"], "--tp 2 is not divisible"),
    ],
)
def test_user_errors_in_a_fresh_process_are_one_line(argv: list[str], named: str) -> None:
    """What a user sees for each command: exit 2, one line naming the flag, no traceback."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "triton_offload", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and named in lines[0], result.stderr
    assert "Traceback" not in result.stderr
