"""vLLM 0.33's real core scheduler and ``TritonOffloadingConnector``'s worker side, stepped
by hand on CPU caches (the harness of the load-failure and fault-injection tests).

A stand-in model "computes" each scheduled token's KV as a pure function of (token,
position, layer), so a request's blocks after it finished must equal a cold run's
whatever was loaded: a corrupt byte in a block counted as loaded shows as a difference.
The connector's extra config can be changed (another spec, secondary tiers, host size);
the hits the connector granted and the positions the model computed are kept per request.
Importing this module imports vLLM: a test module imports it inside ``try``.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import triton_offload.vllm as tv

RUNNER_OUTPUT_FIELDS = {field.name for field in dataclasses.fields(ModelRunnerOutput)}

BLOCK = 16
NUM_BLOCKS = 64
PROMPT = 6 * BLOCK  # six blocks offloaded by the first request
HEADS = (1, 1)  # the KV heads of each group's layer (two groups: a hybrid layout)


def kv_value(token: int, position: int, layer: int) -> float:
    """What the stand-in model computes for one token: a function of token and position."""
    return float((token * 131 + position * 7 + layer * 1009) % 65521) + 0.5


class Engine:
    """vLLM's core scheduler and this backend's worker side, stepped by hand."""

    def __init__(
        self,
        tmp_path: Any,
        policy: str,
        num_groups: int = 1,
        extra_config: dict[str, Any] | None = None,
    ) -> None:
        """``extra_config`` is merged into the connector's ``kv_connector_extra_config``
        (default: this backend's CPU spec, 4 MiB of host memory, the torch copy path)."""
        model_dir = tmp_path / "model"
        model_dir.mkdir(exist_ok=True)
        # A tiny OPT config: vLLM's ModelConfig reads it; no weights are needed.
        (model_dir / "config.json").write_text(
            json.dumps(
                {"model_type": "opt", "architectures": ["OPTForCausalLM"], "num_hidden_layers": 2}
            )
        )
        model = ModelConfig(model=str(model_dir), dtype="float32", seed=0, skip_tokenizer_init=True)
        specs = [
            FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=HEADS[g], head_size=4, dtype=torch.float32
            )
            for g in range(num_groups)
        ]
        self.layers = [f"layer.{g}" for g in range(num_groups)]
        self.kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=spec.page_size_bytes * NUM_BLOCKS,
                    layers=[name],
                    layer_stride=spec.page_size_bytes * NUM_BLOCKS,
                    block_stride=spec.page_size_bytes,
                )
                for spec, name in zip(specs, self.layers, strict=True)
            ],
            kv_cache_groups=[
                KVCacheGroupSpec([name], spec)
                for spec, name in zip(specs, self.layers, strict=True)
            ],
        )
        self.vllm_config = VllmConfig(
            scheduler_config=SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=512,
                max_model_len=1024,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            model_config=model,
            # No GPU prefix cache: every hit below is a load from the host tier.
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
            kv_transfer_config=KVTransferConfig(
                kv_connector="TritonOffloadingConnector",
                kv_connector_module_path="triton_offload.vllm",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "cpu_bytes_to_use": 1 << 22,
                    "backend": "torch",
                    **(extra_config or {}),
                },
                kv_load_failure_policy=policy,
                engine_id=f"load-failures-{uuid.uuid4()}",
            ),
            device_config=DeviceConfig("cpu"),
        )
        self.vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK,
            hash_block_size=BLOCK,
        )
        self.worker = tv.TritonOffloadingConnector(
            self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
        )
        self.caches = {
            name: torch.full((NUM_BLOCKS, 2, BLOCK, HEADS[g], 4), -1.0)
            for g, name in enumerate(self.layers)
        }
        with set_current_vllm_config(self.vllm_config):
            self.worker.register_kv_caches(self.caches)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.computed: dict[str, list[int]] = {}  # request -> positions the model computed
        self.finished: dict[str, Any] = {}  # request -> finish reason
        self.snapshots: dict[str, list[list[torch.Tensor]]] = {}  # request -> its blocks' KV
        self.context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        # Request -> tokens the connector said it would load for it (its first answer
        # that was a number), beyond what the request had computed then.
        self.hits: dict[str, int] = {}
        #: Each step's KV-connector stats payload, as vLLM's scheduler sends it to its
        #: stat loggers (workers' stats merged with the scheduler's).
        self.connector_stats: list[dict[str, Any]] = []
        connector = self.scheduler.connector
        matched = connector.get_num_new_matched_tokens

        def recorded(request: Any, num_computed_tokens: int, *args: Any, **kwargs: Any) -> Any:
            answer = matched(request, num_computed_tokens, *args, **kwargs)
            if answer[0] is not None and request.request_id not in self.hits:
                self.hits[request.request_id] = num_computed_tokens + answer[0]
            return answer

        connector.get_num_new_matched_tokens = recorded

    @property
    def connector_scheduler(self) -> Any:
        return self.scheduler.connector.connector_scheduler

    @property
    def transfer_worker(self) -> Any:
        return self.worker.connector_worker.worker.worker  # the TritonOffloadingWorker

    @property
    def offloading_manager(self) -> Any:
        """vLLM's offloading manager the connector scheduler uses (CPU or tiering)."""
        return self.connector_scheduler.manager

    def settle(self, timeout_s: float = 20.0) -> None:
        """Step the idle scheduler until the offloading manager has nothing in flight
        (a tiering manager's writes to its secondary tiers, for instance)."""
        deadline = time.monotonic() + timeout_s
        self.step()
        while self.offloading_manager.has_pending_work():
            if time.monotonic() > deadline:
                raise AssertionError("the offloading manager did not settle")
            time.sleep(0.005)
            self.step()

    def recomputed(self, req_id: str) -> bool:
        """Whether the model computed a position the connector had said it would load."""
        hit = self.hits.get(req_id, 0)
        return any(position < hit for position in self.computed.get(req_id, ()))

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()

    def add(self, req_id: str, tokens: list[int]) -> Any:
        request = Request(
            request_id=req_id,
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.scheduler.add_request(request)
        self.computed[req_id] = []
        return request

    def _compute(self, output: Any) -> list[str]:
        """The stand-in model: each scheduled token's KV into its blocks, every group."""
        sampled = []
        for req_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens - count
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            for name in self.layers:
                # As an attention layer does: wait for its load before reading its KV
                # (a no-op unless the step's sync loads go layer by layer).
                self.worker.wait_for_layer_load(name)
            for position in range(start, start + count):
                token = request.all_token_ids[position]
                self.computed[req_id].append(position)
                for g, name in enumerate(self.layers):
                    block = block_ids[g][position // BLOCK]
                    self.caches[name][block, :, position % BLOCK] = kv_value(token, position, g)
            sampled.append(req_id)
            # Its KV as the model sees it this step (the last step's copy is the final one).
            self.snapshots[req_id] = [
                [self.caches[name][b].clone() for b in block_ids[g]]
                for g, name in enumerate(self.layers)
            ]
        return sampled

    def step(self) -> int:
        """One engine step; returns the number of tokens it scheduled."""
        output = self.scheduler.schedule()
        self.start(output)
        return self.finish(output)

    def start(self, output: Any) -> None:
        """A step's worker side before the model runs: vLLM submits the stores deferred
        from the last step (``handle_preemptions``, ``start_load_kv``) and the loads."""
        meta = output.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(self.context)

    def finish(self, output: Any) -> int:
        """The rest of a step: the model, the transfer reports, the scheduler's update;
        returns the number of tokens the step scheduled."""
        scheduled = self._compute(output)
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(output.finished_req_ids)
        invalid = self.worker.get_block_ids_with_load_errors()
        stats = self.worker.get_kv_connector_stats()  # as vLLM's model runner asks
        report = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        # vLLM 0.34's ModelRunnerOutput has no req_id_to_index (the index is the order).
        index = (
            {"req_id_to_index": {req_id: i for i, req_id in enumerate(scheduled)}}
            if "req_id_to_index" in RUNNER_OUTPUT_FIELDS
            else {}
        )
        runner = ModelRunnerOutput(
            req_ids=scheduled,
            **index,
            sampled_token_ids=[
                [7]
                if self.scheduler.requests[r].num_computed_tokens
                >= self.scheduler.requests[r].num_prompt_tokens
                else []
                for r in scheduled
            ],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=invalid,
                kv_connector_stats=stats,
                kv_connector_worker_meta=report,
            ),
        )
        for outputs in self.scheduler.update_from_output(output, runner).values():
            if outputs.scheduler_stats is not None and outputs.scheduler_stats.kv_connector_stats:
                self.connector_stats.append(outputs.scheduler_stats.kv_connector_stats)
            for out in outputs.outputs:
                if out.finish_reason is not None:
                    self.finished[out.request_id] = out.finish_reason
        return int(output.total_num_scheduled_tokens)

    def run(
        self, request: Any, steps: int = 40, timeout_s: float = 20.0
    ) -> list[list[torch.Tensor]]:
        """Step until ``request`` finished and no transfer is in flight; its KV per group
        and block as the model saw it in its last step. ``steps`` bounds the steps that
        scheduled tokens; steps that scheduled none (a request waiting for a tier's
        promotion or a load) count against ``timeout_s`` instead."""
        deadline = time.monotonic() + timeout_s
        while steps > 0:
            if self.step():
                steps -= 1
            elif time.monotonic() > deadline:
                break
            else:
                time.sleep(0.002)
            done = request.request_id in self.finished
            if done and not self.connector_scheduler._jobs and not self.scheduler.requests:
                return self.snapshots[request.request_id]
        raise AssertionError(f"request {request.request_id} did not finish")

    def expected(self, tokens: list[int]) -> list[list[torch.Tensor]]:
        """A cold run's KV for the prompt positions, per group and block."""
        blocks = []
        for g in range(len(self.layers)):
            group = []
            for b in range(-(-len(tokens) // BLOCK)):
                page = torch.full((2, BLOCK, HEADS[g], 4), -1.0)
                for slot in range(BLOCK):
                    position = b * BLOCK + slot
                    if position < len(tokens):
                        page[:, slot] = kv_value(tokens[position], position, g)
                group.append(page)
            blocks.append(group)
        return blocks


def prompt(extra: int = 0, seed: int = 3) -> list[int]:
    return [(seed * 37 + 11 * i) % 997 + 1 for i in range(PROMPT + extra)]


def differing_blocks(engine: Engine, kv: list[list[torch.Tensor]], tokens: list[int]) -> int:
    """How many (group, block) pages differ from the cold run over the prompt positions
    (the model rewrites what it computes: a difference is a block loaded wrong)."""
    expected = engine.expected(tokens)
    count = 0
    for actual_blocks, cold_blocks in zip(kv, expected, strict=False):
        for b, cold in enumerate(cold_blocks):
            filled = min(BLOCK, len(tokens) - b * BLOCK)
            count += not torch.equal(actual_blocks[b][:, :filled], cold[:, :filled])
    return count


def assert_prompt_kv(engine: Engine, kv: list[list[torch.Tensor]], tokens: list[int]) -> None:
    """Every prompt position of every group equals the cold run (positions the run
    never reached, past the prompt, are not compared)."""
    expected = engine.expected(tokens)
    for g, (actual_blocks, cold_blocks) in enumerate(zip(kv, expected, strict=False)):
        for b, cold in enumerate(cold_blocks):
            filled = min(BLOCK, len(tokens) - b * BLOCK)
            assert torch.equal(actual_blocks[b][:, :filled], cold[:, :filled]), (g, b)


def _offload_first_request(engine: Engine) -> list[int]:
    tokens = prompt()
    first = engine.add("A", tokens)
    kv = engine.run(first)
    assert_prompt_kv(engine, kv, tokens)
    assert engine.computed["A"] == list(range(PROMPT))
    return tokens


def _corrupt_host_chunk(engine: Engine, chunk_of_prompt: int) -> None:
    """Flip one byte of the host row holding block ``chunk_of_prompt`` of request A."""
    scheduler = engine.connector_scheduler
    manager = scheduler.manager
    probe = engine.add("probe", prompt(8))
    state = scheduler._req_status.get("probe")
    if state is None:  # the connector tracks a request from its first lookup
        scheduler.on_new_request(probe)
        state = scheduler._req_status["probe"]
    state.update_offload_keys()
    key = state.group_states[0].offload_keys[chunk_of_prompt]
    chunk = manager._policy.get(key)
    engine.scheduler.finish_requests("probe", RequestStatus.FINISHED_ABORTED)
    engine.computed.pop("probe")
    pool = engine.transfer_worker.engine.pool
    pool[chunk.chunk_id, 5] ^= 0x40
