"""``triton-offload verify``: cold prefill vs offload hit, bitwise, over a scenario matrix.

For every model preset, DCP size and chunk size, prompts placed around the chunk grid
(on a boundary, one token after, one before, shorter than a chunk, several chunks, an
extension of a stored prompt, and one with the host pool cleared in between) run once
cold (storing) and once after clearing the GPU cache (looking up, loading, recomputing
the rest); per preset and DCP size, ``corrupt-chunk`` alters one stored chunk's bytes
before the hit, and the load must refuse it (its seal) and recompute from it. The table
shows what the lookup allowed, what was loaded and recomputed, the chunks refused, and
whether generated tokens and logits equal the cold run's; the exit status is 1 if any
scenario differs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triton_offload.cli.args import (
    UsageError,
    check_fits_in_memory,
    check_output_dir,
    folder,
    format_bytes,
    int_at_least,
)
from triton_offload.cli.interrupt import (
    Interrupted,
    PhaseTracker,
    ignore_further,
    interrupts_raise,
)
from triton_offload.planner.presets import PRESETS, preset_names

if TYPE_CHECKING:  # serving imports torch: loaded only when a run starts
    from triton_offload.verify.serving import Scenario, ScenarioResult

__all__ = [
    "MAX_REQUEST_TOKENS",
    "PARTIAL_JSON",
    "PHASES",
    "RESULTS_JSON",
    "configure_parser",
    "format_table",
    "needed_bytes",
    "run",
]

#: What ``--out`` receives: a complete run's rows, or an interrupted run's (a new name,
#: so a complete file written earlier into the folder stays as it was).
RESULTS_JSON = "verify.json"
PARTIAL_JSON = "verify.partial.json"
#: What the interrupt message and the progress lines call each phase.
PHASES = {
    "start-up": "start-up (importing torch, building the scenarios)",
    "scenarios": "the scenarios",
    "report": "writing the results",
}

_BACKENDS = ("torch", "triton")

#: Longest request (prompt + new tokens) verify runs. The verification model computes
#: every token alone, against every earlier one, so time grows with the square of the
#: prompt: the 7 scenarios of one preset at DCP 2 with 16 blocks per chunk (prompts up
#: to 1,797 tokens) took 12 s on one core; at 4,096 tokens they take about a minute.
MAX_REQUEST_TOKENS = 4096


def configure_parser(parser: argparse.ArgumentParser) -> None:
    from triton_offload.verify.injections import INJECTIONS

    names = preset_names("verify")
    parser.add_argument(
        "--preset",
        choices=[*names, "all"],
        default="all",
        help="model preset, a scaled-down model run end to end on the CPU (the same names "
        "as plan): "
        + "; ".join(f"{name}: {PRESETS[name].description}" for name in names)
        + "; default: all",
    )
    parser.add_argument(
        "--dcp",
        type=int_at_least(1, "DCP size"),
        default=None,
        metavar="N",
        help="DCP size (default: 1 and 2)",
    )
    parser.add_argument(
        "--blocks-per-chunk",
        type=int_at_least(1, "blocks per chunk"),
        default=None,
        metavar="N",
        help="GPU blocks per offloaded chunk (default: 1 and 2); prompts grow with the chunk "
        f"and a request may reach at most {MAX_REQUEST_TOKENS} tokens",
    )
    parser.add_argument(
        "--backend",
        choices=_BACKENDS,
        default="torch",
        help="TransferEngine backend; 'triton' runs the copy kernels (under "
        "TRITON_INTERPRET=1 on CPU, set here when CUDA is absent)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int_at_least(1, "new tokens"),
        default=8,
        metavar="N",
        help="tokens decoded per request",
    )
    parser.add_argument(
        "--inject",
        choices=INJECTIONS,
        default=None,
        help="testing aid, makes verify fail on purpose: mamba-span-dcp (Mamba span "
        "multiplied by DCP), no-mamba-round-down (Mamba planned as a sliding window, no "
        "round-down), wrong-slot (load jobs with rotated GPU blocks), vllm-lookup (vLLM "
        "0.33's stock lookup rule; fails the mamba-chunk-cut scenarios), no-seal-check "
        "(loads skip the seal check; fails the corrupt-chunk scenarios)",
    )
    parser.add_argument(
        "--out",
        type=folder,
        default=None,
        metavar="DIR",
        help=f"also write the rows to DIR/{RESULTS_JSON} (created if missing); an "
        f"interrupted run writes the rows it finished to DIR/{PARTIAL_JSON} instead",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def _prepare_backend(backend: str) -> str | None:
    """Make the Triton kernels runnable on this machine; an error message if impossible.

    The verification model lives on the CPU, so the kernels run under the interpreter,
    which must be switched on before the kernel module defines its ``@triton.jit``
    functions.
    """
    if backend != "triton" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if "triton_offload.kernels.copy_blocks" in sys.modules:
        return (
            "the kernels need TRITON_INTERPRET=1 (the verification model runs on the "
            "CPU), but the kernels were already imported without it; set TRITON_INTERPRET=1 "
            "in the environment"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    return None


def needed_bytes(scenarios: Sequence[Scenario], max_new_tokens: int) -> int:
    """Bytes the largest server of a run allocates: every rank's cache tensors (float32)
    and every rank's host pool (``num_host_rows`` pages: the longest group row and the
    seal)."""
    import inspect

    from triton_offload.transfer.seal import SEAL_BYTES
    from triton_offload.verify.model import ModelConfig
    from triton_offload.verify.serving import PRESETS as LAYERS
    from triton_offload.verify.serving import OffloadServer

    rows = inspect.signature(OffloadServer).parameters["num_host_rows"].default
    servers: dict[tuple[str, int, int], int] = {}
    for s in scenarios:
        key = (s.preset, s.dcp, s.blocks_per_chunk)
        tokens = max(s.first_len, s.second_len) + max_new_tokens
        servers[key] = max(servers.get(key, 0), tokens)
    largest = 0
    for (preset, dcp, bpc), tokens in servers.items():
        c = ModelConfig(layers=LAYERS[preset])
        blocks = 2 * max(c.blocks_per_rank(g, tokens, dcp) for g in range(len(c.group_kinds)))
        attention = 2 * c.block_size * c.hidden_size * 4  # K and V pages
        mamba = ((c.conv_kernel - 1) * c.hidden_size + c.hidden_size * c.ssm_state_size) * 4
        page = {kind: mamba if kind == "mamba" else attention for kind in c.layers}
        cache = dcp * blocks * sum(page[kind] for kind in c.layers)
        row = max(bpc * page[kind] * c.layers.count(kind) for kind in c.group_kinds)
        largest = max(largest, cache + dcp * rows * ((row + 15) // 16 * 16 + SEAL_BYTES))
    return largest


def _check_sizes(args: argparse.Namespace, scenarios: Sequence[Scenario]) -> None:
    """Refuse a run that would not fit in memory, or whose prompts are too long."""
    flags = " ".join(
        f"--{name.replace('_', '-')} {value}"
        for name, value in (("dcp", args.dcp), ("blocks_per_chunk", args.blocks_per_chunk))
        if value is not None
    )
    longest = max(max(s.first_len, s.second_len) for s in scenarios)
    request = longest + args.max_new_tokens
    if request > MAX_REQUEST_TOKENS:
        if longest + 1 <= MAX_REQUEST_TOKENS:
            raise UsageError(
                f"--max-new-tokens {args.max_new_tokens}: with prompts of up to {longest:,} "
                f"tokens a request reaches {request:,} tokens; verify runs requests of at most "
                f"{MAX_REQUEST_TOKENS:,} tokens (the model computes every token alone)"
            )
        chunk = max(s.first_len // 2 for s in scenarios if s.name.endswith("/boundary"))
        raise UsageError(
            f"{flags or '--preset ' + args.preset}: chunks of up to {chunk:,} tokens make "
            f"prompts of up to {longest:,} tokens and would need "
            f"{format_bytes(needed_bytes(scenarios, args.max_new_tokens))} of caches and host "
            f"pools; verify runs requests of at most "
            f"{MAX_REQUEST_TOKENS:,} tokens (the model computes every token alone, so time "
            "grows with the square of the prompt)"
        )
    check_fits_in_memory(
        flags or "--preset " + args.preset,
        needed_bytes(scenarios, args.max_new_tokens),
        "the verification caches and host pools",
    )


def format_table(results: Sequence[ScenarioResult]) -> str:
    """The scenario table (one row per ``ScenarioResult``)."""
    header = (
        "scenario",
        "prompt",
        "lookup",
        "loaded",
        "recomputed",
        "load bytes",
        "refused",
        "tokens equal",
        "logits equal",
        "max |diff|",
        "result",
    )
    rows = [header]
    for r in results:
        s = r.scenario
        rows.append(
            (
                s.name,
                str(s.second_len),
                str(r.lookup_tokens),
                str(r.loaded_tokens),
                str(r.recomputed_tokens),
                str(r.load_bytes),
                str(r.refused_chunks),
                "yes" if r.tokens_equal else "NO",
                "yes" if r.logits_equal else "NO",
                f"{r.max_abs_diff:.3g}",
                "ok" if r.passed else "FAIL",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _rows(results: Sequence[ScenarioResult]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        row = asdict(r)
        row["passed"] = r.passed
        if row["max_abs_diff"] != row["max_abs_diff"]:  # NaN (not compared) is not JSON
            row["max_abs_diff"] = None
        rows.append(row)
    return rows


def _write_json(out: Path, name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``out/name`` under a temporary name, then rename it: an
    interrupt never leaves half a file."""
    target = out / name
    staged = out / f".{name}.{os.getpid()}.tmp"
    try:
        staged.write_text(json.dumps(payload, indent=2) + "\n")
        os.replace(staged, target)
    finally:
        staged.unlink(missing_ok=True)
    return target


def run(args: argparse.Namespace) -> int:
    problem = _prepare_backend(args.backend)
    if problem is not None:
        raise UsageError(f"--backend {args.backend}: {problem}")
    if args.out is not None:
        check_output_dir("--out", args.out, (RESULTS_JSON, PARTIAL_JSON))
    tracker = PhaseTracker("verify", progress=not args.no_progress, labels=PHASES)
    results: list[ScenarioResult] = []
    scenarios: Sequence[Scenario] = ()
    with interrupts_raise(), tracker.heartbeat():
        try:
            tracker.enter("start-up")
            from triton_offload.verify.serving import PRESETS as LAYERS
            from triton_offload.verify.serving import build_scenarios, run_scenarios

            presets = list(LAYERS) if args.preset == "all" else [args.preset]
            dcps = [1, 2] if args.dcp is None else [args.dcp]
            bpcs = [1, 2] if args.blocks_per_chunk is None else [args.blocks_per_chunk]
            scenarios = build_scenarios(presets, dcps, bpcs)
            _check_sizes(args, scenarios)
            inject = f", injected bug: {args.inject}" if args.inject else ""
            print(
                f"verify: {len(scenarios)} scenarios, backend {args.backend}, "
                f"{args.max_new_tokens} new tokens per request{inject}",
                flush=True,
            )
            start = time.perf_counter()
            number = itertools.count(1)
            run_scenarios(
                scenarios,
                backend=args.backend,
                inject=args.inject,
                max_new_tokens=args.max_new_tokens,
                results=results,
                on_scenario=lambda s: tracker.enter(
                    "scenarios", s.name, line=f"scenario {next(number)}/{len(scenarios)} {s.name}"
                ),
            )
            elapsed = time.perf_counter() - start
            tracker.enter("report")
            written = None
            if args.out is not None:
                payload = {"partial": None, "scenarios": _rows(results)}
                written = _write_json(args.out, RESULTS_JSON, payload)
                (args.out / PARTIAL_JSON).unlink(missing_ok=True)  # superseded
        except (Interrupted, KeyboardInterrupt) as stop:
            signum = stop.signum if isinstance(stop, Interrupted) else int(signal.SIGINT)
            return _interrupted(Interrupted(signum), tracker, args, scenarios, results)
    print(format_table(results))
    if written is not None:
        print(f"\nwrote {written}")
    failed = [r for r in results if not r.passed]
    if failed:
        print(f"\nFAILED: {len(failed)} of {len(results)} scenarios ({elapsed:.1f} s)")
        for r in failed:
            print(f"  {r.failure}")
        return 1
    print(f"\nall {len(results)} scenarios equal ({elapsed:.1f} s)")
    return 0


def _interrupted(
    stop: Interrupted,
    tracker: PhaseTracker,
    args: argparse.Namespace,
    scenarios: Sequence[Scenario],
    results: Sequence[ScenarioResult],
) -> int:
    """An interrupted run: the finished rows, marked partial, to ``--out`` (a new file)
    or, without ``--out``, as a table on stdout; one line on stderr."""
    ignore_further()  # also after a KeyboardInterrupt that bypassed our handler
    message = f"interrupted by {stop.name} during {tracker.where()}"
    done = (
        f"{len(results)} of {len(scenarios)} scenarios finished" if scenarios else "no scenario ran"
    )
    where = "nothing written"
    if args.out is not None:
        payload = {
            "partial": {
                "signal": stop.name,
                "phase": tracker.phase,
                "where": tracker.where(),
                "message": f"{message}; {done}",
            },
            "scenarios": _rows(results),
        }
        where = f"partial results in {_write_json(args.out, PARTIAL_JSON, payload)}"
    elif results:
        print(f"PARTIAL ({message}; {done}):\n{format_table(results)}")
        where = "partial table on stdout"
    print(f"triton-offload verify: {message}; {done}; {where}", file=sys.stderr)
    return stop.exit_status
