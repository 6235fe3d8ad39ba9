"""One vLLM engine, in a process of its own: ``python tests/helpers/engine_runner.py SPEC.json``.

tests/system/test_vllm_engine_real.py starts this script once per engine, so that every engine
starts from a fresh process (an engine restart is a new process, as users see it), its
log can be read whole, and what it leaves behind (``/dev/shm`` files, mappings) is seen
after it is gone. It runs the steps of the spec in order and writes what it saw as JSON
to ``spec["out"]``:

- ``{"generate": NAME, "prompts": [[ids...], ...]}``: greedy generation of every prompt
  in one batch; records tokens, each token's logprob and finish reason, and the
  engine's counters after the step (``metrics``; triton_offload's own, per label set:
  ``triton_counters``);
- ``{"reset": true}``: ``reset_prefix_cache()`` (the device prefix cache only);
- ``{"corrupt": true}``: damages the first payload bytes of every sealed page of this
  engine's host region (vLLM's ``/dev/shm/vllm_offload_*`` file, opened through this
  process's mapping since vLLM unlinks the name), as damaged host memory would; the
  pages are found by their seals (triton_offload's seal format);
- ``{"fail_copies": true}``: from now on every copy from the host pool into the cache
  raises inside the copier (needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the workers run
  in this process);
- ``{"shutdown": true}``: shuts the engine down and records the region files and
  mappings still there.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import traceback
from typing import Any

#: Counters read from ``LLM.get_metrics()`` (vLLM's names; vLLM 0.33 and later).
COUNTERS = (
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prefix_cache_hits",
    "vllm:kv_offload_load_bytes",
    "vllm:kv_offload_store_bytes",
)


def counters(llm: Any) -> dict[str, float]:
    """Each counter of :data:`COUNTERS` summed over its labels (histograms: their sum)."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for metric in llm.get_metrics():
        if metric.name in totals:
            value = getattr(metric, "value", None)
            if value is None:
                value = getattr(metric, "sum", 0.0)
            totals[metric.name] += float(value)
    return totals


#: The prefix of triton_offload's own counters in vLLM's metrics.
TRITON_PREFIX = "vllm:triton_offload_"
#: Labels every metric of the engine carries (left out of the names below).
ENGINE_LABELS = ("engine", "model_name")


def triton_counters(llm: Any) -> dict[str, float]:
    """triton_offload's counters in ``LLM.get_metrics()``, one entry per label set, named
    ``name{label=value,...}`` (labels sorted, the engine's own left out)."""
    found: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(TRITON_PREFIX):
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(metric.labels.items()) if k not in ENGINE_LABELS
            )
            name = f"{metric.name}{{{labels}}}"
            found[name] = found.get(name, 0.0) + float(metric.value)
    return found


def completion_of(output: Any) -> dict[str, Any]:
    """A request's output as the tests compare it: tokens, each token's logprob, why it
    finished."""
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = [
        float(step[token].logprob) if step and token in step else None
        for token, step in zip(tokens, completion.logprobs or [], strict=False)
    ]
    return {"tokens": tokens, "logprobs": logprobs, "finish_reason": completion.finish_reason}


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=1, detokenize=False, ignore_eos=True
    )
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    results = [completion_of(output) for output in outputs]
    return results


def region_files() -> list[str]:
    """This process's mappings of host regions, as files it can open (vLLM unlinks a
    region's ``/dev/shm`` name once every worker mapped it: ``/proc/self/map_files``
    still opens the file behind a mapping)."""
    found: dict[str, str] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            names = [field for field in fields[5:] if "vllm_offload_" in field]
            if names and names[0] not in found:
                found[names[0]] = f"/proc/self/map_files/{fields[0]}"
    return [found[name] for name in sorted(found)]


def mapped_regions() -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({line.split()[5] for line in f if "vllm_offload_" in line})


def corrupt_region(files: list[str]) -> int:
    """Damage the first 16 payload bytes of every sealed page in ``files``; returns how
    many pages.

    A page starts on an OS page boundary (vLLM's rows are rounded up to it, and worker
    0's page starts its row); the page of a seal is the boundary below it whose first
    ``payload_bytes`` bytes match the seal's checksum (by the algorithm the seal names).
    """
    import mmap

    import numpy as np

    from triton_offload.transfer.seal import (
        SEAL_BYTES,
        SEAL_MAGIC,
        Seal,
        page_checksum,
        read_seal,
    )

    flipped = 0
    for path in files:
        with open(path, "r+b") as f:
            data = mmap.mmap(f.fileno(), 0)
            try:
                position = data.find(SEAL_MAGIC)
                while position >= 0:
                    record = np.frombuffer(data[position : position + SEAL_BYTES], np.uint8)
                    seal = read_seal(np.concatenate([np.zeros(1, np.uint8), record]))
                    if isinstance(seal, Seal) and seal.payload_bytes > 0:
                        start = (position - seal.payload_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
                        while start >= 0:
                            payload = data[start : start + seal.payload_bytes]
                            if page_checksum(payload, seal.algorithm) == seal.payload_checksum:
                                # 16 bytes: whole values of any dtype (exponents too)
                                for offset in range(min(16, seal.payload_bytes)):
                                    data[start + offset] ^= 0x5A
                                flipped += 1
                                break
                            start -= mmap.PAGESIZE
                    position = data.find(SEAL_MAGIC, position + 1)
                data.flush()
            finally:
                data.close()
    return flipped


def fail_copies() -> None:
    """Make every copy from the host pool raise inside the CPU copier."""
    from triton_offload.transfer import copiers
    from triton_offload.transfer.jobs import FROM_POOL

    original = copiers.HostCopier.prepare

    def prepare(self: Any, table: Any, direction: int, *args: Any, **kwargs: Any) -> Any:
        run = original(self, table, direction, *args, **kwargs)
        if direction != FROM_POOL:
            return run

        def broken() -> None:
            raise OSError("test: the copy from the host pool failed")

        return broken

    copiers.HostCopier.prepare = prepare


def shutdown(llm: Any) -> None:
    if hasattr(llm, "shutdown"):
        llm.shutdown()
    else:
        llm.llm_engine.engine_core.shutdown()


def prompt(entry: Any, block_size: int) -> list[int]:
    """A prompt: token ids, or ``{"blocks": n, "plus": k, "seed": s}`` (``n`` blocks of
    the engine's block size and ``k`` tokens)."""
    if isinstance(entry, list):
        return entry
    from engine_models import prompt_ids

    return prompt_ids(entry["blocks"] * block_size + entry.get("plus", 0), entry["seed"])


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    report: dict[str, Any] = {"steps": {}, "error": None}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    llm = None
    try:
        from vllm import LLM

        llm = LLM(**spec["engine"])
        block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
        report["block_size"] = block_size
        report["mapped_at_start"] = mapped_regions()
        # This engine's files in /dev/shm (other engines may run beside it).
        engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
        leftovers = f"/dev/shm/*{engine_id}*"
        report["files_at_start"] = sorted(glob.glob(leftovers))
        for step in spec["steps"]:
            if "generate" in step:
                prompts = [prompt(p, block_size) for p in step["prompts"]]
                outputs = generate(llm, prompts, spec.get("max_tokens", 8))
                report["steps"][step["generate"]] = {
                    "outputs": outputs,
                    "metrics": counters(llm),
                    "triton_counters": triton_counters(llm),
                }
            elif "reset" in step:
                report["reset"] = bool(llm.reset_prefix_cache())
            elif "corrupt" in step:
                report["corrupted"] = corrupt_region(region_files())
            elif "fail_copies" in step:
                fail_copies()
            elif "shutdown" in step:
                shutdown(llm)
                llm = None
                import gc

                gc.collect()
                report["after_shutdown"] = {
                    "files": sorted(glob.glob(leftovers)),
                    "mapped": mapped_regions(),
                }
    except BaseException:
        report["error"] = traceback.format_exc()
        if llm is not None:
            # Best effort: an engine that failed must not leave its region behind.
            try:
                shutdown(llm)
            except BaseException:
                report["error"] += "\nshutdown after the failure:\n" + traceback.format_exc()
    with open(spec["out"], "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    # Skip interpreter teardown: an engine left running must not hang the test.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
