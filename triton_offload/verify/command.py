"""``triton-offload verify``: cold prefill vs offload hit, bitwise, over a scenario matrix.

For every model preset, DCP size and chunk size, prompts placed around the chunk grid
(on a boundary, one token after, one before, shorter than a chunk, several chunks, an
extension of a stored prompt, and one with the host pool cleared in between) run once
cold (storing) and once after clearing the GPU cache (looking up, loading, recomputing
the rest). The table shows what the lookup allowed, what was loaded and recomputed,
and whether generated tokens and logits equal the cold run's; the exit status is 1 if
any scenario differs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from triton_offload.cli_args import int_at_least

if TYPE_CHECKING:  # serving imports torch: loaded only when a run starts
    from triton_offload.verify.serving import ScenarioResult

__all__ = ["configure_parser", "format_table", "run"]

_BACKENDS = ("torch", "triton")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    from triton_offload.verify.serving import INJECTIONS, PRESETS

    parser.add_argument(
        "--preset",
        choices=[*PRESETS, "all"],
        default="all",
        help="model preset: hybrid-swa (attention + sliding window + Mamba), hybrid "
        "(attention + Mamba), mamba (Mamba only); default: all",
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
        help="GPU blocks per offloaded chunk (default: 1 and 2)",
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
        "0.33's stock lookup rule; fails the mamba-chunk-cut scenarios)",
    )


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
            "backend 'triton' needs TRITON_INTERPRET=1 (the verification model runs on the "
            "CPU), but the kernels were already imported without it; set TRITON_INTERPRET=1 "
            "in the environment"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    return None


def format_table(results: Sequence[ScenarioResult]) -> str:
    """The scenario table (one row per ``ScenarioResult``)."""
    header = (
        "scenario",
        "prompt",
        "lookup",
        "loaded",
        "recomputed",
        "load bytes",
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


def run(args: argparse.Namespace) -> int:
    problem = _prepare_backend(args.backend)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    from triton_offload.verify.serving import PRESETS, build_scenarios, run_scenarios

    presets = list(PRESETS) if args.preset == "all" else [args.preset]
    dcps = [1, 2] if args.dcp is None else [args.dcp]
    bpcs = [1, 2] if args.blocks_per_chunk is None else [args.blocks_per_chunk]
    scenarios = build_scenarios(presets, dcps, bpcs)
    inject = f", injected bug: {args.inject}" if args.inject else ""
    print(
        f"verify: {len(scenarios)} scenarios, backend {args.backend}, "
        f"{args.max_new_tokens} new tokens per request{inject}"
    )
    start = time.perf_counter()
    results = run_scenarios(
        scenarios, backend=args.backend, inject=args.inject, max_new_tokens=args.max_new_tokens
    )
    elapsed = time.perf_counter() - start
    print(format_table(results))
    failed = [r for r in results if not r.passed]
    if failed:
        print(f"\nFAILED: {len(failed)} of {len(results)} scenarios ({elapsed:.1f} s)")
        for r in failed:
            print(f"  {r.failure}")
        return 1
    print(f"\nall {len(results)} scenarios equal ({elapsed:.1f} s)")
    return 0
