"""The fault-injection workload: vLLM's core scheduler with this connector
(:class:`tests.helpers.vllm_engine.Engine`), a row of counts per fault, the steps that
serve a request and judge its blocks, and the fs and obj tiers' set-up
(``tests/system/test_faults.py`` describes the faults; the tier repair tests reuse it).
Importing this module skips the importing test module, with the import error as the
reason, where vLLM cannot be imported.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

try:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.request import Request

    from tests.helpers.vllm_engine import BLOCK, PROMPT, Engine, differing_blocks, prompt
    from triton_offload.vllm.integrity import host_manager
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    pytest.skip(f"vllm cannot be imported: {error}", allow_module_level=True)

from tests.helpers.tier_peers import prefer_cuda12_nixl
from triton_offload.transfer.seal import SealFormat, read_seal, write_seal

CHUNKS = PROMPT // BLOCK  # one block per chunk: request A stores six chunks
BAD = 2  # the chunk a fault hits (0-based)
HOST_PAGE = 4096  # one chunk's row: 512 bytes of KV + the seal, rounded to the page


@dataclasses.dataclass
class Row:
    """One fault's outcome and counts."""

    fault: str
    outcome: str = ""
    failed_loads: int = 0  # load jobs a worker reported failed
    refused_chunks: int = 0  # chunks refused by a seal check or a tier's failed read
    recomputed: int = 0  # requests that recomputed tokens the connector meant to load
    failed_stores: int = 0  # store jobs completed unpublished
    corrupt_loads: int = 0  # blocks counted as loaded whose bytes differ from cold
    crashes: int = 0  # exceptions that escaped the scheduler or the connector
    kept: str = ""  # chunks that were fine and hit afterwards


def make_engine(engines: list[Engine], tmp_path: Path, **extra: Any) -> Engine:
    engine = Engine(tmp_path, "recompute", extra_config=extra or None)
    engines.append(engine)
    return engine


def serve(engine: Engine, row: Row, req_id: str, tokens: list[int]) -> None:
    """Run one request to its end (see :func:`serve_rest`)."""
    engine.add(req_id, tokens)
    serve_rest(engine, row, req_id, tokens)


def serve_rest(engine: Engine, row: Row, req_id: str, tokens: list[int]) -> None:
    """Run a request already added to its end; count an exception escaping the
    scheduler or the connector as a crash and every block that differs from the cold
    run as a corrupt load."""
    request = engine.scheduler.requests[req_id]
    try:
        kv = engine.run(request)
    except AssertionError:
        raise  # the harness's own check (the request did not finish)
    except Exception:
        row.crashes += 1
        raise
    bad = differing_blocks(engine, kv, tokens)
    row.corrupt_loads += bad
    assert bad == 0, f"{bad} blocks of {req_id} differ from the cold run"
    assert str(engine.finished[req_id]) == "length"


def keys_of(engine: Engine, tokens: list[int]) -> list[Any]:
    """The offload keys of a prompt's whole chunks (one block per chunk, group 0)."""
    request = Request(
        "keys", tokens, SamplingParams(max_tokens=1), None, block_hasher=engine.hasher
    )
    return [make_offload_key(block_hash, 0) for block_hash in request.block_hashes]


def first_computed_block(engine: Engine, req_id: str) -> int:
    return min(engine.computed[req_id]) // BLOCK


TOKENS = prompt()
SECOND = TOKENS + [5] * 8  # A's prompt and eight more tokens


def host_row(engine: Engine, key: Any) -> int:
    return int(host_manager(engine.offloading_manager)._policy.get(key).chunk_id)


def tiered_engine(engines: list[Engine], tmp_path: Path, tier: dict[str, Any]) -> Engine:
    """TritonTieringOffloadingSpec: eight host chunks over one of vLLM's secondary tiers."""
    return make_engine(
        engines,
        tmp_path,
        spec_name="TritonTieringOffloadingSpec",
        spec_module_path="triton_offload.vllm",
        cpu_bytes_to_use=8 * HOST_PAGE,
        secondary_tiers=[tier],
    )


def fs_tier(root: Path) -> dict[str, Any]:
    return {"type": "fs", "root_dir": str(root), "n_read_threads": 1, "n_write_threads": 1}


def fs_file(engine: Engine, key: Any) -> Path:
    return Path(engine.offloading_manager.secondary_tiers[0].file_mapper.get_file_name(key))


def reseal_as_another_layout(data: bytes, page_bytes: int) -> bytes:
    """The chunk's bytes as a writer with another row layout leaves them: K and V
    halves swapped, sealed (valid checksum, same key and configuration) with another
    layout digest."""
    row = np.frombuffer(data, dtype=np.uint8).copy()
    page = row[:page_bytes]
    seal = read_seal(page)
    assert not isinstance(seal, str), seal
    payload, half = seal.payload_bytes, seal.payload_bytes // 2
    page[:payload] = np.concatenate([page[half:payload], page[:half]])
    fmt = SealFormat(seal.config_digest, bytes(8), seal.page_index, seal.page_count)
    write_seal(page, payload, fmt, seal.key_digest)
    return row.tobytes()


def load_cuda12_nixl() -> None:
    """vLLM's obj tier imports NIXL in this process: its CUDA-12 build (the CUDA-13
    build's OBJ plugin needs a library no wheel ships; see tier_peers)."""
    prefer_cuda12_nixl()
    import nixl

    build = getattr(getattr(nixl, "_pkg", None), "__name__", None)
    if build != "nixl_cu12":
        pytest.fail(f"nixl was imported as {build} before the obj rows; they need nixl_cu12")
