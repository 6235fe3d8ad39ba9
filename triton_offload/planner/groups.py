"""Cache-group and parallelism descriptions: the planner's inputs.

Pure Python, no torch: a scheduler process builds these from its model config
and hands them to :func:`triton_offload.planner.plan.plan_offload`.

Every field is validated when the object is built, so a bad geometry fails at
the boundary with a message that names the field and the value, never later as
an assert or, worse, as a plan that silently loads the wrong tokens.
"""

from __future__ import annotations

import enum
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

__all__ = [
    "MAMBA_CACHE_MODES",
    "GroupKind",
    "GroupSpec",
    "ParallelSpec",
    "PlanningError",
    "check_positive_int",
]


class PlanningError(ValueError):
    """A geometry the planner refuses: the message names the field and the value."""


class GroupKind(str, enum.Enum):
    """What one cache group holds; decides its span and its window."""

    FULL_ATTENTION = "full_attention"
    MLA = "mla"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MAMBA = "mamba"

    @property
    def is_attention(self) -> bool:
        """Attention KV is sharded token-interleaved across DCP ranks; Mamba state is not."""
        return self is not GroupKind.MAMBA

    @property
    def is_unbounded(self) -> bool:
        """Full attention and MLA read the whole prefix: a hit needs every chunk before it."""
        return self in (GroupKind.FULL_ATTENTION, GroupKind.MLA)


# "none": no prefix states (only the live one); "align": a state at every block
# boundary of the prompt; "all": a state at every block boundary. Both "align" and
# "all" hold valid states only at chunk boundaries, so a hit must end on one.
MAMBA_CACHE_MODES: tuple[str, ...] = ("none", "align", "all")


def check_positive_int(field: str, value: Any) -> int:
    """Return ``value`` if it is a positive ``int``; TypeError/ValueError naming it otherwise.

    ``bool`` is rejected although it subclasses ``int``: ``block_size=True`` is a bug
    at the call site, not a block of one token.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{field} must be positive, got {value}")
    return value


def _check_optional_positive_int(field: str, value: Any) -> int | None:
    return None if value is None else check_positive_int(field, value)


def _check_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{field} must be a bool, got {value!r} ({type(value).__name__})")
    return value


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group as the inference engine allocates it.

    ``kind`` accepts a :class:`GroupKind` or its string value and is stored as a
    ``GroupKind``. ``block_size`` is tokens per GPU block *on one rank*.
    ``sliding_window`` (tokens, the token itself included) is required for, and only
    allowed on, ``sliding_window`` groups; ``attention_chunk_size`` likewise for
    ``chunked_local`` groups. ``mamba_cache_mode`` is one of ``MAMBA_CACHE_MODES`` and
    must stay ``"none"`` for attention groups. ``is_eagle`` marks an EAGLE/MTP draft
    group (its newest chunk is volatile). ``dcp_sharded=None`` means the kind's
    default: attention kinds are DCP-sharded, Mamba state is replicated.
    """

    kind: GroupKind
    block_size: int
    _: KW_ONLY
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    mamba_cache_mode: str = "none"
    is_eagle: bool = False
    dcp_sharded: bool | None = None
    name: str = ""

    if TYPE_CHECKING:
        # What callers may pass: ``kind`` as its string value too (normalised below).
        def __init__(
            self,
            kind: GroupKind | str,
            block_size: int,
            *,
            sliding_window: int | None = None,
            attention_chunk_size: int | None = None,
            mamba_cache_mode: str = "none",
            is_eagle: bool = False,
            dcp_sharded: bool | None = None,
            name: str = "",
        ) -> None: ...

    def __post_init__(self) -> None:
        # ``kind`` may arrive as its string value; store the enum (frozen, hence
        # object.__setattr__).
        object.__setattr__(self, "kind", _parse_kind(self.kind))
        check_positive_int("block_size", self.block_size)
        _check_optional_positive_int("sliding_window", self.sliding_window)
        _check_optional_positive_int("attention_chunk_size", self.attention_chunk_size)
        if not isinstance(self.mamba_cache_mode, str):
            raise TypeError(f"mamba_cache_mode must be a str, got {self.mamba_cache_mode!r}")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"unknown mamba_cache_mode {self.mamba_cache_mode!r}; expected one of "
                f"{', '.join(MAMBA_CACHE_MODES)}"
            )
        _check_bool("is_eagle", self.is_eagle)
        if self.dcp_sharded is not None:
            _check_bool("dcp_sharded", self.dcp_sharded)
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {self.name!r}")
        self._check_kind_fields()

    def _check_kind_fields(self) -> None:
        label = f"group {self.label!r}"
        if self.kind is GroupKind.SLIDING_WINDOW and self.sliding_window is None:
            raise ValueError(f"{label}: sliding_window group needs sliding_window=<tokens>")
        if self.kind is not GroupKind.SLIDING_WINDOW and self.sliding_window is not None:
            raise ValueError(
                f"{label}: sliding_window={self.sliding_window} is only valid for "
                f"sliding_window groups, not {self.kind.value}"
            )
        if self.kind is GroupKind.CHUNKED_LOCAL and self.attention_chunk_size is None:
            raise ValueError(f"{label}: chunked_local group needs attention_chunk_size=<tokens>")
        if self.kind is not GroupKind.CHUNKED_LOCAL and self.attention_chunk_size is not None:
            raise ValueError(
                f"{label}: attention_chunk_size={self.attention_chunk_size} is only valid "
                f"for chunked_local groups, not {self.kind.value}"
            )
        if self.kind is not GroupKind.MAMBA and self.mamba_cache_mode != "none":
            raise ValueError(
                f"{label}: mamba_cache_mode={self.mamba_cache_mode!r} is only valid for "
                f"mamba groups, not {self.kind.value}"
            )

    @property
    def label(self) -> str:
        """``name`` if given, else the kind's value (for messages and tables)."""
        return self.name or self.kind.value

    @property
    def is_dcp_sharded(self) -> bool:
        """Whether one GPU block spans ``block_size * dcp_size`` tokens of the sequence."""
        return self.kind.is_attention if self.dcp_sharded is None else self.dcp_sharded

    @property
    def window_tokens(self) -> int | None:
        """How far back attention reaches in tokens; None for unbounded kinds and Mamba."""
        if self.kind is GroupKind.SLIDING_WINDOW:
            return self.sliding_window
        if self.kind is GroupKind.CHUNKED_LOCAL:
            return self.attention_chunk_size
        return None

    @property
    def requires_mamba_alignment(self) -> bool:
        """Mamba in ``align``/``all`` mode: valid states only at chunk boundaries."""
        return self.kind is GroupKind.MAMBA and self.mamba_cache_mode in ("align", "all")


def _parse_kind(kind: Any) -> GroupKind:
    if isinstance(kind, GroupKind):
        return kind
    if not isinstance(kind, str):
        raise TypeError(f"kind must be a GroupKind or str, got {kind!r} ({type(kind).__name__})")
    try:
        return GroupKind(kind)
    except ValueError:
        known = ", ".join(k.value for k in GroupKind)
        raise ValueError(f"unknown group kind {kind!r}; expected one of {known}") from None


@dataclass(frozen=True)
class ParallelSpec:
    """Parallel sizes of the deployment.

    Only ``dcp_size`` changes the planner's math (DCP shards attention KV
    token-interleaved, so one block spans ``dcp_size`` times more tokens); TP
    splits heads and PCP splits prefill work, neither changes which tokens a block
    covers. They are carried (and validated) so a plan records its deployment.

    ``tp_size`` must be a multiple of ``dcp_size``, as vLLM requires: DCP runs on the
    GPUs of the TP group (it splits the tokens of each KV-head replica over
    ``dcp_size`` of the TP ranks), so ``tp=2, dcp=4`` is no deployment, and a plan for
    it would describe spans no engine ever allocates.
    """

    tp_size: int = 1
    dcp_size: int = 1
    pcp_size: int = 1

    def __post_init__(self) -> None:
        check_positive_int("tp_size", self.tp_size)
        check_positive_int("dcp_size", self.dcp_size)
        check_positive_int("pcp_size", self.pcp_size)
        if self.tp_size % self.dcp_size:
            raise ValueError(
                f"tp_size {self.tp_size} is not divisible by dcp_size {self.dcp_size} "
                "(DCP ranks split the TP group)"
            )
