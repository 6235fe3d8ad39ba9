"""TritonOffloadingConnector in vLLM's real connector objects, on CPU tensors: the
scheduler side alone (:class:`Engine`) and both roles moving bytes (:class:`Serving`).
Built and judged in ``tests/vllm/test_connector.py``; every ``Serving`` is listed in
``_OPEN_SERVINGS`` until it is closed. Importing this module skips the importing test
module, with the import error as the reason, where vLLM cannot be imported.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import pytest
import torch

try:
    from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.platforms import current_platform
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.kv_offload.base import LookupResult
    from vllm.v1.request import Request

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"
    # Module-level names below call vLLM's classes: skip before they run.
    pytest.skip(VLLM_ERROR, allow_module_level=True)


MODULE = "triton_offload.vllm"


def attention(block: int) -> Any:
    return FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=4, dtype=torch.float32)


def window(block: int, tokens: int) -> Any:
    return SlidingWindowSpec(
        block_size=block, num_kv_heads=1, head_size=4, dtype=torch.float32, sliding_window=tokens
    )


class Engine:
    """One scheduler-side connector (ours or vLLM's stock one) over real vLLM objects."""

    def __init__(
        self,
        specs: list[Any],
        *,
        stock: bool = False,
        tp: int = 1,
        dcp: int = 1,
        role: Any = None,
        extra: dict[str, Any] | None = None,
        engine_id: str = "engine-0",
    ) -> None:
        extra_config: dict[str, Any] = {"cpu_bytes_to_use": 1 << 22, **(extra or {})}
        if stock:
            extra_config |= {"spec_name": "TritonOffloadingSpec", "spec_module_path": MODULE}
        with patch.object(current_platform, "device_count", return_value=tp):
            parallel = ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp)
        self.vllm_config = SimpleNamespace(
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector" if stock else "TritonOffloadingConnector",
                kv_connector_module_path=None if stock else MODULE,
                kv_role="kv_both",
                kv_connector_extra_config=extra_config,
                engine_id=engine_id,
            ),
            parallel_config=parallel,
            cache_config=CacheConfig(
                block_size=min(s.block_size for s in specs),
                enable_prefix_caching=True,
                mamba_cache_mode="align",
            ),
            model_config=SimpleNamespace(
                model="hybrid",
                use_mla=False,
                max_model_len=4096,
                dtype=torch.float32,
                get_total_num_kv_heads=lambda: tp,
            ),
            kv_events_config=None,
            use_v2_model_runner=False,
            speculative_config=None,
            num_hash_lookahead_tokens=0,  # vLLM 0.34 reads it (0: no lookahead hashes)
            attention_config=SimpleNamespace(hisparse_config=None),
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=256,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)
            ],
        )
        import triton_offload.vllm as tv

        cls = OffloadingConnector if stock else tv.TritonOffloadingConnector
        self.connector = cls(
            self.vllm_config, role or KVConnectorRole.SCHEDULER, self.kv_cache_config
        )
        _, self.hash_block_size = resolve_kv_cache_block_sizes(
            self.kv_cache_config, self.vllm_config
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(self.hash_block_size, sha256)

    @property
    def scheduler(self) -> Any:
        return self.connector.connector_scheduler

    def request(self, req_id: str, num_tokens: int) -> Any:
        request = Request(
            request_id=req_id,
            prompt_token_ids=[(7 * i + 3) % 50 for i in range(num_tokens)],
            sampling_params=SamplingParams(max_tokens=4),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.connector.on_new_request(request)
        state = self.scheduler._req_status[req_id]
        state.update_offload_keys()
        return request

    def store(self, request: Any, chunks: list[list[int]], *, complete: bool = True) -> None:
        """Store chunks ``chunks[g]`` of each group through the CPU manager."""
        state = self.scheduler._req_status[request.request_id]
        keys = [
            group_state.offload_keys[c]
            for group_state, group_chunks in zip(state.group_states, chunks, strict=True)
            for c in group_chunks
        ]
        manager = self.scheduler.manager
        prepared = manager.prepare_store(keys, state.req_context)
        assert prepared is not None and prepared.keys_to_store == keys
        if complete:
            manager.complete_store(keys, state.req_context)

    def hit(self, request: Any, computed: int = 0) -> int | None:
        tokens, _ = self.connector.get_num_new_matched_tokens(request, computed)
        self.scheduler._release_step()  # what build_connector_meta does at the step's end
        return tokens


_OPEN_SERVINGS: list[Serving] = []


class Serving:
    """Our connector in both roles over CPU tensors: the scheduler side (real requests,
    block hashes, CPU manager), the worker side (``register_kv_caches`` on real tensors,
    the TransferEngine moving bytes), and vLLM's own KV managers allocating the loading
    request's blocks. The core scheduler's part (scheduler outputs, the Mamba boundary
    hand-offs) is played here step by step."""

    NUM_BLOCKS = 256

    def __init__(self, specs: list[Any]) -> None:
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

        # Each instance maps its own shared region (one engine id), released by close().
        engine_id = f"serving-{uuid.uuid4()}"
        self.scheduler_side = Engine(specs, engine_id=engine_id)
        self.worker_side = Engine(specs, role=KVConnectorRole.WORKER, engine_id=engine_id)
        _OPEN_SERVINGS.append(self)
        self.specs = specs
        generator = torch.Generator().manual_seed(0)
        self.tensors: dict[str, torch.Tensor] = {}
        for index, spec in enumerate(specs):
            shape = spec.shapes[0] if isinstance(spec, MambaSpec) else (2, spec.block_size, 1, 4)
            self.tensors[f"layer.{index}"] = torch.randn(
                self.NUM_BLOCKS, *shape, generator=generator
            )
        self.worker_side.connector.register_kv_caches(self.tensors)
        self.engine = self.worker_side.connector.connector_worker.worker.engine
        pool = BlockPool(self.NUM_BLOCKS, enable_caching=True, hash_block_size=4)
        scheduler_block = max(s.block_size for s in specs)
        self.managers = [
            KVCacheSpecRegistry.get_manager_class(spec)(
                kv_cache_spec=spec,
                block_pool=pool,
                enable_caching=True,
                kv_cache_group_id=index,
                scheduler_block_size=scheduler_block,
            )
            for index, spec in enumerate(specs)
        ]

    @property
    def connector(self) -> Any:
        return self.scheduler_side.connector

    def close(self) -> None:
        """Shut the worker side down: the engine stops, the shared region is released."""
        self.worker_side.connector.shutdown()

    def step(self, output: Any) -> set[str]:
        """One engine step: scheduler metadata -> worker transfers -> worker report."""
        return self.work(self.connector.build_connector_meta(output), output)

    def work(self, meta: Any, output: Any) -> set[str]:
        """The worker's half of a step: run ``meta``'s transfers, report to the scheduler."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.forward_context import ForwardContext
        from vllm.v1.outputs import KVConnectorOutput

        worker = self.worker_side.connector
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(
            ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        )
        worker.wait_for_save()
        _, received = worker.get_finished(set(output.finished_req_ids))
        report = worker.build_connector_worker_meta() or OffloadingWorkerMetadata()
        worker.clear_connector_metadata()
        self.connector.update_connector_output(
            KVConnectorOutput(finished_recving=received, kv_connector_worker_meta=report)
        )
        return set(received or ())

    @staticmethod
    def output(
        new: list[tuple[str, tuple[list[int], ...]]] = (),  # type: ignore[assignment]
        scheduled: dict[str, int] | None = None,
        finished: set[str] | None = None,
        handoffs: dict[str, list[tuple[int, int, int]]] | None = None,
        preempted: set[str] | None = None,
    ) -> Any:
        from vllm.v1.core.sched.output import KVConnectorBlockState

        return SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b) for r, b in new],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], new_block_ids=[], resumed_req_ids=set()
            ),
            num_scheduled_tokens=scheduled or {},
            finished_req_ids=finished or set(),
            preempted_req_ids=preempted or set(),
            kv_cache_block_copies=None,
            kv_connector_block_state=None
            if handoffs is None
            else KVConnectorBlockState(
                req_ids=set(handoffs),
                resolve_block_ids={}.__getitem__,
                boundary_state_offloads=handoffs,
            ),
        )

    def store_prompt(self, num_tokens: int) -> tuple[Any, list[list[int]]]:
        """Request A computes ``num_tokens`` prompt tokens in blocks from id 128 up and
        finishes; its chunks are stored. Returns (request, block ids per group)."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.request import RequestStatus

        request = self.scheduler_side.request("A", num_tokens)
        assert self.connector.get_num_new_matched_tokens(request, 0) == (0, False)
        self.connector.update_state_after_alloc(
            request, KVCacheBlocks(tuple([] for _ in self.specs)), 0
        )
        next_id = 128
        block_ids: list[list[int]] = []
        handoffs = []
        for index, spec in enumerate(self.specs):
            count = -(-num_tokens // spec.block_size)
            block_ids.append(list(range(next_id, next_id + count)))
            next_id += count
            if isinstance(spec, MambaSpec):
                # The core hands over the block holding the state at each chunk boundary.
                tpc = spec.block_size
                handoffs += [
                    (index, block_ids[index][b // spec.block_size - 1], b)
                    for b in range(tpc, num_tokens + 1, tpc)
                ]
        self.step(
            self.output(
                new=[("A", tuple(block_ids))],
                scheduled={"A": num_tokens},
                handoffs={"A": handoffs} if handoffs else None,
            )
        )
        request.num_computed_tokens = num_tokens
        request.status = RequestStatus.FINISHED_STOPPED
        self.connector.request_finished(request, [])
        self.step(self.output(finished={"A"}))
        for _ in range(3):  # deferred store submissions and their reports
            if not self.connector.connector_scheduler._jobs:
                break
            self.step(self.output())
        assert not self.connector.connector_scheduler._jobs
        return request, block_ids

    def stored_chunks(self, num_tokens: int) -> list[list[int]]:
        """Which chunks of the prompt the CPU manager holds, per group (a probe request)."""
        probe = self.scheduler_side.request("probe", num_tokens)
        state = self.connector.connector_scheduler._req_status[probe.request_id]
        manager = self.connector.connector_scheduler.manager
        return [
            [
                c
                for c, key in enumerate(group.offload_keys)
                if manager.lookup(key, state.req_context) is LookupResult.HIT
            ]
            for group in state.group_states
        ]

    def load_prompt(self, num_tokens: int) -> tuple[int, list[list[Any]]]:
        """Request B (same prompt) looks up, vLLM's managers allocate its blocks, the
        load runs. Returns (hit tokens, B's blocks per group)."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks

        request = self.scheduler_side.request("B", num_tokens)
        hit, load_async = self.connector.get_num_new_matched_tokens(request, 0)
        assert hit and load_async
        for manager in self.managers:
            manager.add_local_computed_blocks("B", [], 0, hit)
        for manager in self.managers:
            manager.allocate_external_computed_blocks("B", 0, hit)
        blocks = [list(m.req_to_blocks["B"]) for m in self.managers]
        self.connector.update_state_after_alloc(request, KVCacheBlocks(tuple(blocks)), hit)
        received = self.step(self.output())
        for _ in range(3):
            if "B" in received:
                break
            received |= self.step(self.output())
        assert "B" in received
        return hit, blocks
