"""`triton-offload verify`: the scenario matrix passes, every injected bug fails it by name,
and the loaded-token counts are the planner's and really come from the pool."""

from __future__ import annotations

import pytest

from triton_offload.cli import main
from triton_offload.verify.model import ModelConfig
from triton_offload.verify.serving import (
    PRESETS,
    OffloadServer,
    Scenario,
    ScenarioResult,
    build_scenarios,
    chunk_keys,
    prompt_tokens,
    run_scenario,
    run_scenarios,
)


def _by_name(results: list[ScenarioResult]) -> dict[str, ScenarioResult]:
    return {r.scenario.name: r for r in results}


@pytest.fixture(scope="module")
def matrix() -> dict[str, ScenarioResult]:
    """The default matrix on the torch backend: every preset, DCP 1 and 2, bpc 1 and 2."""
    return _by_name(run_scenarios(build_scenarios(list(PRESETS), [1, 2], [1, 2])))


def test_full_matrix_is_bitwise_equal(matrix: dict[str, ScenarioResult]) -> None:
    # Seven prompts per preset, DCP and chunk size, one corrupt-chunk per preset and DCP,
    # plus one mamba-chunk-cut per DCP.
    assert len(matrix) == len(PRESETS) * 2 * 2 * 7 + len(PRESETS) * 2 + 2
    failures = [r.failure for r in matrix.values() if not r.passed]
    assert failures == []
    for r in matrix.values():
        assert r.tokens_equal and r.logits_equal and r.max_abs_diff == 0.0


def test_loaded_tokens_are_the_planners(matrix: dict[str, ScenarioResult]) -> None:
    # Hand-computed (block 16): spans 32/16 at DCP 2, Mamba hits rounded down to its chunk.
    expected = {
        # the worked example: 64 tokens, attention chunks [0, 1], Mamba [1, 3] -> 32
        "mamba-hybrid-tiny/dcp2/bpc1/boundary": 32,
        "mamba-hybrid-tiny/dcp2/bpc1/boundary+1": 64,
        "mamba-hybrid-tiny/dcp2/bpc1/boundary-1": 32,
        "mamba-hybrid-tiny/dcp2/bpc1/short": 0,
        "mamba-hybrid-tiny/dcp2/bpc1/several": 96,
        # Mamba only, align mode: 32 tokens load 16 (not 31), 33 load 32
        "mamba-tiny/dcp1/bpc1/boundary": 16,
        "mamba-tiny/dcp1/bpc1/boundary+1": 32,
        "swa-mamba-hybrid-tiny/dcp2/bpc2/extension": 128,
        # attention chunk A = 16 (32 at DCP 2), Mamba chunk 4A, 12A + 1 tokens stored
        # without attention chunk 9: the gap at 9A is inside Mamba chunk 2 -> 8A
        "mamba-hybrid-tiny/dcp1/bpc1/mamba-chunk-cut": 128,
        "mamba-hybrid-tiny/dcp2/bpc1/mamba-chunk-cut": 256,
    }
    for name, tokens in expected.items():
        result = matrix[name]
        assert result.lookup_tokens == tokens, name
        assert result.loaded_tokens == tokens, name
        assert result.recomputed_tokens == result.scenario.second_len - tokens, name
        assert (result.load_bytes > 0) == (tokens > 0), name


def test_loaded_bytes_are_the_needed_blocks(matrix: dict[str, ScenarioResult]) -> None:
    # hybrid, DCP 1, bpc 1, 16 tokens loaded: one block of each attention layer (K and V,
    # 16 x 32 float32) and one Mamba block per Mamba layer (conv 3 x 32 + SSM 32 x 8).
    attention = 2 * 2 * 16 * 32 * 4
    mamba = 2 * (3 * 32 + 32 * 8) * 4
    assert matrix["mamba-hybrid-tiny/dcp1/bpc1/boundary"].load_bytes == attention + mamba
    # Three attention chunks, but still one Mamba chunk (window 1): a Mamba hit reads
    # only the state at its end.
    assert matrix["mamba-hybrid-tiny/dcp1/bpc1/several"].load_bytes == 3 * attention + mamba
    # DCP 2: both ranks load; the Mamba state is replicated, so it is loaded twice.
    assert matrix["mamba-tiny/dcp2/bpc1/boundary"].load_bytes == 2 * mamba


def test_clearing_the_host_pool_turns_every_hit_into_a_recompute(
    matrix: dict[str, ScenarioResult],
) -> None:
    for preset in PRESETS:
        for dcp in (1, 2):
            for bpc in (1, 2):
                prefix = f"{preset}/dcp{dcp}/bpc{bpc}"
                kept, cleared = matrix[f"{prefix}/boundary+1"], matrix[f"{prefix}/host-cleared"]
                assert kept.scenario.second_len == cleared.scenario.second_len
                assert kept.loaded_tokens > 0
                assert cleared.lookup_tokens == cleared.loaded_tokens == cleared.load_bytes == 0
                assert cleared.recomputed_tokens == cleared.scenario.second_len
                assert cleared.passed


def test_table_counts_match_an_independent_lookup() -> None:
    config = ModelConfig(layers=PRESETS["swa-mamba-hybrid-tiny"])
    with OffloadServer(config, dcp=2, blocks_per_chunk=1, max_tokens=200) as server:
        scenario = Scenario("probe", "swa-mamba-hybrid-tiny", 2, 1, 100, 150)
        result = run_scenario(server, scenario, max_new_tokens=4)
        assert result.passed, result.failure
        # Ask the planner again, from the manager's presence bits, as a caller would.
        prompt = prompt_tokens(150, config.vocab_size)
        present = []
        for g, group in enumerate(server.plan.groups):
            tpc = group.tokens_per_chunk
            keys = chunk_keys(prompt, tpc, 150 // tpc)
            present.append(server.manager.lookup(keys, g))
        # run_scenario leaves the stored chunks of request 1 in the pool.
        assert server.plan.lookup(150, 0, present) == result.lookup_tokens == 96


def test_tiny_host_pool_stays_correct() -> None:
    # Not enough rows for every reachable chunk: some groups store nothing (the manager
    # returns None), the lookup sees holes, and the result must still be exact.
    config = ModelConfig(layers=PRESETS["swa-mamba-hybrid-tiny"])
    with OffloadServer(config, dcp=1, blocks_per_chunk=1, max_tokens=80, num_host_rows=3) as srv:
        result = run_scenario(
            srv, Scenario("tiny", "swa-mamba-hybrid-tiny", 1, 1, 65, 65), max_new_tokens=4
        )
    assert result.passed, result.failure


def _verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    status = main(["verify", *args])
    return status, capsys.readouterr().out


def test_cli_prints_the_table_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _verify(
        capsys, "--preset", "mamba-hybrid-tiny", "--dcp", "2", "--blocks-per-chunk", "1"
    )
    assert status == 0, out
    assert "max |diff|" in out and "recomputed" in out
    assert "mamba-hybrid-tiny/dcp2/bpc1/several" in out
    assert "refused" in out and "mamba-hybrid-tiny/dcp2/bpc1/corrupt-chunk" in out
    assert "all 9 scenarios equal" in out  # seven prompts + corrupt-chunk + mamba-chunk-cut


# Each injected bug on a matrix slice where it must show; the same slice passes without it.
INJECTED = [
    ("mamba-span-dcp", ["--preset", "mamba-hybrid-tiny", "--dcp", "2", "--blocks-per-chunk", "1"],
     "mamba-hybrid-tiny/dcp2/bpc1/boundary+1"),
    ("no-mamba-round-down", ["--preset", "mamba-tiny", "--dcp", "1", "--blocks-per-chunk", "1"],
     "mamba-tiny/dcp1/bpc1/boundary"),
    ("wrong-slot", ["--preset", "swa-mamba-hybrid-tiny", "--dcp", "1", "--blocks-per-chunk", "2"],
     "swa-mamba-hybrid-tiny/dcp1/bpc2/boundary"),
    ("vllm-lookup", ["--preset", "mamba-hybrid-tiny", "--dcp", "1", "--blocks-per-chunk", "1"],
     "mamba-hybrid-tiny/dcp1/bpc1/mamba-chunk-cut"),
    ("no-seal-check", ["--preset", "mamba-hybrid-tiny", "--dcp", "2", "--blocks-per-chunk", "1"],
     "mamba-hybrid-tiny/dcp2/bpc1/corrupt-chunk"),
]  # fmt: skip


@pytest.mark.parametrize(("bug", "args", "scenario"), INJECTED, ids=[b for b, _, _ in INJECTED])
def test_each_injected_bug_fails_verify_by_name(
    capsys: pytest.CaptureFixture[str], bug: str, args: list[str], scenario: str
) -> None:
    status, out = _verify(capsys, *args)
    assert status == 0, out
    status, out = _verify(capsys, *args, "--inject", bug)
    assert status == 1, out
    assert "FAILED" in out
    failure_lines = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    assert any(line.startswith(f"{scenario}: ") for line in failure_lines), out


def test_no_round_down_claims_the_boundary_hit() -> None:
    # vLLM before PR #44599: a 32-token Mamba prompt with chunks [0, 1] stored claimed 31.
    results = _by_name(
        run_scenarios(build_scenarios(["mamba-tiny"], [1], [1]), inject="no-mamba-round-down")
    )
    bad = results["mamba-tiny/dcp1/bpc1/boundary"]
    assert bad.lookup_tokens == 31
    assert not bad.logits_equal


def test_vllm_lookup_ends_inside_the_mamba_chunk() -> None:
    """vLLM's stock rule on the mamba-chunk-cut geometry: 144 tokens (the attention gap,
    inside Mamba chunk 2), whose state is the one after token 191; the planner: 128."""
    scenarios = [s for s in build_scenarios(["mamba-hybrid-tiny"], [1], [1]) if "cut" in s.name]
    stock = run_scenarios(scenarios, inject="vllm-lookup")[0]
    assert (stock.lookup_tokens, stock.logits_equal) == (144, False)
    planned = run_scenarios(scenarios)[0]
    assert (planned.lookup_tokens, planned.passed) == (128, True)


def test_triton_kernels_under_the_interpreter() -> None:
    # The real copy kernel (interpreted on CPU): one DCP 2 scenario set, hybrid with SWA.
    results = run_scenarios(build_scenarios(["swa-mamba-hybrid-tiny"], [2], [2]), backend="triton")
    assert [r.failure for r in results if not r.passed] == []
    assert any(r.loaded_tokens > 0 for r in results)


def test_bad_arguments_exit_two(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--dcp", "0"])
    assert exit_info.value.code == 2
    assert "argument --dcp: DCP size 0 must be >= 1" in capsys.readouterr().err


def test_server_rejects_bad_input() -> None:
    config = ModelConfig(layers=PRESETS["mamba-tiny"])
    with pytest.raises(ValueError, match="'bogus'"):
        OffloadServer(config, inject="bogus")
    with (
        OffloadServer(config, max_tokens=20) as server,
        pytest.raises(ValueError, match="exceeds max_tokens 20"),
    ):
        server.run([1] * 16, 8, lookup=False, store=False)
