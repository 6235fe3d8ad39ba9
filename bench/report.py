"""Turns a :class:`~triton_offload.bench.harness.Results` into a terminal table,
``results.json``, ``report.md`` and a PNG plot (GB/s vs page size, ceiling drawn).

Every ratio in the summary compares numbers of the same run and the same case.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_offload.bench.harness import CUT_NOTE, HostCost, Measurement, Results

RESULTS_JSON = "results.json"
REPORT_MD = "report.md"
PLOT_PNG = "bandwidth.png"
SWEEP_PNG = "sweep.png"
#: What an interrupted run writes instead: new names, so a complete report written
#: earlier into the same folder stays as it was.
PARTIAL_JSON = "results.partial.json"
PARTIAL_MD = "report.partial.md"


@dataclass(frozen=True)
class Verdict:
    """Who wins one (case, direction), and by how much, from one run's numbers."""

    case: str
    direction: str
    winner: Measurement | None
    best_project: Measurement | None
    best_baseline: Measurement | None
    ceiling: Measurement | None

    @property
    def project_vs_baseline(self) -> float | None:
        if self.best_project is None or self.best_baseline is None:
            return None
        assert self.best_project.gbps is not None and self.best_baseline.gbps is not None
        return self.best_project.gbps / self.best_baseline.gbps

    def sentence(self) -> str:
        if self.winner is None:
            return f"{self.case} {self.direction}: no path was timed"
        parts = [
            f"{self.case} {self.direction}: fastest path **{self.winner.path}** "
            f"({self.winner.role}, {_gb(self.winner.gbps)})"
        ]
        if self.best_project is not None:
            text = f"best project path {self.best_project.path} {_gb(self.best_project.gbps)}"
            ratio = self.project_vs_baseline
            if ratio is not None and self.best_baseline is not None:
                text += (
                    f" = {ratio:.2f}x the best baseline {self.best_baseline.path} "
                    f"({_gb(self.best_baseline.gbps)})"
                )
            if self.best_project.pct_ceiling is not None and self.ceiling is not None:
                text += (
                    f", {self.best_project.pct_ceiling:.0f}% of the ceiling "
                    f"({_gb(self.ceiling.gbps)}{_ceiling_range(self.ceiling)})"
                )
            parts.append(text)
        elif self.best_baseline is not None:
            parts.append(f"no project path timed; best baseline {self.best_baseline.path}")
        return "; ".join(parts)


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} GB/s"


def _ceiling_range(ceiling: Measurement) -> str:
    """'; its jobs ranged 2.27-8.49' when the ceiling's jobs varied, else ''."""
    if ceiling.gbps_min is None or ceiling.gbps_max is None:
        return ""
    return f"; its {ceiling.repeats} jobs ranged {ceiling.gbps_min:.2f}-{ceiling.gbps_max:.2f}"


#: What each status of a row means (printed in report.md and in the terminal).
STATUS_MEANINGS: dict[str, str] = {
    "ok": "verified byte-exact first (one store and one load into poisoned destinations: "
    "source unchanged, addressed bytes equal, every other byte unchanged), then timed; "
    "only these rows have GB/s",
    "verified": "byte-exact under the Triton interpreter (no CUDA here): correctness only, no GB/s",
    "cut": "not started: the run's wall-clock budget (--max-seconds) ran out first",
    "skipped": "left out by design, the note says why (e.g. per-page copies of over 20,000 "
    "pages per job)",
    "unavailable": "cannot run on this machine (needs CUDA, or a baseline's optional API is "
    "missing); not a failure",
    "FAILED": "not byte-exact, or it crashed; the note says where. A FAILED path of this "
    "project makes `triton-offload bench` exit with status 1",
}


def status_of(m: Measurement) -> str:
    """The row's status as reported: ``cut`` for a path the budget left out."""
    return "cut" if m.status == "skipped" and m.note == CUT_NOTE else m.status


def verdicts(measurements: Sequence[Measurement]) -> list[Verdict]:
    """One verdict per (case, direction), in the order the cases were run."""
    keys: list[tuple[str, str]] = []
    for m in measurements:
        if (m.case, m.direction) not in keys:
            keys.append((m.case, m.direction))
    out = []
    for case, direction in keys:
        timed = [
            m
            for m in measurements
            if m.case == case and m.direction == direction and m.status == "ok"
        ]

        def best(role: str, rows: list[Measurement] = timed) -> Measurement | None:
            candidates = [m for m in rows if m.role == role]
            return max(candidates, key=lambda m: m.gbps or 0.0) if candidates else None

        contenders = [m for m in timed if m.role != "ceiling"]
        out.append(
            Verdict(
                case=case,
                direction=direction,
                winner=max(contenders, key=lambda m: m.gbps or 0.0) if contenders else None,
                best_project=best("project"),
                best_baseline=best("baseline"),
                ceiling=best("ceiling"),
            )
        )
    return out


# ------------------------------------------------------------------------------ tables


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _spread(m: Measurement) -> str:
    if m.gbps_min is None or m.gbps_max is None:
        return "-"
    return f"{m.gbps_min:.2f}-{m.gbps_max:.2f}"


def _row_cells(m: Measurement) -> list[str]:
    return [
        m.case,
        m.direction,
        m.path,
        m.role,
        status_of(m),
        _fmt(m.gbps, ".2f"),
        _spread(m),
        str(m.repeats) if m.gbps is not None else "-",
        _fmt(m.pct_ceiling, ".0f"),
        _fmt(None if m.device_s is None else m.device_s * 1e3, ".3f"),
        _fmt(None if m.host_s is None else m.host_s * 1e6, ".0f"),
        "-" if m.launches is None else str(m.launches),
        m.note,
    ]


MEASUREMENT_HEADER = [
    "case",
    "dir",
    "path",
    "role",
    "status",
    "GB/s",
    "min-max",
    "jobs",
    "% ceil",
    "ms/job",
    "host us/job",
    "launches/job",
    "note",
]

HOST_HEADER = ["case", "blocks", "planes", "descriptors", "project us", "pointers us", "ratio"]


def _host_cells(h: HostCost) -> list[str]:
    return [
        h.case,
        str(h.blocks),
        str(h.planes),
        str(h.descriptors),
        f"{h.project_s * 1e6:.0f}",
        f"{h.pointer_s * 1e6:.0f}",
        f"{h.ratio:.1f}x",
    ]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def escape(cell: str) -> str:
        return cell.replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _environment_line(env: dict[str, Any]) -> str:
    device = env.get("gpu") or f"CPU only ({env.get('cpu')}, {env.get('cpu_count')} cores)"
    parts = [
        f"device: {device}",
        f"driver: {env.get('driver') or 'n/a'}",
        f"torch {env.get('torch')}",
        f"triton {env.get('triton')}",
        f"CUDA runtime {env.get('cuda_runtime') or 'n/a'}",
        f"vllm {env.get('vllm') or 'not importable'}",
    ]
    if env.get("dma_path"):
        parts.append(f"dma path: {env['dma_path']}")
    return ", ".join(parts)


def terminal_report(results: Results) -> str:
    sections = [f"triton-offload bench -- {_environment_line(results.environment)}"]
    if not results.environment.get("cuda_available"):
        sections.append(
            "No CUDA: GB/s are CPU memory copies (caches and pool in host memory); the "
            "Triton kernels ran only as an interpreted correctness pass."
        )
    sections.append(text_table(MEASUREMENT_HEADER, [_row_cells(m) for m in results.measurements]))
    sections.append(
        "GB/s: median of `jobs` timed jobs; min-max: the slowest and fastest job.\n"
        + "\n".join(f"  {k}: {v}" for k, v in STATUS_MEANINGS.items())
    )
    sections.append("Summary (same-run numbers):")
    sections.extend("  " + v.sentence().replace("**", "") for v in verdicts(results.measurements))
    if results.host_costs:
        impl = results.host_costs[0].pointer_impl
        sections.append(
            "Host cost of preparing one job (full-size model, median): project "
            f"build_job_table vs per-(block x layer) pointers [{impl}]:"
        )
        sections.append(text_table(HOST_HEADER, [_host_cells(h) for h in results.host_costs]))
    if results.correctness:
        sections.append("Interpreted correctness pass (no GB/s):")
        sections.append(
            text_table(
                ["case", "path", "status", "note"],
                [[m.case, m.path, m.status, m.note] for m in results.correctness],
            )
        )
    if results.notes:
        sections.append("Notes:\n" + "\n".join(f"  - {n}" for n in results.notes))
    sections.append(f"wall time {results.wall_s:.1f} s")
    return "\n\n".join(sections)


def markdown_report(results: Results, plots: Sequence[str] = ()) -> str:
    env = results.environment
    cfg = results.config
    out = [
        "# triton-offload bench report" + (" (partial)" if results.partial else ""),
        "",
        *(
            [
                f"**Partial run: {results.partial['message']}.** Only what finished before "
                "the cut is below.",
                "",
            ]
            if results.partial
            else []
        ),
        _environment_line(env) + ".",
        "",
        "GB/s = bytes of the job / time per job / 1e9. Each figure is the median of its "
        "timed jobs; `min-max` gives the GB/s of the slowest and the fastest of them and "
        f"`jobs` how many were timed (after {cfg['warmup']} untimed warm-up job(s); "
        f"--repeats {cfg['repeats']} per path). "
        + (
            "Times are CUDA events around each job on its stream."
            if env.get("cuda_available")
            else "No CUDA: every path is a CPU memory copy timed by wall clock; the Triton "
            "kernels ran only as an interpreted correctness pass (no GB/s claimed)."
        ),
        "",
        "The ceiling is one contiguous copy of the same number of bytes, timed in the same "
        f"run: {3 * cfg['repeats']} jobs before the other paths of a case and "
        f"{3 * cfg['repeats']} after; its figure is the faster pass's median, its `min-max` "
        "covers both passes. A `% ceil` compares a median with that median: read it against "
        "the ceiling's own range (section *Ceiling spread*).",
        "",
        "Statuses: " + "; ".join(f"`{k}`: {v}" for k, v in STATUS_MEANINGS.items()) + ".",
        "",
        "## Who wins",
        "",
    ]
    out += [f"- {v.sentence()}" for v in verdicts(results.measurements)]
    captions = {
        PLOT_PNG: "GB/s of every path on each model preset",
        SWEEP_PNG: "GB/s vs page size and pages per job (raw sweep)",
    }
    for name in plots:
        out += ["", f"![{captions.get(name, name)}]({name})"]
    ceilings = [m for m in results.measurements if m.role == "ceiling" and m.gbps is not None]
    if ceilings:
        out += [
            "",
            "## Ceiling spread",
            "",
            "One contiguous copy of each case's bytes; `max/min` is how far its fastest job "
            "was from its slowest (1.00: steady).",
            "",
            markdown_table(
                ["case", "dir", "median GB/s", "min GB/s", "max GB/s", "max/min", "jobs"],
                [
                    [
                        m.case,
                        m.direction,
                        f"{m.gbps:.2f}",
                        _fmt(m.gbps_min, ".2f"),
                        _fmt(m.gbps_max, ".2f"),
                        "-"
                        if not m.gbps_min or m.gbps_max is None
                        else f"{m.gbps_max / m.gbps_min:.2f}",
                        str(m.repeats),
                    ]
                    for m in ceilings
                ],
            ),
        ]
    if results.cases:
        out += ["", "## Cases", ""]
        out += [
            f"- **{c['name']}**: {c['description']}. One job: "
            f"{c['job_bytes'] / 2**20:.1f} MiB in {c['job_pages']} pages ("
            + "; ".join(
                f"{g['name']}: {g['layers']} layers x {g['blocks_per_job']} blocks x "
                + " + ".join(f"{b:,} B" for b in g["plane_bytes"])
                for g in c["groups"]
            )
            + ")."
            for c in results.cases
        ]
    out += [
        "",
        "## All measurements",
        "",
        markdown_table(MEASUREMENT_HEADER, [_row_cells(m) for m in results.measurements]),
    ]
    if results.host_costs:
        impl = results.host_costs[0].pointer_impl
        out += [
            "",
            "## Host cost of preparing one job",
            "",
            "Full-size model, median of repeats. Project: `TransferEngine.build_job_table` "
            "(one pair per block, fully validated). Pointers: one source and destination "
            f"address and size per (block x layer plane), via {impl}.",
            "",
            markdown_table(HOST_HEADER, [_host_cells(h) for h in results.host_costs]),
        ]
    if results.correctness:
        out += [
            "",
            "## Interpreted correctness pass",
            "",
            markdown_table(
                ["case", "path", "status", "note"],
                [[m.case, m.path, m.status, m.note] for m in results.correctness],
            ),
        ]
    if results.notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in results.notes]
    out += ["", f"Wall time of the run: {results.wall_s:.1f} s.", ""]
    return "\n".join(out)


# -------------------------------------------------------------------------------- plot

#: Colours of this project's paths (saturated, filled markers, solid lines) and of the
#: baselines (muted, hollow markers, dashed lines); the ceiling is black.
PROJECT_COLORS = {"triton": "#1f4fd1", "dma": "#d62728", "auto": "#2ca02c", "torch": "#7b2fbe"}
BASELINE_COLORS = {
    "per-page-copy": "#8c564b",
    "index-copy": "#7f7f7f",
    "flat-triton": "#b8a000",
    "batched-dma": "#17becf",
    "vllm-swap-blocks": "#e377c2",
}
#: Marker shape of each preset in the preset plot, in the order the presets ran.
PRESET_MARKERS = ("o", "s", "D", "^", "v", "P", "X", "h", "*", "<", ">")
#: Paths of one preset are drawn this many octaves apart around its page size, so that
#: equal figures do not hide each other (the horizontal bar shows the true page range).
DODGE_OCTAVES = 0.07


def _style(name: str, role: str) -> dict[str, Any]:
    if role == "ceiling":
        return {"color": "black", "marker": "_", "filled": True, "linestyle": ":"}
    if role == "project":
        color = PROJECT_COLORS.get(name, "#1f4fd1")
        return {"color": color, "marker": "o", "filled": True, "linestyle": "-"}
    color = BASELINE_COLORS.get(name, "#555555")
    return {"color": color, "marker": "s", "filled": False, "linestyle": "--"}


def _legend_label(name: str, role: str) -> str:
    if role == "ceiling":
        return "ceiling: one contiguous copy of the job's bytes"
    return name


def _legend_handles(
    rows: Sequence[Measurement], shapes: dict[str, str] | None = None
) -> tuple[list[Any], list[str]]:
    """Legend entries grouped under 'this project' and 'baselines' headers (and, with
    ``shapes``, one entry per preset showing its marker)."""
    from matplotlib.lines import Line2D

    roles = {m.path: m.role for m in rows}
    handles: list[Any] = []
    labels: list[str] = []
    # With preset shapes the marker says the preset, so a path's entry is its colour
    # alone (solid: this project, dashed: a baseline); in the sweep plot it is the line.
    filled, hollow = (
        ("filled markers", "hollow markers") if shapes else ("filled, solid", "hollow, dashed")
    )
    for role, header in (
        ("project", f"this project ({filled}):"),
        ("baseline", f"baselines, copy paths in use today ({hollow}):"),
        ("ceiling", "reference:"),
    ):
        names = [n for n in dict.fromkeys(m.path for m in rows) if roles[n] == role]
        if not names:
            continue
        handles.append(Line2D([], [], linestyle="none", marker=None))
        labels.append(header)
        for name in names:
            style = _style(name, role)
            if shapes:
                handles.append(
                    Line2D(
                        [], [], color=style["color"], linestyle=style["linestyle"], linewidth=2.5
                    )
                )
                labels.append(_legend_label(name, role))
                continue
            handles.append(
                Line2D(
                    [],
                    [],
                    color=style["color"],
                    linestyle=style["linestyle"],
                    marker=style["marker"],
                    markersize=9 if role == "ceiling" else 6,
                    markerfacecolor=style["color"] if style["filled"] else "white",
                    markeredgewidth=2 if role == "ceiling" else 1.2,
                )
            )
            labels.append(_legend_label(name, role))
    if shapes:
        handles.append(Line2D([], [], linestyle="none", marker=None))
        labels.append("presets (marker shape):")
        for case, marker in shapes.items():
            handles.append(
                Line2D([], [], linestyle="none", marker=marker, color="#444444", markersize=6)
            )
            labels.append(case)
    return handles, labels


def _page_label(size: float) -> str:
    """``16384 -> '16 KiB'``, ``1.5 MiB`` for sizes that are not whole units."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            value = size / scale
            whole = abs(value - round(value)) < 0.05
            return f"{value:.0f} {unit}" if whole else f"{value:.1f} {unit}"
    return f"{size:.0f} B"


def _set_page_ticks(
    axis: Any, low: float, high: float, ticks: Sequence[float] | None = None
) -> None:
    """Log-2 page axis from ``low`` to ``high``; ticks at ``ticks``, or at powers of 4
    (2 when the span is short): evenly spaced, whatever the data's page sizes are.
    Labels that would touch are hidden later by :func:`_thin_tick_labels`."""
    import math

    axis.set_xscale("log", base=2)
    axis.set_xlim(low, high)
    if ticks is None:
        first, last = math.ceil(math.log2(low)), math.floor(math.log2(high))
        step = 2 if last - first >= 6 else 1
        ticks = [2.0**e for e in range(first, last + 1) if e % step == 0]
    axis.set_xticks(ticks)
    axis.set_xticklabels([_page_label(t) for t in ticks], fontsize=8)
    axis.xaxis.set_minor_locator(_null_locator())


def _null_locator() -> Any:
    from matplotlib.ticker import NullLocator

    return NullLocator()


def _thin_tick_labels(axis: Any, renderer: Any) -> None:
    """Hide x tick labels that would overlap the previous visible one."""
    last = None
    for label in sorted(axis.get_xticklabels(), key=lambda t: t.get_position()[0]):
        if not label.get_visible() or not label.get_text():
            continue
        box = label.get_window_extent(renderer)
        if last is not None and box.x0 < last.x1 + 4:
            label.set_visible(False)
            continue
        last = box


def _mean_pages(results: Results) -> dict[str, tuple[float, int, int]]:
    """Per case: byte-weighted mean page size, smallest and largest page (bytes).

    A job of several page sizes (Mamba hybrid: 256 KiB K/V, 48 KiB conv state, 2 MiB
    SSM state) moves most of its bytes in the large pages; the byte-weighted mean
    ``sum(bytes_p * p) / sum(bytes_p)`` places it where its bytes are.
    """
    out: dict[str, tuple[float, int, int]] = {}
    for case in results.cases:
        weight: dict[int, int] = {}
        for group in case["groups"]:
            count = group["layers"] * group["blocks_per_job"]
            for page in group["plane_bytes"]:
                weight[page] = weight.get(page, 0) + page * count
        total = sum(weight.values())
        if total:
            mean = sum(page * w for page, w in weight.items()) / total
            out[case["name"]] = (mean, min(weight), max(weight))
    return out


def _preset_rows(results: Results, direction: str) -> list[Measurement]:
    return [
        m
        for m in results.measurements
        if not m.sweep and m.direction == direction and m.status == "ok" and m.gbps is not None
    ]


def preset_figure(results: Results) -> Any:
    """GB/s of every path on every model preset, one panel per direction.

    x: the job's byte-weighted mean page size (log scale), a horizontal bar from its
    smallest to its largest page when the job mixes sizes; each preset is named once
    at the top of the panel, over a dotted guide line. Paths of one preset sit side by
    side around its page size (``DODGE_OCTAVES``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory

    directions = list(results.config["directions"])
    fig, axes = plt.subplots(
        1, len(directions), figsize=(6.2 * len(directions) + 3.4, 5.6), squeeze=False
    )
    device = results.environment.get("gpu") or "CPU only (host memory copies)"
    fig.suptitle(f"triton-offload bench: model presets, {device}", fontsize=11)
    pages = _mean_pages(results)
    all_rows = [m for d in directions for m in _preset_rows(results, d)]
    order = list(dict.fromkeys(m.path for m in all_rows))
    cases = list(dict.fromkeys(m.case for m in all_rows))

    def place(m: Measurement) -> tuple[float, int, int]:
        return pages.get(m.case, (float(m.page_bytes), m.page_bytes, m.page_bytes))

    # The preset is also the marker's shape: points of presets with close page sizes
    # (16 and 18 KiB) stand side by side, and the shape tells them apart.
    shapes = {case: PRESET_MARKERS[i % len(PRESET_MARKERS)] for i, case in enumerate(cases)}
    lows = [place(m)[1] for m in all_rows] or [4096]
    highs = [place(m)[2] for m in all_rows] or [1 << 20]
    top = max((m.gbps_max or m.gbps or 0.0 for m in all_rows), default=1.0)
    for axis, direction in zip(axes[0], directions, strict=True):
        rows = _preset_rows(results, direction)
        band = blended_transform_factory(axis.transData, axis.transAxes)
        for case in cases:
            mean, low, high = pages.get(case, (0.0, 0, 0))
            if mean:
                axis.axvline(mean, color="#bbbbbb", linestyle=":", linewidth=0.8, zorder=0)
            if high > low:  # a job of several page sizes: its range, once, along the bottom
                axis.hlines(0.025, low, high, transform=band, color="#666666", linewidth=2.5)
                axis.plot(
                    [low, high], [0.025, 0.025], "|", transform=band, color="#666666",
                    markersize=8,
                )  # fmt: skip
        for index, name in enumerate(order):
            mine = [m for m in rows if m.path == name]
            if not mine:
                continue
            style = _style(name, mine[0].role)
            shift = 2.0 ** ((index - (len(order) - 1) / 2) * DODGE_OCTAVES)
            for m in mine:
                mean, low, high = place(m)
                x = mean * shift
                err_low = (m.gbps - m.gbps_min) if m.gbps_min is not None else 0.0
                err_high = (m.gbps_max - m.gbps) if m.gbps_max is not None else 0.0
                drawn = axis.errorbar(
                    [x],
                    [m.gbps],
                    yerr=[[max(err_low, 0.0)], [max(err_high, 0.0)]],
                    fmt=shapes[m.case],
                    color=style["color"],
                    markersize=7 if m.role == "ceiling" else 6,
                    markerfacecolor=style["color"] if style["filled"] else "white",
                    markeredgewidth=1.5 if style["filled"] else 1.3,
                    elinewidth=0.8,
                    capsize=0,
                    zorder=3 if m.role == "project" else 2,
                )
                drawn.lines[0].set_gid(f"{m.case}|{m.path}")
        _set_page_ticks(axis, min(lows) / 2, max(highs) * 2)
        axis.set_title(
            f"{direction} ({'device -> pool' if direction == 'store' else 'pool -> device'})",
            fontsize=10,
        )
        axis.set_xlabel(
            "page size (log scale): the job's byte-weighted mean; grey bar: its page range"
        )
        axis.set_ylabel("GB/s (1e9 bytes/s): median, whisker: slowest to fastest job")
        axis.grid(True, which="major", alpha=0.3)
    handles, labels = _legend_handles(all_rows, shapes)
    if handles:
        fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    legend_share = 3.4 / (6.2 * len(directions) + 3.4)
    fig.tight_layout(rect=(0, 0, 1 - legend_share, 0.95))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    levels = 1
    for axis in axes[0]:
        _thin_tick_labels(axis, renderer)
        rows = _label_presets(axis, cases, pages, renderer, blended_transform_factory)
        levels = max(levels, rows)
    # Room above the highest whisker for the rows of preset names.
    for axis in axes[0]:
        axis.set_ylim(0, top * 1.05 / max(0.3, 1 - 0.065 * levels - 0.03))
    return fig


def _label_presets(
    axis: Any,
    cases: Sequence[str],
    pages: dict[str, tuple[float, int, int]],
    renderer: Any,
    blended: Any,
) -> int:
    """Name each preset once at the top of ``axis``, on the first row where its label
    overlaps no other (and stays inside the panel); returns the rows used."""
    transform = blended(axis.transData, axis.transAxes)
    frame = axis.get_window_extent(renderer)
    placed: list[list[Any]] = []
    for case in sorted((c for c in cases if c in pages), key=lambda c: pages[c][0]):
        x = pages[case][0]
        for row in range(len(cases) + 1):
            y = 0.98 - 0.065 * row
            text = axis.text(x, y, case, transform=transform, ha="center", va="top", fontsize=8)
            box = text.get_window_extent(renderer)
            if box.x0 < frame.x0 + 2:
                text.set_ha("left")
            elif box.x1 > frame.x1 - 2:
                text.set_ha("right")
            box = text.get_window_extent(renderer)
            if row == len(placed):
                placed.append([])
            if all(not box.overlaps(other) for other in placed[row]):
                placed[row].append(box)
                break
            text.remove()
    return len(placed)


def sweep_figure(results: Results) -> Any | None:
    """The raw sweep: GB/s vs page size, one panel per (direction, pages per job), one
    line per path. None when the run had no sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [m for m in results.measurements if m.sweep and m.status == "ok" and m.gbps is not None]
    if not rows:
        return None
    directions = [d for d in results.config["directions"] if any(m.direction == d for m in rows)]
    counts = sorted({m.job_pages for m in rows})
    width = 3.3 * len(counts) + 3.4
    fig, axes = plt.subplots(
        len(directions), len(counts), figsize=(width, 3.3 * len(directions) + 0.8),
        squeeze=False, sharey=True,
    )  # fmt: skip
    device = results.environment.get("gpu") or "CPU only (host memory copies)"
    fig.suptitle(f"triton-offload bench: raw sweep (one plane), {device}", fontsize=11)
    order = list(dict.fromkeys(m.path for m in rows))
    sizes = sorted({m.page_bytes for m in rows})
    top = max(m.gbps_max or m.gbps or 0.0 for m in rows)
    for r, direction in enumerate(directions):
        for c, count in enumerate(counts):
            axis = axes[r][c]
            for name in order:
                mine = sorted(
                    (m for m in rows if m.path == name and m.direction == direction
                     and m.job_pages == count),
                    key=lambda m: m.page_bytes,
                )  # fmt: skip
                if not mine:
                    continue
                style = _style(name, mine[0].role)
                axis.errorbar(
                    [m.page_bytes for m in mine],
                    [m.gbps for m in mine],
                    yerr=[
                        [max(0.0, (m.gbps or 0.0) - (m.gbps_min or m.gbps or 0.0)) for m in mine],
                        [max(0.0, (m.gbps_max or m.gbps or 0.0) - (m.gbps or 0.0)) for m in mine],
                    ],
                    color=style["color"],
                    linestyle=style["linestyle"],
                    marker=style["marker"],
                    markersize=10 if mine[0].role == "ceiling" else 5,
                    markerfacecolor=style["color"] if style["filled"] else "white",
                    linewidth=1.8 if mine[0].role == "project" else 1.2,
                    elinewidth=0.7,
                    capsize=0,
                )
            _set_page_ticks(axis, sizes[0] / 1.6, sizes[-1] * 1.6, ticks=sizes)
            axis.set_title(f"{direction}, {count:,} pages per job", fontsize=9)
            axis.set_ylim(0, top * 1.1)
            axis.grid(True, which="major", alpha=0.3)
            if r == len(directions) - 1:
                axis.set_xlabel("page size (log scale)", fontsize=8)
            if c == 0:
                axis.set_ylabel("GB/s: median, whisker: range", fontsize=8)
    handles, labels = _legend_handles(rows)
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 3.4 / width, 0.94))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for axis in axes.flat:
        _thin_tick_labels(axis, renderer)
    return fig


def plot(results: Results, path: Path, sweep_path: Path | None = None) -> list[Path]:
    """Write the preset plot to ``path`` and, when the run had a sweep, the sweep plot
    to ``sweep_path``; returns the files written."""
    import matplotlib.pyplot as plt

    written = []
    for figure, target in ((preset_figure(results), path), (sweep_figure(results), sweep_path)):
        if figure is None or target is None:
            if figure is not None:
                plt.close(figure)
            continue
        figure.savefig(target, dpi=120, format="png")
        plt.close(figure)
        written.append(target)
    return written


# ------------------------------------------------------------------------------- write


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT/SIGTERM wait while inside (delivered on exit): a set of files is renamed
    into place all or none, never half the set when an interrupt lands between two."""
    held = {signal.SIGINT, signal.SIGTERM}
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    except (AttributeError, OSError, ValueError):  # no pthread_sigmask here
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _staged(out_dir: Path, name: str) -> Path:
    return out_dir / f".{name}.{os.getpid()}.tmp"


def _commit(out_dir: Path, names: Sequence[str], remove: Sequence[str] = ()) -> None:
    """Rename the staged files of ``names`` over their final names and delete ``remove``,
    with interrupts held: an earlier report is replaced whole or not at all."""
    with _signals_held():
        for name in names:
            os.replace(_staged(out_dir, name), out_dir / name)
        for name in remove:
            (out_dir / name).unlink(missing_ok=True)


def _discard_staged(out_dir: Path, names: Sequence[str]) -> None:
    for name in names:
        _staged(out_dir, name).unlink(missing_ok=True)


def _payload(results: Results) -> dict[str, Any]:
    payload = results.to_json()
    payload["summary"] = [
        {
            "case": v.case,
            "direction": v.direction,
            "winner": v.winner.path if v.winner else None,
            "best_project": v.best_project.path if v.best_project else None,
            "best_baseline": v.best_baseline.path if v.best_baseline else None,
            "project_vs_best_baseline": v.project_vs_baseline,
            "project_pct_of_ceiling": v.best_project.pct_ceiling if v.best_project else None,
            "ceiling_gbps": v.ceiling.gbps if v.ceiling else None,
            "ceiling_gbps_min": v.ceiling.gbps_min if v.ceiling else None,
            "ceiling_gbps_max": v.ceiling.gbps_max if v.ceiling else None,
            "text": v.sentence().replace("**", ""),
        }
        for v in verdicts(results.measurements)
    ]
    return payload


def write_all(results: Results, out_dir: Path) -> dict[str, Path]:
    """Write the plots, results.json and report.md into ``out_dir``; returns their paths
    (keys ``plot``, ``sweep_plot`` when the run had a sweep, ``json``, ``markdown``).

    Every file is written under a temporary name first and renamed into place at the
    end, together: an interrupt while plotting leaves an earlier report untouched. A
    partial report of an earlier, interrupted run in the folder is removed then (this
    complete one supersedes it).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    staged: list[str] = []
    try:
        try:
            written = plot(results, _staged(out_dir, PLOT_PNG), _staged(out_dir, SWEEP_PNG))
            staged += [PLOT_PNG if p == _staged(out_dir, PLOT_PNG) else SWEEP_PNG for p in written]
        except ImportError:  # matplotlib comes with the [bench] extra; the numbers do not need it
            results.notes.append(
                "plot skipped: matplotlib is not installed (pip install '.[bench]')"
            )
        _staged(out_dir, RESULTS_JSON).write_text(json.dumps(_payload(results), indent=2) + "\n")
        staged.append(RESULTS_JSON)
        plots = [name for name in (PLOT_PNG, SWEEP_PNG) if name in staged]
        _staged(out_dir, REPORT_MD).write_text(markdown_report(results, plots))
        staged.append(REPORT_MD)
        _commit(out_dir, staged, remove=(PARTIAL_JSON, PARTIAL_MD))
    finally:
        _discard_staged(out_dir, (PLOT_PNG, SWEEP_PNG, RESULTS_JSON, REPORT_MD))
    keys = {PLOT_PNG: "plot", SWEEP_PNG: "sweep_plot", RESULTS_JSON: "json", REPORT_MD: "markdown"}
    return {keys[name]: out_dir / name for name in staged}


def write_partial(results: Results, out_dir: Path) -> list[Path]:
    """Write an interrupted run's ``results.partial.json`` and ``report.partial.md``
    (no plots: drawing them takes seconds, and the run was asked to stop).

    ``results.partial`` says where the run was cut. The complete report's names are
    never touched."""
    assert results.partial is not None, "write_partial is for an interrupted run"
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        _staged(out_dir, PARTIAL_JSON).write_text(json.dumps(_payload(results), indent=2) + "\n")
        _staged(out_dir, PARTIAL_MD).write_text(markdown_report(results))
        _commit(out_dir, (PARTIAL_JSON, PARTIAL_MD))
    finally:
        _discard_staged(out_dir, (PARTIAL_JSON, PARTIAL_MD))
    return [out_dir / PARTIAL_JSON, out_dir / PARTIAL_MD]


__all__ = [
    "PARTIAL_JSON",
    "PARTIAL_MD",
    "PLOT_PNG",
    "REPORT_MD",
    "RESULTS_JSON",
    "STATUS_MEANINGS",
    "SWEEP_PNG",
    "Verdict",
    "markdown_report",
    "plot",
    "preset_figure",
    "status_of",
    "sweep_figure",
    "terminal_report",
    "verdicts",
    "write_all",
    "write_partial",
]
