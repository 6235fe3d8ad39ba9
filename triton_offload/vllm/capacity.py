"""Whether ``cpu_bytes_to_use`` holds one chunk, judged before the model loads.

The spec knows a chunk's bytes once vLLM laid the KV cache out (after the model loaded):
``worker_kv_bytes_per_block`` from the cache tensors, the seal, the region's alignment
(:class:`ChunkRow`, :func:`no_chunk_message`). Before that, the tokens of a GPU block are
not settled (the attention backend may change the configured block size when the
worker starts: vLLM's CPU backend took 128-token blocks where the config said 16), but a
plain attention model's bytes per token are: K and V of every layer, ``2 x KV heads per
rank x head size x dtype bytes``. A chunk holds at least one token per GPU block, so a
capacity below that floor (:class:`ChunkFloor`) holds no chunk whatever the block size,
and is refused while vLLM builds its config (:func:`check_capacity_before_load`); one
between the floor and a chunk is refused by the spec after the model loaded. Models
whose bytes per token the configuration does not pin down (hybrid, MLA,
attention-free, layers without attention or sharing another's KV, pipeline or context
parallel, canonical rows) are left to the spec's check.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

from triton_offload.transfer.seal import SEAL_BYTES


@dataclasses.dataclass(frozen=True)
class ChunkRow:
    """A chunk's host row: ``copies`` worker pages of ``blocks_per_chunk`` GPU blocks of
    ``block_bytes`` (plus a seal each when ``sealed``), rounded up to ``alignment``."""

    copies: int
    blocks_per_chunk: int
    block_bytes: int
    sealed: bool
    alignment: int

    @property
    def row_bytes(self) -> int:
        page = self.blocks_per_chunk * self.block_bytes + (SEAL_BYTES if self.sealed else 0)
        return -(-page * self.copies // self.alignment) * self.alignment


def no_chunk_message(cpu_bytes: Any, row: ChunkRow) -> str:
    """The refusal of a ``cpu_bytes_to_use`` that holds no chunk (one text, before and
    after the model loads)."""
    seals = f" + a {SEAL_BYTES}-byte seal" if row.sealed else ""
    return (
        f"kv_connector_extra_config['cpu_bytes_to_use'] {cpu_bytes} holds no chunk: one "
        f"chunk takes {row.row_bytes} bytes ({row.copies} worker page(s) of "
        f"{row.blocks_per_chunk} blocks x {row.block_bytes} bytes{seals} each, the row "
        f"rounded up to {row.alignment} bytes); give at least {row.row_bytes} (one chunk), "
        "and many times that to hold whole prompts"
    )


@dataclasses.dataclass(frozen=True)
class ChunkFloor:
    """The least a chunk's host row can take before the GPU block's tokens are known:
    ``copies`` worker pages of at least ``tokens`` tokens of ``token_bytes`` each (plus a
    seal each when ``sealed``), rounded up to ``alignment``."""

    copies: int
    tokens: int
    token_bytes: int
    sealed: bool
    alignment: int

    @property
    def row_bytes(self) -> int:
        page = self.tokens * self.token_bytes + (SEAL_BYTES if self.sealed else 0)
        return -(-page * self.copies // self.alignment) * self.alignment


def floor_message(cpu_bytes: Any, floor: ChunkFloor) -> str:
    """The refusal of a ``cpu_bytes_to_use`` below :class:`ChunkFloor` (before the model
    loads: the exact figure comes with the spec's check)."""
    seals = f" + a {SEAL_BYTES}-byte seal" if floor.sealed else ""
    return (
        f"kv_connector_extra_config['cpu_bytes_to_use'] {cpu_bytes} holds no chunk: one "
        f"chunk takes at least {floor.row_bytes} bytes ({floor.copies} worker page(s) of "
        f"at least {floor.tokens} token(s) x {floor.token_bytes} bytes{seals} each, the row "
        f"rounded up to {floor.alignment} bytes; the exact size is known once the model's "
        f"KV cache is laid out); give at least {floor.row_bytes}, and many times that to "
        "hold whole prompts"
    )


def _item_bytes(dtype: Any) -> int | None:
    itemsize = getattr(dtype, "itemsize", None)
    return int(itemsize) if isinstance(itemsize, int) and itemsize > 0 else None


def _least_chunk_tokens(extra: Mapping[str, Any]) -> int:
    """The fewest tokens a chunk can hold: its GPU blocks at one token each, or the
    tokens ``block_size`` names (checked by ``check_chunk_size``)."""
    if extra.get("blocks_per_chunk") is not None:
        return int(extra["blocks_per_chunk"])
    if extra.get("block_size") is not None:
        return int(extra["block_size"])
    return 1


def chunk_floor_before_load(
    extra: Mapping[str, Any], vllm_config: Any, alignment: int
) -> ChunkFloor | None:
    """The least a chunk's row can take, from the configuration alone, or None where the
    configuration does not pin a token's bytes down (see the module docstring)."""
    model = getattr(vllm_config, "model_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if model is None or parallel is None or cache is None or extra.get("canonical_layout"):
        return None
    if model.is_hybrid or model.use_mla or model.is_attention_free or model.has_noops:
        return None
    if getattr(model, "is_encoder_decoder", False):
        return None
    text = getattr(model, "hf_text_config", None)
    if getattr(text, "num_kv_shared_layers", 0) or getattr(text, "kv_sharing", None):
        return None
    if (
        parallel.pipeline_parallel_size != 1
        or parallel.decode_context_parallel_size != 1
        or getattr(parallel, "prefill_context_parallel_size", 1) != 1
    ):
        return None
    if cache.cache_dtype == "auto":
        item = _item_bytes(model.dtype)
    elif str(cache.cache_dtype).startswith("fp8"):
        item = 1
    else:
        return None
    if item is None:
        return None
    layers = model.get_num_layers_by_block_type(parallel, "attention")
    token_bytes = layers * 2 * model.get_num_kv_heads(parallel) * model.get_head_size() * item
    if token_bytes <= 0:
        return None
    return ChunkFloor(
        copies=int(parallel.world_size),
        tokens=_least_chunk_tokens(extra),
        token_bytes=int(token_bytes),
        sealed=bool(extra.get("verify_chunks", True)),
        alignment=alignment,
    )


def building_vllm_config(max_frames: int = 40) -> Any:
    """The ``VllmConfig`` whose construction is calling into this package, or None: the
    nearest caller frame whose ``self`` is one (vLLM hands the connector class only its
    KV transfer config while it builds the ``VllmConfig``)."""
    try:
        from vllm.config import VllmConfig
    except ImportError:  # pragma: no cover - only called from vLLM's own calls
        return None
    frame = inspect.currentframe()
    try:
        for _ in range(max_frames):
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, VllmConfig):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame kept here would keep every caller's locals alive


def check_capacity_before_load(extra: Mapping[str, Any], vllm_config: Any, alignment: int) -> None:
    """ValueError (:func:`floor_message`) when ``cpu_bytes_to_use`` is below the least a
    chunk of the model ``vllm_config`` describes can take; nothing where that is unknown."""
    floor = chunk_floor_before_load(extra, vllm_config, alignment)
    if floor is None:
        return
    if int(extra["cpu_bytes_to_use"]) < floor.row_bytes:
        raise ValueError(floor_message(extra["cpu_bytes_to_use"], floor))


__all__ = [
    "ChunkFloor",
    "ChunkRow",
    "building_vllm_config",
    "check_capacity_before_load",
    "chunk_floor_before_load",
    "floor_message",
    "no_chunk_message",
]
