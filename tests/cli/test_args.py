"""Every numeric flag has an upper bound; a value over it, a flag that would do nothing
without another one, and an empty ``--out`` are refused before any work: exit 2 and one
line naming the flag, the value and the bound (and whether time or memory set it)."""

from __future__ import annotations

import pytest
from triton_offload.bench import harness

from triton_offload.cli import main
from triton_offload.verify import serving


def _no_work(*_: object, **__: object) -> None:
    raise AssertionError("the command started working although an argument was refused")


@pytest.fixture(autouse=True)
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "run", _no_work)
    monkeypatch.setattr(serving, "run_scenarios", _no_work)


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.out == ""
    assert "Traceback" not in captured.err
    assert captured.err.count("\n") == 1, captured.err  # one line
    return captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # plan
        (
            ["plan", "--group", "full_attention:16", "--tp", "99999999999999999999999"],
            "argument --tp: TP size 99999999999999999999999 must be <= 65,536 (ranks",
        ),
        (["plan", "--group", "full_attention:16", "--dcp", "65537"], "--dcp: DCP size 65537"),
        (["plan", "--group", "full_attention:16", "--pcp", "70000"], "--pcp: PCP size 70000"),
        (
            ["plan", "--group", "full_attention:16", "--blocks-per-chunk", "100000000000000"],
            "--blocks-per-chunk: blocks per chunk 100000000000000 must be <= 1,048,576 (memory",
        ),
        (
            ["plan", "--group", "full_attention:16", "--prompt-tokens", "3000000000"],
            "--prompt-tokens: prompt tokens 3000000000 must be <= 2,147,483,647",
        ),
        (
            ["plan", "--group", "full_attention:1", "--prompt-tokens", "1000000000"],
            "--prompt-tokens 1000000000: the sample lookup (1,000,000,000 chunks x 64 B) would "
            "need 59.6 GiB; the sample walks at most 16,777,216 chunks",
        ),
        (
            ["plan", "--group", "full_attention:16", "--computed-tokens", "3000000000"],
            "--computed-tokens: computed tokens 3000000000 must be <= 2,147,483,647",
        ),
        (
            ["plan", "--group", "full_attention:99999999999"],
            "block size 99999999999 must be <= 2,147,483,647",
        ),
        (
            ["plan", "--group", "full_attention:16", "--group", "sliding_window:16:window=3e9"],
            "window '3e9' is not an integer",
        ),
        (
            [
                "plan",
                "--group",
                "full_attention:16",
                "--group",
                "sliding_window:16:window=3000000000",
            ],
            "window 3000000000 must be <= 2,147,483,647",
        ),
        # bench
        (
            ["bench", "--repeats", "1000000000"],
            "--repeats: repeats 1000000000 must be <= 1,000 (time",
        ),
        (["bench", "--warmup", "101"], "--warmup: warm-up count 101 must be <= 100 (time"),
        (
            ["bench", "--max-seconds", "100000"],
            "--max-seconds: max seconds 100000 must be <= 86,400",
        ),
        (["bench", "--out", ""], "argument --out: empty folder name ''"),
        (
            ["bench", "--page-sizes", "64k"],
            "--page-sizes 65536: only the raw sweep uses it; add --sweep",
        ),
        (["bench", "--pages", "16"], "--pages 16: only the raw sweep uses it; add --sweep"),
        (
            ["bench", "--sweep", "--pages", "10000000000"],
            "--pages 10000000000: a job of 10,000,000,000 pages of 4.0 KiB is 37.3 TiB; pages "
            "per job must be <= 16,384 (memory: at most 64.0 MiB per sweep job without CUDA)",
        ),
        (
            ["bench", "--sweep", "--page-sizes", "100g"],
            "--page-sizes 107374182400: a job of 16 pages of 100.0 GiB is 1.6 TiB; page size "
            "must be <= 4.0 MiB (memory: at most 64.0 MiB per sweep job without CUDA)",
        ),
        (
            ["bench", "--quick", "--sweep", "--page-sizes", "4m"],
            "page size must be <= 512.0 KiB (memory: at most 8.0 MiB per sweep job of a "
            "--quick run without CUDA)",
        ),
        # verify
        (["verify", "--out", ""], "argument --out: empty folder name ''"),
        (["verify", "--dcp", "99999999999999999999999"], "verify runs requests of at most 4,096"),
        (["verify", "--blocks-per-chunk", "100000"], "verify runs requests of at most 4,096"),
        (["verify", "--max-new-tokens", "5000"], "--max-new-tokens 5000: with prompts"),
    ],
)
def test_bound_refused_with_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(capsys, argv)
    assert message in err, err
