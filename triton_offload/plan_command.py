"""``triton-offload plan``: print a model's offload plan as a table.

Pure Python, no torch: shows what the planner decides for a geometry (each group's
span, chunk, window, alignment count and store-reachable chunks for a sample
prompt) and what a lookup of that prompt returns when every reachable chunk is
stored. Groups come from a named preset or from repeated ``--group`` flags.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from triton_offload.cli_args import int_at_least
from triton_offload.groups import MAMBA_CACHE_MODES, GroupKind, GroupSpec, ParallelSpec
from triton_offload.plan import OffloadPlan, plan_offload

__all__ = ["PRESETS", "configure_parser", "parse_group", "run"]

# name -> (description, groups). Block sizes are per rank; DCP scales attention spans.
PRESETS: dict[str, tuple[str, tuple[GroupSpec, ...]]] = {
    "dense": (
        "Llama-like dense model: one full-attention group, 16-token blocks",
        (GroupSpec("full_attention", 16, name="attention"),),
    ),
    "mamba-hybrid": (
        "Qwen3-Next/Nemotron-H-like hybrid: full attention + Mamba state (align mode), "
        "16-token blocks (the seed geometry; add --dcp 2 for spans 32/16; the bench preset "
        "of this family uses the larger attention blocks vLLM's hybrid allocator picks)",
        (
            GroupSpec("full_attention", 16, name="attention"),
            GroupSpec("mamba", 16, mamba_cache_mode="align", name="mamba"),
        ),
    ),
    # Same model family and window as `triton-offload bench`'s swa-hybrid preset.
    "swa-hybrid": (
        "gpt-oss-like sliding-window hybrid: full attention + sliding window of 128 tokens, "
        "16-token blocks",
        (
            GroupSpec("full_attention", 16, name="full"),
            GroupSpec("sliding_window", 16, sliding_window=128, name="sliding"),
        ),
    ),
    "mla-swa-hybrid": (
        "MLA + sliding-window hybrid: MLA with 256-token blocks + sliding window of 128 "
        "tokens with 64-token blocks (DeepSeek-V4-like)",
        (
            GroupSpec("mla", 256, name="mla"),
            GroupSpec("sliding_window", 64, sliding_window=128, name="swa"),
        ),
    ),
}

_GROUP_HELP = (
    "a cache group as KIND:BLOCK[:window=TOKENS][:mode=MODE][:eagle][:name=NAME] "
    f"(KIND: {', '.join(k.value for k in GroupKind)}; MODE: {', '.join(MAMBA_CACHE_MODES)}; "
    "window= is the sliding window or the local-attention chunk); repeatable, in group order"
)


def parse_group(text: str) -> GroupSpec:
    """``KIND:BLOCK[:window=N][:mode=M][:eagle][:name=S]`` -> GroupSpec.

    Raises ``argparse.ArgumentTypeError`` with the offending part, so argparse exits
    with status 2 and a usage line.
    """
    parts = text.split(":")
    if len(parts) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KIND:BLOCK[:option...]")
    kind, block_text, *options = parts
    try:
        block_size = int(block_text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: block size {block_text!r} is not an integer"
        ) from None
    kwargs: dict[str, Any] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if key == "eagle" and not sep:
            kwargs["is_eagle"] = True
        elif key == "window" and sep:
            try:
                window = int(value)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: window {value!r} is not an integer"
                ) from None
            field = (
                "attention_chunk_size"
                if kind == GroupKind.CHUNKED_LOCAL.value
                else "sliding_window"
            )
            kwargs[field] = window
        elif key == "mode" and sep:
            kwargs["mamba_cache_mode"] = value
        elif key == "name" and sep:
            kwargs["name"] = value
        else:
            raise argparse.ArgumentTypeError(
                f"{text!r}: unknown option {option!r} (window=N, mode=M, eagle, name=S)"
            )
    try:
        return GroupSpec(kind, block_size, **kwargs)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


def configure_parser(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="; ".join(f"{name}: {desc}" for name, (desc, _) in PRESETS.items()),
    )
    source.add_argument(
        "--group", action="append", type=parse_group, metavar="KIND:BLOCK[:...]", help=_GROUP_HELP
    )
    parser.add_argument(
        "--tp", type=int_at_least(1, "TP size"), default=1, help="tensor-parallel size"
    )
    parser.add_argument(
        "--dcp", type=int_at_least(1, "DCP size"), default=1, help="decode-context-parallel size"
    )
    parser.add_argument(
        "--pcp", type=int_at_least(1, "PCP size"), default=1, help="prefill-context-parallel size"
    )
    parser.add_argument(
        "--blocks-per-chunk",
        type=int_at_least(1, "blocks per chunk"),
        default=1,
        help="GPU blocks per offload chunk",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int_at_least(0, "prompt tokens"),
        default=1024,
        help="sample prompt length",
    )
    parser.add_argument(
        "--computed-tokens",
        type=int_at_least(0, "computed tokens"),
        default=0,
        help="tokens of the prompt already on the GPU for the sample lookup",
    )


def _fail(message: str) -> int:
    """Report a cross-flag error the way argparse does (status 2)."""
    print(f"triton-offload plan: error: {message}", file=sys.stderr)
    return 2


def build_plan(args: argparse.Namespace) -> OffloadPlan:
    groups = PRESETS[args.preset][1] if args.preset else tuple(args.group)
    parallel = ParallelSpec(tp_size=args.tp, dcp_size=args.dcp, pcp_size=args.pcp)
    return plan_offload(groups, parallel, blocks_per_chunk=args.blocks_per_chunk)


def run(args: argparse.Namespace) -> int:
    if args.computed_tokens > args.prompt_tokens:
        return _fail(
            f"--computed-tokens {args.computed_tokens} exceeds --prompt-tokens {args.prompt_tokens}"
        )
    try:
        plan = build_plan(args)
    except (TypeError, ValueError) as error:
        return _fail(str(error))
    prompt = args.prompt_tokens
    if args.preset:
        print(f"preset {args.preset}: {PRESETS[args.preset][0]}")
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
