"""Bench presets: page shapes in bytes from model dimensions, scaling, the sweep grid."""

from __future__ import annotations

import pytest
import torch
from triton_offload.bench import cases
from triton_offload.bench.cases import KiB, MiB
from triton_offload.bench.paths import build_workspace, plan_for

from triton_offload.planner import presets as model_presets


def test_llama_tp1_pages_are_32_kib_k_and_v() -> None:
    case = cases.CASES["llama3.1-8b-tp1"]
    (group,) = case.groups
    # 16 tokens x 8 KV heads x 128 head dim x 2 bytes (bf16)
    assert group.plane_bytes == (16 * 8 * 128 * 2, 16 * 8 * 128 * 2) == (32768, 32768)
    assert group.layers == 32
    assert group.blocks_per_job == 2048 // 16 == 128
    # 64 KiB per layer per block, 32 layers, 128 blocks
    assert case.job_bytes == 32 * 64 * KiB * 128 == 256 * MiB
    assert case.job_pages == 32 * 2 * 128


def test_llama_tp4_splits_kv_heads_to_8_kib() -> None:
    (group,) = cases.CASES["llama3.1-8b-tp4"].groups
    assert group.plane_bytes == (8192, 8192)  # 16 x 2 heads x 128 x 2 bytes


def test_mla_is_one_18432_byte_plane_per_layer() -> None:
    (group,) = cases.CASES["deepseek-mla"].groups
    assert group.kind == "mla"
    assert group.plane_bytes == (18_432,)  # 576 values x 2 bytes x 16 tokens
    assert model_presets.mla_page_bytes(16, 576, 2) == 18_432


def test_mamba_hybrid_has_kb_conv_and_mb_ssm_planes() -> None:
    attention, mamba = cases.CASES["mamba-hybrid"].groups
    assert mamba.kind == "mamba" and mamba.mamba_cache_mode == "align"
    conv, ssm = mamba.plane_bytes
    assert conv == 8192 * 3 * 2 == 48 * KiB  # (conv_dim, d_conv - 1) bf16
    assert ssm == 32 * 128 * 128 * 4 == 2 * MiB  # heads x head_dim x d_state fp32
    assert mamba.blocks_per_job == 1  # the state at the hit end
    assert attention.plane_bytes == (256 * 2 * 256 * 2,) * 2
    assert attention.blocks_per_job == 2048 // 256


def test_swa_hybrid_window_group_moves_only_its_window() -> None:
    full, sliding = cases.CASES["swa-hybrid"].groups
    assert full.plane_bytes == sliding.plane_bytes == (16 * 8 * 64 * 2,) * 2 == (16384, 16384)
    assert sliding.kind == "sliding_window" and sliding.sliding_window == 128
    assert sliding.blocks_per_job == 128 // 16 + 1
    assert full.blocks_per_job == 128


def test_byte_helpers() -> None:
    assert model_presets.attention_page_bytes(16, 8, 128, 2) == 32 * KiB
    assert model_presets.mamba_conv_bytes(10, 4, 2) == 60
    assert model_presets.mamba_ssm_bytes(2, 3, 4, 4) == 96


@pytest.mark.parametrize("name", list(cases.CASES))
def test_scaling_keeps_page_shapes_and_meets_target(name: str) -> None:
    case = cases.CASES[name]
    target = 4 * MiB
    scaled = cases.scale_case(case, target)
    floor = all(g.layers == 1 and g.blocks_per_job == 1 for g in scaled.groups)
    assert scaled.job_bytes <= target or floor
    assert scaled.job_bytes > target / 4  # not scaled to nothing
    for before, after in zip(case.groups, scaled.groups, strict=True):
        assert after.plane_bytes == before.plane_bytes
        assert after.layers >= 1 and after.blocks_per_job >= 1
    assert cases.scale_case(case, case.job_bytes) == case


def test_scaling_floor_is_one_layer_and_one_block() -> None:
    scaled = cases.scale_case(cases.CASES["mamba-hybrid"], 1)
    assert [(g.layers, g.blocks_per_job) for g in scaled.groups] == [(1, 1), (1, 1)]


@pytest.mark.parametrize("name", list(cases.CASES))
def test_presets_build_real_plans_and_workspaces(name: str) -> None:
    case = cases.scale_case(cases.CASES[name], 1 * MiB)
    plan = plan_for(case)
    assert [g.kind.value for g in plan.groups] == [g.kind for g in case.groups]
    ws = build_workspace(case, torch.device("cpu"))
    assert ws.job_bytes == case.job_bytes
    assert ws.job_pages == case.job_pages
    for group, shape in enumerate(case.groups):
        blocks = ws.gpu_blocks[group]
        assert len(set(blocks)) == len(blocks) == shape.blocks_per_job
        assert [ws.layout.planes[i].page_bytes for i in ws.layout.group_planes[group]] == list(
            shape.plane_bytes
        ) * shape.layers
    rows = [r for group_rows in ws.host_rows for r in group_rows]
    assert len(set(rows)) == len(rows) < ws.num_host_blocks  # unaddressed rows exist


def test_sweep_grid_skips_jobs_over_the_cap() -> None:
    grid, skipped = cases.sweep_cases([4 * KiB, 2 * MiB], [16, 1024], max_job_bytes=64 * MiB)
    assert [c.name for c in grid] == ["sweep-4KiBx16", "sweep-4KiBx1024", "sweep-2MiBx16"]
    assert len(skipped) == 1 and "2MiB x 1024 pages" in skipped[0]
    assert grid[1].job_bytes == 4 * KiB * 1024 and grid[1].job_pages == 1024


@pytest.mark.parametrize(
    ("text", "value"), [("4k", 4096), ("64KiB", 65536), ("2m", 2 * MiB), ("512", 512)]
)
def test_parse_size(text: str, value: int) -> None:
    assert cases.parse_size(text) == value


@pytest.mark.parametrize("text", ["4x", "", "0", "-1k"])
def test_parse_size_rejects_with_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="page size"):
        cases.parse_size(text)


def test_sweep_case_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="page size 0"):
        cases.sweep_case(0, 16)
    with pytest.raises(ValueError, match="pages per job 0"):
        cases.sweep_case(4096, 0)
