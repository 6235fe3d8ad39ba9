"""Interrupts at any traced line, and the vLLM worker as a fuzz target
(``tests/system/test_interrupt_fuzz.py`` describes the guarantee they check; the
interrupt counter and scheduler suites reuse them). Importing this module needs no
vLLM: the worker target imports it when built.
"""

from __future__ import annotations

import dataclasses
import dis
import linecache
import os
import random
import sys
import uuid
from collections.abc import Callable, Hashable
from typing import Any

from triton_offload.transfer import engine as engine_module

ENGINE_FILE = engine_module.__file__


class Interrupter:
    """Counts line events in the traced files during one call; raises ``error`` at the
    ``at``-th one (``at`` 0: never). Python unsets a trace function that raises, so one
    call gets one interrupt at most.

    Not counted: the line event of a ``with`` statement's line when its block ends. An
    exception raised there by a trace function skips ``__exit__`` (a lock left held, the
    next acquire hangs), which no signal can do: CPython runs signal handlers only at a
    few points (after a call returns, on a backward jump), and a block's ``__exit__``
    call always runs. An interrupt at the end of the block is the one raised at its
    last line.
    """

    def __init__(self, files: set[str]) -> None:
        self.files = files
        self.at = 0
        self.error: type[BaseException] = KeyboardInterrupt
        self.count = 0
        self.site: tuple[str, int, str] | None = None
        #: Extra test of a line event (regression tests aim at one state of the books).
        self.condition: Callable[[Any], bool] | None = None
        self._entries: dict[Any, dict[int, int]] = {}

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename in self.files:
            return self._local
        return None

    def _block_end(self, frame: Any) -> bool:
        """True at a ``with`` line's event after its first instruction (the block ends)."""
        code = frame.f_code
        entries = self._entries.get(code)
        if entries is None:
            entries = {}
            for instruction in dis.get_instructions(code):
                positions = getattr(instruction, "positions", None)  # Python 3.11+
                line = positions.lineno if positions else instruction.starts_line
                if line is not None and line not in entries:
                    entries[line] = instruction.offset
            self._entries[code] = entries
        line = frame.f_lineno
        if frame.f_lasti == entries.get(line):
            return False
        text = linecache.getline(code.co_filename, line).lstrip()
        return text.startswith(("with ", "async with "))

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event != "line" or self._block_end(frame):
            return self._local
        if self.condition is None or self.condition(frame):
            self.count += 1
            if self.count == self.at:
                code = frame.f_code
                self.site = (os.path.basename(code.co_filename), frame.f_lineno, code.co_name)
                raise self.error
        return self._local

    def call(self, function: Callable[[], Any], at: int, error: type[BaseException]) -> Any:
        self.at, self.error, self.count, self.site = at, error, 0, None
        sys.settrace(self._global)
        try:
            return function()
        finally:
            sys.settrace(None)


def _worker_file() -> str:
    from triton_offload.vllm import worker

    return str(worker.__file__)


def waitable(engine: Any, ids: list[Hashable]) -> list[Hashable]:
    """Hang guard (peeks at the engine's books): on the CPU path every job finished
    before its submit returned or raised, so a job in the books that is not marked
    finished is stranded and ``wait`` on it would never return."""
    active = engine._active
    return [i for i in ids if i not in active or active[i].finished.is_set()]


class WorkerTarget:
    """vLLM's worker as ``tests/vllm/test_spec.py`` builds it, on the CPU path with
    ``verify_chunks`` on (stores sealed, loads verified, in ``get_finished``)."""

    def __init__(self) -> None:
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        import triton_offload.vllm as tv
        from tests.helpers.spec_geometry import Caches, _config
        from triton_offload.vllm.integrity import KeyedCPULoadStoreSpec

        self.gpu_spec, self.host_spec = GPULoadStoreSpec, KeyedCPULoadStoreSpec
        config = _config({"backend": "torch", "verify_chunks": True})
        config = dataclasses.replace(config, engine_id=f"fuzz-{uuid.uuid4().hex}")
        self.worker = tv.TritonOffloadingSpec(config).get_worker(Caches().canonical)
        self.files = {ENGINE_FILE, _worker_file()}

    def submit(self, rng: random.Random, store: bool, job_id: int) -> Callable[[], bool]:
        from tests.helpers.spec_geometry import BPC, NUM_BLOCKS

        group = rng.randrange(2)  # attention chunks 0-3, Mamba chunks 4-7
        chunks = rng.sample(range(4 * group, 4 * group + 4), rng.randint(1, 2))
        blocks = rng.sample(range(NUM_BLOCKS), BPC * len(chunks))
        sizes = [len(blocks), 0] if group == 0 else [0, len(blocks)]
        gpu = self.gpu_spec(blocks, sizes, [0, 0])
        # Keys of another generation now and then: such a load fails its verification.
        host = self.host_spec(chunks, [f"key-{c}-{rng.randrange(2)}".encode() for c in chunks])
        if store:
            return lambda: self.worker.submit_store(job_id, gpu, host)
        expedited = rng.random() < 0.3
        return lambda: self.worker.submit_load(job_id, host, gpu, expedited)

    def get_finished(self) -> list[Any]:
        return list(self.worker.get_finished())

    def wait(self, ids: list[Hashable]) -> None:
        self.worker.wait(ids)

    def waitable(self, ids: list[Hashable]) -> list[Hashable]:
        return waitable(self.worker.engine, ids)

    def close(self) -> None:
        self.worker.shutdown()
