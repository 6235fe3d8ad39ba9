"""`triton-offload verify`'s sealed host pages: stores are sealed, a load checks every chunk
it reads, an altered chunk is refused, dropped and recomputed (the corrupt-chunk
scenarios), and without the check the same flip gives wrong logits."""

from __future__ import annotations

import pytest
import torch

from triton_offload.transfer.seal import SEAL_BYTES, key_digest, seal_problem
from triton_offload.verify.model import ModelConfig
from triton_offload.verify.serving import (
    PRESETS,
    OffloadServer,
    Scenario,
    ScenarioResult,
    build_scenarios,
    chunk_keys,
    prompt_tokens,
    run_scenarios,
)

CHECKSUM = "payload checksum mismatch (the chunk's bytes changed after it was sealed)"


def _corrupt_scenarios() -> list[Scenario]:
    return [s for s in build_scenarios(list(PRESETS), [1, 2], [1]) if "corrupt" in s.name]


@pytest.fixture(scope="module")
def refused() -> dict[str, ScenarioResult]:
    return {r.scenario.name: r for r in run_scenarios(_corrupt_scenarios())}


def test_every_preset_and_dcp_has_a_corrupt_chunk_scenario() -> None:
    names = [s.name for s in build_scenarios(list(PRESETS), [1, 2], [1, 2])]
    expected = [f"{p}/dcp{d}/bpc1/corrupt-chunk" for p in PRESETS for d in (1, 2)]
    assert [n for n in names if n.endswith("corrupt-chunk")] == expected
    # A run of --blocks-per-chunk 2 has its own.
    names = [s.name for s in build_scenarios(["mamba-tiny"], [2], [2])]
    assert "mamba-tiny/dcp2/bpc2/corrupt-chunk" in names


def test_altered_chunk_is_refused_and_the_rest_recomputed(
    refused: dict[str, ScenarioResult],
) -> None:
    # C = the largest chunk: 16 tokens, 32 at DCP 2 where attention is the largest group.
    # A 3C + 1-token prompt, group 0's chunk 2 altered: the lookup hits 3C, the load
    # stops at 2C, C + 1 tokens are recomputed; bitwise the cold run.
    for name, result in refused.items():
        c = 32 if "dcp2" in name and not name.startswith("mamba-tiny") else 16
        assert (result.scenario.second_len, result.lookup_tokens) == (3 * c + 1, 3 * c), name
        assert (result.loaded_tokens, result.recomputed_tokens) == (2 * c, c + 1), name
        assert result.refused_chunks == 1, name
        # DCP-sharded attention is altered on the last rank's page (every rank is
        # checked); replicated Mamba state on rank 0's, the copy the model reads.
        rank = 1 if "dcp2" in name and not name.startswith("mamba-tiny") else 0
        assert result.refusals == [f"group 0 chunk 2 (rank {rank}): {CHECKSUM}"], name
        assert result.passed, result.failure
        assert result.tokens_equal and result.logits_equal and result.max_abs_diff == 0.0


def test_without_the_seal_check_the_flip_gives_wrong_logits() -> None:
    """The scenario cannot pass vacuously: the same flip, loaded unchecked, changes the
    logits (and the scenario fails naming itself)."""
    for result in run_scenarios(_corrupt_scenarios(), inject="no-seal-check"):
        name = result.scenario.name
        assert result.refused_chunks == 0, name
        assert result.loaded_tokens == result.lookup_tokens > 0, name
        assert not result.logits_equal, name
        assert any(p.startswith("logits differ") for p in result.problems), name
        assert "the altered chunk 2 of group 0 was loaded, not refused" in result.problems
        assert result.failure.startswith(f"{name}: ")


def test_no_seal_check_changes_nothing_else() -> None:
    scenarios = [
        s for s in build_scenarios(["swa-mamba-hybrid-tiny"], [2], [1]) if "corrupt" not in s.name
    ]
    results = run_scenarios(scenarios, inject="no-seal-check")
    assert [r.failure for r in results if not r.passed] == []
    assert all(r.refused_chunks == 0 for r in results)


def _server(preset: str, dcp: int = 1, max_tokens: int = 120) -> OffloadServer:
    return OffloadServer(ModelConfig(layers=PRESETS[preset]), dcp=dcp, max_tokens=max_tokens)


def test_stored_chunks_are_sealed_on_every_rank() -> None:
    with _server("swa-mamba-hybrid-tiny", dcp=2) as server:
        for rank, engine in enumerate(server.engines):
            pages = server.pages[rank]
            # The engine's pool is each page without its seal: rows a page apart.
            assert pages.shape[1] == engine.row_bytes + SEAL_BYTES
            assert engine.pool.data_ptr() == pages.data_ptr()
            assert engine.row_stride == pages.stride(0) == engine.row_bytes + SEAL_BYTES
        prompt = prompt_tokens(97, server.config.vocab_size)
        cold = server.run(prompt, 2, lookup=False, store=True)
        checked = 0
        for g, chunks in enumerate(cold.stored_chunks):
            tpc = server.plan.groups[g].tokens_per_chunk
            keys = chunk_keys(prompt, tpc, len(prompt) // tpc)
            for c in chunks:
                row = server.manager.row_of(keys[c], g)
                assert row is not None
                for rank, sealer in enumerate(server.sealers):
                    assert sealer.problem(row, g, key_digest(keys[c])) is None
                    page = server.pages[rank][row].numpy()
                    # The rank's page of the chunk, under its own key only.
                    assert seal_problem(page, sealer.format, key_digest(keys[c])) is None
                    other = key_digest(keys[c - 1] if c else keys[c + 1])
                    assert "another key's chunk" in str(seal_problem(page, sealer.format, other))
                    assert sealer.format.page_index == rank and sealer.format.page_count == 2
                    checked += 1
        assert checked > 2 * 6
        # A row never stored has no seal.
        free = server.manager.num_rows - 1
        assert "no seal" in str(server.sealers[0].problem(free, 0, None))


def test_refused_chunk_is_dropped_and_stored_afresh() -> None:
    with _server("mamba-hybrid-tiny") as server:
        prompt = prompt_tokens(49, server.config.vocab_size)
        server.run(prompt, 2, lookup=False, store=True)
        server.flip_byte(prompt, 0, 2, rank=0)
        server.clear_gpu()
        warm = server.run(prompt, 2, lookup=True, store=False)
        assert (warm.lookup_tokens, warm.loaded_tokens) == (48, 32)
        keys = [chunk_keys(prompt, 16, 3), chunk_keys(prompt, 16, 3)]
        present = [server.manager.lookup(keys[g], g) for g in range(2)]
        assert present == [[True, True, False], [True, True, True]]
        # The reduced hit is the planner's own answer with the chunk absent.
        assert server.plan.lookup(49, 0, present) == 32
        # Stored again by the next request (the drop freed the key), then loaded whole.
        server.run(prompt, 2, lookup=False, store=True)
        server.clear_gpu()
        again = server.run(prompt, 2, lookup=True, store=False)
        assert (again.lookup_tokens, again.loaded_tokens, again.refused) == (48, 48, [])
        assert again.generated == warm.generated


def test_each_reduced_hit_is_checked_in_turn() -> None:
    # Attention chunk 2 and Mamba chunk 1 altered: the hit of 48 refuses attention chunk 2,
    # the reduced hit of 32 reads Mamba chunk 1 and refuses it too; 16 tokens load.
    with _server("mamba-hybrid-tiny") as server:
        prompt = prompt_tokens(49, server.config.vocab_size)
        cold = server.run(prompt, 4, lookup=False, store=True)
        server.flip_byte(prompt, 0, 2, rank=0)
        server.flip_byte(prompt, 1, 1, rank=0)
        server.clear_gpu()
        warm = server.run(prompt, 4, lookup=True, store=False)
        assert [(r.group, r.chunk) for r in warm.refused] == [(0, 2), (1, 1)]
        assert (warm.lookup_tokens, warm.loaded_tokens, warm.recomputed_tokens) == (48, 16, 33)
        assert warm.generated == cold.generated
        assert all(torch.equal(warm.logits[p], cold.logits[p]) for p in warm.logits)


def test_another_chunks_page_is_refused_by_its_key() -> None:
    # Chunk 1's page (seal included) copied over chunk 2's row: a valid seal, another key.
    with _server("mamba-tiny") as server:
        prompt = prompt_tokens(49, server.config.vocab_size)
        cold = server.run(prompt, 4, lookup=False, store=True)
        keys = chunk_keys(prompt, 16, 3)
        rows = [server.manager.row_of(k, 0) for k in keys]
        server.pages[0][rows[2]] = server.pages[0][rows[1]]
        server.clear_gpu()
        warm = server.run(prompt, 4, lookup=True, store=False)
        assert [str(r) for r in warm.refused] == [
            "group 0 chunk 2 (rank 0): another key's chunk (key digest differs)"
        ]
        assert warm.loaded_tokens == 32 and warm.generated == cold.generated


def test_flip_byte_needs_a_stored_chunk() -> None:
    with _server("mamba-tiny") as server:
        prompt = prompt_tokens(49, server.config.vocab_size)
        with pytest.raises(ValueError, match="chunk 2 of group 0 is not stored"):
            server.flip_byte(prompt, 0, 2, rank=0)
        with pytest.raises(ValueError, match="chunk 3 of group 0 is not a full chunk"):
            server.flip_byte(prompt, 0, 3, rank=0)
