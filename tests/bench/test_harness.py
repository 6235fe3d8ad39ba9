"""Bench harness logic: every path is verified byte-exact before it is timed, a path
that fails verification is reported FAILED and never timed, and the measurement loop
turns times into GB/s and % of the same run's ceiling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_offload.bench import cases, harness, paths
from triton_offload.bench.harness import Config, Progress
from triton_offload.bench.paths import STORE, PerPageCopyPath, build_workspace

CPU = torch.device("cpu")


def _tiny_case() -> cases.Case:
    return harness.correctness_case()


def _config(**overrides: object) -> Config:
    values: dict[str, object] = {
        "presets": ["llama3.1-8b-tp4"],
        "sweep": False,
        "directions": ["store", "load"],
        "repeats": 2,
        "warmup": 0,
        "paths": ["torch", "per-page-copy", "index-copy"],
        "quick": True,
        "device": CPU,
        "target_bytes": 256 * 1024,
    }
    values.update(overrides)
    return Config(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["torch", "auto", "per-page-copy", "index-copy", "ceiling"])
def test_cpu_paths_verify_byte_exact(name: str) -> None:
    ws = build_workspace(_tiny_case(), CPU)
    runner = paths.make_path(name, ws)
    try:
        assert runner.verify() is None
    finally:
        runner.close()


@pytest.mark.parametrize("name", ["triton", "flat-triton"])
def test_interpreted_paths_verify_byte_exact(name: str) -> None:
    ws = build_workspace(_tiny_case(), CPU)
    runner = paths.make_path(name, ws)
    try:
        assert runner.verify() is None
    finally:
        runner.close()


class _SkipsLastPage(PerPageCopyPath):
    """A broken store: the last page of the last plane is not copied."""

    def submit(self, direction: str) -> None:
        if direction == STORE:
            group = self._planes[-1][2]
            keep = self.ws.gpu_blocks[group], self.ws.host_rows[group]
            self.ws.gpu_blocks[group], self.ws.host_rows[group] = keep[0][:-1], keep[1][:-1]
            try:
                super().submit(direction)
            finally:
                self.ws.gpu_blocks[group], self.ws.host_rows[group] = keep
        else:
            super().submit(direction)


class _WritesUnaddressedRow(PerPageCopyPath):
    """A broken store: also writes a pool row that no job addresses."""

    def submit(self, direction: str) -> None:
        super().submit(direction)
        if direction == STORE:
            self.pool.tensor[-1, 0] = 1


class _LoadTouchesOtherBlocks(PerPageCopyPath):
    """A broken load: also overwrites a block that the job does not address."""

    def submit(self, direction: str) -> None:
        super().submit(direction)
        if direction != STORE:
            plane = self.ws.layout.planes[0]
            spare = sorted(set(range(plane.num_blocks)) - set(self.ws.gpu_blocks[0]))[0]
            plane.view[spare] = 0


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (_SkipsLastPage, "store wrote pool row"),
        (_WritesUnaddressedRow, "store wrote pool row"),
        (_LoadTouchesOtherBlocks, "load did not restore"),
    ],
)
def test_verification_catches_wrong_bytes(broken: type, message: str) -> None:
    ws = build_workspace(_tiny_case(), CPU)
    runner = broken(ws)
    problem = runner.verify()
    assert problem is not None and message in problem


def test_failed_path_is_reported_and_never_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[str] = []

    class Broken(_WritesUnaddressedRow):
        def submit(self, direction: str) -> None:
            timed.append(direction)
            super().submit(direction)

    real = paths.make_path
    monkeypatch.setattr(
        harness,
        "make_path",
        lambda name, ws: Broken(ws) if name == "per-page-copy" else real(name, ws),
    )
    rows = harness.run_case(cases.scale_case(cases.CASES["llama3.1-8b-tp4"], 1 << 18), _config())
    broken = [r for r in rows if r.path == "per-page-copy"]
    assert [r.status for r in broken] == ["FAILED", "FAILED"]
    assert all(r.gbps is None and r.device_s is None for r in broken)
    assert "not byte-exact" in broken[0].note
    assert timed == ["store"]  # only the verification store, which failed


def test_run_case_reports_gbps_against_same_run_ceiling() -> None:
    case = cases.scale_case(cases.CASES["llama3.1-8b-tp4"], 1 << 18)
    rows = harness.run_case(case, _config())
    by = {(r.path, r.direction): r for r in rows}
    assert {p for p, _ in by} == {"ceiling", "torch", "per-page-copy", "index-copy"}
    for direction in ("store", "load"):
        ceiling = by[("ceiling", direction)]
        assert ceiling.status == "ok" and ceiling.pct_ceiling == pytest.approx(100.0)
        for name in ("torch", "per-page-copy", "index-copy"):
            row = by[(name, direction)]
            assert row.status == "ok", row.note
            assert row.job_bytes == case.job_bytes
            assert row.gbps == pytest.approx(case.job_bytes / row.device_s / 1e9)
            assert row.pct_ceiling == pytest.approx(100 * row.gbps / ceiling.gbps)
    assert by[("per-page-copy", "store")].launches == case.job_pages


def test_unavailable_paths_say_why() -> None:
    ws = build_workspace(_tiny_case(), CPU)
    for name, reason in [
        ("dma", "needs CUDA"),
        ("batched-dma", "needs CUDA"),
        ("vllm-swap-blocks", "needs CUDA"),
    ]:
        with pytest.raises(paths.PathUnavailable, match=reason):
            paths.make_path(name, ws)
    with pytest.raises(ValueError, match="unknown path 'nope'"):
        paths.make_path("nope", ws)


def test_sweep_cases_come_after_presets_and_respect_the_cap() -> None:
    config = _config(
        sweep=True,
        sweep_page_bytes=[4096, 1 << 20],
        sweep_pages=[16, 1024],
        sweep_max_bytes=16 << 20,
    )
    cases, notes = harness.cases_for(config)
    assert [c.name for c in cases] == [
        "llama3.1-8b-tp4",
        "sweep-4KiBx16",
        "sweep-4KiBx1024",
        "sweep-1MiBx16",
    ]
    assert any("1MiB x 1024 pages" in n for n in notes)
    assert any(n.startswith("llama3.1-8b-tp4: scaled") for n in notes)


def test_host_cost_compares_tables_for_the_full_size_job() -> None:
    cost = harness.host_cost(cases.CASES["llama3.1-8b-tp1"], repeats=1)
    assert (cost.blocks, cost.planes, cost.descriptors) == (128, 64, 128 * 64)
    assert cost.project_s > 0 and cost.pointer_s > 0
    assert "vLLM 0.33" in cost.pointer_impl or "vllm 0.33" in cost.pointer_impl


def test_pointer_builders_agree_with_the_layout() -> None:
    prep = harness.job_preparation(cases.scale_case(cases.CASES["swa-hybrid"], 1 << 20))
    try:
        prep.pointers()
        ws = prep.workspace
        _, offsets = prep.project()
        assert offsets.tolist()[-1] == sum(len(b) for b in ws.gpu_blocks)
        src, _, sizes = ws.descriptors(prep.engine.pool_address, STORE)
        assert src.size == ws.job_pages and int(sizes.sum()) == ws.job_bytes
    finally:
        prep.close()


def test_progress_bar_reaches_total() -> None:
    import io

    out = io.StringIO()
    bar = Progress(3, stream=out)
    for label in ("a", "b", "c"):
        bar.step(label)
    text = out.getvalue()
    assert "3/3" in text and bar.done == 3


def test_numpy_pointer_build_matches_vllm_when_importable() -> None:
    builder, impl = harness.vllm_pointer_builder()
    if builder is None:
        pytest.skip(f"vllm not importable here ({impl} is used)")
    view = torch.empty((50, 2048), dtype=torch.uint8)[:, :1000]  # strided rows
    ids = np.array([7, 0, 49, 3], dtype=np.int64)
    ours = np.empty(4, dtype=np.uint64)
    theirs = np.empty(4, dtype=np.uint64)
    harness._numpy_sub_block_ptrs(ids, 1, ours, view)
    builder(ids, 1, theirs, view)
    assert ours.tolist() == theirs.tolist()
    assert ours.tolist() == [view.data_ptr() + i * 2048 for i in ids.tolist()]


def test_host_cost_without_vllm_is_labelled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "vllm_pointer_builder", lambda: (None, "numpy re-creation"))
    cost = harness.host_cost(cases.CASES["llama3.1-8b-tp4"], repeats=1)
    assert cost.pointer_impl == "numpy re-creation" and cost.pointer_s > 0
