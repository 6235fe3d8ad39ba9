"""Layer-wise sync loads against whole-job loads: time to first token of a hit, same run.

A stand-in model of ``LAYERS`` attention layers (K and V planes of ``PAGE`` bytes per
block) loads a hit of ``BLOCKS`` blocks in the step that computes the rest of the
prompt; its forward is a matmul per layer (``FORWARD_DIM`` square, ``FORWARD_REPEATS``
times), run after that layer's wait. Rows (printed and in ``extra_info``), medians of
alternated rounds:

- ``copy_s``: the whole job alone; ``forward_s``: the forward alone;
- ``whole_s``: whole-job load, the host waits for it, then the forward (vLLM's own path);
- ``layered_s``: stage by stage, the forward waiting for each layer's stage only;
- ``speedup`` = whole_s / layered_s; ``overlap`` = (copy_s + forward_s - layered_s) /
  min(copy_s, forward_s): the share of the shorter one hidden behind the other;
- ``slowdown``: how much a concurrent copy slows the forward (forward time with the
  copy running beside it / forward_s; CUDA: both on their own streams);
- ``stage_GBps``: median bandwidth of one layer's stage (CUDA events).

CPU path (the copy on the engine's thread, the forward on this one) everywhere; CUDA
(``-m cuda``, run by ``bench/gpu_check.sh``): the copy kernel on the expedited stream,
the forward on the default stream. Run:
``python -m pytest bench/suites/bench_layerwise.py --benchmark-enable -s``.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import pytest
import torch

from triton_offload import GroupSpec, plan_offload
from triton_offload.transfer.engine import TransferEngine
from triton_offload.transfer.jobs import JobSpec

LAYERS = 16
PAGE = 32 << 10  # K and V pages of 32 KiB: Llama-3.1-8B per layer at TP 1
BLOCKS = 64
#: The stand-in forward's matmul size: a layer's compute about as long as its copy (on an
#: H200 a 1024^2 matmul takes microseconds, so CUDA repeats it; on 2 CPU cores 256^2).
FORWARD_DIM = {"cuda": 4096, "cpu": 256}
FORWARD_REPEATS = 2
ROUNDS = 9
SMOKE = {"layers": 4, "page": 4 << 10, "blocks": 8, "dim": 128, "rounds": 2}


class Model:
    """The caches, an engine on them and the stand-in forward."""

    def __init__(self, device: str, layers: int, page: int, blocks: int, dim: int) -> None:
        self.device = torch.device(device)
        self.layers = layers
        kv = [
            torch.zeros(2, 2 * blocks, page, dtype=torch.uint8, device=device)
            for _ in range(layers)
        ]
        caches = [[(t[0], t[1]) for t in kv]]
        self.engine = TransferEngine(
            plan_offload([GroupSpec("full_attention", 16)], blocks_per_chunk=1),
            caches,
            blocks,
            backend="triton" if self.device.type == "cuda" else "torch",
        )
        self.engine.pool.copy_(torch.randint(0, 256, self.engine.pool.shape, dtype=torch.uint8))
        self.spec = JobSpec([list(range(blocks))], [list(range(blocks))])
        self.stages = [()] + [(2 * layer, 2 * layer + 1) for layer in range(layers)]
        self.nbytes = 2 * layers * blocks * page
        self.weight = torch.randn(dim, dim, device=device)
        self.job = 0

    def _layer(self) -> None:
        x = self.weight
        for _ in range(FORWARD_REPEATS):
            x = x @ self.weight
        self.sink = x

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward(self, waits: Any = None) -> None:
        for layer in range(self.layers):
            if waits is not None:
                waits(layer + 1)
            self._layer()

    def _drain(self) -> None:
        while self.engine.jobs_in_flight():
            self.engine.get_finished()
            time.sleep(0.0002)

    def copy_alone(self) -> None:
        self.job += 1
        self.engine.submit_load(self.job, self.spec, expedited=True)
        self.engine.wait([self.job])
        self._sync()
        self._drain()

    def forward_alone(self) -> None:
        self.forward()
        self._sync()

    def whole(self) -> None:
        self.job += 1
        self.engine.submit_load(self.job, self.spec, expedited=True)
        self.engine.wait([self.job])
        self.forward()
        self._sync()
        self._drain()

    def layered(self) -> Any:
        self.job += 1
        handle = self.engine.submit_layered_loads([(self.job, self.spec)], self.stages)
        handle.wait(0)
        self.forward(handle.wait)
        self._sync()
        handle.join()
        self._drain()
        return handle

    def forward_beside_copy(self) -> None:
        self.job += 1
        self.engine.submit_load(self.job, self.spec)
        self.forward()
        self._sync()
        self.engine.wait([self.job])
        self._drain()


def _median(run: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _stage_gbps(model: Model) -> float | None:
    """Median GB/s of one layer's stage (CUDA: timed events around each stage)."""
    if model.device.type != "cuda":
        return None
    model.job += 1
    handle = model.engine.submit_layered_loads([(model.job, model.spec)], model.stages)
    handle.join()
    model._drain()
    events = handle.events
    if not all(getattr(e, "elapsed_time", None) for e in events):
        return None
    stage_bytes = model.nbytes / model.layers
    rates = []
    for first, second in itertools.pairwise(events):  # stage k: events k - 1 to k
        try:
            seconds = first.elapsed_time(second) / 1e3
        except RuntimeError:  # events recorded without timing
            return None
        if seconds > 0:
            rates.append(stage_bytes / seconds / 1e9)
    return round(statistics.median(rates), 2) if rates else None


def _run(benchmark: Any, device: str) -> None:
    small = benchmark.disabled and device == "cpu"
    if small:
        layers, page, blocks, dim, rounds = (
            SMOKE["layers"],
            SMOKE["page"],
            SMOKE["blocks"],
            SMOKE["dim"],
            SMOKE["rounds"],
        )
    else:
        layers, page, blocks, dim, rounds = LAYERS, PAGE, BLOCKS, FORWARD_DIM[device], ROUNDS
    model = Model(device, layers, page, blocks, dim)
    model.whole()  # warm-up: compile, allocate
    model.layered()
    benchmark.group = f"layer-wise loads, {device}"
    benchmark.pedantic(model.layered, rounds=1, iterations=1)
    times = {
        "copy_s": _median(model.copy_alone, rounds),
        "forward_s": _median(model.forward_alone, rounds),
    }
    whole, layered = [], []
    for _ in range(rounds):  # alternated
        whole.append(_median(model.whole, 1))
        layered.append(_median(model.layered, 1))
    times["whole_s"] = statistics.median(whole)
    times["layered_s"] = statistics.median(layered)
    beside = _median(model.forward_beside_copy, rounds)
    shorter = min(times["copy_s"], times["forward_s"])
    overlap = (times["copy_s"] + times["forward_s"] - times["layered_s"]) / shorter
    info = {
        **{key: round(value * 1e3, 3) for key, value in times.items()},
        "bytes": model.nbytes,
        "speedup": round(times["whole_s"] / times["layered_s"], 3),
        "overlap": round(overlap, 3),
        "slowdown": round(beside / times["forward_s"], 3),
        "stage_GBps": _stage_gbps(model),
    }
    benchmark.extra_info.update(info)
    print(
        f"\nlayer-wise {device}: {model.nbytes >> 20} MiB over {layers} layers: copy "
        f"{info['copy_s']} ms, forward {info['forward_s']} ms, whole-job {info['whole_s']} ms, "
        f"layer-wise {info['layered_s']} ms (speedup {info['speedup']}, overlap "
        f"{info['overlap']}), forward beside a copy x{info['slowdown']}, stage "
        f"{info['stage_GBps']} GB/s"
    )
    model.engine.shutdown()


def test_layerwise_cpu(benchmark: Any) -> None:
    _run(benchmark, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layerwise_cuda(benchmark: Any) -> None:
    _run(benchmark, "cuda")
