"""One preset table: a name means the same model in plan, bench and verify."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from triton_offload.bench import cases as bench_cases

from triton_offload.cli import bench as bench_command
from triton_offload.planner.groups import GroupSpec
from triton_offload.planner.presets import PRESETS, describe_presets, preset_names
from triton_offload.verify import serving
from triton_offload.verify.model import ModelConfig

COMMANDS_DOC = Path(__file__).resolve().parents[2] / "docs" / "commands.md"


def _shape(spec: GroupSpec) -> tuple[object, ...]:
    return (spec.name, spec.kind.value, spec.block_size, spec.sliding_window, spec.mamba_cache_mode)


def test_every_command_takes_its_presets_from_the_table() -> None:
    assert list(bench_command.PRESET_NAMES) == preset_names("bench")
    assert list(bench_cases.CASES) == preset_names("bench")
    assert list(serving.PRESETS) == preset_names("verify")
    assert preset_names("plan") == list(PRESETS)


@pytest.mark.parametrize("name", preset_names("bench"))
def test_bench_case_is_the_planners_model(name: str) -> None:
    """The pages bench moves belong to the groups plan shows for the same name."""
    case = bench_cases.CASES[name]
    shapes = [
        (g.name, g.kind, g.block_size, g.sliding_window, g.mamba_cache_mode) for g in case.groups
    ]
    assert shapes == [_shape(spec) for spec in PRESETS[name].groups]


def test_bench_tp_is_the_names() -> None:
    """llama3.1-8b-tp4 splits the 8 KV heads over 4 ranks: 8 KiB pages, a quarter of TP 1."""
    tp1 = bench_cases.CASES["llama3.1-8b-tp1"].groups[0].plane_bytes
    tp4 = bench_cases.CASES["llama3.1-8b-tp4"].groups[0].plane_bytes
    assert PRESETS["llama3.1-8b-tp4"].tp_size == 4 and PRESETS["llama3.1-8b-tp1"].tp_size == 1
    assert tp1 == (32768, 32768) and tp4 == (8192, 8192)


@pytest.mark.parametrize("name", preset_names("verify"))
def test_verify_model_is_the_planners_model(name: str) -> None:
    config = ModelConfig(layers=serving.PRESETS[name])
    assert [_shape(s) for s in serving.group_specs(config)] == [
        _shape(s) for s in PRESETS[name].groups
    ]
    assert name.endswith("-tiny")


def test_tiny_presets_scale_down_a_named_model_or_say_what_they_are() -> None:
    for name in preset_names("verify"):
        base = name.removesuffix("-tiny")
        if base in PRESETS:  # same group kinds as the full-size model
            kinds = [s.kind for s in PRESETS[base].groups]
            assert kinds == [s.kind for s in PRESETS[name].groups]
            assert f"{base} scaled down" in PRESETS[name].description


def test_help_text_and_the_commands_page_list_every_preset() -> None:
    text = describe_presets()
    page = COMMANDS_DOC.read_text()
    for name, preset in PRESETS.items():
        assert re.search(rf"^  {re.escape(name)} +\[{', '.join(preset.commands)}\]", text, re.M)
        row = [line for line in page.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(row) == 1, f"docs/commands.md lists preset {name} {len(row)} times"
        cells = [cell.strip() for cell in row[0].strip().strip("|").split("|")]
        expected = ["yes" if c in preset.commands else "-" for c in ("plan", "bench", "verify")]
        assert cells[-3:] == expected, row[0]


def test_preset_names_rejects_an_unknown_command() -> None:
    with pytest.raises(ValueError, match="command 'serve' is not one of plan, bench, verify"):
        preset_names("serve")
