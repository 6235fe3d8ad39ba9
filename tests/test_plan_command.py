"""`triton-offload plan`: presets, --group parsing, the table, and flag errors (exit 2)."""

from __future__ import annotations

import argparse

import pytest

from triton_offload import GroupKind, GroupSpec
from triton_offload.cli import main
from triton_offload.plan_command import PRESETS, parse_group


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


def test_seed_preset_under_dcp2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_plan(
        capsys, "--preset", "mamba-hybrid", "--tp", "2", "--dcp", "2", "--prompt-tokens", "64"
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
        "--preset", "mamba-hybrid",
        "--dcp", "2", "--pcp", "2", "--blocks-per-chunk", "2",
        "--prompt-tokens", "200",
    )  # fmt: skip
    assert code == 0
    assert table_row(out, "attention")[3:6] == ["16", "32", "64"]
    assert table_row(out, "mamba")[3:] == ["16", "16", "32", "1", "2", "no", "6", "1,3,5"]
    assert "pcp=2" in out
    assert "-> load 192 tokens" in out


@pytest.mark.parametrize("preset", sorted(PRESETS))
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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "one of the arguments --preset --group is required"),
        (["--preset", "gpt5"], "invalid choice: 'gpt5'"),
        (["--preset", "dense", "--group", "mla:64"], "not allowed with argument"),
        (["--group", "attention:16"], "unknown group kind 'attention'"),
        (["--group", "full_attention"], "expected KIND:BLOCK"),
        (["--group", "full_attention:sixteen"], "block size 'sixteen' is not an integer"),
        (["--group", "full_attention:0"], "block_size must be positive, got 0"),
        (["--group", "sliding_window:16"], "sliding_window group needs sliding_window"),
        (["--group", "sliding_window:16:window=0"], "sliding_window must be positive, got 0"),
        (["--group", "sliding_window:16:window=x"], "window 'x' is not an integer"),
        (["--group", "mamba:16:mode=fast"], "unknown mamba_cache_mode 'fast'"),
        (["--group", "mamba:16:size=3"], "unknown option 'size=3'"),
        (["--preset", "dense", "--dcp", "0"], "argument --dcp: DCP size 0 must be >= 1"),
        (["--preset", "dense", "--tp", "-2"], "argument --tp: TP size -2 must be >= 1"),
        (["--preset", "dense", "--blocks-per-chunk", "1.5"], "'1.5' is not an integer"),
        (["--preset", "dense", "--prompt-tokens", "-1"], "prompt tokens -1 must be >= 0"),
        (
            ["--preset", "dense", "--prompt-tokens", "10", "--computed-tokens", "11"],
            "--computed-tokens 11 exceeds --prompt-tokens 10",
        ),
        (
            ["--group", "mamba:16:mode=align", "--group", "mamba:32:mode=all"],
            "disagree on their chunk",
        ),
    ],
)
def test_bad_flags_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run_plan(capsys, *argv)
    assert code == 2
    assert "error:" in err
    assert message in err
    assert out == ""


def test_parse_group_raises_argument_type_error() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"'mla:-4': block_size must be positive"):
        parse_group("mla:-4")
