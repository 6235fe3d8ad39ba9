"""A serving loop over the verification model built only from the library's public pieces.

``OffloadServer`` plays an inference engine with an offloading connector:
``plan_offload`` decides what to store and how much a lookup may load,
``HostBlockManager`` maps chunk keys to host-pool rows, and one ``TransferEngine`` per
DCP rank moves the bytes between that rank's cache and its pool. A scenario runs a
request cold (storing the chunks the planner calls reachable), clears the GPU cache,
then runs a second request (the same prompt or an extension of it) that looks up, loads
what the lookup allows, recomputes the rest and decodes; its tokens and logits must be
bitwise those of a cold run.

Host pages are sealed as vLLM's worker seals them (:mod:`triton_offload.transfer.seal`):
each pool row is one page, the engine's row followed by a 64-byte seal written after the
store's copy finished (the chunk key's digest, the config and row-layout digests, the
rank's page index, the payload's CRC-32). Every chunk a load needs is checked on every
rank before any byte moves; a refused chunk is dropped from the ``HostBlockManager``,
marked absent, and the planner's lookup on what remains gives the hit to load (the hit
stays valid: the load stops before the first refused position, on the Mamba grid). The
``corrupt-chunk`` scenarios flip one byte of a stored chunk to see it happen.

Testing aids (``inject=``) re-create known bugs so that a check that must fail can be
seen failing:

- ``mamba-span-dcp``: the Mamba group is planned as DCP-sharded, so its span is
  ``block_size * dcp`` (the span bug vLLM fixed for DCP); keys then name the wrong states.
- ``no-mamba-round-down``: the Mamba group is planned as a one-token sliding window,
  as vLLM before PR #44599 treated it; a hit may end between two stored states and the
  state after the chunk's last token is restored at a position before it.
- ``wrong-slot``: every load job hands the engine its GPU blocks rotated by one, a
  wrong slot mapping in the data path.
- ``vllm-lookup``: lookups follow vLLM 0.33's stock rule
  (:mod:`triton_offload.verify.stock_lookup`) instead of the planner's. The
  ``mamba-chunk-cut`` scenarios trigger it: attention in 16-token chunks, Mamba in
  64-token chunks, one attention chunk of the stored prompt lost from the pool; the
  stock rule rounds the hit down to the Mamba grid once, the attention gap cuts it
  inside a Mamba chunk, and the state after that chunk's last token is restored at
  the cut.
- ``no-seal-check``: chunks are sealed but loads never check the seals, so the
  ``corrupt-chunk`` scenarios load the altered bytes (their logits then differ: the
  scenario cannot pass without the check).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from array import array
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from triton_offload.planner.groups import GroupKind, GroupSpec, ParallelSpec
from triton_offload.planner.plan import OffloadPlan, plan_offload
from triton_offload.planner.presets import PRESETS as MODEL_PRESETS
from triton_offload.transfer.host_blocks import HostBlockManager, LoadHandle, StoreHandle
from triton_offload.transfer.jobs import JobSpec
from triton_offload.transfer.layout import CacheLayout, build_layout
from triton_offload.transfer.seal import (
    SEAL_BYTES,
    PageSealer,
    SealFormat,
    digest8,
    key_digest,
    layout_description,
)

# The planner and the data path only: the loop is what an engine integration would write.
from triton_offload.verify.injections import INJECTIONS
from triton_offload.verify.model import HybridCache, HybridModel, ModelConfig, RequestBlocks
from triton_offload.verify.stock_lookup import stock_groups, vllm_stock_hit

if TYPE_CHECKING:
    from triton_offload.transfer.engine import Backend, TransferEngine

__all__ = [
    "INJECTIONS",
    "PRESETS",
    "OffloadServer",
    "Refusal",
    "RequestResult",
    "Scenario",
    "ScenarioResult",
    "build_scenarios",
    "chunk_keys",
    "group_specs",
    "run_scenarios",
]


#: Model presets: layer stacks of the verification model, the ``-tiny`` presets of the
#: package's preset table (``mamba-hybrid-tiny``: full attention + Mamba, the DCP/Mamba
#: span geometry; ``swa-mamba-hybrid-tiny``: every group kind the model has;
#: ``mamba-tiny``: Mamba only, where no attention grid hides a bad round-down).
PRESETS: dict[str, tuple[str, ...]] = {
    name: preset.verify_layers
    for name, preset in MODEL_PRESETS.items()
    if preset.verify_layers is not None
}


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one intra-op thread: the model's ops are tiny, and on a busy machine
    waking a second thread costs ~1 ms per op (measured: 0.4 ms vs 3 ms per token)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def group_specs(config: ModelConfig, inject: str | None = None) -> list[GroupSpec]:
    """The cache groups of the model as an engine would declare them (bugs via ``inject``)."""
    specs = []
    bs = config.block_size
    for kind in config.group_kinds:
        if kind == "attention":
            specs.append(GroupSpec(GroupKind.FULL_ATTENTION, bs, name="attention"))
        elif kind == "sliding_window":
            specs.append(
                GroupSpec(
                    GroupKind.SLIDING_WINDOW,
                    bs,
                    sliding_window=config.sliding_window,
                    name="sliding_window",
                )
            )
        elif inject == "mamba-span-dcp":
            specs.append(
                GroupSpec(
                    GroupKind.MAMBA,
                    config.mamba_block,
                    mamba_cache_mode="align",
                    dcp_sharded=True,
                    name="mamba",
                )
            )
        elif inject == "no-mamba-round-down":
            specs.append(
                GroupSpec(
                    GroupKind.SLIDING_WINDOW,
                    config.mamba_block,
                    sliding_window=1,
                    dcp_sharded=False,
                    name="mamba",
                )
            )
        else:
            block = config.mamba_block
            specs.append(GroupSpec(GroupKind.MAMBA, block, mamba_cache_mode="align", name="mamba"))
    return specs


def chunk_keys(tokens: Sequence[int], tokens_per_chunk: int, count: int) -> list[bytes]:
    """Key of chunk ``i`` = hash of the token prefix up to the chunk's end (chained), so a
    prompt that extends a stored one finds its chunks."""
    keys = []
    digest = b""
    for i in range(count):
        chunk = tokens[i * tokens_per_chunk : (i + 1) * tokens_per_chunk]
        h = hashlib.sha256(digest)
        h.update(array("q", chunk).tobytes())
        digest = h.digest()
        keys.append(digest)
    return keys


@dataclass(frozen=True)
class Refusal:
    """A chunk a load refused: its seal check failed on ``rank`` (the first rank that
    failed) for ``problem``; the chunk was dropped from the host pool."""

    group: int
    chunk: int
    rank: int
    problem: str

    def __str__(self) -> str:
        return f"group {self.group} chunk {self.chunk} (rank {self.rank}): {self.problem}"


@dataclass
class RequestResult:
    """What one request did. ``logits[p]`` are the logits after the token at position p
    (only positions this request computed)."""

    prompt_len: int
    generated: list[int]
    logits: dict[int, torch.Tensor]
    lookup_tokens: int = 0  # the planner's answer (0 when the request did no lookup)
    loaded_tokens: int = 0  # position the prefill resumed at (after refused chunks)
    refused: list[Refusal] = field(default_factory=list)  # chunks whose seal failed
    recomputed_tokens: int = 0  # prompt tokens the model actually ran
    load_bytes: int = 0
    store_bytes: int = 0
    stored_chunks: list[list[int]] = field(default_factory=list)
    replica_mismatches: list[tuple[int, int]] = field(default_factory=list)


class OffloadServer:
    """One model, ``dcp`` ranks (each with its cache view, block tables and engine), one
    host block manager shared by the ranks (a row id names the same chunk on every rank).

    Args:
        config: the model.
        dcp: DCP ranks simulated.
        blocks_per_chunk: GPU blocks per offloaded chunk.
        backend: ``TransferEngine`` backend ("torch", "triton", ...).
        max_tokens: longest request (prompt + generated) to size the GPU caches for.
        num_host_rows: host pool rows (per rank; the manager's ``num_rows``). Each row
            is one sealed page: the engine's row, then ``SEAL_BYTES``.
        inject: a testing aid from ``INJECTIONS`` (see the module docstring), or None.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dcp: int = 1,
        blocks_per_chunk: int = 1,
        backend: Backend = "torch",
        max_tokens: int = 512,
        num_host_rows: int = 512,
        inject: str | None = None,
        model: HybridModel | None = None,
    ) -> None:
        # Imported here, not at module level: `verify --backend triton` must switch the
        # Triton interpreter on before the engine imports the kernels.
        from triton_offload.transfer.engine import TransferEngine

        if inject is not None and inject not in INJECTIONS:
            raise ValueError(f"inject {inject!r} is not one of {INJECTIONS}")
        self.config = config
        self.dcp = dcp
        self.inject = inject
        self.model = model if model is not None else HybridModel(config)
        self.plan: OffloadPlan = plan_offload(
            group_specs(config, inject),
            ParallelSpec(tp_size=dcp, dcp_size=dcp),
            blocks_per_chunk=blocks_per_chunk,
        )
        self.max_tokens = max_tokens
        num_groups = len(config.group_kinds)
        self.num_gpu_blocks = 2 * max(
            config.blocks_per_rank(g, max_tokens, dcp) for g in range(num_groups)
        )
        self.cache = HybridCache(config, dcp, self.num_gpu_blocks)
        self.manager = HostBlockManager(num_host_rows)
        #: Loads check seals (off only under the ``no-seal-check`` testing aid).
        self.check_seals = inject != "no-seal-check"
        self.engines: list[TransferEngine] = []
        #: Per rank: the host pages, uint8 ``[num_host_rows, row_bytes + SEAL_BYTES]``,
        #: and their sealer (the engine's pool is each page without its seal).
        self.pages: list[torch.Tensor] = []
        self.sealers: list[PageSealer] = []
        for rank in range(dcp):
            caches = self.cache.rank_caches(rank)
            layout = build_layout(caches, num_groups=num_groups, blocks_per_chunk=blocks_per_chunk)
            pages = torch.zeros(num_host_rows, layout.row_bytes + SEAL_BYTES, dtype=torch.uint8)
            engine = TransferEngine(
                self.plan,
                caches,
                num_host_rows,
                device="cpu",
                backend=backend,
                pool=pages[:, : layout.row_bytes],
            )
            self.engines.append(engine)
            self.pages.append(pages)
            self.sealers.append(
                PageSealer(
                    pages.numpy(),
                    self._seal_format(engine.layout, rank),
                    engine.layout.group_row_bytes,
                )
            )
        self._requests = itertools.count()
        self._jobs = itertools.count()

    def _seal_format(self, layout: CacheLayout, rank: int) -> SealFormat:
        """What rank ``rank``'s seals say besides the key, as vLLM's worker derives it: a
        config digest of what the scheduler knows (the model and the plan's geometry), a
        layout digest of the rank's row layout, and the rank's page of the chunk."""
        config = digest8(f"triton_offload.verify;{self.config!r};{self.plan!r}")
        description = layout_description(layout.planes, self.plan.blocks_per_chunk)
        return SealFormat(config, digest8(description), rank, self.dcp)

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()

    def __enter__(self) -> OffloadServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def clear_gpu(self) -> None:
        """Forget the GPU cache: every byte becomes noise that only a load can replace."""
        self.cache.poison(seed=next(self._requests) + 1000)

    def clear_host(self) -> None:
        """Forget every stored chunk (the pool bytes stay, but no key reaches them)."""
        self.manager.clear()

    def flip_byte(self, prompt: Sequence[int], group: int, chunk: int, rank: int) -> int:
        """Alter a stored chunk's host bytes, as a bad host page or tier would: every bit
        of one byte of rank ``rank``'s page of chunk ``chunk`` of ``group`` is flipped.
        Returns the byte's offset in the page.

        The byte is the highest of the middle float32 value of the group's first plane,
        slot 0 (sign and exponent: the model reads it, and its value changes by far more
        than rounding). ValueError if the chunk is not stored.
        """
        keys = self._keys(prompt, group)
        if not 0 <= chunk < len(keys):
            raise ValueError(f"chunk {chunk} of group {group} is not a full chunk of the prompt")
        row = self.manager.row_of(keys[chunk], group)
        if row is None:
            raise ValueError(f"chunk {chunk} of group {group} is not stored: nothing to alter")
        layout = self.engines[rank].layout
        plane = layout.planes[layout.group_planes[group][0]]
        offset = plane.pool_offset + plane.page_bytes // 2 // 4 * 4 + 3
        self.pages[rank][row, offset] ^= 0xFF
        return offset

    # ------------------------------------------------------------------ one request
    def run(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        lookup: bool,
        store: bool,
        lost: Collection[tuple[int, int]] = (),
    ) -> RequestResult:
        """Prefill ``prompt`` (after loading what a lookup allows), decode greedily, store.

        ``lost``: ``(group, chunk)`` pairs the store skips, as if the pool had lost them.
        """
        n = len(prompt)
        if n < 1:
            raise ValueError("prompt is empty")
        if n + max_new_tokens > self.max_tokens:
            raise ValueError(
                f"prompt of {n} tokens + {max_new_tokens} new tokens exceeds max_tokens "
                f"{self.max_tokens}"
            )
        blocks = self._allocate(n + max_new_tokens)
        result = RequestResult(prompt_len=n, generated=[], logits={})
        resume = 0
        if lookup:
            present = self._present(prompt)
            hit = self._hit(len(prompt), present)
            result.lookup_tokens = hit
            hit, result.load_bytes, result.refused = self._load(prompt, hit, blocks, present)
            # Without a windowed group a hit may cover the whole prompt; the last token
            # is still computed for its logits (its KV is rewritten with the same bytes).
            resume = min(hit, n - 1)
        result.loaded_tokens = resume
        with single_thread():
            logits = None
            for position in range(resume, n):
                logits = self.model.step(prompt[position], position, self.cache, blocks)
                result.logits[position] = logits
                result.recomputed_tokens += 1
            assert logits is not None
            for position in range(n, n + max_new_tokens):
                token = int(torch.argmax(logits))
                result.generated.append(token)
                if position == n + max_new_tokens - 1:
                    break
                logits = self.model.step(token, position, self.cache, blocks)
                result.logits[position] = logits
        result.replica_mismatches = list(blocks.replica_mismatches)
        if store:
            result.store_bytes, result.stored_chunks = self._store(prompt, blocks, lost)
        return result

    def _allocate(self, num_tokens: int) -> RequestBlocks:
        """Block tables per group and rank: a fresh random choice of physical blocks, so a
        load lands in other blocks than the store read from."""
        request = next(self._requests)
        ids = []
        for g in range(len(self.config.group_kinds)):
            count = self.config.blocks_per_rank(g, num_tokens, self.dcp)
            per_rank = []
            for rank in range(self.dcp):
                generator = torch.Generator().manual_seed(request * 1009 + g * 31 + rank)
                perm = torch.randperm(self.num_gpu_blocks, generator=generator)
                per_rank.append(perm[:count].tolist())
            ids.append(per_rank)
        return RequestBlocks(self.config, self.dcp, self.num_gpu_blocks, ids)

    def _keys(self, prompt: Sequence[int], group: int) -> list[bytes]:
        tpc = self.plan.groups[group].tokens_per_chunk
        return chunk_keys(prompt, tpc, len(prompt) // tpc)

    def _present(self, prompt: Sequence[int]) -> list[list[bool]]:
        """Per group, which of the prompt's full chunks the host pool holds."""
        return [self.manager.lookup(self._keys(prompt, g), g) for g in range(len(self.plan.groups))]

    def _hit(self, num_tokens: int, present: list[list[bool]]) -> int:
        if self.inject == "vllm-lookup":
            groups, mamba_align = stock_groups(self.plan)
            return vllm_stock_hit(groups, mamba_align, num_tokens, 0, present)
        return self.plan.lookup(num_tokens, 0, present)

    def _load(
        self,
        prompt: Sequence[int],
        hit: int,
        blocks: RequestBlocks,
        present: list[list[bool]],
    ) -> tuple[int, int, list[Refusal]]:
        """Load what a hit of ``hit`` tokens reads; returns (hit loaded, bytes, refusals).

        Every chunk the hit reads is checked on every rank, its rows pinned, before any
        byte moves. A refused chunk is dropped from the pool and marked absent in
        ``present``, and the lookup runs again on what remains: the same rule gives the
        largest valid hit without it (one that ends before the chunk's first token, on
        the Mamba grid), whose chunks are checked in turn.
        """
        refusals: list[Refusal] = []
        while hit:
            handles: list[tuple[int, int, LoadHandle]] = []
            try:
                for g in range(len(self.plan.groups)):
                    lo, top = self.plan.groups[g].needed_chunks(hit)
                    keys = self._keys(prompt, g)[lo:top]
                    if len(keys) != top - lo:
                        raise RuntimeError(
                            f"lookup hit of {hit} tokens needs chunks [{lo}, {top}) of group "
                            f"{g}, beyond the prompt's full chunks"
                        )
                    handles.append((g, lo, self.manager.prepare_load(keys, g)))
                bad = self._refused(handles) if self.check_seals else []
                if not bad:
                    return hit, self._submit_load(handles, blocks), refusals
            finally:
                for _, _, handle in handles:
                    self.manager.complete_load(handle)
            for refusal in bad:  # unpinned now: nothing else holds these rows
                key = self._keys(prompt, refusal.group)[refusal.chunk]
                busy = self.manager.drop([key], refusal.group)
                assert not busy, (refusal, busy)
                present[refusal.group][refusal.chunk] = False
            refusals.extend(bad)
            hit = self._hit(len(prompt), present)
        return 0, 0, refusals

    def _refused(self, handles: Sequence[tuple[int, int, LoadHandle]]) -> list[Refusal]:
        """The chunks of a load whose seal fails on some rank (the first such rank)."""
        bad = []
        for g, lo, handle in handles:
            for index, (key, row) in enumerate(zip(handle.keys, handle.rows, strict=True)):
                digest = key_digest(bytes(key))
                for rank, sealer in enumerate(self.sealers):
                    problem = sealer.problem(row, g, digest)
                    if problem is not None:
                        bad.append(Refusal(g, lo + index, rank, problem))
                        break
        return bad

    def _submit_load(
        self, handles: Sequence[tuple[int, int, LoadHandle]], blocks: RequestBlocks
    ) -> int:
        """One load job per rank for the pinned rows; returns the bytes moved."""
        bpc = self.plan.blocks_per_chunk
        total = 0
        for rank, engine in enumerate(self.engines):
            groups: list[tuple[list[int], list[int], int]] = []
            for g, lo, handle in handles:
                ids = blocks.block_ids[g][rank][lo * bpc : lo * bpc + len(handle.rows) * bpc]
                if self.inject == "wrong-slot" and len(ids) > 1:
                    ids = ids[1:] + ids[:1]
                groups.append((ids, list(handle.rows), lo * bpc))
            job = ("load", next(self._jobs))
            if not engine.submit_load(job, JobSpec.from_groups(groups)):
                raise RuntimeError(f"rank {rank} engine refused load job {job}")
            total += _finish(engine, job)
        return total

    def _store(
        self, prompt: Sequence[int], blocks: RequestBlocks, lost: Collection[tuple[int, int]] = ()
    ) -> tuple[int, list[list[int]]]:
        """Store the reachable chunks of the prompt; returns (bytes per rank summed, chunks)."""
        bpc = self.plan.blocks_per_chunk
        n = len(prompt)
        granted: list[tuple[int, list[int], StoreHandle]] = []
        stored: list[list[int]] = []
        for g in range(len(self.plan.groups)):
            reachable = self.plan.store_reachable_chunks(g, self.plan.storable_chunk_count(g, n))
            reachable = [c for c in reachable if (g, c) not in lost]
            keys = self._keys(prompt, g)
            handle = self.manager.prepare_store([keys[i] for i in reachable], g)
            if handle is None:  # pool full of chunks in use: store nothing of this group
                stored.append([])
                continue
            chunks = [reachable[i] for i in handle.indices]
            granted.append((g, chunks, handle))
            stored.append(chunks)
        # One job per run of consecutive chunks (the k-th run of every group together).
        runs = {g: _runs(chunks) for g, chunks, _ in granted}
        rows = {g: dict(zip(chunks, handle.rows, strict=True)) for g, chunks, handle in granted}
        digests = {
            g: dict(zip(chunks, map(key_digest, handle.keys), strict=True))
            for g, chunks, handle in granted
        }
        success = True
        total = 0
        for k in range(max((len(r) for r in runs.values()), default=0)):
            for rank, engine in enumerate(self.engines):
                groups = []
                for g in range(len(self.plan.groups)):
                    group_runs = runs.get(g, [])
                    if k >= len(group_runs):
                        groups.append(([], [], 0))
                        continue
                    lo, top = group_runs[k]
                    ids = blocks.block_ids[g][rank][lo * bpc : top * bpc]
                    groups.append((ids, [rows[g][c] for c in range(lo, top)], lo * bpc))
                job = ("store", next(self._jobs))
                if not engine.submit_store(job, JobSpec.from_groups(groups)):
                    success = False
                    continue
                try:
                    total += _finish(engine, job)
                except RuntimeError:
                    success = False
                    continue
                # The copy finished: seal its chunks on this rank (as vLLM's worker does
                # before it reports a store), each under its key.
                for g, group_runs in runs.items():
                    if k < len(group_runs):
                        for c in range(*group_runs[k]):
                            self.sealers[rank].seal(rows[g][c], g, digests[g][c])
        for _, _, handle in granted:
            self.manager.complete_store(handle, success=success)
        return total, stored


def _runs(chunks: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted chunk indices -> ``[lo, top)`` runs of consecutive chunks."""
    out: list[tuple[int, int]] = []
    for c in chunks:
        if out and out[-1][1] == c:
            out[-1] = (out[-1][0], c + 1)
        else:
            out.append((c, c + 1))
    return out


def _finish(engine: TransferEngine, job: tuple[str, int]) -> int:
    """Wait for ``job`` and return its bytes; RuntimeError if it failed."""
    engine.wait([job])
    results = {r.job_id: r for r in engine.get_finished()}
    result = results.get(job)
    if result is None or not result.success:
        raise RuntimeError(f"transfer job {job} failed")
    return int(result.transfer_size)


# ---------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    """Request 1 (``first_len`` tokens) stores; request 2 (``second_len`` tokens, same
    prefix) loads. ``clear_host`` empties the host pool in between (every hit must
    become a recompute); ``lost_chunks`` are left out of the store (a pool that lost
    them); ``corrupt_chunk`` ``(group, chunk, rank)`` has one byte of that rank's page
    flipped after the store (the load must refuse it, drop it and recompute from it)."""

    name: str
    preset: str
    dcp: int
    blocks_per_chunk: int
    first_len: int
    second_len: int
    clear_host: bool = False
    mamba_block_size: int = 0  # the model's Mamba block (0: its block_size)
    lost_chunks: tuple[tuple[int, int], ...] = ()  # (group, chunk) the first store skips
    corrupt_chunk: tuple[int, int, int] | None = None  # (group, chunk, rank) altered


@dataclass
class ScenarioResult:
    """Outcome of one scenario; ``problems`` lists every way it failed (empty: passed)."""

    scenario: Scenario
    lookup_tokens: int = 0
    loaded_tokens: int = 0
    recomputed_tokens: int = 0
    load_bytes: int = 0
    refused_chunks: int = 0  # chunks the load refused (their seal failed), dropped
    refusals: list[str] = field(default_factory=list)  # each refusal: where and why
    tokens_equal: bool = False
    logits_equal: bool = False
    max_abs_diff: float = float("nan")
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def failure(self) -> str:
        """Why the scenario failed, naming it ('' when it passed)."""
        return f"{self.scenario.name}: " + "; ".join(self.problems) if self.problems else ""


def _plan(config: ModelConfig, dcp: int, blocks_per_chunk: int) -> OffloadPlan:
    """The (correct) plan of the model at this DCP size and chunk size."""
    return plan_offload(
        group_specs(config),
        ParallelSpec(tp_size=dcp, dcp_size=dcp),
        blocks_per_chunk=blocks_per_chunk,
    )


def _chunk_tokens(config: ModelConfig, dcp: int, blocks_per_chunk: int) -> int:
    """The largest chunk of the (correct) plan: prompt lengths are placed around it."""
    return _plan(config, dcp, blocks_per_chunk).max_tokens_per_chunk


def build_scenarios(
    presets: Sequence[str], dcps: Sequence[int], blocks_per_chunks: Sequence[int]
) -> list[Scenario]:
    """The matrix: for each preset, DCP size and chunk size, prompts placed around the
    largest chunk ``C``: exactly ``2C``, ``2C + 1``, ``2C - 1``, shorter than one chunk,
    several chunks, an extension of a stored prompt, and a run with the host pool
    cleared between the requests. Per preset and DCP size (the first chunk size):
    ``corrupt-chunk``, and ``mamba-chunk-cut`` for ``mamba-hybrid-tiny``."""
    scenarios = []
    for preset in presets:
        config = ModelConfig(layers=PRESETS[preset])
        for dcp in dcps:
            for bpc in blocks_per_chunks:
                c = _chunk_tokens(config, dcp, bpc)
                prefix = f"{preset}/dcp{dcp}/bpc{bpc}"
                cases = [
                    ("boundary", 2 * c, 2 * c, False),
                    ("boundary+1", 2 * c + 1, 2 * c + 1, False),
                    ("boundary-1", 2 * c - 1, 2 * c - 1, False),
                    ("short", max(1, c // 2), max(1, c // 2), False),
                    ("several", 3 * c + c // 2 + 1, 3 * c + c // 2 + 1, False),
                    ("extension", 2 * c + 3, 3 * c + 5, False),
                    ("host-cleared", 2 * c + 1, 2 * c + 1, True),
                ]
                for label, first, second, clear in cases:
                    scenarios.append(
                        Scenario(f"{prefix}/{label}", preset, dcp, bpc, first, second, clear)
                    )
                if bpc == blocks_per_chunks[0]:  # beside its chunk size: the same server
                    scenarios.append(_corrupt_chunk(preset, config, dcp, bpc))
            if preset == "mamba-hybrid-tiny":
                scenarios.append(_mamba_chunk_cut(preset, config, dcp, blocks_per_chunks[0]))
    return scenarios


def _corrupt_chunk(preset: str, config: ModelConfig, dcp: int, bpc: int) -> Scenario:
    """A ``3C + 1``-token prompt (``C`` the largest chunk) stored whole, then the chunk of
    group 0 that starts at token ``2C`` altered: the lookup still finds ``3C`` tokens, the
    load refuses that chunk and loads ``2C`` (the largest valid hit without it: attention
    stops at its start, the Mamba state at ``2C`` is stored), the rest is recomputed.

    The byte is flipped on the last rank where each rank's page holds its own tokens
    (DCP-sharded attention: every rank's page is checked), on rank 0 for replicated
    Mamba state (the model reads rank 0's copy, so the altered byte is one it reads)."""
    plan = _plan(config, dcp, bpc)
    c = plan.max_tokens_per_chunk
    group = plan.groups[0]
    rank = dcp - 1 if group.spec.is_dcp_sharded else 0
    length = 3 * c + 1
    return Scenario(
        f"{preset}/dcp{dcp}/bpc{bpc}/corrupt-chunk",
        preset,
        dcp,
        bpc,
        length,
        length,
        corrupt_chunk=(0, 2 * c // group.tokens_per_chunk, rank),
    )


def _mamba_chunk_cut(preset: str, config: ModelConfig, dcp: int, bpc: int) -> Scenario:
    """Attention chunk ``A`` (``block_size * dcp * bpc``), Mamba chunk ``M = 4A``, a
    prompt of ``3M + 1`` tokens stored without attention chunk ``2M / A + 1``: the hit
    must stop at ``2M`` (the Mamba state there), not at the attention gap ``2M + A``,
    inside Mamba chunk 2 (vLLM's stock rule loads the state at ``3M`` there)."""
    attention_chunk = config.block_size * dcp * bpc
    mamba_block = 4 * config.block_size * dcp
    mamba_chunk = mamba_block * bpc
    length = 3 * mamba_chunk + 1
    lost = ((0, 2 * mamba_chunk // attention_chunk + 1),)
    return Scenario(
        f"{preset}/dcp{dcp}/bpc{bpc}/mamba-chunk-cut",
        preset,
        dcp,
        bpc,
        length,
        length,
        mamba_block_size=mamba_block,
        lost_chunks=lost,
    )


def prompt_tokens(length: int, vocab_size: int, seed: int = 1234) -> list[int]:
    """A fixed pseudo-random prompt; prompts of one run share their prefixes."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def run_scenario(server: OffloadServer, scenario: Scenario, max_new_tokens: int) -> ScenarioResult:
    result = ScenarioResult(scenario)
    vocab = server.config.vocab_size
    longest = max(scenario.first_len, scenario.second_len)
    tokens = prompt_tokens(longest, vocab)
    first, second = tokens[: scenario.first_len], tokens[: scenario.second_len]
    try:
        server.clear_host()
        server.clear_gpu()
        reference = None
        if second != first:
            reference = server.run(second, max_new_tokens, lookup=False, store=False)
            server.clear_gpu()
        cold = server.run(
            first, max_new_tokens, lookup=False, store=True, lost=scenario.lost_chunks
        )
        reference = reference or cold
        if scenario.corrupt_chunk is not None:
            server.flip_byte(first, *scenario.corrupt_chunk)
        if scenario.clear_host:
            server.clear_host()
        server.clear_gpu()
        warm = server.run(second, max_new_tokens, lookup=True, store=False)
    except Exception as error:  # any failure of the data path is this scenario's failure
        result.problems.append(f"{type(error).__name__}: {error}")
        return result
    result.lookup_tokens = warm.lookup_tokens
    result.loaded_tokens = warm.loaded_tokens
    result.recomputed_tokens = warm.recomputed_tokens
    result.load_bytes = warm.load_bytes
    result.refused_chunks = len(warm.refused)
    result.refusals = [str(r) for r in warm.refused]
    result.tokens_equal = warm.generated == reference.generated
    result.logits_equal = all(torch.equal(warm.logits[p], reference.logits[p]) for p in warm.logits)
    diffs = [(warm.logits[p] - reference.logits[p]).abs().max().item() for p in warm.logits]
    result.max_abs_diff = max(diffs, default=0.0)
    problems = result.problems
    if not result.tokens_equal:
        problems.append("generated tokens differ")
    if not result.logits_equal:
        problems.append(f"logits differ (max |diff| {result.max_abs_diff:.3g})")
    if warm.replica_mismatches:
        position, layer = warm.replica_mismatches[0]
        problems.append(
            f"Mamba state replicas differ across DCP ranks (position {position}, layer {layer})"
        )
    if warm.loaded_tokens + warm.recomputed_tokens != len(second):
        problems.append(
            f"loaded {warm.loaded_tokens} + recomputed {warm.recomputed_tokens} tokens != "
            f"prompt length {len(second)}"
        )
    if warm.loaded_tokens and not warm.load_bytes:
        problems.append(f"{warm.loaded_tokens} tokens counted as loaded but no byte moved")
    problems.extend(_refusal_problems(server, scenario, second, warm))
    return result


def _refusal_problems(
    server: OffloadServer, scenario: Scenario, prompt: Sequence[int], warm: RequestResult
) -> list[str]:
    """What is wrong with the refusals of the warm request: an altered chunk must be
    refused (and only it), dropped from the pool, after a lookup that counted it."""
    refused = [(r.group, r.chunk) for r in warm.refused]
    if scenario.corrupt_chunk is None:
        return [f"refused unaltered chunks: {'; '.join(map(str, warm.refused))}"] if refused else []
    group, chunk, _ = scenario.corrupt_chunk
    problems = []
    lo, top = server.plan.groups[group].needed_chunks(warm.lookup_tokens)
    if not lo <= chunk < top:
        problems.append(
            f"the lookup's {warm.lookup_tokens} tokens do not read the altered chunk {chunk} "
            f"of group {group} (nothing to refuse)"
        )
    if refused != [(group, chunk)]:
        problems.append(
            f"the altered chunk {chunk} of group {group} was "
            + ("loaded, not refused" if not refused else f"not the one refused: {refused}")
        )
    if server.manager.lookup(server._keys(prompt, group)[chunk : chunk + 1], group) != [False]:
        problems.append(f"the altered chunk {chunk} of group {group} is still in the host pool")
    return problems


def run_scenarios(
    scenarios: Sequence[Scenario],
    *,
    backend: Backend = "torch",
    inject: str | None = None,
    max_new_tokens: int = 8,
    results: list[ScenarioResult] | None = None,
    on_scenario: Callable[[Scenario], None] | None = None,
) -> list[ScenarioResult]:
    """Run scenarios, one server per (preset, dcp, blocks_per_chunk).

    Results are appended to ``results`` (a new list by default) as each scenario ends,
    so a run cut short (an interrupt) leaves the finished ones there; ``on_scenario``
    is called as each one starts (the command names where it was cut, and prints
    progress)."""
    results = [] if results is None else results
    key = None
    server: OffloadServer | None = None
    models: dict[str, HybridModel] = {}
    try:
        for scenario in scenarios:
            if on_scenario is not None:
                on_scenario(scenario)
            this = (
                scenario.preset,
                scenario.dcp,
                scenario.blocks_per_chunk,
                scenario.mamba_block_size,
            )
            if this != key:
                if server is not None:
                    server.close()
                config = ModelConfig(
                    layers=PRESETS[scenario.preset], mamba_block_size=scenario.mamba_block_size
                )
                model_key = f"{scenario.preset}/{scenario.mamba_block_size}"
                if model_key not in models:
                    models[model_key] = HybridModel(config)
                model = models[model_key]
                group = [
                    x
                    for x in scenarios
                    if (x.preset, x.dcp, x.blocks_per_chunk, x.mamba_block_size) == this
                ]
                longest = max(max(x.first_len, x.second_len) for x in group) + max_new_tokens
                server = OffloadServer(
                    config,
                    dcp=scenario.dcp,
                    blocks_per_chunk=scenario.blocks_per_chunk,
                    backend=backend,
                    max_tokens=longest,
                    inject=inject,
                    model=model,
                )
                key = this
            assert server is not None
            results.append(run_scenario(server, scenario, max_new_tokens))
    finally:
        if server is not None:
            server.close()
    return results
