"""Turns a :class:`~triton_offload.bench.harness.Results` into a terminal table,
``results.json``, ``report.md`` and a PNG plot (GB/s vs page size, ceiling drawn).

Every ratio in the summary compares numbers of the same run and the same case.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triton_offload.bench.harness import HostCost, Measurement, Results
from triton_offload.bench.presets import size_label

RESULTS_JSON = "results.json"
REPORT_MD = "report.md"
PLOT_PNG = "bandwidth.png"


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
                    f"({_gb(self.ceiling.gbps)})"
                )
            parts.append(text)
        elif self.best_baseline is not None:
            parts.append(f"no project path timed; best baseline {self.best_baseline.path}")
        return "; ".join(parts)


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} GB/s"


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


def _row_cells(m: Measurement) -> list[str]:
    return [
        m.case,
        m.direction,
        m.path,
        m.role,
        m.status,
        _fmt(m.gbps, ".2f"),
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


def markdown_report(results: Results, plot_name: str | None) -> str:
    env = results.environment
    cfg = results.config
    out = [
        "# triton-offload bench report",
        "",
        _environment_line(env) + ".",
        "",
        f"Repeats per figure: {cfg['repeats']} (median), warm-up {cfg['warmup']}; directions: "
        f"{', '.join(cfg['directions'])}. GB/s = bytes of the job / median time per job / 1e9. "
        + (
            "Times are CUDA events around each job on its stream."
            if env.get("cuda_available")
            else "No CUDA: every path is a CPU memory copy timed by wall clock; the Triton "
            "kernels ran only as an interpreted correctness pass (no GB/s claimed)."
        ),
        "The ceiling is one contiguous copy of the same number of bytes in the same run.",
        "",
        "## Who wins",
        "",
    ]
    out += [f"- {v.sentence()}" for v in verdicts(results.measurements)]
    if plot_name is not None:
        out += ["", f"![GB/s vs page size]({plot_name})"]
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


def plot(results: Results, path: Path) -> None:
    """GB/s vs page size (log x), one panel per direction.

    Raw-sweep points are joined into one line per path (per page size, the largest
    job); model presets are unjoined markers at the page size carrying most of their
    bytes, labelled with the preset. The ceiling is black: dashed over the sweep, a bar
    marker per preset.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = list(results.config["directions"])
    fig, axes = plt.subplots(
        1, len(directions), figsize=(7.5 * len(directions), 5.5), squeeze=False, sharey=True
    )
    device = results.environment.get("gpu") or "CPU only (host memory copies)"
    fig.suptitle(f"triton-offload bench: bandwidth vs page size, {device}")
    names = list(dict.fromkeys(m.path for m in results.measurements if m.path != "ceiling"))
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}
    for axis, direction in zip(axes[0], directions, strict=True):
        rows = [
            m
            for m in results.measurements
            if m.direction == direction and m.status == "ok" and m.gbps is not None
        ]
        plotted: list[float] = []
        for name in ["ceiling", *names]:
            mine = [m for m in rows if m.path == name]
            sweep = _curve([m for m in mine if m.sweep])
            preset = [m for m in mine if not m.sweep]
            plotted += [y for _, y in sweep] + [m.gbps or 0.0 for m in preset]
            is_ceiling = name == "ceiling"
            color = "black" if is_ceiling else colors[name]
            label = "ceiling (one contiguous copy)" if is_ceiling else name
            if sweep:
                axis.plot(
                    [x for x, _ in sweep],
                    [y for _, y in sweep],
                    linestyle="--" if is_ceiling else "-",
                    marker=None if is_ceiling else "o",
                    color=color,
                    linewidth=2 if is_ceiling else 1.5,
                    label=label,
                )
                label = "_nolegend_"
            if preset:
                axis.scatter(
                    [m.page_bytes for m in preset],
                    [m.gbps for m in preset],
                    marker="_" if is_ceiling else "s",
                    s=300 if is_ceiling else 30,
                    color=color,
                    label=label,
                    zorder=3,
                )
            if is_ceiling:
                for m in preset:
                    axis.annotate(
                        m.case,
                        (m.page_bytes, m.gbps or 0.0),
                        fontsize=7,
                        textcoords="offset points",
                        xytext=(4, 4),
                    )
        axis.set_xscale("log", base=2)
        sizes = sorted({m.page_bytes for m in rows})
        if sizes:
            axis.set_xlim(sizes[0] / 1.6, sizes[-1] * 3)
        axis.set_xticks(sizes)
        axis.set_xticklabels([size_label(t) for t in sizes], rotation=45, fontsize=8)
        axis.set_title(
            f"{direction} ({'device -> pool' if direction == 'store' else 'pool -> device'})"
        )
        axis.set_xlabel("page size (bytes, log scale); squares: model presets")
        axis.set_ylabel("bandwidth (GB/s = 1e9 bytes/s, median)")
        top = max(plotted, default=1.0)
        axis.set_ylim(0, top * 1.2)  # headroom for the preset labels
        axis.grid(True, which="both", alpha=0.3)
    handles: dict[str, Any] = {}
    for axis in axes[0]:
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _curve(rows: Sequence[Measurement]) -> list[tuple[int, float]]:
    """Per page size, the point of the largest job."""
    by_size: dict[int, Measurement] = {}
    for m in rows:
        current = by_size.get(m.page_bytes)
        if current is None or m.job_bytes > current.job_bytes:
            by_size[m.page_bytes] = m
    return [(size, by_size[size].gbps or 0.0) for size in sorted(by_size)]


# ------------------------------------------------------------------------------- write


def write_all(results: Results, out_dir: Path) -> dict[str, Path]:
    """Write the plot, results.json and report.md into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    plot_path = out_dir / PLOT_PNG
    try:
        plot(results, plot_path)
        written["plot"] = plot_path
    except ImportError:  # matplotlib comes with the [bench] extra; the numbers do not need it
        results.notes.append("plot skipped: matplotlib is not installed (pip install '.[bench]')")
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
            "text": v.sentence().replace("**", ""),
        }
        for v in verdicts(results.measurements)
    ]
    written["json"] = out_dir / RESULTS_JSON
    written["json"].write_text(json.dumps(payload, indent=2) + "\n")
    written["markdown"] = out_dir / REPORT_MD
    plot_name = PLOT_PNG if "plot" in written else None
    written["markdown"].write_text(markdown_report(results, plot_name))
    return written


__all__ = [
    "PLOT_PNG",
    "REPORT_MD",
    "RESULTS_JSON",
    "Verdict",
    "markdown_report",
    "plot",
    "terminal_report",
    "verdicts",
    "write_all",
]
