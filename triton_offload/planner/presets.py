"""The model presets of every ``triton-offload`` command: one name, one model.

Pure Python, no torch: ``triton-offload plan`` and ``--help`` read this table without
importing the data path. A preset is a model as the engine allocates its KV cache:
its cache groups (kind, block size per rank, window, Mamba mode) and the TP size it is
deployed at. The same name means the same groups in every command:

- ``plan`` accepts every preset and prints its plan;
- ``bench`` accepts the presets with page shapes (``bench=True``): it moves the
  model's real K/V, MLA and Mamba pages (their byte sizes live beside the harness,
  in ``triton_offload.bench.cases``, derived from the model's dimensions);
- ``verify`` accepts the ``-tiny`` presets: scaled-down models small enough to run
  end to end on a CPU (16-token blocks, a 32-wide hidden state), with the group kinds
  of the model they are named after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from triton_offload.planner.groups import GroupKind, GroupSpec

__all__ = [
    "BF16",
    "FP32",
    "PRESETS",
    "VERIFY_SLIDING_WINDOW",
    "GroupPages",
    "KiB",
    "MiB",
    "ModelPreset",
    "attention_page_bytes",
    "describe_presets",
    "mamba_conv_bytes",
    "mamba_ssm_bytes",
    "mla_page_bytes",
    "preset_names",
]

#: Sliding window (tokens) of the verification models' sliding-window layer. 24 is
#: not a multiple of the 16-token block, so a window starts inside a block.
VERIFY_SLIDING_WINDOW = 24
#: Block size (tokens per rank) of the verification models.
VERIFY_BLOCK_SIZE = 16


KiB = 1024
MiB = 1024 * KiB
BF16 = 2
FP32 = 4


def attention_page_bytes(block_size: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one K (or V) page: ``block_size * kv_heads * head_dim * dtype_bytes``."""
    return block_size * kv_heads * head_dim * dtype_bytes


def mla_page_bytes(block_size: int, latent_values: int, dtype_bytes: int) -> int:
    """Bytes of one MLA latent page (compressed KV + rope key, one plane per layer)."""
    return block_size * latent_values * dtype_bytes


def mamba_conv_bytes(conv_dim: int, d_conv: int, dtype_bytes: int) -> int:
    """Bytes of one conv state: ``(conv_dim, d_conv - 1)`` values."""
    return conv_dim * (d_conv - 1) * dtype_bytes


def mamba_ssm_bytes(heads: int, head_dim: int, d_state: int, dtype_bytes: int) -> int:
    """Bytes of one SSM state: ``(heads, head_dim, d_state)`` values."""
    return heads * head_dim * d_state * dtype_bytes


@dataclass(frozen=True)
class GroupPages:
    """The pages ``bench`` moves for one group: ``layers`` layers, each with one plane
    per entry of ``plane_bytes``."""

    group: str
    layers: int
    plane_bytes: tuple[int, ...]


@dataclass(frozen=True)
class ModelPreset:
    """One named model: its cache groups as the engine declares them.

    ``tp_size`` is the TP size the name states (``llama3.1-8b-tp4``): ``plan`` uses it
    and refuses another ``--tp``; None when the name states none (``--tp`` is free).
    ``pages`` gives, per group, the layers and the page bytes of one layer's planes
    (K and V: two; MLA: one; Mamba: conv then SSM) that ``triton-offload bench`` moves;
    empty when bench has no page shapes for the model.
    ``verify_layers`` is the layer stack of a verification model (``attention``,
    ``sliding_window``, ``mamba``), set only for ``-tiny`` presets.
    """

    name: str
    description: str
    groups: tuple[GroupSpec, ...]
    tp_size: int | None = None
    pages: tuple[GroupPages, ...] = ()
    verify_layers: tuple[str, ...] | None = None

    @property
    def bench(self) -> bool:
        """Whether ``triton-offload bench`` has this model's page shapes."""
        return bool(self.pages)

    @property
    def commands(self) -> tuple[str, ...]:
        """The ``triton-offload`` commands that accept this preset."""
        return (
            "plan",
            *(["bench"] if self.bench else []),
            *(["verify"] if self.verify_layers else []),
        )


def _verify_groups(layers: Sequence[str]) -> tuple[GroupSpec, ...]:
    """The cache groups of a verification model: one per layer kind present, in the
    order attention, sliding window, Mamba (the model's own group order)."""
    block = VERIFY_BLOCK_SIZE
    groups = {
        "attention": GroupSpec(GroupKind.FULL_ATTENTION, block, name="attention"),
        "sliding_window": GroupSpec(
            GroupKind.SLIDING_WINDOW, block, sliding_window=VERIFY_SLIDING_WINDOW,
            name="sliding_window",
        ),
        "mamba": GroupSpec(GroupKind.MAMBA, block, mamba_cache_mode="align", name="mamba"),
    }  # fmt: skip
    return tuple(spec for kind, spec in groups.items() if kind in layers)


def _tiny(name: str, description: str, layers: tuple[str, ...]) -> ModelPreset:
    return ModelPreset(name, description, _verify_groups(layers), verify_layers=layers)


_LLAMA = (GroupSpec(GroupKind.FULL_ATTENTION, 16, name="attention"),)
# Llama-3.1-8B: 8 KV heads x 128, bf16, 16-token blocks; TP 4 splits the heads 2 per rank.
_LLAMA_TP1_PAGE = attention_page_bytes(16, 8, 128, BF16)
_LLAMA_TP4_PAGE = attention_page_bytes(16, 8 // 4, 128, BF16)

_ALL: tuple[ModelPreset, ...] = (
    ModelPreset(
        "llama3.1-8b-tp1",
        "Llama-3.1-8B at TP 1: 32 full-attention layers, 8 KV heads x 128, bf16, "
        "16-token blocks (32 KiB K and V pages)",
        _LLAMA,
        tp_size=1,
        pages=(GroupPages("attention", 32, (_LLAMA_TP1_PAGE,) * 2),),
    ),
    ModelPreset(
        "llama3.1-8b-tp4",
        "Llama-3.1-8B at TP 4: the same model, 2 KV heads per rank (8 KiB pages, deep in "
        "the small-page DMA cliff)",
        _LLAMA,
        tp_size=4,
        pages=(GroupPages("attention", 32, (_LLAMA_TP4_PAGE,) * 2),),
    ),
    ModelPreset(
        "deepseek-mla",
        "DeepSeek-like MLA: 61 layers, one 576-value latent page per layer and block, bf16, "
        "16-token blocks",
        (GroupSpec(GroupKind.MLA, 16, name="mla"),),
        pages=(GroupPages("mla", 61, (mla_page_bytes(16, 576, BF16),)),),
    ),
    ModelPreset(
        "mamba-hybrid",
        "Qwen3-Next-like hybrid: 12 full-attention layers + 36 Mamba layers (align mode), "
        "256-token blocks (vLLM's hybrid allocator raises the attention block toward the "
        "Mamba page)",
        (
            GroupSpec(GroupKind.FULL_ATTENTION, 256, name="attention"),
            GroupSpec(GroupKind.MAMBA, 256, mamba_cache_mode="align", name="mamba"),
        ),
        pages=(
            GroupPages("attention", 12, (attention_page_bytes(256, 2, 256, BF16),) * 2),
            # Qwen3-Next-like linear attention: conv over 2*16*128 + 32*128 = 8192
            # channels with kernel 4, recurrent state 32 heads x 128 x 128 kept in fp32.
            GroupPages(
                "mamba", 36, (mamba_conv_bytes(8192, 4, BF16), mamba_ssm_bytes(32, 128, 128, FP32))
            ),
        ),
    ),
    ModelPreset(
        "swa-hybrid",
        "gpt-oss-like hybrid: 18 full-attention + 18 sliding-window layers (128 tokens), "
        "8 KV heads x 64, 16-token blocks",
        (
            GroupSpec(GroupKind.FULL_ATTENTION, 16, name="full"),
            GroupSpec(GroupKind.SLIDING_WINDOW, 16, sliding_window=128, name="sliding"),
        ),
        pages=(
            GroupPages("full", 18, (attention_page_bytes(16, 8, 64, BF16),) * 2),
            GroupPages("sliding", 18, (attention_page_bytes(16, 8, 64, BF16),) * 2),
        ),
    ),
    ModelPreset(
        "mla-swa-hybrid",
        "DeepSeek-V4-like hybrid: MLA with 256-token blocks + a 128-token sliding window "
        "with 64-token blocks",
        (
            GroupSpec(GroupKind.MLA, 256, name="mla"),
            GroupSpec(GroupKind.SLIDING_WINDOW, 64, sliding_window=128, name="swa"),
        ),
    ),
    _tiny(
        "mamba-hybrid-tiny",
        "mamba-hybrid scaled down: 2 full-attention + 2 Mamba layers (align mode), 16-token "
        "blocks (with --tp 2 --dcp 2: spans 32 and 16, the DCP/Mamba span geometry)",
        ("attention", "mamba", "attention", "mamba"),
    ),
    _tiny(
        "swa-mamba-hybrid-tiny",
        "tiny model with every group kind verify checks: full attention + sliding window "
        f"({VERIFY_SLIDING_WINDOW} tokens) + 2 Mamba layers (align mode), 16-token blocks",
        ("attention", "mamba", "sliding_window", "mamba"),
    ),
    _tiny(
        "mamba-tiny",
        "tiny Mamba-only model: 2 Mamba layers (align mode), 16-token blocks; no attention "
        "grid hides a hit that ends between two stored states",
        ("mamba", "mamba"),
    ),
)

#: name -> preset, in the order ``--help`` and docs/commands.md list them.
PRESETS: dict[str, ModelPreset] = {p.name: p for p in _ALL}


def preset_names(command: str) -> list[str]:
    """Names of the presets ``command`` (``plan``, ``bench`` or ``verify``) accepts."""
    if command not in ("plan", "bench", "verify"):
        raise ValueError(f"command {command!r} is not one of plan, bench, verify")
    return [name for name, preset in PRESETS.items() if command in preset.commands]


def describe_presets(width: int = 88) -> str:
    """The preset table as text: name, the commands that accept it, the model (wrapped
    to ``width`` columns)."""
    import textwrap

    name_width = max(len(name) for name in PRESETS)
    lines = []
    for name, preset in PRESETS.items():
        text = f"[{', '.join(preset.commands)}] {preset.description}"
        indent = " " * (name_width + 4)
        wrapped = textwrap.wrap(text, width=width - len(indent))
        lines.append(f"  {name.ljust(name_width)}  {wrapped[0]}")
        lines += [indent + part for part in wrapped[1:]]
    return "\n".join(lines)
