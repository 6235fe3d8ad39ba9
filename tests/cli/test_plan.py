"""`triton-offload plan`: presets, --group parsing, the table, and flag errors (exit 2)."""

from __future__ import annotations

import argparse

import pytest

from triton_offload import GroupKind, GroupSpec
from triton_offload.cli import args as cli_args
from triton_offload.cli import main
from triton_offload.cli.plan import parse_group
from triton_offload.planner.presets import preset_names


def run_plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def table_row(out: str, group: str) -> list[str]:
    for line in out.splitlines():
        cells = line.split()
        if len(cells) > 1 and cells[1] == group:
            return cells
    raise AssertionError(f"no row for {group!r} in:\n{out}")


def test_mamba_hybrid_preset_under_dcp2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_plan(
        capsys, "--preset", "mamba-hybrid-tiny", "--tp", "2", "--dcp", "2", "--prompt-tokens", "64"
    )
    assert (code, err) == (0, "")
    # index, name, kind, block, span, chunk, window, align, eagle, storable, reachable
    assert table_row(out, "attention") == [
        "0", "attention", "full_attention", "16", "32", "32", "-", "-", "no", "2", "0-1",
    ]  # fmt: skip
    assert table_row(out, "mamba") == [
        "1", "mamba", "mamba/align", "16", "16", "16", "1", "2", "no", "4", "1,3",
    ]  # fmt: skip
    assert "alignment_tokens: 32" in out
    assert "mamba_align_tokens: 16" in out
    assert "-> load 32 tokens (hit ends at token 32)" in out


def test_groups_from_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_plan(
        capsys,
        "--group", "full_attention:16",
        "--group", "sliding_window:4:window=8:name=swa",
        "--prompt-tokens", "33",
    )  # fmt: skip
    assert code == 0
    assert table_row(out, "swa")[4:] == ["4", "4", "2", "4", "no", "8", "2-3,6-7"]
    assert "-> load 32 tokens" in out
    code, out, _ = run_plan(
        capsys,
        "--group", "full_attention:16",
        "--group", "sliding_window:4:window=8",
        "--prompt-tokens", "33",
        "--computed-tokens", "16",
    )  # fmt: skip
    assert code == 0
    assert "16 computed" in out
    assert "-> load 16 tokens (hit ends at token 32)" in out


def test_blocks_per_chunk_and_pcp_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_plan(
        capsys,
        "--preset", "mamba-hybrid-tiny",
        "--tp", "2", "--dcp", "2", "--pcp", "2", "--blocks-per-chunk", "2",
        "--prompt-tokens", "200",
    )  # fmt: skip
    assert code == 0
    assert table_row(out, "attention")[3:6] == ["16", "32", "64"]
    assert table_row(out, "mamba")[3:] == ["16", "16", "32", "1", "2", "no", "6", "1,3,5"]
    assert "pcp=2" in out
    assert "-> load 192 tokens" in out


@pytest.mark.parametrize("preset", preset_names("plan"))
def test_every_preset_prints_a_hit(capsys: pytest.CaptureFixture[str], preset: str) -> None:
    code, out, _ = run_plan(capsys, "--preset", preset, "--prompt-tokens", "8192")
    assert code == 0
    assert f"preset {preset}:" in out
    hit = int(out.rsplit("-> load ", 1)[1].split()[0])
    assert 0 < hit <= 8192


def test_parse_group_options() -> None:
    spec = parse_group("mamba:16:mode=all:eagle:name=ssm")
    assert spec == GroupSpec(GroupKind.MAMBA, 16, mamba_cache_mode="all", is_eagle=True, name="ssm")
    assert parse_group("chunked_local:16:window=8192").attention_chunk_size == 8192
    assert parse_group("sliding_window:16:window=128").sliding_window == 128


def test_preset_states_its_tp(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_plan(capsys, "--preset", "llama3.1-8b-tp4", "--prompt-tokens", "64")
    assert code == 0
    assert "parallel: tp=4 dcp=1" in out
    code, out, _ = run_plan(capsys, "--preset", "mamba-hybrid", "--tp", "8", "--dcp", "2")
    assert code == 0
    assert "parallel: tp=8 dcp=2" in out
    # 256-token blocks at DCP 2: attention spans 512 tokens, Mamba state 256
    assert table_row(out, "attention")[3:6] == ["256", "512", "512"]
    assert table_row(out, "mamba")[3:6] == ["256", "256", "256"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "one of the arguments --preset --group is required"),
        (["--preset", "gpt5"], "argument --preset: invalid choice: 'gpt5'"),
        (["--preset", "dense"], "argument --preset: invalid choice: 'dense'"),
        (["--preset", "swa-hybrid", "--group", "mla:64"], "not allowed with argument"),
        (["--group", "attention:16"], "'attention:16': unknown group kind 'attention'"),
        (["--group", "full_attention"], "expected KIND:BLOCK"),
        (["--group", "full_attention:sixteen"], "block size 'sixteen' is not an integer"),
        (["--group", "full_attention:0"], "'full_attention:0': block size 0 must be >= 1"),
        (
            ["--group", "sliding_window:16"],
            "'sliding_window:16': a sliding_window group needs window=TOKENS",
        ),
        (
            ["--group", "chunked_local:16"],
            "'chunked_local:16': a chunked_local group needs window=TOKENS (its local-attention "
            "chunk), e.g. chunked_local:16:window=128",
        ),
        (["--group", "sliding_window:16:window=0"], "window 0 must be >= 1"),
        (["--group", "sliding_window:16:window=x"], "window 'x' is not an integer"),
        (
            ["--group", "sliding_window:16:window=10:window=20"],
            "'sliding_window:16:window=10:window=20': option 'window' given twice",
        ),
        (["--group", "mamba:16:eagle:eagle"], "'mamba:16:eagle:eagle': option 'eagle' given twice"),
        (["--group", "mla:16:name="], "'mla:16:name=': option name= needs a value"),
        (["--group", "mla:16:name"], "'mla:16:name': option name= needs a value"),
        (["--group", "sliding_window:16:window="], "option window= needs a value"),
        (["--group", "mamba:16:mode="], "option mode= needs a value"),
        (["--group", "mla:16:eagle=yes"], "'eagle' takes no value, got 'eagle=yes'"),
        (
            ["--group", "full_attention:16:window=8"],
            "window= is only for sliding_window and chunked_local groups, not full_attention",
        ),
        (["--group", "mla:16:mode=align"], "mode= is only for mamba groups, not mla"),
        (["--group", "mamba:16:mode=fast"], "unknown mode 'fast'; expected one of none"),
        (["--group", "mamba:16:size=3"], "unknown option 'size=3'"),
        (
            ["--group", "full_attention:16", "--group", "full_attention:32"],
            "--group: groups 0 and 1 are both named 'full_attention'; give each group a unique",
        ),
        (
            ["--group", "mla:16:name=a", "--group", "mamba:16:name=a"],
            "both named 'a'",
        ),
        (["--preset", "swa-hybrid", "--dcp", "0"], "argument --dcp: DCP size 0 must be >= 1"),
        (["--preset", "swa-hybrid", "--tp", "-2"], "argument --tp: TP size -2 must be >= 1"),
        (
            ["--preset", "swa-hybrid", "--tp", "2", "--dcp", "4"],
            "--tp 2 is not divisible by --dcp 4",
        ),
        (["--preset", "swa-hybrid", "--dcp", "2"], "--tp 1 is not divisible by --dcp 2"),
        (
            ["--preset", "llama3.1-8b-tp4", "--tp", "2"],
            "--tp 2: preset llama3.1-8b-tp4 is deployed at TP 4",
        ),
        (["--preset", "swa-hybrid", "--blocks-per-chunk", "1.5"], "'1.5' is not an integer"),
        (["--preset", "swa-hybrid", "--prompt-tokens", "-1"], "prompt tokens -1 must be >= 0"),
        (
            ["--preset", "swa-hybrid", "--prompt-tokens", "10", "--computed-tokens", "11"],
            "--computed-tokens 11 exceeds --prompt-tokens 10",
        ),
        (
            ["--preset", "llama3.1-8b-tp1", "--prompt-tokens", "2000000000"],
            "--prompt-tokens 2000000000: the sample lookup (125,000,000 chunks x 64 B) "
            "would need 7.5 GiB",
        ),
        (
            ["--group", "mamba:16:mode=align", "--group", "mamba:32:mode=all:name=m2"],
            "disagree on their chunk",
        ),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run_plan(capsys, *argv)
    assert code == 2
    assert err.startswith("triton-offload plan: error: ")
    assert message in err
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line, no usage block
    assert out == ""


def test_sample_prompt_checked_against_free_memory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_args, "available_memory_bytes", lambda: 1 << 20)
    code, out, err = run_plan(capsys, "--preset", "llama3.1-8b-tp1", "--prompt-tokens", "1600000")
    assert code == 2 and out == ""
    assert (
        "--prompt-tokens 1600000: the sample lookup (100,000 chunks x 64 B) would need 6.1 MiB "
        "(6,400,000 bytes), more than the 1.0 MiB of memory available"
    ) in err
    monkeypatch.setattr(cli_args, "available_memory_bytes", lambda: 1 << 30)
    code, out, err = run_plan(capsys, "--preset", "llama3.1-8b-tp1", "--prompt-tokens", "1600000")
    assert code == 0 and "load 1600000 tokens" in out


def test_bad_flag_in_a_fresh_process_prints_one_line_and_no_traceback() -> None:
    """What a user sees: exit 2, one line on stderr naming the flag and the value."""
    import subprocess
    import sys

    for argv in (
        ["--group", "chunked_local:16"],
        ["--preset", "llama3.1-8b-tp1", "--prompt-tokens", "100000000000"],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "triton_offload", "plan", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1, result.stderr
        assert "Traceback" not in result.stderr
        assert argv[-1] in lines[0]


def test_help_explains_the_columns(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_plan(capsys, "--help")
    assert code == 0
    assert "window     chunks a hit needs before its end (unit: chunks" in out
    assert "storable   full chunks of the sample prompt" in out
    for name in preset_names("plan"):
        assert name in out


def test_parse_group_raises_argument_type_error() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"'mla:-4': block size -4 must be >= 1"):
        parse_group("mla:-4")
