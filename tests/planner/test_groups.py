"""GroupSpec / ParallelSpec: parsing, defaults, and bad input named in the error."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from triton_offload import GroupKind, GroupSpec, ParallelSpec


def test_kind_accepts_string_and_enum() -> None:
    assert GroupSpec("mla", 64).kind is GroupKind.MLA
    assert GroupSpec(GroupKind.MAMBA, 16).kind is GroupKind.MAMBA
    assert GroupSpec("mamba", 16) == GroupSpec(GroupKind.MAMBA, 16)


@pytest.mark.parametrize(
    ("kind", "sharded"),
    [
        ("full_attention", True),
        ("mla", True),
        ("sliding_window", True),
        ("chunked_local", True),
        ("mamba", False),
    ],
)
def test_dcp_sharding_defaults_by_kind(kind: str, sharded: bool) -> None:
    extra: dict[str, int] = {}
    if kind == "sliding_window":
        extra["sliding_window"] = 128
    if kind == "chunked_local":
        extra["attention_chunk_size"] = 128
    spec = GroupSpec(kind, 16, **extra)  # type: ignore[arg-type]
    assert spec.is_dcp_sharded is sharded
    assert GroupSpec(kind, 16, dcp_sharded=not sharded, **extra).is_dcp_sharded is not sharded  # type: ignore[arg-type]


def test_options_are_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        GroupSpec("sliding_window", 16, 128)  # type: ignore[misc]
    spec = GroupSpec("full_attention", 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 32  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelSpec().dcp_size = 2  # type: ignore[misc]


def test_label_and_window_tokens() -> None:
    assert GroupSpec("full_attention", 16).label == "full_attention"
    assert GroupSpec("full_attention", 16, name="attn").label == "attn"
    assert GroupSpec("sliding_window", 16, sliding_window=100).window_tokens == 100
    assert GroupSpec("chunked_local", 16, attention_chunk_size=8192).window_tokens == 8192
    assert GroupSpec("mamba", 16).window_tokens is None
    assert GroupSpec("mamba", 16, mamba_cache_mode="all").requires_mamba_alignment
    assert not GroupSpec("mamba", 16).requires_mamba_alignment


@pytest.mark.parametrize("block_size", [0, -16])
def test_non_positive_block_size(block_size: int) -> None:
    with pytest.raises(ValueError, match=rf"block_size must be positive, got {block_size}"):
        GroupSpec("full_attention", block_size)


@pytest.mark.parametrize("block_size", [True, 16.0, "16", None])
def test_block_size_wrong_type(block_size: object) -> None:
    with pytest.raises(TypeError, match=r"block_size must be an int, got"):
        GroupSpec("full_attention", block_size)  # type: ignore[arg-type]


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match=r"unknown group kind 'linear_attention'"):
        GroupSpec("linear_attention", 16)
    with pytest.raises(TypeError, match=r"kind must be a GroupKind or str, got 3"):
        GroupSpec(3, 16)  # type: ignore[arg-type]


def test_unknown_mamba_cache_mode() -> None:
    with pytest.raises(ValueError, match=r"unknown mamba_cache_mode 'prefix'"):
        GroupSpec("mamba", 16, mamba_cache_mode="prefix")


def test_mamba_mode_only_on_mamba() -> None:
    with pytest.raises(ValueError, match=r"mamba_cache_mode='align' is only valid for mamba"):
        GroupSpec("full_attention", 16, mamba_cache_mode="align")


def test_sliding_window_group_needs_window() -> None:
    with pytest.raises(ValueError, match=r"sliding_window group needs sliding_window"):
        GroupSpec("sliding_window", 16)
    with pytest.raises(ValueError, match=r"chunked_local group needs attention_chunk_size"):
        GroupSpec("chunked_local", 16)


@pytest.mark.parametrize("window", [0, -4])
def test_non_positive_window(window: int) -> None:
    with pytest.raises(ValueError, match=rf"sliding_window must be positive, got {window}"):
        GroupSpec("sliding_window", 16, sliding_window=window)
    with pytest.raises(ValueError, match=rf"attention_chunk_size must be positive, got {window}"):
        GroupSpec("chunked_local", 16, attention_chunk_size=window)


def test_window_on_wrong_kind() -> None:
    with pytest.raises(ValueError, match=r"sliding_window=128 is only valid for sliding_window"):
        GroupSpec("full_attention", 16, sliding_window=128)
    with pytest.raises(ValueError, match=r"attention_chunk_size=64 is only valid for chunked"):
        GroupSpec("sliding_window", 16, sliding_window=8, attention_chunk_size=64)


def test_flag_types() -> None:
    with pytest.raises(TypeError, match=r"is_eagle must be a bool, got 1"):
        GroupSpec("full_attention", 16, is_eagle=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dcp_sharded must be a bool, got 'yes'"):
        GroupSpec("full_attention", 16, dcp_sharded="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["tp_size", "dcp_size", "pcp_size"])
@pytest.mark.parametrize("value", [0, -2])
def test_parallel_non_positive(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"{field} must be positive, got {value}"):
        ParallelSpec(**{field: value})


@pytest.mark.parametrize("field", ["tp_size", "dcp_size", "pcp_size"])
@pytest.mark.parametrize("value", [True, 2.0])
def test_parallel_wrong_type(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=rf"{field} must be an int, got {value!r}"):
        ParallelSpec(**{field: value})  # type: ignore[arg-type]


def test_planner_imports_no_torch() -> None:
    """The scheduler process must be able to plan without importing torch."""
    import subprocess

    code = (
        "import sys; import triton_offload.planner.plan, triton_offload.planner.lookup, "
        "triton_offload.planner.groups, triton_offload.cli.plan; "
        "from triton_offload import plan_offload, GroupSpec; "
        "plan_offload([GroupSpec('full_attention', 16)]).lookup(32, 0, [[True, True]]); "
        "bad = [m for m in ('torch', 'triton', 'numpy') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + result.stdout


@pytest.mark.parametrize(("tp", "dcp"), [(1, 2), (2, 4), (6, 4), (3, 2)])
def test_parallel_tp_not_divisible_by_dcp(tp: int, dcp: int) -> None:
    """vLLM runs DCP on the TP group's GPUs: tp must be a multiple of dcp."""
    with pytest.raises(ValueError, match=rf"tp_size {tp} is not divisible by dcp_size {dcp}"):
        ParallelSpec(tp_size=tp, dcp_size=dcp)


@pytest.mark.parametrize(("tp", "dcp"), [(1, 1), (2, 2), (4, 2), (8, 4), (6, 3)])
def test_parallel_tp_multiple_of_dcp(tp: int, dcp: int) -> None:
    assert ParallelSpec(tp_size=tp, dcp_size=dcp).dcp_size == dcp
