"""The fake vLLM ``OffloadingConfig`` the vLLM tests build their specs from.

vLLM builds this config from its engine and KV-cache configs; the tests write it out
directly: groups, bytes per block, ``extra_config``, the parallel layout and the
host-memory layout. vLLM is imported when a config is built, so a test module that
skips without vLLM can still import this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def hybrid_groups(attention_tokens_per_block: int = 16) -> tuple[Any, ...]:
    """A full-attention group (``attn.0``) and a Mamba group (``mamba.0``, a window of
    one chunk) of 16 tokens per block."""
    from vllm.v1.kv_offload.config import OffloadingGroupConfig

    return (
        OffloadingGroupConfig(
            tokens_per_block=attention_tokens_per_block, layer_names=("attn.0",), group_id=0
        ),
        OffloadingGroupConfig(
            tokens_per_block=16,
            layer_names=("mamba.0",),
            group_id=1,
            sliding_window_size_in_chunks=1,
        ),
    )


def offloading_config(
    *,
    groups: Sequence[Any],
    worker_bytes: int,
    blocks_per_chunk: int,
    extra_config: dict[str, Any],
    engine_id: str,
    rank: int = 0,
    world_size: int = 1,
    tp_size: int | None = None,
    dcp_size: int = 1,
    replicated: bool = False,
    model_name: str = "test",
    max_model_len: int = 1024,
) -> Any:
    """An ``OffloadingConfig`` for one worker; ``tp_size`` defaults to ``world_size``."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=tuple(groups),
        worker_kv_bytes_per_block=worker_bytes,
        enable_kv_cache_events=False,
        extra_config=extra_config,
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model_name, dtype="bfloat16", max_model_len=max_model_len),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size if tp_size is None else tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=dcp_size,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=replicated,
    )
