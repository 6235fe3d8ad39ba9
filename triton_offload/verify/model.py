"""A tiny deterministic hybrid model that reads a paged cache the way a serving engine does.

Layers (any mix, chosen by ``ModelConfig.layers``):

- ``attention``: causal multi-head attention with ALiBi position bias over every
  earlier token, K and V in a paged cache of ``block_size`` tokens per block (two
  planes per layer).
- ``sliding_window``: the same over the last ``sliding_window`` tokens only.
- ``mamba``: a Mamba-style recurrent layer: a short causal convolution (its state is the
  last ``conv_kernel - 1`` inputs) feeding a diagonal SSM (state ``hidden x ssm_state``).
  Its blocks hold ``mamba_block_size`` tokens (``block_size`` unless set).
  The cache works like Mamba's ``align`` mode: block ``b`` ends up holding the state
  after token ``(b + 1) * block_size - 1``, the state after the last token of the block.
  Token ``t`` reads the state from block ``(t - 1) // block_size`` and writes its new
  state to block ``t // block_size``. A prefill resumed at position ``P`` therefore
  needs block ``P // block_size - 1`` holding the state after token ``P - 1``: it
  exists only when ``P`` is a multiple of ``block_size`` (hence the planner's Mamba
  round-down).

Decode context parallelism (DCP) is simulated: with ``dcp`` ranks, attention K/V of token
``t`` lives on rank ``t % dcp`` at rank-local index ``t // dcp`` (each rank has its own
block table and cache tensors), attention gathers from every rank; Mamba state is
replicated, every rank holds (and must hold) the same bytes. A token read from a rank
whose Mamba state differs from rank 0's is recorded in ``RequestBlocks.replica_mismatches``.

Every token is computed alone, with the same operations in the same order whatever came
before it, so a prefill resumed from a restored cache yields bitwise the logits of a cold
prefill. Weights come from a fixed seed: float32 on CPU, nothing to download.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "LAYER_KINDS",
    "HybridCache",
    "HybridModel",
    "ModelConfig",
    "RequestBlocks",
]

LAYER_KINDS = ("attention", "sliding_window", "mamba")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the verification model. Cache groups follow ``group_kinds``."""

    layers: tuple[str, ...] = ("attention", "mamba", "sliding_window", "mamba")
    vocab_size: int = 64
    hidden_size: int = 32
    num_heads: int = 2
    block_size: int = 16
    sliding_window: int = 24
    # Mamba block size in tokens; 0: ``block_size``. A larger one puts the attention
    # groups on a finer chunk grid than the Mamba group.
    mamba_block_size: int = 0
    conv_kernel: int = 4
    ssm_state_size: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("layers must not be empty")
        for kind in self.layers:
            if kind not in LAYER_KINDS:
                raise ValueError(f"layer kind {kind!r} is not one of {LAYER_KINDS}")
        for name in ("vocab_size", "hidden_size", "num_heads", "block_size", "sliding_window"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.mamba_block_size < 0:
            raise ValueError(f"mamba_block_size must be >= 0, got {self.mamba_block_size}")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be at least 2, got {self.conv_kernel}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )

    @property
    def mamba_block(self) -> int:
        """Tokens per Mamba block (``mamba_block_size`` or ``block_size``)."""
        return self.mamba_block_size or self.block_size

    @property
    def group_kinds(self) -> tuple[str, ...]:
        """One cache group per layer kind present, in the order of ``LAYER_KINDS``."""
        return tuple(kind for kind in LAYER_KINDS if kind in self.layers)

    def layer_group(self, layer: int) -> int:
        return self.group_kinds.index(self.layers[layer])

    def group_layers(self, group: int) -> list[int]:
        kind = self.group_kinds[group]
        return [i for i, k in enumerate(self.layers) if k == kind]

    def blocks_per_rank(self, group: int, num_tokens: int, dcp: int) -> int:
        """GPU blocks one rank needs for ``num_tokens`` tokens of ``group``."""
        if self.group_kinds[group] == "mamba":
            return _ceil_div(num_tokens, self.mamba_block)
        return _ceil_div(_ceil_div(num_tokens, dcp), self.block_size)  # rank 0 holds the most


class HybridCache:
    """Every rank's paged cache, one tensor per plane stacked over ranks.

    ``planes[layer]`` is ``(k, v)`` for attention layers, each ``[dcp, num_blocks,
    block_size, hidden]``, and ``(conv, ssm)`` for Mamba layers, ``[dcp, num_blocks,
    conv_kernel - 1, hidden]`` and ``[dcp, num_blocks, hidden, ssm_state]``. Rank ``r``'s
    cache is the contiguous slice ``[r]`` of each: what that rank's engine registers.
    """

    def __init__(self, config: ModelConfig, dcp: int, num_blocks: int) -> None:
        if dcp < 1:
            raise ValueError(f"dcp must be positive, got {dcp}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.config = config
        self.dcp = dcp
        self.num_blocks = num_blocks
        c = config
        self.planes: list[tuple[torch.Tensor, torch.Tensor]] = []
        for kind in c.layers:
            if kind == "mamba":
                shapes = [
                    (dcp, num_blocks, c.conv_kernel - 1, c.hidden_size),
                    (dcp, num_blocks, c.hidden_size, c.ssm_state_size),
                ]
            else:
                shapes = [(dcp, num_blocks, c.block_size, c.hidden_size)] * 2
            a, b = (torch.zeros(s, dtype=torch.float32) for s in shapes)
            self.planes.append((a, b))

    def rank_caches(self, rank: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """``caches[g]`` = rank ``rank``'s layers of group ``g``, as ``TransferEngine`` takes."""
        out: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for group in range(len(self.config.group_kinds)):
            out.append(
                [
                    (self.planes[i][0][rank], self.planes[i][1][rank])
                    for i in self.config.group_layers(group)
                ]
            )
        return out

    def poison(self, seed: int) -> None:
        """Overwrite every byte with seeded noise: a cleared GPU cache that nobody reloaded."""
        generator = torch.Generator().manual_seed(seed)
        for a, b in self.planes:
            for t in (a, b):
                t.copy_(torch.randn(t.shape, generator=generator) * 3.0)


class RequestBlocks:
    """One request's block tables on every rank, with the gather indices derived from them.

    ``block_ids[g][r]`` lists rank ``r``'s physical block ids of group ``g`` in request
    order. Attention token ``t`` sits on rank ``t % dcp`` at local index ``t // dcp``;
    Mamba block ``b`` is replicated on every rank.
    """

    def __init__(
        self,
        config: ModelConfig,
        dcp: int,
        num_blocks: int,
        block_ids: Sequence[Sequence[Sequence[int]]],
    ) -> None:
        kinds = config.group_kinds
        if len(block_ids) != len(kinds):
            raise ValueError(f"block_ids has {len(block_ids)} groups, model has {len(kinds)}")
        self.block_ids = [[list(ids) for ids in group] for group in block_ids]
        self.replica_mismatches: list[tuple[int, int]] = []  # (position, layer)
        bs = config.block_size
        self.attention_slots: dict[int, torch.Tensor] = {}
        self.mamba_rows: dict[int, torch.Tensor] = {}
        for g, kind in enumerate(kinds):
            ranks = self.block_ids[g]
            if len(ranks) != dcp:
                raise ValueError(f"group {g} has block tables for {len(ranks)} ranks, dcp is {dcp}")
            for ids in ranks:
                for i in ids:
                    if not 0 <= i < num_blocks:
                        raise ValueError(f"block id {i} out of range [0, {num_blocks})")
            if kind == "mamba":
                count = min(len(ids) for ids in ranks)
                rows = [[r * num_blocks + ranks[r][b] for r in range(dcp)] for b in range(count)]
                self.mamba_rows[g] = torch.tensor(rows, dtype=torch.int64).reshape(count, dcp)
            else:
                capacity = min(len(ranks[r]) * bs * dcp + r for r in range(dcp))
                slots = []
                for t in range(capacity):
                    r, local = t % dcp, t // dcp
                    slots.append((r * num_blocks + ranks[r][local // bs]) * bs + local % bs)
                self.attention_slots[g] = torch.tensor(slots, dtype=torch.int64)
        caps = [len(s) for s in self.attention_slots.values()]
        caps += [r.shape[0] * config.mamba_block for r in self.mamba_rows.values()]
        self.capacity = min(caps)  # tokens these tables hold in every group


class HybridModel:
    """Greedy-decoding hybrid model; ``step`` computes one token against the paged cache."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        c = config
        g = torch.Generator().manual_seed(c.seed)
        d = c.hidden_size

        def rand(*shape: int, scale: float) -> torch.Tensor:
            return torch.randn(shape, generator=g) * scale

        self.embedding = rand(c.vocab_size, d, scale=1.0)
        self.lm_head = rand(d, c.vocab_size, scale=1.0 / math.sqrt(d))
        self.alibi_slopes = torch.tensor(
            [2.0 ** (-(i + 1)) for i in range(c.num_heads)], dtype=torch.float32
        )
        self.weights: list[dict[str, torch.Tensor]] = []
        for kind in c.layers:
            w = {"norm": 1.0 + rand(d, scale=0.1)}
            if kind == "mamba":
                w["w_in"] = rand(d, 2 * d, scale=1.0 / math.sqrt(d))
                w["conv"] = rand(c.conv_kernel, d, scale=0.5)
                w["conv_bias"] = rand(d, scale=0.1)
                # Decay close to 1: a long memory, so a wrong restored state stays visible.
                w["decay"] = 1.0 - 0.08 * torch.rand((d, c.ssm_state_size), generator=g)
                w["b"] = rand(d, c.ssm_state_size, scale=1.0)
                w["c"] = rand(d, c.ssm_state_size, scale=1.0 / math.sqrt(c.ssm_state_size))
                w["skip"] = rand(d, scale=0.5)
                w["w_out"] = rand(d, d, scale=1.0 / math.sqrt(d))
            else:
                w["w_qkv"] = rand(d, 3 * d, scale=1.0 / math.sqrt(d))
                w["w_out"] = rand(d, d, scale=1.0 / math.sqrt(d))
            self.weights.append(w)

    @torch.no_grad()
    def step(
        self, token: int, position: int, cache: HybridCache, blocks: RequestBlocks
    ) -> torch.Tensor:
        """Logits ``[vocab]`` after token ``token`` at ``position``; writes its cache entries."""
        c = self.config
        if not 0 <= token < c.vocab_size:
            raise ValueError(f"token {token} out of range [0, {c.vocab_size})")
        x = self.embedding[token]
        for layer, kind in enumerate(c.layers):
            w = self.weights[layer]
            h = _rms_norm(x) * w["norm"]
            group = c.layer_group(layer)
            if kind == "mamba":
                out = self._mamba(h, w, position, layer, cache, blocks.mamba_rows[group], blocks)
            else:
                window = c.sliding_window if kind == "sliding_window" else None
                out = self._attention(
                    h, w, position, window, cache.planes[layer], blocks.attention_slots[group]
                )
            x = x + out
        return _rms_norm(x) @ self.lm_head

    def _attention(
        self,
        h: torch.Tensor,
        w: dict[str, torch.Tensor],
        position: int,
        window: int | None,
        planes: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
    ) -> torch.Tensor:
        c = self.config
        heads, dh = c.num_heads, c.hidden_size // c.num_heads
        q, k, v = (h @ w["w_qkv"]).split(c.hidden_size)
        k_flat = planes[0].view(-1, c.hidden_size)
        v_flat = planes[1].view(-1, c.hidden_size)
        slot = int(slots[position])
        k_flat[slot] = k
        v_flat[slot] = v
        start = 0 if window is None else max(0, position - window + 1)
        index = slots[start : position + 1]  # global token order, every rank
        keys = k_flat.index_select(0, index).view(-1, heads, dh).transpose(0, 1)
        values = v_flat.index_select(0, index).view(-1, heads, dh).transpose(0, 1)
        scores = (keys @ q.view(heads, dh, 1)).squeeze(-1) / math.sqrt(dh)
        # ALiBi: a bias growing with the distance to the query ties each key to its slot,
        # so K/V restored into the wrong slots changes the output (plain attention would
        # only see a reordered set of keys).
        distance = torch.arange(position - start, -1, -1, dtype=torch.float32)
        scores = scores - self.alibi_slopes.unsqueeze(1) * distance
        probs = torch.softmax(scores, dim=-1)
        out = (probs.unsqueeze(1) @ values).reshape(c.hidden_size)
        return out @ w["w_out"]

    def _mamba(
        self,
        h: torch.Tensor,
        w: dict[str, torch.Tensor],
        position: int,
        layer: int,
        cache: HybridCache,
        rows: torch.Tensor,
        blocks: RequestBlocks,
    ) -> torch.Tensor:
        c = self.config
        d = c.hidden_size
        conv_plane, ssm_plane = cache.planes[layer]
        conv_flat = conv_plane.view(-1, c.conv_kernel - 1, d)
        ssm_flat = ssm_plane.view(-1, d, c.ssm_state_size)
        x_in, gate = (h @ w["w_in"]).split(d)
        if position == 0:
            conv_state = torch.zeros(c.conv_kernel - 1, d)
            ssm_state = torch.zeros(d, c.ssm_state_size)
        else:
            # align mode: the state after token position-1 lives in that token's block.
            read = rows[(position - 1) // c.mamba_block]
            conv_all = conv_flat.index_select(0, read)
            ssm_all = ssm_flat.index_select(0, read)
            if cache.dcp > 1 and not (
                torch.equal(conv_all, conv_all[:1].expand_as(conv_all))
                and torch.equal(ssm_all, ssm_all[:1].expand_as(ssm_all))
            ):
                blocks.replica_mismatches.append((position, layer))
            conv_state, ssm_state = conv_all[0], ssm_all[0]
        window = torch.cat((conv_state, x_in.unsqueeze(0)))
        u = torch.nn.functional.silu((window * w["conv"]).sum(0) + w["conv_bias"])
        ssm_state = w["decay"] * ssm_state + w["b"] * u.unsqueeze(1)
        y = (ssm_state * w["c"]).sum(1) + w["skip"] * u
        y = y * torch.nn.functional.silu(gate)
        write = rows[position // c.mamba_block]
        conv_flat.index_copy_(0, write, window[1:].unsqueeze(0).expand(cache.dcp, -1, -1))
        ssm_flat.index_copy_(0, write, ssm_state.unsqueeze(0).expand(cache.dcp, -1, -1))
        return y @ w["w_out"]


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean() + 1e-6)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
