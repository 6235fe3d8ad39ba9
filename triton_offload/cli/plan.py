"""``triton-offload plan``: print a model's offload plan as a table.

Pure Python, no torch: shows what the planner decides for a geometry (each group's
span, chunk, window, alignment count and store-reachable chunks for a sample
prompt) and what a lookup of that prompt returns when every reachable chunk is
stored. Groups come from a named preset or from repeated ``--group`` flags.
"""

from __future__ import annotations

import argparse
from typing import Any

from triton_offload.cli.args import UsageError, check_fits_in_memory, format_bytes, int_between
from triton_offload.cli.interrupt import PhaseTracker
from triton_offload.planner.groups import MAMBA_CACHE_MODES, GroupKind, GroupSpec, ParallelSpec
from triton_offload.planner.plan import OffloadPlan, plan_offload
from triton_offload.planner.presets import PRESETS, preset_names

__all__ = [
    "COLUMNS",
    "MAX_BLOCKS_PER_CHUNK",
    "MAX_RANKS",
    "MAX_SAMPLE_CHUNKS",
    "MAX_TOKENS",
    "SAMPLE_BYTES_PER_CHUNK",
    "build_plan",
    "configure_parser",
    "parse_group",
    "run",
]

#: Peak bytes the sample lookup holds per chunk of a group (presence row, reachable
#: chunk list, the table's ranges): 56 B measured with tracemalloc, rounded up.
SAMPLE_BYTES_PER_CHUNK = 64
#: Most chunks (all groups together) the sample lookup walks: ~0.7 us per chunk was
#: measured on one core, so this bound (16.7M chunks, e.g. a 268M-token prompt of one
#: 16-token group) answers within ~12 s and 1 GiB. Real contexts are far shorter.
MAX_SAMPLE_CHUNKS = 1 << 24
#: Upper bounds of the numeric flags; each message says where its bound comes from.
#: Token counts (prompt, window, block): vLLM keeps token positions in 32-bit integers.
MAX_TOKENS = (1 << 31) - 1
#: Ranks (--tp, --dcp, --pcp): one GPU each; no model instance spans more GPUs (the
#: plan's own time and memory do not grow with them).
MAX_RANKS = 1 << 16
#: Memory: one chunk is one host block holding this many GPU blocks of every layer of
#: its group; 2^20 blocks of even a 4 KiB page are 4 GiB per layer.
MAX_BLOCKS_PER_CHUNK = 1 << 20
_TOKENS_WHY = "vLLM's token positions are 32-bit integers"
_RANKS_WHY = "ranks: one GPU each, more than any model instance runs on"

_WINDOW_KINDS = (GroupKind.SLIDING_WINDOW.value, GroupKind.CHUNKED_LOCAL.value)
_OPTIONS = "window=TOKENS, mode=MODE, eagle, name=NAME"
_GROUP_HELP = (
    "a cache group as KIND:BLOCK[:window=TOKENS][:mode=MODE][:eagle][:name=NAME] "
    f"(KIND: {', '.join(k.value for k in GroupKind)}; BLOCK: tokens per GPU block on one "
    "rank; window=: the sliding window (sliding_window, required) or the local-attention "
    "chunk (chunked_local, required), in tokens; mode=: the Mamba cache mode "
    f"({', '.join(MAMBA_CACHE_MODES)}; mamba only); eagle: an EAGLE/MTP draft group; name=: "
    "the group's name in the table, unique); repeatable, in group order"
)


def _positive(text: str, what: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {what} {value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: {what} {number} must be >= 1")
    if number > MAX_TOKENS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {what} {number} must be <= {MAX_TOKENS:,} ({_TOKENS_WHY})"
        )
    return number


def parse_group(text: str) -> GroupSpec:
    """``KIND:BLOCK[:window=N][:mode=M][:eagle][:name=S]`` -> GroupSpec.

    Every message speaks the flag's own syntax (``window=``, not the GroupSpec field
    it fills). Raises ``argparse.ArgumentTypeError`` with the offending part, so
    argparse exits with status 2 naming ``--group`` and the value.
    """
    parts = text.split(":")
    if len(parts) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KIND:BLOCK[:option...]")
    kind, block_text, *options = parts
    known = [k.value for k in GroupKind]
    if kind not in known:
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown group kind {kind!r}; expected one of {', '.join(known)}"
        )
    block_size = _positive(text, "block size", block_text)
    kwargs: dict[str, Any] = {}
    seen: set[str] = set()
    for option in options:
        key, sep, value = option.partition("=")
        if key in seen:
            raise argparse.ArgumentTypeError(f"{text!r}: option {key!r} given twice")
        seen.add(key)
        if key == "eagle":
            if sep:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: 'eagle' takes no value, got {option!r}"
                )
            kwargs["is_eagle"] = True
            continue
        if key not in ("window", "mode", "name"):
            raise argparse.ArgumentTypeError(
                f"{text!r}: unknown option {option!r} (options: {_OPTIONS})"
            )
        if not sep or not value:
            raise argparse.ArgumentTypeError(f"{text!r}: option {key}= needs a value")
        if key == "window":
            if kind not in _WINDOW_KINDS:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: window= is only for {' and '.join(_WINDOW_KINDS)} groups, "
                    f"not {kind}"
                )
            field = "sliding_window" if kind == "sliding_window" else "attention_chunk_size"
            kwargs[field] = _positive(text, "window", value)
        elif key == "mode":
            if kind != GroupKind.MAMBA.value:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: mode= is only for mamba groups, not {kind}"
                )
            if value not in MAMBA_CACHE_MODES:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: unknown mode {value!r}; expected one of "
                    f"{', '.join(MAMBA_CACHE_MODES)}"
                )
            kwargs["mamba_cache_mode"] = value
        else:
            kwargs["name"] = value
    if kind in _WINDOW_KINDS and "window" not in seen:
        what = "sliding window" if kind == "sliding_window" else "local-attention chunk"
        raise argparse.ArgumentTypeError(
            f"{text!r}: a {kind} group needs window=TOKENS (its {what}), e.g. {text}:window=128"
        )
    try:
        return GroupSpec(kind, block_size, **kwargs)
    except (TypeError, ValueError) as error:  # a rule of GroupSpec the syntax cannot see
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


#: What each column of the table means (``plan --help`` and docs/commands.md say the same).
COLUMNS = """\
columns of the table:
  block      tokens per GPU block on one rank
  span       tokens of the sequence one GPU block covers: block x DCP for DCP-sharded
             groups (every attention kind), block for Mamba state (replicated)
  chunk      tokens per offloaded chunk: span x --blocks-per-chunk
  window     chunks a hit needs before its end (unit: chunks, not tokens); '-' for full
             attention and MLA (every earlier chunk), 1 for Mamba (the state at the end)
  align      chunks of this group per aligned segment (loads end on the unbounded
             groups' shared chunk boundary); '-' when no alignment applies
  eagle      an EAGLE/MTP draft group (its newest chunk is volatile)
  storable   full chunks of the sample prompt (a partial chunk is never stored)
  reachable  the storable chunks worth storing: those some later aligned hit can end
             within the window after; the others are skipped"""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.epilog = COLUMNS
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--preset",
        choices=preset_names("plan"),
        metavar="NAME",
        help="a model preset (the same names as bench and verify): "
        + "; ".join(f"{name}: {PRESETS[name].description}" for name in preset_names("plan")),
    )
    source.add_argument(
        "--group", action="append", type=parse_group, metavar="KIND:BLOCK[:...]", help=_GROUP_HELP
    )
    parser.add_argument(
        "--tp",
        type=int_between(1, MAX_RANKS, "TP size", _RANKS_WHY),
        default=None,
        help="tensor-parallel size, a multiple of --dcp (default: the preset's, else 1)",
    )
    parser.add_argument(
        "--dcp",
        type=int_between(1, MAX_RANKS, "DCP size", _RANKS_WHY),
        default=1,
        help="decode-context-parallel size",
    )
    parser.add_argument(
        "--pcp",
        type=int_between(1, MAX_RANKS, "PCP size", _RANKS_WHY),
        default=1,
        help="prefill-context-parallel size",
    )
    parser.add_argument(
        "--blocks-per-chunk",
        type=int_between(
            1,
            MAX_BLOCKS_PER_CHUNK,
            "blocks per chunk",
            "memory: a chunk is one host block of that many GPU blocks per layer",
        ),
        default=1,
        help="GPU blocks per offload chunk",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int_between(0, MAX_TOKENS, "prompt tokens", _TOKENS_WHY),
        default=1024,
        help="sample prompt length",
    )
    parser.add_argument(
        "--computed-tokens",
        type=int_between(0, MAX_TOKENS, "computed tokens", _TOKENS_WHY),
        default=0,
        help="tokens of the prompt already on the GPU for the sample lookup",
    )


def build_plan(args: argparse.Namespace) -> OffloadPlan:
    """The plan the flags describe; UsageError naming the flag for a bad combination."""
    if args.preset:
        preset = PRESETS[args.preset]
        groups = preset.groups
        if preset.tp_size is not None and args.tp not in (None, preset.tp_size):
            raise UsageError(
                f"--tp {args.tp}: preset {preset.name} is deployed at TP {preset.tp_size} "
                "(its name says so); leave --tp out"
            )
        tp = preset.tp_size if args.tp is None else args.tp
    else:
        groups = tuple(args.group)
        tp = args.tp
    tp = 1 if tp is None else tp
    if tp % args.dcp:
        raise UsageError(
            f"--tp {tp} is not divisible by --dcp {args.dcp} (DCP ranks split the TP group)"
        )
    labels: dict[str, int] = {}
    for index, spec in enumerate(groups):
        if spec.label in labels:
            raise UsageError(
                f"--group: groups {labels[spec.label]} and {index} are both named "
                f"{spec.label!r}; give each group a unique :name=NAME"
            )
        labels[spec.label] = index
    parallel = ParallelSpec(tp_size=tp, dcp_size=args.dcp, pcp_size=args.pcp)
    try:
        return plan_offload(groups, parallel, blocks_per_chunk=args.blocks_per_chunk)
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None


def _check_sample_size(plan: OffloadPlan, prompt: int) -> None:
    """Refuse a sample prompt whose lookup would not fit in memory or in seconds."""
    chunks = sum(group.storable_chunk_count(prompt) for group in plan.groups)
    needed = chunks * SAMPLE_BYTES_PER_CHUNK
    flag = f"--prompt-tokens {prompt}"
    what = f"the sample lookup ({chunks:,} chunks x {SAMPLE_BYTES_PER_CHUNK} B)"
    if chunks > MAX_SAMPLE_CHUNKS:
        raise UsageError(
            f"{flag}: {what} would need {format_bytes(needed)}; the sample walks at most "
            f"{MAX_SAMPLE_CHUNKS:,} chunks ({MAX_SAMPLE_CHUNKS * SAMPLE_BYTES_PER_CHUNK >> 20} "
            "MiB, ~12 s), use a shorter prompt or larger --blocks-per-chunk"
        )
    check_fits_in_memory(flag, needed, what)


def run(args: argparse.Namespace) -> int:
    if args.computed_tokens > args.prompt_tokens:
        raise UsageError(
            f"--computed-tokens {args.computed_tokens} exceeds --prompt-tokens {args.prompt_tokens}"
        )
    plan = build_plan(args)
    prompt = args.prompt_tokens
    _check_sample_size(plan, prompt)
    if args.preset:
        print(f"preset {args.preset}: {PRESETS[args.preset].description}")
    # The sample of the longest allowed prompt walks for ~12 s: a heartbeat line on
    # stderr after every quiet 10 s (nothing for the usual sub-second table).
    tracker = PhaseTracker("plan", labels={"start-up": "the plan table and sample lookup"})
    with tracker.heartbeat():
        print(plan.describe(prompt_tokens=prompt))
        present = []
        for index, group in enumerate(plan.groups):
            row = bytearray(group.storable_chunk_count(prompt))
            for chunk in plan.store_reachable_chunks(index, len(row)):
                row[chunk] = 1
            present.append(row)
        hit = plan.lookup(prompt, args.computed_tokens, present)
    print(
        f"lookup: prompt {prompt} tokens, {args.computed_tokens} computed, every reachable "
        f"chunk stored -> load {hit} tokens"
        + (f" (hit ends at token {args.computed_tokens + hit})" if hit else "")
    )
    return 0
