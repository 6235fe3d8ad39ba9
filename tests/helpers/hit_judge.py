"""Two independent references for load-side hits, shared by the tests.

``hit_is_valid`` / ``largest_valid_hit`` judge a hit from first principles (what a
prefill resumed at the hit end reads), not from the planner's code:

- A hit end ``H`` must exceed ``num_computed_tokens`` and not exceed ``num_tokens``;
  with any windowed group (sliding window, chunked local, Mamba) ``H <= num_tokens - 1``
  (the last prompt token is recomputed for its logits).
- Unbounded groups (full attention, MLA): every token in ``[computed, H)`` lies in a
  present chunk.
- Sliding window of ``w`` tokens (the token itself included): every token in
  ``[max(computed, H - w + 1), H)``; chunked local attention of chunk ``c``: every
  token in ``[max(computed, H - H mod c), H)``.
- Mamba: ``H`` is a multiple of its ``tokens_per_chunk`` and chunk ``H / tpc - 1`` (the
  state after token ``H - 1``) is present.
- A load moves whole chunks: a hit that ends inside a chunk of a windowed group loads
  the block of the first recomputed token, so that chunk is present too, even where
  attention reads none of its tokens (a one-token window, chunked local attention at a
  local-chunk boundary). DESIGN's rule leaves this out; vLLM 0.33's load needs it: its
  scheduler loads every allocated block up to ``cdiv(H, block_size)`` and asserts when
  that chunk is not a whole one of the prompt (``tests/vllm/test_connector_hit_rule.py``).
- EAGLE groups: the chunk after the one holding token ``H - 1`` is present as well (it
  is queried and popped: the draft KV of the hit's last position is rewritten).
- Only whole chunks (``i < num_tokens // tpc``) are ever present; chunks wholly below
  ``num_computed_tokens`` are on the GPU and need not be.

The model of vLLM 0.33's rule the planner is compared with lives in
``triton_offload.verify.stock_lookup`` (``verify --inject vllm-lookup`` runs it too).
"""

from __future__ import annotations

from collections.abc import Sequence

from triton_offload import GroupKind, OffloadPlan
from triton_offload.verify.stock_lookup import StockGroup, stock_groups, vllm_stock_hit


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _holds(row: Sequence[bool], chunk: int, full_chunks: int) -> bool:
    return chunk < full_chunks and chunk < len(row) and bool(row[chunk])


def hit_is_valid(
    plan: OffloadPlan,
    num_tokens: int,
    num_computed: int,
    present: Sequence[Sequence[bool]],
    hit_end: int,
) -> bool:
    """Whether resuming the prefill at ``hit_end`` restores exactly a cold prefill's state."""
    if hit_end <= num_computed or hit_end > num_tokens:
        return False
    if any(g.kind is not GroupKind.FULL_ATTENTION and g.kind is not GroupKind.MLA
           for g in plan.groups) and hit_end > num_tokens - 1:  # fmt: skip
        return False
    for group, row in zip(plan.groups, present, strict=True):
        spec = group.spec
        tpc = group.tokens_per_chunk
        full_chunks = num_tokens // tpc
        if spec.kind is GroupKind.MAMBA:
            if hit_end % tpc or not _holds(row, hit_end // tpc - 1, full_chunks):
                return False
            tokens: range = range(0)
        elif spec.kind is GroupKind.SLIDING_WINDOW:
            assert spec.sliding_window is not None
            tokens = range(max(num_computed, hit_end - spec.sliding_window + 1), hit_end)
        elif spec.kind is GroupKind.CHUNKED_LOCAL:
            assert spec.attention_chunk_size is not None
            tokens = range(
                max(num_computed, hit_end - hit_end % spec.attention_chunk_size), hit_end
            )
        else:
            tokens = range(num_computed, hit_end)
        # The chunks holding those tokens (token t lies in chunk t // tpc).
        chunks = set(range(tokens.start // tpc, (tokens.stop - 1) // tpc + 1)) if tokens else set()
        if spec.kind is not GroupKind.MAMBA and hit_end % tpc:
            chunks.add(hit_end // tpc)  # the chunk the hit ends inside is loaded whole
        if spec.is_eagle:
            chunks.add(cdiv(hit_end, tpc))
        on_gpu = num_computed // tpc
        if not all(_holds(row, c, full_chunks) for c in chunks if c >= on_gpu):
            return False
    return True


def largest_valid_hit(
    plan: OffloadPlan, num_tokens: int, num_computed: int, present: Sequence[Sequence[bool]]
) -> int:
    """Tokens beyond ``num_computed`` of the largest valid hit end (0: none), by brute force."""
    for hit_end in range(num_tokens, num_computed, -1):
        if hit_is_valid(plan, num_tokens, num_computed, present, hit_end):
            return hit_end - num_computed
    return 0


__all__ = [
    "StockGroup",
    "hit_is_valid",
    "largest_valid_hit",
    "stock_groups",
    "vllm_stock_hit",
]
