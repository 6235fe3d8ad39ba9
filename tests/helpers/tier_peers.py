"""Two offloading instances in two processes, joined by one of vLLM's real secondary tiers.

A :class:`PeerHost` is a child process (multiprocessing ``spawn``) that imports torch
and vLLM once and then holds any number of instances (:class:`Peer`, opened per test).
An instance builds a vLLM offloading spec from an ``OffloadingConfig`` (vLLM's stock
``TieringOffloadingSpec`` or this project's ``TritonTieringOffloadingSpec``), its
scheduler-side tiering manager (vLLM's own: the CPU primary tier on the shared
``/dev/shm`` region plus the secondary tier) and, for this project's spec, its worker on
CPU "GPU" caches. The test process drives it over a pipe:

- ``store(names)``: chunks named ``names`` go into the CPU tier and cascade to the
  secondary tier. This project's spec stores them from its caches through its worker;
  the stock spec (its worker needs CUDA) writes the rows of the region directly, as its
  worker would. The reply holds each chunk's row bytes (and cache bytes, with caches).
- ``lookup(names)``: one request looks the chunks up in order; a hit found in the
  secondary tier is promoted through the real transport, then the chunk's row is read
  back (and loaded into poisoned cache blocks, with caches). Each name ends in ``HIT``,
  ``MISS`` or ``TIMEOUT`` (its deadline passed); the lookup stops at the first chunk that
  is not a hit, as a prefix lookup does.

Under ``canonical_layout`` an instance has ``tp`` ranks, each with vLLM-registered caches
(``vllm_canonical_judge``: their ``CanonicalKVCaches`` carry vLLM's canonical mappings).
This project's spec moves them with one worker per rank (one spec per rank, one region);
the stock spec moves them with vLLM's own canonical descriptors replayed on the region's
rows, every rank in turn, as its CUDA workers would. A store by this project's workers
also reports the row vLLM's descriptors make from the same caches (``replayed``).

Between commands a host keeps stepping its instances' managers (``on_schedule_end``), as
vLLM's scheduler does every step, so a peer-to-peer tier serves its counterpart while
idle.

The test process starts and stops every host by PID: :meth:`PeerHost.close` asks for a
clean shutdown, kills the process if it does not come, and removes the ``/dev/shm``
regions (and this backend's plane notes) that a killed host could not remove.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

STOCK = "TieringOffloadingSpec"
TRITON = "TritonTieringOffloadingSpec"

#: NIXL's UCX backend between two processes of one machine: shared memory and TCP over
#: the loopback device only (no InfiniBand, no other interface).
UCX_LOOPBACK_ENV = {"UCX_TLS": "sm,self,tcp", "UCX_NET_DEVICES": "lo"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the peer binds it moments later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def missing_modules(*names: str) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


#: Modules each tier needs beyond vLLM (``pip install -e '.[tiers]'``). The obj tier
#: needs NIXL's CUDA-12 build (the CUDA-13 build's OBJ plugin links libcuobjclient.so.1,
#: which no wheel ships) and boto3 (moto's own dependency) to reach the objects.
NEEDS = {
    "fs": (),
    "p2p": ("nixl", "nixl_cu12", "zmq", "msgspec"),
    "obj": ("nixl", "nixl_cu12", "moto", "flask", "flask_cors", "boto3"),
    "kvcr": ("kvcr", "nixl", "nixl_cu12", "zmq", "msgspec"),
}


#: vLLM's module of each tier that imports a dependency's API (not just its name).
TIER_MODULES = {"kvcr": "vllm.v1.kv_offload.tiering.kvcr.manager"}


def unusable(tier: str) -> str | None:
    """Why the installed vLLM cannot build ``tier`` on its installed dependencies, or
    None. vLLM 0.34's kvcr tier imports names kvcr 0.1.1 (the latest release) does not
    have (``kvcr.ZmqPeerControlChannel``); no install of the tiers extra fixes that."""
    module = TIER_MODULES.get(tier)
    if module is None or missing_modules(*NEEDS[tier]):
        return None
    prefer_cuda12_nixl()
    try:
        importlib.import_module(module)
    except ImportError as error:
        return f"the installed vLLM's {tier} tier cannot be imported: {error}"
    return None


def require(tier: str) -> None:
    """Skip (fail where ``TRITON_OFFLOAD_REQUIRE_TIERS=1``, as in CI) without the tier's
    dependencies; skip where the installed vLLM's tier does not work with them."""
    import pytest

    missing = missing_modules(*NEEDS[tier])
    if missing:
        reason = (
            f"the {tier} tier needs {', '.join(missing)}: install the tiers extra "
            "(pip install -e '.[tiers]')"
        )
        if os.environ.get("TRITON_OFFLOAD_REQUIRE_TIERS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    problem = unusable(tier)
    if problem:
        pytest.skip(problem)


@dataclasses.dataclass(frozen=True)
class PeerConfig:
    """One instance: its spec, its secondary tier and the geometry of its chunks."""

    spec_name: str
    tier: dict[str, Any]
    #: Bytes of one plane per GPU block; two planes (K, V) per block.
    plane_bytes: int = 1024
    blocks_per_chunk: int = 2
    num_chunks: int = 4
    num_blocks: int = 16
    dtype: str = "bfloat16"
    canonical_layout: bool = False
    #: vLLM's KV cache layout name; canonical_layout needs one (its format id names it).
    kv_cache_layout: str | None = None
    #: Seed of this instance's cache contents (and of the stock spec's row contents).
    seed: int = 0
    #: Tensor-parallel ranks (workers) of the instance; more than one needs
    #: canonical_layout (the default layout's caches are one worker's planes).
    tp: int = 1
    engine_id: str = dataclasses.field(default_factory=lambda: f"tiers-{uuid.uuid4().hex}")
    #: kv_transfer_params / kv_hints a lookup request carries (p2p, kvcr), built by
    #: :func:`request_fields` in the child.
    source: dict[str, Any] | None = None
    #: Per-chunk lookup deadline, seconds.
    lookup_timeout_s: float = 10.0

    @property
    def page_bytes(self) -> int:
        """One worker's page of a chunk."""
        return 2 * self.plane_bytes * self.blocks_per_chunk

    @property
    def region_path(self) -> str:
        # vLLM's SharedOffloadRegion file for this engine id.
        return f"/dev/shm/vllm_offload_{self.engine_id}.mmap"

    @property
    def shm_paths(self) -> list[str]:
        """Files the instance leaves in /dev/shm until it shuts down: vLLM's region and,
        for this backend's default layout, each worker's published plane arrangement."""
        from triton_offload.vllm.tiers import layout_note_path

        notes = [layout_note_path(self.engine_id, rank) for rank in range(self.tp)]
        return [self.region_path, *notes]


class S3Server:
    """A local S3 endpoint (moto in server mode) on 127.0.0.1, in its own process.

    Started with ``python -m moto.server``; :meth:`close` stops it by PID.
    """

    BUCKET = "kv-offload"

    def __init__(self, start_timeout_s: float = 60.0) -> None:
        import subprocess

        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
        )
        self.pid = self.process.pid
        try:
            self._create_bucket(start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _create_bucket(self, timeout_s: float) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        url = f"http://{self.endpoint}/{self.BUCKET}"
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.process.returncode}")
            try:
                # An unsigned CreateBucket: moto accepts it (no authentication).
                urllib.request.urlopen(urllib.request.Request(url, method="PUT"), timeout=2)
                return
            except (urllib.error.URLError, ConnectionError) as error:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto server on {self.endpoint}: {error}") from error
                time.sleep(0.1)

    def tier(self, prefix: str) -> dict[str, Any]:
        """vLLM's ``obj`` tier config for this server."""
        return {
            "type": "obj",
            "prefix": prefix,
            "io_threads": 2,
            "store_config": {
                "bucket": self.BUCKET,
                "endpoint_override": f"http://{self.endpoint}",
                "access_key": "testing",
                "secret_key": "testing",
                "region": "us-east-1",
                "scheme": "http",
            },
        }

    def client(self) -> Any:
        """A boto3 S3 client of this server (the test's side: read and replace objects)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=f"http://{self.endpoint}",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def object_name(self, file_name: str) -> str:
        """The name under which NIXL's OBJ plugin stored vLLM's object ``file_name``.

        vLLM names an object ``{prefix}/`` joined with its file mapper's path, which
        starts with ``/``; the plugin's AWS SDK sends the path with the double slash
        collapsed. The object is found by listing, so the test depends on neither rule.
        """
        prefix, _, rest = file_name.partition("/")
        listed = self.client().list_objects_v2(Bucket=self.BUCKET, Prefix=prefix)
        tail = "/" + rest.rsplit("/", 1)[-1]
        names = [item["Key"] for item in listed.get("Contents", ()) if item["Key"].endswith(tail)]
        if len(names) != 1:
            raise LookupError(f"{len(names)} objects match {file_name!r}: {names}")
        return names[0]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except Exception:
                self.process.kill()
                self.process.wait(10)

    @classmethod
    @contextlib.contextmanager
    def running(cls) -> Iterator[S3Server]:
        """A module fixture's server: started, yielded, stopped by PID and checked gone."""
        server = cls()
        try:
            yield server
        finally:
            server.close()
        assert server.process.poll() is not None, f"S3 server {server.pid} still runs"


class PeerError(RuntimeError):
    """A command failed in the peer (its traceback is the message) or timed out."""


class PeerHost:
    """A child process that holds offloading instances, started on construction.

    Importing torch and vLLM takes seconds per process on a small machine, so one host
    serves many tests: each test opens its instances (:meth:`open`) and closes them.
    """

    def __init__(self, env: dict[str, str] | None = None, start_timeout_s: float = 120.0) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_host_main, args=(child, dict(env or {})), daemon=True
        )
        self.process.start()
        child.close()
        self.pid = int(self.process.pid or 0)
        #: /dev/shm files of its instances (regions, plane notes), removed on close.
        self.regions: set[str] = set()
        self.started = False
        self._start_timeout_s = start_timeout_s

    def wait_started(self) -> dict[str, Any]:
        """Wait for the host's imports; its PID and the NIXL build it would load."""
        try:
            info = self._reply(self._start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.started = True
        return info

    def _reply(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise PeerError(f"peer {self.pid} gave no answer within {timeout_s} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise PeerError(
                f"peer {self.pid} ended (exit code {self.process.exitcode}) without answering"
            ) from None
        if status != "ok":
            raise PeerError(f"peer {self.pid}: {value}")
        return value

    def call(self, command: str, *args: Any, timeout_s: float = 60.0) -> Any:
        if not self.started:
            self.wait_started()
        self._conn.send((command, args))
        return self._reply(timeout_s)

    def open(self, config: PeerConfig) -> Peer:
        self.regions.update(config.shm_paths)
        self.call("open", config)
        return Peer(self, config)

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        """The peer disappears: SIGKILL, no clean-up of its own."""
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)
        self._remove_regions()

    def _remove_regions(self) -> None:
        for path in self.regions:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def close(self, timeout_s: float = 30.0) -> None:
        """Shut the host down cleanly if it still runs, kill it otherwise; always reap it
        and remove the region files of its instances."""
        try:
            if self.process.is_alive():
                with contextlib.suppress(OSError, PeerError, EOFError, BrokenPipeError):
                    self.started = True
                    self.call("quit", timeout_s=timeout_s)
                self.process.join(timeout_s)
            if self.process.is_alive():
                os.kill(self.pid, signal.SIGKILL)
                self.process.join(10)
        finally:
            self._conn.close()
            self._remove_regions()


@dataclasses.dataclass
class Peer:
    """One instance inside a :class:`PeerHost`."""

    host: PeerHost
    config: PeerConfig

    @property
    def engine_id(self) -> str:
        return self.config.engine_id

    def store(self, names: list[str]) -> dict[str, dict[str, bytes]]:
        """Store chunks; per name its row bytes (and, with a worker, its cache bytes)."""
        return self.host.call("store", self.engine_id, names)

    def lookup(self, names: list[str], timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
        """Look chunks up in one request; per name the result and the bytes of a hit."""
        return self.host.call("lookup", self.engine_id, names, timeout_s=timeout_s)

    def close(self) -> None:
        if self.host.alive():
            self.host.call("close", self.engine_id)


# ------------------------------------------------------------------ child side


def prefer_cuda12_nixl() -> None:
    """Make ``import nixl`` pick the CUDA-12 build where both are installed.

    The ``nixl`` meta package installs ``nixl-cu12`` and ``nixl-cu13`` and picks one by
    the CUDA version torch was built with; a CPU build of torch has none, and then it
    takes ``nixl_cu13`` first, whose OBJ plugin needs ``libcuobjclient.so.1`` (no wheel
    ships it). A ``None`` entry in ``sys.modules`` makes that import fail as "not
    installed", and the meta package falls back to ``nixl_cu12``.
    """
    if "nixl" not in sys.modules and importlib.util.find_spec("nixl_cu12") is not None:
        sys.modules.setdefault("nixl_cu13", None)  # type: ignore[arg-type]


def _offloading_config(config: PeerConfig, rank: int = 0) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from triton_offload.transfer.seal import SEAL_BYTES

    # Room for num_chunks rows of either spec: this backend's default-layout pages end
    # with a seal, and vLLM rounds a row up to its region's alignment (the OS page), so
    # a 4096-byte page takes an 8 KiB row there.
    alignment = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
    row = -(-(config.page_bytes + SEAL_BYTES) * config.tp // alignment) * alignment
    extra: dict[str, Any] = {
        "spec_name": config.spec_name,
        "cpu_bytes_to_use": config.num_chunks * row,
        "secondary_tiers": [dict(config.tier)],
    }
    if config.spec_name == TRITON:
        extra.update({"spec_module_path": "triton_offload.vllm", "backend": "torch"})
    if config.canonical_layout:
        extra["canonical_layout"] = True
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("attn",), group_id=0),),
        worker_kv_bytes_per_block=2 * config.plane_bytes,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=config.engine_id,
        model=OffloadingModelConfig(name="tiers-test", dtype=config.dtype, max_model_len=1024),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=config.blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=config.tp,
            tp_size=config.tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        canonical_layout=config.canonical_layout,
        kv_cache_layout=config.kv_cache_layout,
    )


def _key(name: str) -> Any:
    from vllm.v1.kv_offload.base import make_offload_key

    # A 32-byte block hash, as vLLM's sha256 prefix caching makes.
    return make_offload_key(hashlib.sha256(name.encode()).digest(), 0)


def _pattern(seed: int, name: str, size: int) -> bytes:
    """Deterministic bytes of one chunk row (stock spec, no worker)."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}:{name}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


def request_fields(config: PeerConfig, request_id: str, keys: list[Any]) -> dict[str, Any]:
    """The fields of a lookup request that point a p2p or kvcr consumer at its source."""
    source = config.source
    if not source:
        return {}
    if source["kind"] == "p2p":
        return {
            "kv_transfer_params": {
                "remote_kv_source": {
                    "kv_request_id": request_id,
                    "remote_host": "127.0.0.1",
                    "remote_port": source["port"],
                }
            }
        }
    # kvcr: a router hint naming the source's control endpoint and the block hashes.
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
    from vllm.v1.kv_hints.protocol import KvHintAction, KvHintsEnvelope
    from vllm.v1.kv_offload.base import get_offload_block_hash

    hashes = [maybe_convert_block_hash(BlockHash(get_offload_block_hash(k))) for k in keys]
    return {
        "kv_hints": KvHintsEnvelope(
            protocol_version="0.1",
            message_id=request_id,
            actions=[
                KvHintAction(
                    action_id=f"{request_id}-fetch",
                    action_type="kv.fetch",
                    action_version="1.0",
                    payload={
                        "mode": "copy",
                        "source_control_endpoint": f"tcp://127.0.0.1:{source['port']}",
                        "block_hashes": [int(h) for h in hashes],
                    },
                )
            ],
        )
    }


def _canonical_geometry(config: PeerConfig) -> Any:
    """The ``vllm_canonical_judge`` geometry of a canonical instance: one attention layer
    of 16-token bf16 blocks, 2 KV heads per rank (K and V side by side per head), its
    head size chosen so that one rank's page is ``2 * plane_bytes``."""
    from tests.helpers.vllm_canonical_judge import Geometry

    kinds = {"LBNHC": "nhd", "LBHNC": "hnd"}
    if config.kv_cache_layout not in kinds:
        raise ValueError(f"kv_cache_layout {config.kv_cache_layout!r} not in {sorted(kinds)}")
    block_size, heads = 16, 2
    # page = block_size * heads * (K + V) * head_size * 2 bytes = 2 * plane_bytes
    head_size, rest = divmod(config.plane_bytes, 2 * block_size * heads)
    if rest:
        raise ValueError(f"plane_bytes {config.plane_bytes} is no multiple of 64")
    return Geometry(
        "tiers",
        kinds[config.kv_cache_layout],
        total_heads=heads * config.tp,
        tp=config.tp,
        layers=1,
        block_size=block_size,
        head_size=head_size,
    )


@contextlib.contextmanager
def _ranks_on_one_node() -> Iterator[None]:
    """Build workers of every rank in this one process.

    vLLM 0.34's tiering spec (and this project's, as it does) asks vLLM's TP, PP and PCP
    process groups whether the workers span nodes before a worker maps the region; the
    harness has no such groups, and its ranks share one process, so one node. The
    check is answered for the duration (a release without it is unaffected).
    """
    from triton_offload.vllm.releases import RELEASE

    check = RELEASE.check_workers_on_one_node
    RELEASE.check_workers_on_one_node = lambda: None
    try:
        yield
    finally:
        RELEASE.check_workers_on_one_node = check


class _Instance:
    """The child's spec, manager, optional workers, caches and the region's rows."""

    def __init__(self, config: PeerConfig) -> None:
        import numpy as np
        import torch
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
        )
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        self.config = config
        self.spec = OffloadingSpecFactory.create_spec(_offloading_config(config))
        self.manager = self.spec.get_manager()
        #: This project's workers, one per rank (none for the stock spec).
        self.workers: list[Any] = []
        #: Per worker, the CanonicalKVCaches it was built on (vLLM 0.34 resolves a
        #: job's GPU blocks to pointers into them before submitting it).
        self.worker_caches: list[Any] = []
        #: Per rank, vLLM's CanonicalKVCaches (canonical_layout only).
        self.canonical: list[Any] = []
        #: The cache pages a chunk's blocks are read from and loaded into: (num_blocks,
        #: page bytes) int8 views, every rank's in rank order.
        self.pages: list[torch.Tensor] = []
        self._alive: list[Any] = []  # tensors the views above point into
        if config.canonical_layout:
            from tests.helpers.vllm_canonical_judge import vllm_canonical_caches

            geometry = _canonical_geometry(config)
            for rank in range(config.tp):
                kv_caches, tensors = vllm_canonical_caches(
                    geometry, rank, seed=config.seed * 1000 + rank, num_blocks=config.num_blocks
                )
                self.canonical.append(kv_caches)
                self._alive += tensors
                self.pages += [
                    t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors
                ]
            if config.spec_name == TRITON:
                # One spec per rank, as vLLM builds one in every worker process; rank 0's
                # is the scheduler's. Every worker maps the scheduler's region.
                specs = [self.spec] + [
                    OffloadingSpecFactory.create_spec(_offloading_config(config, rank))
                    for rank in range(1, config.tp)
                ]
                with _ranks_on_one_node():
                    for spec, kv_caches in zip(specs, self.canonical, strict=True):
                        self.workers.append(spec.get_worker(kv_caches))
                self.worker_caches = list(self.canonical)
        elif config.spec_name == TRITON:
            if config.tp != 1:
                raise ValueError("tp > 1 needs canonical_layout in this harness")
            generator = torch.Generator().manual_seed(config.seed)
            self.pages = [
                torch.randint(
                    -128,
                    128,
                    (config.num_blocks, config.plane_bytes),
                    dtype=torch.int8,
                    generator=generator,
                )
                for _ in range(2)
            ]
            # This backend's default layout takes refs without a canonical mapping.
            refs = [CanonicalKVCacheRef(i, config.plane_bytes) for i in range(2)]
            caches = CanonicalKVCaches(
                tensors=[CanonicalKVCacheTensor(p, config.plane_bytes) for p in self.pages],
                group_data_refs=[refs],
            )
            self.workers.append(self.spec.get_worker(caches))
            self.worker_caches = [caches]
        view = self.manager.primary_tier.get_kv_memoryview()
        self.rows = np.frombuffer(view, dtype=np.uint8).reshape(self.spec.num_chunks, -1)
        self._job = 0
        self._next_block = 0
        #: Whether a lookup already waited for the p2p handshake with the source.
        self._handshaken = False

    # --------------------------------------------------------------- stepping

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))

    def _busy(self) -> bool:
        # In-flight tier jobs and cascades; a p2p or kvcr tier always reports
        # has_pending_work() (it must be polled), so the manager's own books are read.
        manager = self.manager
        return bool(manager._jobs) or any(
            state.pending_cascade_keys for state in manager._req_state.values()
        )

    def settle(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        self.step()
        while self._busy():
            if time.monotonic() > deadline:
                raise TimeoutError("secondary-tier jobs did not finish")
            time.sleep(0.005)
            self.step()

    def _finish(self, job_id: int) -> None:
        for rank, worker in enumerate(self.workers):
            worker.wait({job_id})
            results = [(r.job_id, r.success) for r in worker.get_finished()]
            if results != [(job_id, True)]:
                raise RuntimeError(f"rank {rank}: transfer job {job_id} finished as {results}")

    def _replay(self, pool: Any, blocks: list[int], row: int, store: bool) -> None:
        """vLLM's canonical descriptors of every rank, in rank order, on ``pool``'s rows
        (a store writes the pages each rank is the writer of)."""
        import numpy as np

        from tests.helpers.vllm_canonical_judge import vllm_replay
        from triton_offload.transfer.jobs import JobSpec

        job = JobSpec.from_groups([(np.array(blocks), np.array([row]), 0)])
        for kv_caches in self.canonical:
            vllm_replay(kv_caches, pool, job, store, self.config.blocks_per_chunk)

    def _blocks(self) -> list[int]:
        """The GPU blocks of the next chunk (a scattered pair of the cache)."""
        bpc = self.config.blocks_per_chunk
        n = self.config.num_blocks
        first = self._next_block
        self._next_block = (first + bpc) % n
        return [(first + k * 5) % n for k in range(bpc)]

    # --------------------------------------------------------------- commands

    def store(self, names: list[str]) -> dict[str, dict[str, bytes]]:
        import numpy as np
        import torch
        from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext

        context = ReqContext(req_id=f"store-{uuid.uuid4().hex}")
        manager = self.manager
        stored: dict[str, dict[str, bytes]] = {}
        with manager.lock:
            manager.on_new_request(context)
        for name in names:
            key = _key(name)
            with manager.lock:
                out = manager.prepare_store([key], context)
            if out is None or list(out.keys_to_store) != [key]:
                raise RuntimeError(f"prepare_store did not take chunk {name!r}: {out}")
            (row,) = (int(r) for r in out.store_spec.block_ids)
            entry: dict[str, bytes] = {}
            if self.workers:
                self._job += 1
                blocks = self._blocks()
                spec = GPULoadStoreSpec(blocks, [len(blocks)], [0])
                if self.canonical:
                    # The judge: vLLM's descriptors on a copy of the row as it was.
                    judge = torch.from_numpy(self.rows[row : row + 1].copy())
                    self._replay(judge, blocks, 0, store=True)
                    entry["replayed"] = judge.numpy().tobytes()
                for rank, worker in enumerate(self.workers):
                    gpu = self._gpu_side(rank, spec)
                    if not worker.submit_store(self._job, gpu, out.store_spec):
                        raise RuntimeError(f"rank {rank}: submit_store refused")
                self._finish(self._job)
                entry["blocks"] = self._block_bytes(blocks)
            elif self.canonical:
                blocks = self._blocks()
                self._replay(torch.from_numpy(self.rows), blocks, row, store=True)
                entry["blocks"] = self._block_bytes(blocks)
            else:
                self.rows[row] = np.frombuffer(
                    _pattern(self.config.seed, name, self.rows.shape[1]), dtype=np.uint8
                )
            entry["row"] = self.rows[row].tobytes()
            stored[name] = entry
            with manager.lock:
                manager.complete_store([key], context)
        self.settle()
        with manager.lock:
            manager.on_request_finished(context)
        self.settle()
        return stored

    def lookup(self, names: list[str]) -> dict[str, dict[str, Any]]:
        from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext

        request_id = f"lookup-{uuid.uuid4().hex}"
        keys = [_key(name) for name in names]
        context = ReqContext(req_id=request_id, **request_fields(self.config, request_id, keys))
        manager = self.manager
        found: dict[str, dict[str, Any]] = {}
        with manager.lock:
            manager.on_new_request(context)
        try:
            self._await_handshake(context)
            for name, key in zip(names, keys, strict=True):
                started = time.monotonic()
                deadline = started + self.config.lookup_timeout_s
                seen = []
                while True:
                    with manager.lock:
                        result = manager.lookup(key, context)
                    seen.append(result.name)
                    if result in (LookupResult.HIT, LookupResult.MISS):
                        break
                    if time.monotonic() > deadline:
                        result = None
                        break
                    time.sleep(0.005)
                    self.step()
                entry: dict[str, Any] = {
                    "result": "TIMEOUT" if result is None else result.name,
                    "seconds": time.monotonic() - started,
                    "seen": sorted(set(seen)),
                }
                if result is LookupResult.HIT:
                    with manager.lock:
                        load_spec = manager.prepare_load([key], context)
                    (row,) = (int(r) for r in load_spec.block_ids)
                    entry["row"] = self.rows[row].tobytes()
                    if self.pages:
                        entry["blocks"] = self._load(load_spec, row, GPULoadStoreSpec)
                    with manager.lock:
                        manager.complete_load([key], context)
                found[name] = entry
                if result is not LookupResult.HIT:
                    break  # a prefix lookup stops at its first miss
        finally:
            with manager.lock:
                manager.on_request_finished(context)
        return found

    def _await_handshake(self, context: Any) -> None:
        """On this instance's first lookup from a p2p source, wait (stepping, within the
        lookup deadline) until its session with the source completed the handshake that
        the request's ``on_new_request`` started.

        Until then vLLM 0.34's p2p tier answers MISS (the request prefills locally rather
        than wait on a peer that may be gone), 0.33's RETRY; a later request finds the
        session ready. Later lookups do not wait: a session to a source that died must
        answer as vLLM answers it.
        """
        if self._handshaken or not self.config.source or self.config.source["kind"] != "p2p":
            return
        self._handshaken = True
        from vllm.v1.kv_offload.tiering.p2p.manager import (
            P2PSecondaryTierManager,
            P2PSourceInfo,
        )

        manager = self.manager
        (tier,) = (t for t in manager.secondary_tiers if isinstance(t, P2PSecondaryTierManager))
        source = context.get_state(P2PSourceInfo)
        deadline = time.monotonic() + self.config.lookup_timeout_s
        while time.monotonic() < deadline:
            with manager.lock:
                session = tier._sessions.get(source.peer_id)
                if session is None or session.ready or not session.alive:
                    return  # ready, or never to be: the lookups say which
            time.sleep(0.005)
            self.step()

    def _load(self, load_spec: Any, row: int, gpu_spec: Any) -> bytes:
        """Load one chunk (host row ``row``) into poisoned cache blocks; the blocks'
        bytes, page by page."""
        import torch

        blocks = self._blocks()
        for page in self.pages:
            page[blocks] = 0x55
        if not self.workers:
            self._replay(torch.from_numpy(self.rows), blocks, row, store=False)
            return self._block_bytes(blocks)
        self._job += 1
        spec = gpu_spec(blocks, [len(blocks)], [0])
        for rank, worker in enumerate(self.workers):
            if not worker.submit_load(self._job, load_spec, self._gpu_side(rank, spec)):
                raise RuntimeError(f"rank {rank}: submit_load refused")
        self._finish(self._job)
        return self._block_bytes(blocks)

    def _gpu_side(self, rank: int, spec: Any) -> Any:
        """A job's GPU side for rank ``rank``'s worker, as the installed vLLM's connector
        worker passes it: vLLM 0.34 resolves the blocks to ``DevicePointers`` into the
        worker's caches, 0.33 passes the ``GPULoadStoreSpec``."""
        try:
            from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers
        except ImportError:
            return spec
        return resolve_device_pointers(spec, self.worker_caches[rank])

    def _block_bytes(self, blocks: list[int]) -> bytes:
        return b"".join(page[blocks].numpy().tobytes() for page in self.pages)

    def shutdown(self) -> None:
        # The tier-poll thread and the tiers stop before the region is unmapped.
        rows, self.rows = self.rows, None
        del rows
        for worker in self.workers:
            worker.shutdown()
        self.manager.shutdown()


def _host_main(conn: Connection, env: dict[str, str]) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.update(env)
    instances: dict[str, _Instance] = {}
    try:
        prefer_cuda12_nixl()
        # The imports every instance needs, done once while the test process waits.
        import torch  # noqa: F401
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401

        import triton_offload.vllm.spec  # noqa: F401

        conn.send(("ok", {"pid": os.getpid()}))
        while True:
            if not conn.poll(0.005):
                for instance in instances.values():
                    instance.step()
                continue
            command, args = conn.recv()
            if command == "quit":
                while instances:
                    instances.popitem()[1].shutdown()
                conn.send(("ok", None))
                conn.close()
                # Every instance is shut down (tiers stopped, regions unlinked): skip the
                # interpreter's teardown of torch, vLLM and NIXL, which takes seconds.
                os._exit(0)
            try:
                if command == "open":
                    (config,) = args
                    instances[config.engine_id] = _Instance(config)
                    value: Any = None
                elif command == "close":
                    instances.pop(args[0]).shutdown()
                    value = None
                elif command == "nixl":
                    module = sys.modules.get("nixl")
                    value = getattr(getattr(module, "_pkg", None), "__name__", None)
                else:
                    value = getattr(instances[args[0]], command)(*args[1:])
            except Exception:
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", value))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        for instance in instances.values():
            with contextlib.suppress(Exception):
                instance.shutdown()
