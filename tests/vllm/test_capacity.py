"""A capacity that holds no chunk, judged from the model's configuration before it loads.

The judge here is the rule itself: a plain attention model's token takes K and V of every
attention layer, ``2 x KV heads per rank x head size x dtype bytes``; a chunk holds at
least one token per GPU block (or the tokens ``block_size`` names); its row is
``copies`` worker pages of those tokens plus a 64-byte seal each, rounded up to the
region's alignment. Below that floor no block size can make a chunk fit. That the floor
never exceeds the spec's exact figure after the model loaded, and is refused before the
model loads, is checked in vLLM's real engine (``tests/system/test_vllm_serve_real.py``).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

try:
    from triton_offload.vllm.capacity import (
        ChunkRow,
        check_capacity_before_load,
        chunk_floor_before_load,
        floor_message,
    )

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")

ALIGNMENT = 4096


def vllm_config(**changes: Any) -> Any:
    """A stand-in for vLLM's ``VllmConfig``: a 4-layer model with 2 KV heads per rank of
    64 dims in bfloat16, 16-token GPU blocks, TP 2."""
    fields = {
        "layers": 4,
        "kv_heads": 2,
        "head_size": 64,
        "dtype": torch.bfloat16,
        "cache_dtype": "auto",
        "block_size": 16,
        "world_size": 2,
        "pp": 1,
        "dcp": 1,
        "pcp": 1,
        "is_hybrid": False,
        "use_mla": False,
        "is_attention_free": False,
        "has_noops": False,
        "text": types.SimpleNamespace(),
    }
    fields.update(changes)
    model = types.SimpleNamespace(
        is_hybrid=fields["is_hybrid"],
        use_mla=fields["use_mla"],
        is_attention_free=fields["is_attention_free"],
        has_noops=fields["has_noops"],
        is_encoder_decoder=False,
        hf_text_config=fields["text"],
        dtype=fields["dtype"],
        get_num_layers_by_block_type=lambda parallel, kind: fields["layers"],
        get_num_kv_heads=lambda parallel: fields["kv_heads"],
        get_head_size=lambda: fields["head_size"],
    )
    parallel = types.SimpleNamespace(
        world_size=fields["world_size"],
        pipeline_parallel_size=fields["pp"],
        decode_context_parallel_size=fields["dcp"],
        prefill_context_parallel_size=fields["pcp"],
    )
    cache = types.SimpleNamespace(
        block_size=fields["block_size"], cache_dtype=fields["cache_dtype"]
    )
    return types.SimpleNamespace(model_config=model, parallel_config=parallel, cache_config=cache)


def expected_row(tokens: int, token_bytes: int, copies: int, sealed: bool) -> int:
    page = tokens * token_bytes + (64 if sealed else 0)
    return -(-page * copies // ALIGNMENT) * ALIGNMENT


@pytest.mark.parametrize(
    ("extra", "changes", "tokens", "item"),
    [
        ({}, {}, 1, 2),
        ({"blocks_per_chunk": 4}, {}, 4, 2),
        ({"block_size": 64}, {}, 64, 2),
        ({"verify_chunks": False}, {}, 1, 2),
        ({}, {"cache_dtype": "fp8_e4m3"}, 1, 1),
        ({}, {"dtype": torch.float32, "world_size": 1}, 1, 4),
        ({"blocks_per_chunk": 2}, {"block_size": None}, 2, 2),
    ],
)
def test_a_plain_attention_models_least_row_follows_from_its_configuration(
    extra: dict[str, Any], changes: dict[str, Any], tokens: int, item: int
) -> None:
    config = vllm_config(**changes)
    floor = chunk_floor_before_load({"cpu_bytes_to_use": 1, **extra}, config, ALIGNMENT)
    assert floor is not None
    token_bytes = 4 * 2 * 2 * 64 * item
    copies = config.parallel_config.world_size
    sealed = extra.get("verify_chunks", True)
    assert (floor.token_bytes, floor.tokens, floor.copies) == (token_bytes, tokens, copies)
    assert floor.row_bytes == expected_row(tokens, token_bytes, copies, sealed)


@pytest.mark.parametrize(
    ("extra", "changes"),
    [
        ({}, {"is_hybrid": True}),
        ({}, {"use_mla": True}),
        ({}, {"is_attention_free": True}),
        ({}, {"has_noops": True}),
        ({}, {"text": types.SimpleNamespace(num_kv_shared_layers=2)}),
        ({}, {"pp": 2}),
        ({}, {"dcp": 2}),
        ({}, {"pcp": 2}),
        ({}, {"cache_dtype": "int4"}),
        ({"canonical_layout": True}, {}),
    ],
)
def test_a_layout_the_configuration_does_not_pin_down_is_left_to_the_spec(
    extra: dict[str, Any], changes: dict[str, Any]
) -> None:
    config = vllm_config(**changes)
    assert chunk_floor_before_load({"cpu_bytes_to_use": 1, **extra}, config, 4096) is None
    check_capacity_before_load({"cpu_bytes_to_use": 1, **extra}, vllm_config(**changes), 4096)


def test_below_the_floor_is_refused_naming_it() -> None:
    config = vllm_config()
    extra = {"cpu_bytes_to_use": 1, "blocks_per_chunk": 8}
    floor = chunk_floor_before_load(extra, config, ALIGNMENT)
    assert floor is not None
    check_capacity_before_load({**extra, "cpu_bytes_to_use": floor.row_bytes}, config, ALIGNMENT)
    with pytest.raises(ValueError) as refused:
        check_capacity_before_load(
            {**extra, "cpu_bytes_to_use": floor.row_bytes - 1}, config, ALIGNMENT
        )
    assert str(refused.value) == floor_message(floor.row_bytes - 1, floor)
    assert f"takes at least {floor.row_bytes} bytes" in str(refused.value)
    assert "2 worker page(s) of at least 8 token(s) x 2048 bytes + a 64-byte seal each" in str(
        refused.value
    )


def test_the_row_rounds_every_workers_page_up_together() -> None:
    row = ChunkRow(copies=3, blocks_per_chunk=2, block_bytes=1000, sealed=True, alignment=4096)
    assert row.row_bytes == 8192  # 3 x (2000 + 64) = 6192 -> 8192
