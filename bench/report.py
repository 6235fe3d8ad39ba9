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

from triton_offload.bench.harness import (
    CUT_NOTE,
    NOISY_ABOVE_CEILING_PCT,
    HostCost,
    Measurement,
    Results,
    noise_of,
)

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
    """Who wins one (case, direction), and by how much, from one run's numbers.

    No winner and no ratio when a row the verdict would name is noise (``noisy``, see
    :func:`~triton_offload.bench.harness.noise_of`): its median says nothing of how
    the paths rank, and a rerun ranks them otherwise."""

    case: str
    direction: str
    winner: Measurement | None
    best_project: Measurement | None
    best_baseline: Measurement | None
    ceiling: Measurement | None
    noisy: tuple[Measurement, ...] = ()

    @property
    def project_vs_baseline(self) -> float | None:
        if self.best_project is None or self.best_baseline is None:
            return None
        assert self.best_project.gbps is not None and self.best_baseline.gbps is not None
        return self.best_project.gbps / self.best_baseline.gbps

    def sentence(self) -> str:
        if self.noisy:
            why = "; ".join(f"{m.path}: {noise_of(m)}" for m in self.noisy)
            return f"{self.case} {self.direction}: no verdict: noisy ({why})"
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
            ceiling_noise = None if self.ceiling is None else noise_of(self.ceiling)
            if ceiling_noise is not None:
                text += f", no share of the ceiling: the ceiling is noisy ({ceiling_noise})"
            elif self.best_project.pct_ceiling is not None and self.ceiling is not None:
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
        winner = max(contenders, key=lambda m: m.gbps or 0.0) if contenders else None
        named = [winner, best("project"), best("baseline")]
        # by identity: the winner is often also the best of its role
        unique = {id(m): m for m in named if m is not None and noise_of(m)}
        noisy = tuple(unique.values())
        out.append(
            Verdict(
                case=case,
                direction=direction,
                winner=None if noisy else winner,
                best_project=None if noisy else named[1],
                best_baseline=None if noisy else named[2],
                ceiling=best("ceiling"),
                noisy=noisy,
            )
        )
    return out


def noise_sentence(measurements: Sequence[Measurement]) -> str | None:
    """What the ``noisy`` column means and what to do about it; None if no row is noisy."""
    timed = [m for m in measurements if m.status == "ok" and m.gbps is not None]
    noisy = [m for m in timed if noise_of(m)]
    if not noisy:
        return None
    return (
        f"{len(noisy)} of {len(timed)} timed rows are noisy (column `noisy`): the middle "
        "half of their jobs spread over more than a quarter of their median, or they ran "
        "faster than the ceiling (one contiguous copy of the same bytes, which no path can "
        "beat), so the machine's speed changed while they ran. No verdict is drawn from "
        "them. For figures that hold, rerun on a quieter machine (no other jobs on its "
        "cores or its GPU), or with more --repeats."
    )


# ------------------------------------------------------------------------------ tables


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _spread(m: Measurement) -> str:
    if m.gbps_min is None or m.gbps_max is None:
        return "-"
    return f"{m.gbps_min:.2f}-{m.gbps_max:.2f}"


def _noisy_cell(m: Measurement) -> str:
    """Why the row is noise, in a word or two ('339% ceil', 'IQR 60%'), else '-'."""
    if noise_of(m) is None:
        return "-"
    above = m.role != "ceiling" and (m.pct_ceiling or 0.0) > NOISY_ABOVE_CEILING_PCT
    return f"{m.pct_ceiling:.0f}% ceil" if above else f"IQR {m.spread:.0%}"


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
        _noisy_cell(m),
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
    "noisy",
    "note",
]

HOST_HEADER = [
    "case",
    "blocks",
    "planes",
    "descriptors",
    "project us",
    "pointers us",
    "ratio",
    "0.34 resolve us",
    "0.34 pointer path us",
]


def _micros(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.0f}"


def _host_cells(h: HostCost) -> list[str]:
    return [
        h.case,
        str(h.blocks),
        str(h.planes),
        str(h.descriptors),
        f"{h.project_s * 1e6:.0f}",
        f"{h.pointer_s * 1e6:.0f}",
        f"{h.ratio:.1f}x",
        _micros(h.resolve_s),
        _micros(h.pointer_path_s),
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


def wall_line(results: Results) -> str:
    """``wall time 102.3 s (from the process's start; measuring 77.3 s of it)``."""
    return (
        f"wall time {results.wall_s:.1f} s (from {results.wall_from}; measuring "
        f"{results.measuring_s:.1f} s of it)"
    )


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
    noise = noise_sentence(results.measurements)
    if noise is not None:
        sections.append(noise.replace("`", ""))
    if results.host_costs:
        impl = results.host_costs[0].pointer_impl
        sections.append(
            "Host cost of preparing one job (full-size model, median): project "
            f"build_job_table (block ids: vLLM 0.33, and TritonOffloadingConnector on 0.34) "
            f"vs per-(block x layer) pointers [{impl}]; vLLM 0.34's connector worker "
            f"resolves every job to pointers first [{results.host_costs[0].resolve_impl}], "
            "and behind vLLM's OffloadingConnector this project's worker derives the block "
            "ids from them (0.34 pointer path = resolve + derive and check + job table):"
        )
        sections.append(text_table(HOST_HEADER, [_host_cells(h) for h in results.host_costs]))
    if results.correctness:
        sections.append("Interpreted correctness pass (no GB/s):")
        sections.append(
            text_table(
                ["case", "path", "status", "note"],
                [[m.case, m.path, status_of(m), m.note] for m in results.correctness],
            )
        )
    if results.notes:
        sections.append("Notes:\n" + "\n".join(f"  - {n}" for n in results.notes))
    sections.append(wall_line(results))
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
    noise = noise_sentence(results.measurements)
    if noise is not None:
        out += ["", f"**Noise.** {noise}"]
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
                [[m.case, m.path, status_of(m), m.note] for m in results.correctness],
            ),
        ]
    if results.notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in results.notes]
    out += [
        "",
        f"Wall time of the command: {results.wall_s:.1f} s from {results.wall_from}, up to "
        f"the writing of this report (measuring: {results.measuring_s:.1f} s of it).",
        "",
    ]
    return "\n".join(out)


# -------------------------------------------------------------------------------- plot

#: Colours of this project's paths (saturated, filled circles, solid lines) and of the
#: baselines (muted, hollow squares, dashed lines). The ceiling is no point at all: a
#: black dashed line over a grey band (its slowest to fastest job), so no marker, filled
#: or not, can be mistaken for it.
PROJECT_COLORS = {"triton": "#1f4fd1", "dma": "#d62728", "auto": "#2ca02c", "torch": "#7b2fbe"}
BASELINE_COLORS = {
    "per-page-copy": "#8c564b",
    "index-copy": "#7f7f7f",
    "flat-triton": "#b8a000",
    "batched-dma": "#17becf",
    "vllm-swap-blocks": "#e377c2",
}
CEILING_LINE = {"color": "black", "linestyle": "--", "linewidth": 1.0}
CEILING_BAND = {"color": "black", "alpha": 0.08, "linewidth": 0}
#: The y range is the paths' own, up to their fastest job times this: the space above
#: holds the ceiling's note, clear of every whisker. A ceiling above the range is not
#: drawn to scale (on a CPU one memcpy ran 3-5x faster than any path, and scaling to it
#: squashed the paths into the bottom eighth); its note says so and gives its value.
HEADROOM = 1.3
#: Marker size (points) of a path's figure; slots are laid out so that two never touch.
MARKER_POINTS = 6.0


def _style(name: str, role: str) -> dict[str, Any]:
    if role == "ceiling":
        return {"color": "black", "marker": "", "filled": False, "linestyle": "--"}
    if role == "project":
        color = PROJECT_COLORS.get(name, "#1f4fd1")
        return {"color": color, "marker": "o", "filled": True, "linestyle": "-"}
    color = BASELINE_COLORS.get(name, "#555555")
    return {"color": color, "marker": "s", "filled": False, "linestyle": "--"}


def _legend_label(name: str, role: str) -> str:
    if role == "ceiling":
        return (
            "ceiling: one contiguous copy of the job's bytes\n(dashed: median, band: slowest "
            "to fastest job;\n\u2191 in a panel: above that panel's scale)"
        )
    return name


def _legend_handles(rows: Sequence[Measurement]) -> tuple[list[Any], list[str]]:
    """Legend entries grouped under 'this project', 'baselines' and 'reference'."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    roles = {m.path: m.role for m in rows}
    handles: list[Any] = []
    labels: list[str] = []
    for role, header in (
        ("project", "this project (filled markers, solid lines):"),
        ("baseline", "baselines, copy paths in use today (hollow, dashed):"),
        ("ceiling", "reference (no marker):"),
    ):
        names = [n for n in dict.fromkeys(m.path for m in rows) if roles[n] == role]
        if not names:
            continue
        handles.append(Line2D([], [], linestyle="none", marker=None))
        labels.append(header)
        for name in names:
            style = _style(name, role)
            if role == "ceiling":
                handles.append((Patch(**CEILING_BAND), Line2D([], [], **CEILING_LINE)))
            else:
                handles.append(
                    Line2D(
                        [],
                        [],
                        color=style["color"],
                        linestyle=style["linestyle"],
                        marker=style["marker"],
                        markersize=MARKER_POINTS,
                        markerfacecolor=style["color"] if style["filled"] else "white",
                        markeredgewidth=1.2,
                    )
                )
            labels.append(_legend_label(name, role))
    return handles, labels


def _page_label(size: float) -> str:
    """``16384 -> '16 KiB'``, ``1.5 MiB`` for sizes that are not whole units."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            value = size / scale
            whole = abs(value - round(value)) < 0.05
            return f"{value:.0f} {unit}" if whole else f"{value:.1f} {unit}"
    return f"{size:.0f} B"


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


def _pages_text(pages: tuple[float, int, int] | None) -> str:
    """``'8 KiB pages'``, or for a mixed job ``'48 KiB-2 MiB pages\nmean 1.5 MiB'`` (two
    lines: one was wider than a narrow panel and ran into its neighbour's labels)."""
    if pages is None:
        return ""
    mean, low, high = pages
    if low == high:
        return f"{_page_label(low)} pages"
    return f"{_page_label(low)}-{_page_label(high)} pages\nmean {_page_label(mean)}"


def _preset_rows(results: Results, direction: str) -> list[Measurement]:
    return [
        m
        for m in results.measurements
        if not m.sweep and m.direction == direction and m.status == "ok" and m.gbps is not None
    ]


def _path_order(rows: Sequence[Measurement]) -> list[str]:
    """Paths that were timed, this project's first, then the baselines (no ceiling)."""
    seen = list(dict.fromkeys(m.path for m in rows if m.role != "ceiling"))
    roles = {m.path: m.role for m in rows}
    return [p for p in seen if roles[p] == "project"] + [p for p in seen if roles[p] != "project"]


def _range(m: Measurement) -> tuple[float, float]:
    """GB/s of the slowest and the fastest job (the median when not recorded)."""
    value = m.gbps or 0.0
    return (
        m.gbps_min if m.gbps_min is not None else value,
        m.gbps_max if m.gbps_max is not None else value,
    )


def _errorbar(axis: Any, xs: Sequence[float], rows: Sequence[Measurement], **style: Any) -> Any:
    """Median markers with a whisker from the slowest to the fastest job."""
    values = [m.gbps or 0.0 for m in rows]
    lows = [max(0.0, v - low) for v, (low, _) in zip(values, map(_range, rows), strict=True)]
    highs = [max(0.0, high - v) for v, (_, high) in zip(values, map(_range, rows), strict=True)]
    return axis.errorbar(xs, values, yerr=[lows, highs], elinewidth=0.8, capsize=0, **style)


def _ceiling_note(axis: Any, value: float, top: float, *, prefix: str = "ceiling") -> None:
    """The ceiling's value in the panel's top-left corner, with an arrow when it is
    above the panel's scale (``top``): its line is not drawn there."""
    text = f"{prefix} {value:.1f} GB/s" + (" \u2191" if value > top else "")
    axis.text(
        0.03, 0.97, text, transform=axis.transAxes, ha="left", va="top", fontsize=7,
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.0},
        zorder=4,
    )  # fmt: skip


def _legend_beside(fig: Any, handles: list[Any], labels: list[str], top: float) -> None:
    """The legend right of the panels: the figure is widened by the legend's measured
    width and the panels are laid out left of it (a guessed width let a long label run
    over the last panel)."""
    if not handles:
        fig.tight_layout(rect=(0, 0, 1, top), h_pad=1.5)
        return
    legend = fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.canvas.draw()
    legend_inches = legend.get_window_extent(fig.canvas.get_renderer()).width / fig.dpi + 0.2
    width, height = fig.get_size_inches()
    fig.set_size_inches(width + legend_inches, height)
    fig.tight_layout(rect=(0, 0, width / (width + legend_inches), top), h_pad=1.5)
    # tight_layout packs a row without x tick labels (shared axis) flush against the
    # next: the top y tick label below touched the "0" above.
    fig.subplots_adjust(hspace=max(fig.subplotpars.hspace, 0.3))


def _preset_panel(axis: Any, rows: Sequence[Measurement], paths: Sequence[str]) -> None:
    """One preset in one direction: a slot per path, y range from the paths."""
    timed = [m for m in rows if m.role != "ceiling"]
    ceiling = next((m for m in rows if m.role == "ceiling"), None)
    reach = [m.gbps_max or m.gbps or 0.0 for m in timed]
    if not reach and ceiling is not None:  # nothing but the ceiling: it is the scale
        reach = [ceiling.gbps_max or ceiling.gbps or 0.0]
    top = HEADROOM * max(reach, default=1.0) or 1.0
    for m in timed:
        style = _style(m.path, m.role)
        drawn = _errorbar(
            axis,
            [paths.index(m.path)],
            [m],
            fmt=style["marker"],
            color=style["color"],
            markersize=MARKER_POINTS,
            markerfacecolor=style["color"] if style["filled"] else "white",
            markeredgewidth=1.3,
            zorder=3 if m.role == "project" else 2,
        )
        drawn.lines[0].set_gid(f"{m.case}|{m.path}")
    if ceiling is not None and ceiling.gbps is not None:
        low, high = _range(ceiling)
        axis.axhspan(low, high, zorder=0, **CEILING_BAND).set_gid(f"{ceiling.case}|ceiling-band")
        axis.axhline(ceiling.gbps, zorder=1, **CEILING_LINE).set_gid(f"{ceiling.case}|ceiling")
        _ceiling_note(axis, ceiling.gbps, top)
    axis.set_ylim(0, top)
    axis.set_xlim(-0.6, max(len(paths), 1) - 0.4)
    axis.set_xticks(range(len(paths)))
    axis.set_xticklabels(paths, rotation=90, fontsize=8)
    axis.tick_params(axis="y", labelsize=8)
    axis.grid(True, axis="y", alpha=0.3)


def preset_figure(results: Results) -> Any:
    """GB/s of every path on every model preset: one panel per (direction, preset).

    Each panel has one slot per path (this project's first), so no two markers share a
    place, and its own y range, set by the paths (the ceiling is a dashed line over a
    band that never sets the scale). The preset's page sizes are in the panel title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = list(results.config["directions"])
    pages = _mean_pages(results)
    all_rows = [m for d in directions for m in _preset_rows(results, d)]
    paths = _path_order(all_rows)
    cases = list(dict.fromkeys(m.case for m in all_rows)) or ["no path was timed"]
    panel = max(2.0, 0.5 + 0.32 * len(paths))
    width = panel * len(cases)
    fig, axes = plt.subplots(
        len(directions), len(cases), figsize=(width, 2.6 * len(directions) + 2.2),
        squeeze=False, sharex=True,
    )  # fmt: skip
    device = results.environment.get("gpu") or "CPU only (host memory copies)"
    fig.suptitle(f"triton-offload bench: model presets, {device}", fontsize=11)
    for r, direction in enumerate(directions):
        rows = _preset_rows(results, direction)
        for c, case in enumerate(cases):
            axis = axes[r][c]
            _preset_panel(axis, [m for m in rows if m.case == case], paths)
            if r == 0:
                axis.set_title(f"{case}\n{_pages_text(pages.get(case))}", fontsize=8)
            if c == 0:
                arrow = "device -> pool" if direction == "store" else "pool -> device"
                axis.set_ylabel(f"{direction} ({arrow})\nGB/s, whisker: job range", fontsize=8)
    _legend_beside(fig, *_legend_handles(all_rows), top=0.95)
    return fig


def _dodge(count: int) -> list[float]:
    """Offsets inside one page-size slot (width 1) for ``count`` paths, side by side."""
    step = min(0.8 / max(count, 1), 0.25)
    return [(j - (count - 1) / 2) * step for j in range(count)]


def sweep_figure(results: Results) -> Any | None:
    """The raw sweep: GB/s vs page size, one panel per (direction, pages per job).

    Page sizes are evenly spaced slots; inside a slot the paths stand side by side, so
    no two markers touch. Each panel's y range is its paths' own; the ceiling is a
    dashed line over its band. None when the run had no sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [m for m in results.measurements if m.sweep and m.status == "ok" and m.gbps is not None]
    if not rows:
        return None
    directions = [d for d in results.config["directions"] if any(m.direction == d for m in rows)]
    counts = sorted({m.job_pages for m in rows})
    order = _path_order(rows)
    sizes = sorted({m.page_bytes for m in rows})
    offsets = dict(zip(order, _dodge(len(order)), strict=True))
    # Wide enough that neighbouring markers of one slot stay apart (11 px at 120 dpi).
    panel = max(3.3, 0.7 + (len(sizes) + 0.4) * 11 * len(order) / 0.8 / 120)
    width = panel * len(counts)
    fig, axes = plt.subplots(
        len(directions), len(counts), figsize=(width, 3.3 * len(directions) + 0.8),
        squeeze=False,
    )  # fmt: skip
    device = results.environment.get("gpu") or "CPU only (host memory copies)"
    fig.suptitle(f"triton-offload bench: raw sweep (one plane), {device}", fontsize=11)
    for r, direction in enumerate(directions):
        for c, count in enumerate(counts):
            axis = axes[r][c]
            here = [m for m in rows if m.direction == direction and m.job_pages == count]
            _sweep_panel(axis, here, order, sizes, offsets)
            axis.set_title(f"{direction}, {count:,} pages per job", fontsize=9)
            if r == len(directions) - 1:
                axis.set_xlabel("page size (one slot per size)", fontsize=8)
            if c == 0:
                axis.set_ylabel("GB/s: median, whisker: range", fontsize=8)
    _legend_beside(fig, *_legend_handles(rows), top=0.94)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for axis in axes.flat:
        _thin_tick_labels(axis, renderer)
    return fig


def _sweep_panel(
    axis: Any,
    rows: Sequence[Measurement],
    order: Sequence[str],
    sizes: Sequence[int],
    offsets: dict[str, float],
) -> None:
    slot = {size: index for index, size in enumerate(sizes)}
    timed = [m for m in rows if m.role != "ceiling"]
    reach = [m.gbps_max or m.gbps or 0.0 for m in timed] or [
        m.gbps_max or m.gbps or 0.0 for m in rows
    ]
    top = HEADROOM * max(reach, default=1.0) or 1.0
    for name in order:
        mine = sorted((m for m in timed if m.path == name), key=lambda m: m.page_bytes)
        if not mine:
            continue
        style = _style(name, mine[0].role)
        drawn = _errorbar(
            axis,
            [slot[m.page_bytes] + offsets[name] for m in mine],
            mine,
            color=style["color"],
            linestyle=style["linestyle"],
            marker=style["marker"],
            markersize=MARKER_POINTS - 1,
            markerfacecolor=style["color"] if style["filled"] else "white",
            linewidth=1.8 if mine[0].role == "project" else 1.2,
        )
        drawn.lines[0].set_gid(f"sweep|{name}")
    ceiling = sorted((m for m in rows if m.role == "ceiling"), key=lambda m: m.page_bytes)
    if ceiling:
        xs = [slot[m.page_bytes] for m in ceiling]
        values = [m.gbps or 0.0 for m in ceiling]
        lows = [_range(m)[0] for m in ceiling]
        highs = [_range(m)[1] for m in ceiling]
        if len(xs) == 1:  # a band needs a width: half a slot around the one point
            xs, values, lows, highs = [xs[0] - 0.25, xs[0] + 0.25], values * 2, lows * 2, highs * 2
        axis.fill_between(xs, lows, highs, zorder=0, **CEILING_BAND)
        axis.plot(xs, values, zorder=1, **CEILING_LINE)[0].set_gid("sweep|ceiling")
        _ceiling_note(axis, max(values), top, prefix="ceiling up to")
    axis.set_ylim(0, top)
    axis.set_xlim(-0.6, len(sizes) - 0.4)
    axis.set_xticks(range(len(sizes)))
    axis.set_xticklabels([_page_label(s) for s in sizes], fontsize=8)
    axis.tick_params(axis="y", labelsize=8)
    axis.grid(True, axis="y", alpha=0.3)


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
            "noisy": [m.path for m in v.noisy],
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
    "noise_sentence",
    "plot",
    "preset_figure",
    "status_of",
    "sweep_figure",
    "terminal_report",
    "verdicts",
    "wall_line",
    "write_all",
    "write_partial",
]
