"""Bench harness on a GPU: every path is byte-exact and timed with CUDA events."""

from __future__ import annotations

import pytest
import torch
from triton_offload.bench import cases, harness

from triton_offload.cli.bench import PATH_NAMES

pytestmark = pytest.mark.cuda


def test_every_path_verifies_and_times_on_cuda() -> None:
    config = harness.Config(
        presets=["llama3.1-8b-tp4"],
        sweep=False,
        directions=["store", "load"],
        repeats=3,
        warmup=1,
        paths=list(PATH_NAMES),
        quick=True,
        device=torch.device("cuda"),
        target_bytes=8 * cases.MiB,
    )
    case = cases.scale_case(cases.CASES["llama3.1-8b-tp4"], 8 * cases.MiB)
    rows = harness.run_case(case, config)
    by = {(r.path, r.direction): r for r in rows}
    for name in ("triton", "dma", "auto", "per-page-copy", "flat-triton", "ceiling"):
        for direction in ("store", "load"):
            row = by[(name, direction)]
            assert row.status == "ok", (name, direction, row.note)
            assert row.gbps is not None and row.gbps > 0
            assert row.device_s is not None and row.host_s is not None
    assert by[("torch", "store")].status == "unavailable"  # the CPU path
    assert ("index-copy", "store") not in by  # CPU-only baseline
    for optional in ("batched-dma", "vllm-swap-blocks"):
        # may be missing here (cuda-python, vllm), but never wrong when present
        assert by[(optional, "store")].status in {"ok", "unavailable"}, by[(optional, "store")].note
