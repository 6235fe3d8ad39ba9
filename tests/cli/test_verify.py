"""`triton-offload verify`: its presets and the sizes it refuses before any work."""

from __future__ import annotations

import pytest

from triton_offload.cli import args as cli_args
from triton_offload.cli import main
from triton_offload.cli.verify import MAX_REQUEST_TOKENS, needed_bytes
from triton_offload.verify import serving


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    try:
        code = main(["verify", *argv])
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err  # one line, no traceback
    return captured.err


def _no_run(*_: object, **__: object) -> None:
    raise AssertionError("scenarios ran although the flags were refused")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--blocks-per-chunk", "100000"],
            "--blocks-per-chunk 100000: chunks of up to 3,200,000 tokens make prompts of up to "
            "38,400,001 tokens and would need 879.7 GiB of caches and host pools; verify runs "
            "requests of at most 4,096 tokens",
        ),
        (["--blocks-per-chunk", "1000"], "--blocks-per-chunk 1000: chunks of up to 32,000"),
        (
            ["--dcp", "2", "--blocks-per-chunk", "40", "--preset", "mamba-hybrid-tiny"],
            "--dcp 2 --blocks-per-chunk 40: chunks of up to 1,280 tokens",
        ),
        (["--dcp", "1000"], "--dcp 1000: chunks of up to 32,000 tokens"),
        (
            ["--max-new-tokens", "5000"],
            "--max-new-tokens 5000: with prompts of up to 385 tokens a request reaches 5,385",
        ),
        (["--preset", "hybrid"], "argument --preset: invalid choice: 'hybrid'"),
        (["--preset", "mamba-hybrid"], "argument --preset: invalid choice: 'mamba-hybrid'"),
        (["--dcp", "0"], "argument --dcp: DCP size 0 must be >= 1"),
    ],
)
def test_refused_before_any_scenario_runs(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(serving, "run_scenarios", _no_run)
    err = refused(capsys, *argv)
    assert err.startswith("triton-offload verify: error: ")
    assert message in err


def test_memory_is_checked_before_any_scenario_runs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving, "run_scenarios", _no_run)
    monkeypatch.setattr(cli_args, "available_memory_bytes", lambda: 1 << 20)
    err = refused(capsys, "--preset", "mamba-hybrid-tiny", "--blocks-per-chunk", "4")
    expected = needed_bytes(serving.build_scenarios(["mamba-hybrid-tiny"], [1, 2], [4]), 8)
    assert (
        f"--blocks-per-chunk 4: the verification caches and host pools would need "
        f"{cli_args.format_bytes(expected)} ({expected:,} bytes), more than the 1.0 MiB"
    ) in err


def test_needed_bytes_counts_caches_and_pools_by_hand() -> None:
    """mamba-tiny, DCP 1, 1 block per chunk, one 16-token prompt + 8 new tokens: 24
    tokens -> 2 blocks per rank, doubled: 4 blocks; a Mamba page is (3 x 32 + 32 x 8)
    float32 = 1408 B; 2 layers; the pool has 512 pages of one chunk of both layers and
    its 64-byte seal."""
    scenario = serving.Scenario("s", "mamba-tiny", 1, 1, 16, 16)
    page = (3 * 32 + 32 * 8) * 4
    cache = 4 * 2 * page
    pool = 512 * (2 * page + 64)
    assert needed_bytes([scenario], 8) == cache + pool


def test_the_default_run_is_within_the_bound() -> None:
    scenarios = serving.build_scenarios(list(serving.PRESETS), [1, 2], [1, 2])
    assert max(max(s.first_len, s.second_len) for s in scenarios) + 8 <= MAX_REQUEST_TOKENS


def test_triton_backend_after_a_compiled_kernel_import_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys
    import types

    monkeypatch.setattr(serving, "run_scenarios", _no_run)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(
        sys.modules, "triton_offload.kernels.copy_blocks", types.ModuleType("stand-in")
    )
    err = refused(capsys, "--backend", "triton", "--preset", "mamba-tiny")
    assert err.startswith("triton-offload verify: error: --backend triton: the kernels need")


def test_a_typo_is_refused_before_torch_is_imported() -> None:
    """Flags are parsed before anything imports torch (a typo took 6-7 s to refuse):
    with torch hidden from a real subprocess the refusal is still the usage line."""
    import subprocess
    import sys

    shim = (
        "import sys; sys.modules['torch'] = None\n"
        "from triton_offload.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    for argv in (["verify", "--presett", "x"], ["verify", "--inject", "nothing-known"]):
        done = subprocess.run(
            [sys.executable, "-c", shim, *argv], capture_output=True, text=True, check=False
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and "needs torch" not in done.stderr, done.stderr
        assert argv[1] in done.stderr, done.stderr
