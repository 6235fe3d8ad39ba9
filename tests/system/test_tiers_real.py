"""vLLM's secondary tiers between two processes, each over its real transport.

Two peer processes (``tests/helpers/tier_peers.py``) each run an offloading instance with one
secondary tier: ``fs`` (a shared folder), ``obj`` (S3 through NIXL's OBJ plugin, against
a local moto server started by a fixture), ``p2p`` (ZMQ control + NIXL/UCX data between
the instances) and ``kvcr`` (NVIDIA's KV Cache Runner: ZMQ control + NIXL/UCX). One
instance stores chunks, the other looks them up; every byte crosses the tier.

- vLLM's stock ``TieringOffloadingSpec`` on both sides proves the harness.
- ``TritonTieringOffloadingSpec`` on both sides shares chunks: they are stored from one
  worker's caches and loaded into the other's byte-exactly.
- Stock and this backend in its default (tagged) layout never share: lookups miss and
  never load the other's bytes.
- Under ``canonical_layout`` (two TP ranks per instance, caches registered through
  vLLM's own connector worker) stock vLLM and this backend share chunks in both
  directions over every tier, kvcr included: this backend's workers write the row
  vLLM's own canonical descriptors write from the same caches, and the consumer's
  caches (vLLM's descriptors replayed on the stock side, this backend's workers on the
  other) receive the producer's blocks byte for byte.
- Two instances of this backend whose page geometry differs never share.
- A peer that is killed mid-session leaves misses, not hangs.

Every lookup is bounded (``PeerConfig.lookup_timeout_s``), every peer and server is
started and stopped by PID by a fixture, and no region file is left in ``/dev/shm``.
The tiers' dependencies are the ``tiers`` extra (``pip install -e '.[tiers]'``); a tier
whose dependency is missing is skipped, naming it.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.tier_peers import (
    NEEDS,
    STOCK,
    TRITON,
    UCX_LOOPBACK_ENV,
    Peer,
    PeerConfig,
    PeerError,
    PeerHost,
    S3Server,
    free_port,
    missing_modules,
    require,
    unusable,
)

try:
    import vllm.v1.kv_offload.tiering.spec  # noqa: F401

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")

#: Tiers whose instances talk to each other (and so can lose their peer).
PEER_TIERS = ("p2p", "kvcr")
#: Tiers this backend accepts in its default layout (it refuses kvcr there: see
#: triton_offload.vllm.tiers); under canonical_layout it takes kvcr too.
TAGGED_TIERS = ("fs", "p2p", "obj")
CANONICAL_TIERS = (*TAGGED_TIERS, "kvcr")
NAMES = ["chunk-0", "chunk-1", "chunk-2"]
#: canonical_layout instances: vLLM needs the KV cache layout name (its canonical format
#: id names the layout family); two ranks, so each canonical page interleaves both
#: ranks' heads token by token (many fragments per page).
CANONICAL = {"canonical_layout": True, "kv_cache_layout": "LBNHC", "tp": 2}  # NHD


class Hosts:
    """The module's two peer processes (each imports torch and vLLM once: seconds).

    A host that died (a test killed it) or was retired is replaced on the next
    :meth:`pair`, so the tests need no order; the kill test, last in this file, costs
    no extra process in a whole-file run.
    """

    def __init__(self) -> None:
        self._pair: list[PeerHost | None] = [None, None]
        self.every: list[PeerHost] = []

    def pair(self) -> tuple[PeerHost, PeerHost]:
        for index, host in enumerate(self._pair):
            if host is None or not host.alive():
                if host is not None:
                    host.close()
                host = PeerHost(UCX_LOOPBACK_ENV)  # both start before either is awaited
                self.every.append(host)
                self._pair[index] = host
        hosts = (self._pair[0], self._pair[1])
        assert hosts[0] is not None and hosts[1] is not None
        for host in hosts:
            if not host.started:
                host.wait_started()
        return hosts

    def retire(self, host: PeerHost) -> None:
        host.close()

    def close(self) -> None:
        for host in self.every:
            host.close()


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    pool = Hosts()
    try:
        yield pool
    finally:
        pool.close()
    for host in pool.every:
        assert not host.alive(), f"peer process {host.pid} still runs"
        left = [path for path in host.regions if os.path.exists(path)]
        assert not left, f"/dev/shm files left behind: {left}"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    require("obj")
    with S3Server.running() as server:
        yield server


def tier_configs(
    tier: str, tmp_path: Path, request: pytest.FixtureRequest
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """(producer tier, consumer tier, the consumer's pointer to the producer)."""
    require(tier)
    if tier == "fs":
        config = {"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 1}
        return config, config, None
    if tier == "obj":
        server: S3Server = request.getfixturevalue("s3_server")
        config = server.tier(prefix=uuid.uuid4().hex)
        return config, config, None
    producer_port, consumer_port = free_port(), free_port()
    if tier == "p2p":

        def p2p(port: int) -> dict[str, Any]:
            return {"type": "p2p", "host": "127.0.0.1", "port": port, "num_threads": 1}

        return p2p(producer_port), p2p(consumer_port), {"kind": "p2p", "port": producer_port}

    def kvcr(port: int) -> dict[str, Any]:
        return {
            "type": "kvcr",
            "control_host": "127.0.0.1",
            "control_ports": [port],
            "control_advertise_host": "127.0.0.1",
            "router_capabilities": ["router_hint"],
            # A pull from a source that died is given up after abandon_timeout_ms (5 s by
            # default; at least twice operation_timeout_ms): that bounds the kill test's
            # miss and the consumer's close.
            "abandon_timeout_ms": 2000,
        }

    return kvcr(producer_port), kvcr(consumer_port), {"kind": "kvcr", "port": producer_port}


@contextlib.contextmanager
def opened(host: PeerHost, config: PeerConfig) -> Iterator[Peer]:
    peer = host.open(config)
    try:
        yield peer
    finally:
        peer.close()
    assert not os.path.exists(config.region_path), "the instance left its region file"


@contextlib.contextmanager
def pair(
    hosts: Hosts,
    tier: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    producer: dict[str, Any],
    consumer: dict[str, Any],
) -> Iterator[tuple[Peer, Peer]]:
    """A producer instance in one process and a consumer in the other, one tier between."""
    producer_tier, consumer_tier, source = tier_configs(tier, tmp_path, request)
    producer_config = PeerConfig(tier=producer_tier, seed=1, **producer)
    consumer_config = PeerConfig(tier=consumer_tier, seed=2, source=source, **consumer)
    first, second = hosts.pair()
    with opened(first, producer_config) as a, opened(second, consumer_config) as b:
        yield a, b


def assert_shared(stored: dict[str, Any], found: dict[str, Any], workers: bool) -> None:
    assert {name: entry["result"] for name, entry in found.items()} == dict.fromkeys(stored, "HIT")
    for name, entry in found.items():
        assert entry["row"] == stored[name]["row"], f"{name}: the row differs"
        if workers:
            # This backend's worker loaded the chunk into poisoned cache blocks.
            assert entry["blocks"] == stored[name]["blocks"], f"{name}: cache bytes differ"


def assert_missed(found: dict[str, Any]) -> None:
    # A prefix lookup stops at its first miss: one entry, a MISS (not a TIMEOUT).
    assert [entry["result"] for entry in found.values()] == ["MISS"], found
    assert not any("row" in entry for entry in found.values())


# ------------------------------------------------------------------ sharing

SAME_SPEC_PAIRS = [
    pytest.param(tier, spec, id=f"{tier}-{name}")
    for tier in ("fs", "p2p", "obj", "kvcr")
    for spec, name in ((STOCK, "stock-stock"), (TRITON, "triton-triton"))
    if not (tier == "kvcr" and spec == TRITON)
]


@pytest.mark.parametrize(("tier", "spec_name"), SAME_SPEC_PAIRS)
def test_chunks_stored_in_one_process_load_byte_exact_in_the_other(
    hosts: Hosts,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    tier: str,
    spec_name: str,
) -> None:
    same = {"spec_name": spec_name}
    with pair(hosts, tier, tmp_path, request, same, same) as (producer, consumer):
        stored = producer.store(NAMES)
        found = consumer.lookup(NAMES)
        assert_shared(stored, found, workers=spec_name == TRITON)
        # A chunk nobody stored ends in a miss, within the lookup deadline.
        assert_missed(consumer.lookup(["never-stored"]))


def test_kvcr_tier_is_refused_by_this_backend_in_a_peer(
    hosts: Hosts, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """kvcr files chunks under the block hash alone: this backend's default-layout rows
    could reach a stock peer, so its spec refuses the tier without canonical_layout,
    naming the option (with it the tier is accepted: below)."""
    # Refused before vLLM builds the tier: this runs without kvcr installed.
    tier = {"type": "kvcr", "control_host": "127.0.0.1", "control_ports": [free_port()]}
    with pytest.raises(
        PeerError,
        match=r"'kvcr' is not supported by TritonTieringOffloadingSpec without canonical_layout",
    ):
        hosts.pair()[0].open(PeerConfig(TRITON, tier))


@pytest.mark.parametrize("tier", TAGGED_TIERS)
@pytest.mark.parametrize(
    ("producer_spec", "consumer_spec"),
    [(STOCK, TRITON), (TRITON, STOCK)],
    ids=["stock-to-triton", "triton-to-stock"],
)
def test_stock_vllm_and_this_backend_never_share_in_the_tagged_layout(
    hosts: Hosts,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    tier: str,
    producer_spec: str,
    consumer_spec: str,
) -> None:
    with pair(
        hosts, tier, tmp_path, request, {"spec_name": producer_spec}, {"spec_name": consumer_spec}
    ) as (producer, consumer):
        producer.store(NAMES)
        assert_missed(consumer.lookup(NAMES))


@pytest.mark.parametrize("tier", CANONICAL_TIERS)
@pytest.mark.parametrize(
    ("producer_spec", "consumer_spec"),
    [(STOCK, STOCK), (STOCK, TRITON), (TRITON, STOCK), (TRITON, TRITON)],
    ids=["stock-to-stock", "stock-to-triton", "triton-to-stock", "triton-to-triton"],
)
def test_chunks_are_shared_under_canonical_layout(
    hosts: Hosts,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    tier: str,
    producer_spec: str,
    consumer_spec: str,
) -> None:
    """Stock vLLM's side moves its caches with vLLM's canonical descriptors (replayed:
    its CUDA workers cannot run on CPU); this backend's with its workers. The rows cross
    the tier unchanged, a store by this backend writes exactly vLLM's row, and the
    consumer's poisoned blocks receive the producer's cache bytes. Stock on both sides
    is the baseline: vLLM's tier carries vLLM's canonical rows and its descriptors
    bring the blocks back."""
    with pair(
        hosts,
        tier,
        tmp_path,
        request,
        {"spec_name": producer_spec, **CANONICAL},
        {"spec_name": consumer_spec, **CANONICAL},
    ) as (producer, consumer):
        stored = producer.store(NAMES)
        if producer_spec == TRITON:
            for name, entry in stored.items():
                assert entry["row"] == entry["replayed"], f"{name}: not vLLM's canonical row"
        assert_shared(stored, consumer.lookup(NAMES), workers=True)
        assert_missed(consumer.lookup(["never-stored"]))


@pytest.mark.parametrize("tier", TAGGED_TIERS)
def test_stock_instances_of_another_kv_dtype_never_share(
    hosts: Hosts, tmp_path: Path, request: pytest.FixtureRequest, tier: str
) -> None:
    """vLLM's own separation, the one this backend's tag rides on: the KV dtype is part
    of the fs folder, the obj prefix and the p2p handshake fingerprint."""
    with pair(
        hosts,
        tier,
        tmp_path,
        request,
        {"spec_name": STOCK},
        {"spec_name": STOCK, "dtype": "float16"},
    ) as (producer, consumer):
        producer.store(NAMES)
        assert_missed(consumer.lookup(NAMES))


@pytest.mark.parametrize("tier", TAGGED_TIERS)
@pytest.mark.parametrize(
    "change",
    [{"blocks_per_chunk": 4}, {"plane_bytes": 512}],
    ids=["blocks-per-chunk", "page-bytes"],
)
def test_this_backend_with_another_page_geometry_never_shares(
    hosts: Hosts,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    tier: str,
    change: dict[str, int],
) -> None:
    with pair(
        hosts, tier, tmp_path, request, {"spec_name": TRITON}, {"spec_name": TRITON, **change}
    ) as (producer, consumer):
        producer.store(NAMES)
        assert_missed(consumer.lookup(NAMES))


# ------------------------------------------------------------------ a peer disappears


@pytest.mark.slow
def test_a_peer_killed_mid_session_leaves_misses_not_hangs(
    hosts: Hosts, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """For each peer tier (p2p between two instances of this backend, kvcr between two
    stock ones) the producer's process is killed (SIGKILL) after a first chunk crossed:
    the consumer's next lookup ends in a miss within its deadline.

    The producer's process is killed and the consumer's is retired afterwards: a KVCR
    consumer whose source died during a transfer cannot close cleanly (below). Later
    tests get new processes.
    """
    tiers = [
        tier for tier in PEER_TIERS if not missing_modules(*NEEDS[tier]) and not unusable(tier)
    ]
    if not tiers:
        require(PEER_TIERS[0])
    doomed, survivor = hosts.pair()
    try:
        consumers = {}
        for tier in tiers:
            # This backend where it takes the tier; stock vLLM over kvcr.
            spec = TRITON if tier in TAGGED_TIERS else STOCK
            producer_tier, consumer_tier, source = tier_configs(tier, tmp_path, request)
            config = PeerConfig(spec, consumer_tier, source=source, lookup_timeout_s=15.0)
            consumers[tier] = survivor.open(config)
            producer = doomed.open(PeerConfig(spec, producer_tier, seed=1))
            stored = producer.store(NAMES)
            found = consumers[tier].lookup(NAMES[:1])
            assert_shared({NAMES[0]: stored[NAMES[0]]}, found, workers=spec == TRITON)
        doomed.kill()
        assert not doomed.alive()
        for consumer in consumers.values():
            found = consumer.lookup(NAMES[1:], timeout_s=60)
            assert_missed(found)
        for tier, consumer in consumers.items():
            try:
                consumer.close()
            except PeerError as error:
                if tier != "kvcr":
                    raise
                # kvcr 0.1.1 cannot learn that a pull from a dead source quiesced, so it
                # keeps its NIXL resources and vLLM keeps the region: the process ends
                # below, and its region file is removed.
                assert "unresolved operations" in str(error), error
            else:
                assert not os.path.exists(consumer.config.region_path), tier
    finally:
        doomed.kill()
        hosts.retire(survivor)
    for host in (doomed, survivor):
        assert not host.alive()
        assert not any(os.path.exists(path) for path in host.regions)
