"""Layer-wise sync loads: the forward's layer ``l`` computes while layer ``l + 1`` arrives.

vLLM calls ``wait_for_layer_load(layer_name)`` before each standard or MLA attention
layer (``maybe_transfer_kv_layer``); its own ``OffloadingConnector`` ignores it and
blocks until a step's sync loads landed whole. With ``"layerwise_loads": true`` in
``kv_connector_extra_config`` (``TritonOffloadingConnector`` only: vLLM's plain
connector cannot report a failed load), a step's sync loads are one layer-staged
submission (``TransferEngine.submit_layered_loads``):

- stage 0: every plane no hook waits for (Mamba/GDN state, a group that is not
  attention, a layer the forward order does not name), loaded whole before
  ``start_load_kv`` returns (CUDA: the compute stream waits for it; CPU: the host);
- then one stage per attention layer, in the order vLLM registered the layers (the
  forward's order); ``wait_for_layer_load`` makes the compute wait for that layer's
  stage only. A KV-sharing layer waits for its target's stage; an unknown name is a
  no-op.

At the end of the step the submission is joined before the step's report: its jobs'
results (and seal verdicts) are reported in the same step, a failed stage fails every
job of the submission, and a stage the forward never waited for (a full CUDA graph
skipped the hooks) fails its jobs too and turns layer-wise loads off for good (the
whole-job path from then on). The whole-job path is also taken when attention runs
inside captured graphs (full CUDA graphs, or compilation without attention as a
splitting op).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from triton_offload.transfer.layout import CacheLayout
from triton_offload.vllm.compat import logger

#: The extra-config key that turns layer-wise sync loads on (default off).
LAYERWISE_KEY = "layerwise_loads"


@dataclass(frozen=True)
class LayerStages:
    """The stages of a layer-wise load and which stage each layer name waits for.

    ``stages[0]``: the planes no hook waits for (possibly empty); ``stages[k]`` for
    ``k >= 1``: the planes of one attention layer. ``stage_of[name]``: the stage a
    layer's ``wait_for_layer_load`` waits for (KV-sharing layers: their target's).
    """

    stages: tuple[tuple[int, ...], ...]
    stage_of: Mapping[str, int]

    @property
    def submitted(self) -> list[tuple[int, ...]]:
        """The stages as the engine takes them: an empty stage 0 is kept (its event
        completes at once), so stage numbers stay the layer map's."""
        return [tuple(stage) for stage in self.stages]


def layer_stages(
    layout: CacheLayout,
    group_layer_names: Sequence[Sequence[str]],
    hooked_groups: set[int],
    layer_order: Sequence[str],
    kv_sharing: Mapping[str, str] | None = None,
) -> LayerStages:
    """Map vLLM's layer names to the engine's planes and cut the stages.

    ``group_layer_names[g]``: the offloaded group ``g``'s layer names in ref order (a
    plane's ``layer`` is its ref's position: ``canonical_layout`` fragment planes keep
    theirs); ``hooked_groups``: the groups whose layers call vLLM's per-layer hooks
    (attention, MLA); ``layer_order``: every layer name in the order vLLM registered the
    caches (the forward's); ``kv_sharing``: a layer that reads another's cache -> that
    layer. A plane whose ref position names no layer goes to stage 0.
    """
    planes_of: dict[str, list[int]] = {}
    unhooked: list[int] = []
    for index, plane in enumerate(layout.planes):
        names = group_layer_names[plane.group] if plane.group < len(group_layer_names) else ()
        name = names[plane.layer] if plane.layer < len(names) else None
        if plane.group in hooked_groups and name is not None:
            planes_of.setdefault(name, []).append(index)
        else:
            unhooked.append(index)
    stages: list[tuple[int, ...]] = [tuple(unhooked)]
    stage_of: dict[str, int] = {}
    for name in layer_order:
        if name in planes_of and name not in stage_of:
            stage_of[name] = len(stages)
            stages.append(tuple(planes_of[name]))
    leftover = sorted(
        p for name, planes in planes_of.items() if name not in stage_of for p in planes
    )
    if leftover:
        # Layers missing from the registration order: nothing would wait for them.
        stages[0] = tuple(sorted(stages[0] + tuple(leftover)))
    for layer, target in (kv_sharing or {}).items():
        if target in stage_of and layer not in stage_of:
            stage_of[layer] = stage_of[target]
    return LayerStages(tuple(stages), stage_of)


def attention_runs_outside_graphs(vllm_config: Any) -> tuple[bool, str]:
    """Whether vLLM calls the per-layer hooks in every step, and if not, why not.

    Eager execution always calls them. With compilation, attention must be a splitting
    op (piecewise graphs run it outside the graphs) and no full CUDA graph may be used
    (it replays the whole forward, hooks included in nothing)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None and getattr(model_config, "enforce_eager", False):
        return True, ""
    compilation = getattr(vllm_config, "compilation_config", None)
    if compilation is None:
        return True, ""
    mode = getattr(compilation, "cudagraph_mode", None)
    name = str(getattr(mode, "name", mode) or "NONE")
    if "FULL" in name:
        return False, f"cudagraph_mode {name} replays attention inside full CUDA graphs"
    splitting = [str(op) for op in (getattr(compilation, "splitting_ops", None) or [])]
    if name != "NONE" and not any("attention" in op for op in splitting):
        return False, "attention is not a splitting op: piecewise graphs capture it"
    return True, ""


class LayerwiseLoads:
    """The connector worker's layer-wise state for one process (see the module)."""

    def __init__(self, stages: LayerStages) -> None:
        self.stages = stages
        self.handle: Any = None
        self.off_reason = ""
        self.started = False  # a layer-wise load ran (logged once)

    @property
    def active(self) -> bool:
        return not self.off_reason

    def turn_off(self, why: str) -> None:
        if not self.off_reason:
            self.off_reason = why
            logger.warning("triton_offload: layer-wise loads off from now on: %s", why)

    def start(self, worker: Any, jobs: list[tuple[int, Any, Any]]) -> bool:
        """Submit a step's sync loads stage by stage and wait for stage 0 (the planes no
        hook waits for). False: the worker refused (the caller falls back)."""
        handle = worker.submit_layered_loads(jobs, self.stages.submitted)
        if handle is None:
            return False
        self.handle = handle
        if not self.started:
            self.started = True
            logger.info(
                "triton_offload: first layer-wise sync load: %d job(s) in %d stages",
                len(jobs),
                handle.num_stages,
            )
        handle.wait(0)
        return True

    def wait(self, layer_name: str) -> None:
        handle = self.handle
        if handle is None:
            return
        stage = self.stages.stage_of.get(layer_name)
        if stage is not None:
            handle.wait(stage)

    def finish(self) -> tuple[Any, ...]:
        """Join the step's submission; the job ids that must be reported failed because
        the forward skipped a stage's wait (the bytes it read may not have landed)."""
        handle, self.handle = self.handle, None
        if handle is None:
            return ()
        handle.join()
        skipped = sorted(set(range(1, handle.num_stages)) - handle.waited)
        if not skipped:
            return ()
        self.turn_off(
            f"the forward did not wait for {len(skipped)} of {handle.num_stages - 1} "
            "layer stages (a captured graph skips vLLM's per-layer hooks); their loads "
            "are reported failed"
        )
        handle.fail_all()
        return tuple(handle.job_ids)


__all__ = [
    "LAYERWISE_KEY",
    "LayerStages",
    "LayerwiseLoads",
    "attention_runs_outside_graphs",
    "layer_stages",
]
