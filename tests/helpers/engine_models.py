"""Tiny random-weight models for vLLM's real engine on a CPU, written locally.

Nothing is fetched: each model is a ``transformers`` config scaled down to hidden size
64, 2 layers and a 256-token vocabulary, initialised from a fixed seed and written with
``save_pretrained``. Prompts are token ids (the engine runs with
``skip_tokenizer_init=True``), so no tokenizer is written.

Weights are drawn wider than ``transformers``' default (``initializer_range`` 0.2): with
the default 0.02 every logit of a 2-layer model is nearly equal, and greedy decoding
would pick among near-ties, where a rounding difference changes the token.

Head size 32 is the smallest the CPU attention backend takes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

VOCAB = 256
HIDDEN = 64
HEAD_DIM = 32
INIT_RANGE = 0.2
#: Sliding windows of the windowed models, in tokens: far below the test prompts (300
#: tokens), so a hit must restore the window's chunks, not just a prefix.
SLIDING_WINDOW = 48


@dataclasses.dataclass(frozen=True)
class TinyModel:
    """A model the tests write: ``name``, the ``dtype`` the CPU backend runs it in,
    and what its cache holds (for the test ids)."""

    name: str
    dtype: str
    groups: str
    build: Callable[[], Any]


def _attention(intermediate_size: int = 128, max_positions: int | None = 2048) -> dict[str, Any]:
    """What every tiny model shares: vocabulary, width, two layers of 32-dim heads, one KV
    head, and weights large enough that greedy decoding picks clear winners
    (``max_positions`` None: the model's own default, which gpt-oss's YaRN rope expects)."""
    shared = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": 2,
        "num_attention_heads": HIDDEN // HEAD_DIM,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "initializer_range": INIT_RANGE,
        "tie_word_embeddings": False,
    }
    if max_positions is not None:
        shared["max_position_embeddings"] = max_positions
    return shared


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        **_attention(),
    )


def _llama_kv2() -> Any:
    """Llama with as many KV heads as query heads (2): under tensor parallel 2 each
    worker holds one KV head of its own (no head is replicated)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**_attention(), "num_key_value_heads": HIDDEN // HEAD_DIM})


def _mistral_swa() -> Any:
    from transformers import MistralConfig

    return MistralConfig(
        **_attention(),
        sliding_window=SLIDING_WINDOW,
    )


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        **_attention(64, max_positions=None),
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_attention(),
        # The CPU kernel of the gated delta rule takes head size 128 only.
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        # Layer 0 gated delta net (linear attention), layer 1 full attention.
        layer_types=["linear_attention", "full_attention"],
    )


MODELS = {
    "llama": TinyModel("llama", "float32", "full attention", _llama),
    "llama-kv2": TinyModel("llama-kv2", "float32", "full attention, 2 KV heads", _llama_kv2),
    "mistral-swa": TinyModel("mistral-swa", "float32", "sliding window", _mistral_swa),
    "gpt-oss": TinyModel("gpt-oss", "bfloat16", "sliding window + full", _gpt_oss),
    "qwen3-next": TinyModel("qwen3-next", "bfloat16", "GDN (Mamba align) + full", _qwen3_next),
}


def write_model(name: str, root: str, seed: int = 0) -> str:
    """Write model ``name`` under ``root`` (once; a finished folder is reused) and return
    its folder."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = MODELS[name]
    folder = os.path.join(root, name)
    done = os.path.join(folder, ".written")
    if os.path.exists(done):
        return folder
    config = spec.build()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    model.save_pretrained(folder, safe_serialization=True)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"do_sample": False}, f)
    with open(done, "w") as f:
        f.write(spec.dtype)
    return folder


def prompt_ids(length: int, seed: int) -> list[int]:
    """A fixed pseudo-random prompt of ``length`` token ids (no tokenizer needed)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(length)]


__all__ = ["MODELS", "TinyModel", "prompt_ids", "write_model"]
