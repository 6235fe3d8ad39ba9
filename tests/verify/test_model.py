"""The verification model: bitwise resumable prefill, DCP placement, sensitivity to wrong caches."""

from __future__ import annotations

import pytest
import torch

from triton_offload.verify.model import HybridCache, HybridModel, ModelConfig, RequestBlocks

CONFIG = ModelConfig()  # attention, mamba, sliding_window, mamba; block 16
NUM_BLOCKS = 24


def _tables(config: ModelConfig, dcp: int, seed: int) -> list[list[list[int]]]:
    ids = []
    for g in range(len(config.group_kinds)):
        per_rank = []
        for rank in range(dcp):
            gen = torch.Generator().manual_seed(seed * 100 + g * 10 + rank)
            per_rank.append(torch.randperm(NUM_BLOCKS, generator=gen)[:10].tolist())
        ids.append(per_rank)
    return ids


def _prompt(n: int) -> list[int]:
    return torch.randint(
        0, CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(7)
    ).tolist()


def _run(
    model: HybridModel, cache: HybridCache, blocks: RequestBlocks, tokens: list[int], start: int = 0
) -> list[torch.Tensor]:
    return [model.step(tokens[p], p, cache, blocks) for p in range(start, len(tokens))]


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(CONFIG)


@pytest.mark.parametrize("dcp", [1, 2])
def test_resumed_prefill_is_bitwise_cold(model: HybridModel, dcp: int) -> None:
    tokens = _prompt(70)
    cache = HybridCache(CONFIG, dcp, NUM_BLOCKS)
    blocks = RequestBlocks(CONFIG, dcp, NUM_BLOCKS, _tables(CONFIG, dcp, 0))
    cold = _run(model, cache, blocks, tokens)
    for resume in (16, 32, 48, 64):  # Mamba states exist at block ends only
        again = _run(model, cache, blocks, tokens, start=resume)
        assert all(torch.equal(a, b) for a, b in zip(cold[resume:], again, strict=True)), resume
    assert blocks.replica_mismatches == []


def test_dcp_does_not_change_the_numbers(model: HybridModel) -> None:
    tokens = _prompt(40)
    outs = []
    for dcp in (1, 2):
        cache = HybridCache(CONFIG, dcp, NUM_BLOCKS)
        blocks = RequestBlocks(CONFIG, dcp, NUM_BLOCKS, _tables(CONFIG, dcp, 1))
        outs.append(_run(model, cache, blocks, tokens))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_resume_between_mamba_states_changes_logits(model: HybridModel) -> None:
    # vLLM's bug fixed by PR #44599: the state after token 31 restored at position 31.
    tokens = _prompt(40)
    cache = HybridCache(CONFIG, 1, NUM_BLOCKS)
    blocks = RequestBlocks(CONFIG, 1, NUM_BLOCKS, _tables(CONFIG, 1, 2))
    cold = _run(model, cache, blocks, tokens)
    wrong = _run(model, cache, blocks, tokens, start=31)
    assert not torch.equal(cold[31], wrong[0])
    assert max((a - b).abs().max().item() for a, b in zip(cold[31:], wrong, strict=True)) > 1e-3


def test_attention_kv_of_token_t_lives_on_rank_t_mod_dcp(model: HybridModel) -> None:
    dcp = 2
    cache = HybridCache(CONFIG, dcp, NUM_BLOCKS)
    ids = _tables(CONFIG, dcp, 3)
    blocks = RequestBlocks(CONFIG, dcp, NUM_BLOCKS, ids)
    k_plane = cache.planes[0][0]  # layer 0 is attention, group 0
    bs = CONFIG.block_size
    for position, token in enumerate(_prompt(37)):
        before = k_plane.clone()
        model.step(token, position, cache, blocks)
        rank, local = position % dcp, position // dcp
        block, offset = ids[0][rank][local // bs], local % bs
        changed = (k_plane != before).any(dim=-1).nonzero().tolist()
        assert changed == [[rank, block, offset]], position


def test_mamba_state_is_written_to_every_rank_in_align_mode(model: HybridModel) -> None:
    dcp = 2
    cache = HybridCache(CONFIG, dcp, NUM_BLOCKS)
    ids = _tables(CONFIG, dcp, 4)
    blocks = RequestBlocks(CONFIG, dcp, NUM_BLOCKS, ids)
    mamba_group = CONFIG.group_kinds.index("mamba")
    ssm = cache.planes[1][1]  # layer 1 is Mamba
    tokens = _prompt(40)
    _run(model, cache, blocks, tokens[:16])
    end_of_block_0 = ssm[0, ids[mamba_group][0][0]].clone()
    _run(model, cache, blocks, tokens[:20], start=16)
    # Block 0 keeps the state after token 15; token 16.. write block 1 on both ranks.
    assert torch.equal(ssm[0, ids[mamba_group][0][0]], end_of_block_0)
    assert torch.equal(ssm[1, ids[mamba_group][1][0]], end_of_block_0)
    assert torch.equal(ssm[0, ids[mamba_group][0][1]], ssm[1, ids[mamba_group][1][1]])
    assert not torch.equal(ssm[0, ids[mamba_group][0][1]], end_of_block_0)


def test_replica_mismatch_is_recorded(model: HybridModel) -> None:
    dcp = 2
    cache = HybridCache(CONFIG, dcp, NUM_BLOCKS)
    ids = _tables(CONFIG, dcp, 5)
    blocks = RequestBlocks(CONFIG, dcp, NUM_BLOCKS, ids)
    tokens = _prompt(20)
    _run(model, cache, blocks, tokens[:16])
    mamba_group = CONFIG.group_kinds.index("mamba")
    cache.planes[3][0][1, ids[mamba_group][1][0]] += 1.0  # rank 1's conv state, layer 3
    _run(model, cache, blocks, tokens, start=16)
    assert blocks.replica_mismatches[0] == (16, 3)


def test_sliding_window_reads_only_its_window(model: HybridModel) -> None:
    tokens = _prompt(60)
    cache = HybridCache(CONFIG, 1, NUM_BLOCKS)
    ids = _tables(CONFIG, 1, 6)
    blocks = RequestBlocks(CONFIG, 1, NUM_BLOCKS, ids)
    cold = _run(model, cache, blocks, tokens)
    swa = CONFIG.group_kinds.index("sliding_window")
    swa_layer = CONFIG.layers.index("sliding_window")
    # Resume at 48: window 24 reaches back to token 25 (block 1); block 0 is never read.
    cache.planes[swa_layer][0][0, ids[swa][0][0]] = 1e4
    assert all(
        torch.equal(a, b)
        for a, b in zip(cold[48:], _run(model, cache, blocks, tokens, start=48), strict=True)
    )
    cache.planes[swa_layer][0][0, ids[swa][0][1]] += 1.0  # block 1 is inside the window
    assert not torch.equal(cold[48], _run(model, cache, blocks, tokens, start=48)[0])


def test_swapped_attention_blocks_change_logits(model: HybridModel) -> None:
    # ALiBi ties keys to slots: K/V restored into swapped blocks must not go unnoticed.
    config = ModelConfig(layers=("attention",))
    attention_only = HybridModel(config)
    tokens = _prompt(40)
    cache = HybridCache(config, 1, NUM_BLOCKS)
    ids = _tables(config, 1, 7)
    blocks = RequestBlocks(config, 1, NUM_BLOCKS, ids)
    cold = _run(attention_only, cache, blocks, tokens)
    for plane in cache.planes[0]:
        a, b = ids[0][0][0], ids[0][0][1]
        plane[0, [a, b]] = plane[0, [b, a]]
    again = _run(attention_only, cache, blocks, tokens, start=32)
    assert (cold[32] - again[0]).abs().max().item() > 1e-3


def test_bad_config_and_tables_name_the_value() -> None:
    with pytest.raises(ValueError, match="'rnn'"):
        ModelConfig(layers=("rnn",))
    with pytest.raises(ValueError, match="hidden_size 30"):
        ModelConfig(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="block id 99"):
        RequestBlocks(CONFIG, 1, NUM_BLOCKS, [[[99]], [[0]], [[0]]])
    with pytest.raises(ValueError, match="2 ranks, dcp is 1"):
        RequestBlocks(CONFIG, 1, NUM_BLOCKS, [[[0], [1]], [[0]], [[0]]])
    model = HybridModel(ModelConfig(layers=("mamba",)))
    cache = HybridCache(model.config, 1, 4)
    blocks = RequestBlocks(model.config, 1, 4, [[[0]]])
    with pytest.raises(ValueError, match="token 64"):
        model.step(64, 0, cache, blocks)
