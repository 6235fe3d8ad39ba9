"""Why a hit that ends inside a chunk needs that chunk, even unread (vLLM 0.33, CPU).

DESIGN's validity rule asks only for the chunks holding tokens a resumed prefill reads.
vLLM 0.33's scheduler-side load (``OffloadingConnectorScheduler.update_state_after_alloc``)
loads, for every group, each allocated block from the computed boundary up to
``cdiv(hit_end, block_size)``, and so the chunk holding the first recomputed token, read
or not. A one-token sliding window beside full attention, 41 tokens: at 40 the window
reads nothing, but its block of tokens 32..47 is allocated and vLLM loads chunk 2, which
no 41-token prompt has whole: its scheduler asserts. The connector's hit is 32, which
vLLM loads. Real vLLM objects; skipped where vLLM does not import.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.connector_serving import VLLM_ERROR, Engine, attention, window

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")


def _load(engine: Engine, request: Any, hit: int) -> None:
    """vLLM's load preparation for ``hit`` external tokens, with the blocks its KV cache
    manager allocates: attention blocks 0..5, window blocks 0 and 1 out of the one-token
    window (null), block 2 (tokens 32..47, the first recomputed token's) allocated."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    null = KVCacheBlock(0)
    null.is_null = True
    attention_blocks = [KVCacheBlock(i) for i in range(1, 7)]
    window_blocks = [null, null, KVCacheBlock(7)]
    engine.scheduler._current_batch_sync_loads = set()
    engine.connector.get_num_new_matched_tokens(request, 0)
    engine.scheduler.update_state_after_alloc(
        request, KVCacheBlocks((attention_blocks, window_blocks)), hit
    )


def _engine() -> tuple[Engine, Any]:
    engine = Engine([attention(8), window(16, 1)])
    request = engine.request("r", 41)
    engine.store(request, [[0, 1, 2, 3, 4], [0, 1]])
    return engine, request


def test_connector_hit_is_one_vllm_can_load() -> None:
    engine, request = _engine()
    assert engine.hit(request) == 32
    _load(engine, request, 32)  # no assertion inside vLLM
    state = engine.scheduler._req_status["r"]
    assert state.loaded_from_offload


def test_the_unread_chunk_hit_is_one_vllm_cannot_load() -> None:
    """40 passes DESIGN's read-only rule, but vLLM asks for chunk 2 of the window group,
    past the keys of the prompt's whole chunks."""
    engine, request = _engine()
    engine.hit(request)
    with pytest.raises(AssertionError) as failed:
        _load(engine, request, 40)
    assert "len(offload_keys) >= end_chunk_idx" in str(failed.traceback[-1].statement)
