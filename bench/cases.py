"""Benchmark cases: the jobs ``bench`` times, from the model presets and the raw sweep.

The models and their page shapes are ``triton_offload.planner.presets``, the table every
command reads (layer counts and per-layer page bytes, derived there from the model's
dimensions). A FlashAttention-style layer stores K and V as two planes of
``block_size * kv_heads * head_dim * dtype_bytes`` bytes per block (Llama-3.1-8B, bf16,
16-token blocks: ``16 * 8 * 128 * 2 = 32 KiB``; at TP 4 the 8 KV heads split into 2 per
rank: 8 KiB). An MLA layer stores one latent plane (576 values); a Mamba layer one conv
state plane (KB-scale) and one SSM state plane (MB-scale), independent of the block size.

A *case* is one job: per group, how many GPU blocks move (a prompt of
``PROMPT_TOKENS`` tokens: every block of an unbounded group, the window of a
sliding-window group, the one state at the hit end of a Mamba group). On a machine
without CUDA a case keeps its page shapes but its layer counts are scaled down so that
one job moves tens of MB, not GBs (see :func:`scale_case`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from triton_offload.planner.groups import GroupKind, GroupSpec
from triton_offload.planner.presets import PRESETS as MODELS
from triton_offload.planner.presets import KiB, MiB, ModelPreset

#: Tokens of the prompt a preset job stores or loads (2k tokens: a common prefix length,
#: and 128 full-attention blocks of 16 tokens).
PROMPT_TOKENS = 2048

#: Byte size of one job on a GPU is the full model; without CUDA layer counts are scaled
#: so one job moves about this many bytes (tens of MB; ~2 minutes for the default run
#: on 2 CPU cores).
CPU_TARGET_BYTES = 24 * MiB
QUICK_TARGET_BYTES = 2 * MiB


@dataclass(frozen=True)
class GroupShape:
    """One cache group of a model: its kind, block size, layers and per-layer planes.

    ``plane_bytes`` lists the page bytes of one layer's planes (K and V: two entries;
    MLA: one; Mamba: conv then SSM). ``blocks_per_job`` is how many GPU blocks of this
    group one job moves.
    """

    name: str
    kind: str
    block_size: int
    layers: int
    plane_bytes: tuple[int, ...]
    blocks_per_job: int
    sliding_window: int | None = None
    mamba_cache_mode: str = "none"

    @property
    def layer_bytes_per_block(self) -> int:
        return sum(self.plane_bytes)

    @property
    def job_bytes(self) -> int:
        return self.layers * self.layer_bytes_per_block * self.blocks_per_job

    @property
    def job_pages(self) -> int:
        return self.layers * len(self.plane_bytes) * self.blocks_per_job


@dataclass(frozen=True)
class Case:
    """One benchmark case: a named set of groups; one job moves ``job_bytes`` bytes."""

    name: str
    description: str
    groups: tuple[GroupShape, ...]
    sweep: bool = False

    @property
    def job_bytes(self) -> int:
        return sum(g.job_bytes for g in self.groups)

    @property
    def job_pages(self) -> int:
        return sum(g.job_pages for g in self.groups)

    @property
    def page_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({b for g in self.groups for b in g.plane_bytes}))

    @property
    def typical_page_bytes(self) -> int:
        """Page size that carries most of the bytes (the x position in the plot)."""
        weight: dict[int, int] = {}
        for g in self.groups:
            for b in g.plane_bytes:
                weight[b] = weight.get(b, 0) + b * g.layers * g.blocks_per_job
        return max(weight, key=lambda b: (weight[b], b))


def _blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def _blocks_per_job(spec: GroupSpec) -> int:
    """GPU blocks of ``spec``'s group one job of ``PROMPT_TOKENS`` tokens moves."""
    if spec.kind is GroupKind.MAMBA:
        return 1  # the one state at the hit end
    if spec.kind is GroupKind.SLIDING_WINDOW:
        assert spec.sliding_window is not None
        # the window plus the partially covered block before it
        return _blocks(spec.sliding_window, spec.block_size) + 1
    return _blocks(PROMPT_TOKENS, spec.block_size)


def model_case(preset: ModelPreset) -> Case:
    """The bench case of a model preset with page shapes: every group with its layers,
    page bytes and the blocks one job of ``PROMPT_TOKENS`` tokens moves."""
    pages = {entry.group: entry for entry in preset.pages}
    if sorted(pages) != sorted(spec.name for spec in preset.groups):
        raise ValueError(
            f"bench pages for {preset.name} name groups {sorted(pages)}, "
            f"the model has {[spec.name for spec in preset.groups]}"
        )
    groups = tuple(
        GroupShape(
            name=spec.name,
            kind=spec.kind.value,
            block_size=spec.block_size,
            layers=pages[spec.name].layers,
            plane_bytes=pages[spec.name].plane_bytes,
            blocks_per_job=_blocks_per_job(spec),
            sliding_window=spec.sliding_window,
            mamba_cache_mode=spec.mamba_cache_mode,
        )
        for spec in preset.groups
    )
    return Case(name=preset.name, description=preset.description, groups=groups)


#: name -> the bench case of every model preset with page shapes.
CASES: dict[str, Case] = {name: model_case(p) for name, p in MODELS.items() if p.bench}

#: Raw sweep axes: page size 4 KiB .. 2 MiB, pages per job 16 .. 100k.
SWEEP_PAGE_BYTES: tuple[int, ...] = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 2 * MiB)
SWEEP_PAGES: tuple[int, ...] = (16, 1024, 16384, 100_000)


def sweep_case(page_bytes: int, pages: int) -> Case:
    """One raw-sweep case: one group, one layer, one plane of ``page_bytes``."""
    if page_bytes < 1:
        raise ValueError(f"page size {page_bytes} must be >= 1 byte")
    if pages < 1:
        raise ValueError(f"pages per job {pages} must be >= 1")
    return Case(
        name=f"sweep-{size_label(page_bytes)}x{pages}",
        description=f"raw sweep: {pages} pages of {size_label(page_bytes)}",
        groups=(
            GroupShape(
                name="pages",
                kind="full_attention",
                block_size=16,
                layers=1,
                plane_bytes=(page_bytes,),
                blocks_per_job=pages,
            ),
        ),
        sweep=True,
    )


def sweep_cases(
    page_sizes: Sequence[int] = SWEEP_PAGE_BYTES,
    pages: Sequence[int] = SWEEP_PAGES,
    *,
    max_job_bytes: int,
) -> tuple[list[Case], list[str]]:
    """The sweep grid, minus combinations over ``max_job_bytes`` (returned as notes)."""
    cases: list[Case] = []
    skipped: list[str] = []
    for size in page_sizes:
        for count in pages:
            if size * count > max_job_bytes:
                skipped.append(
                    f"{size_label(size)} x {count} pages = {size * count / MiB:.0f} MiB "
                    f"exceeds the {max_job_bytes / MiB:.0f} MiB per-job cap"
                )
                continue
            cases.append(sweep_case(size, count))
    return cases, skipped


def scale_case(case: Case, target_bytes: int) -> Case:
    """Scale ``case`` down to at most ``target_bytes`` per job, keeping its page shapes.

    Layer counts shrink first (never below 1 per group); if that is not enough, the
    blocks per job of the biggest groups shrink too (never below 1). One layer and one
    block of every group is the floor, even above the target. A case already under the
    target is returned unchanged.
    """
    if target_bytes < 1:
        raise ValueError(f"target bytes {target_bytes} must be >= 1")
    if case.job_bytes <= target_bytes:
        return case
    factor = target_bytes / case.job_bytes
    groups = [replace(g, layers=max(1, math.floor(g.layers * factor))) for g in case.groups]
    excess = sum(g.job_bytes for g in groups) - target_bytes
    for index in sorted(range(len(groups)), key=lambda i: -groups[i].job_bytes):
        if excess <= 0:
            break
        group = groups[index]
        per_block = group.layers * group.layer_bytes_per_block
        drop = min(group.blocks_per_job - 1, math.ceil(excess / per_block))
        groups[index] = replace(group, blocks_per_job=group.blocks_per_job - drop)
        excess -= drop * per_block
    return replace(case, groups=tuple(groups))


def size_label(size: int) -> str:
    """``4096 -> '4KiB'``, ``2097152 -> '2MiB'``, other sizes in bytes."""
    if size % MiB == 0:
        return f"{size // MiB}MiB"
    if size % KiB == 0:
        return f"{size // KiB}KiB"
    return f"{size}B"


def parse_size(text: str) -> int:
    """``'4k'``, ``'4KiB'``, ``'2m'``, ``'512'`` -> bytes; ValueError naming the text."""
    cleaned = text.strip().lower().replace("ib", "").replace("b", "")
    units = {"k": KiB, "m": MiB, "g": 1024 * MiB}
    try:
        if cleaned and cleaned[-1] in units:
            value = int(cleaned[:-1]) * units[cleaned[-1]]
        else:
            value = int(cleaned)
    except ValueError:
        raise ValueError(f"page size {text!r} is not a size (e.g. 4k, 64KiB, 2m)") from None
    if value < 1:
        raise ValueError(f"page size {text!r} must be at least 1 byte")
    return value


__all__ = [
    "CASES",
    "CPU_TARGET_BYTES",
    "PROMPT_TOKENS",
    "QUICK_TARGET_BYTES",
    "SWEEP_PAGES",
    "SWEEP_PAGE_BYTES",
    "Case",
    "GroupShape",
    "model_case",
    "parse_size",
    "scale_case",
    "size_label",
    "sweep_case",
    "sweep_cases",
]
