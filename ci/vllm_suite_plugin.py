"""pytest plugin: run vLLM's own offloading tests with this project's classes substituted.

Loaded by ``ci/vllm_suite.sh`` as ``-p vllm_suite_plugin``; it edits no test. The mode
comes from ``TRITON_OFFLOAD_SUITE_MODE``:

- ``connector``: vLLM's ``OffloadingConnector`` and ``OffloadingConnectorScheduler`` are
  ``TritonOffloadingConnector`` and its scheduler (by factory name and module attribute),
  so every scheduler test runs the planner's lookups. Some of vLLM's scheduler tests
  replace vLLM's private ``_maximal_prefix_lookup`` on the connector scheduler with a
  stub claiming a hit (``lambda keys, ctx, *_: 1``) while their mock manager answers
  MISS for every key: vLLM's scheduler believes the stub, this project's connector asks
  the manager (it never loads a chunk the manager does not say it holds) and so loads
  nothing. The stub and the mock disagree, so here they are made to agree: vLLM's method
  becomes a descriptor (``_ConsistentPrefixStub``) that, when a test assigns a stub,
  keeps the stub and has the mock manager's ``lookup`` answer as it did (HIT for the
  keys it counted, MISS for the others it was handed).
- ``spec``: vLLM's ``CPUOffloadingSpec`` and ``TieringOffloadingSpec`` are
  ``TritonOffloadingSpec`` and ``TritonTieringOffloadingSpec`` (by factory name and
  module attribute), so every spec a test builds moves bytes through this project.

Tests listed for the mode in ``ci/vllm_suite_expected_failures-<release>.txt`` (the
installed vLLM's major.minor, e.g. ``-0.34.txt``: each release's suite has its own tests
and its own reasons) are marked ``xfail(strict=True)`` with the listed reason: one that
passes fails the run, so the list cannot go stale.

On vLLM >= 0.34 it also lets the CPU platform build configs without triton-cpu, for the
tests only (``ci/vllm_cpu_platform.py``).
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from vllm_cpu_platform import allow_x86_cpu_without_triton

MODES = ("connector", "spec")


def expected_failures_file(version: str | None = None) -> Path:
    """The expected-failure list of the installed (or the given) vLLM release."""
    version = version or importlib.metadata.version("vllm")
    release = ".".join(version.lstrip("v").split(".")[:2])
    path = Path(__file__).with_name(f"vllm_suite_expected_failures-{release}.txt")
    if not path.exists():
        raise pytest.UsageError(f"no expected-failure list for vllm {version}: {path} is missing")
    return path


def _mode() -> str:
    mode = os.environ.get("TRITON_OFFLOAD_SUITE_MODE", "")
    if mode not in MODES:
        raise pytest.UsageError(f"TRITON_OFFLOAD_SUITE_MODE {mode!r} is not one of {MODES}")
    return mode


def expected_failures(mode: str) -> dict[str, str]:
    """``node id -> reason`` for ``mode``; lines are ``mode | node id | reason``."""
    found: dict[str, str] = {}
    expected = expected_failures_file()
    for number, line in enumerate(expected.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = [part.strip() for part in line.split("|")]
        if len(parts) != 3 or not all(parts) or parts[0] not in MODES:
            raise pytest.UsageError(f"{expected.name}:{number}: want 'mode | node id | reason'")
        if parts[0] == mode:
            found[parts[1]] = parts[2]
    return found


class _ConsistentPrefixStub:
    """Stands for vLLM's ``OffloadingConnectorScheduler._maximal_prefix_lookup``.

    Read, it is vLLM's method (or the stub a test assigned to the instance). Assigned
    (``scheduler._maximal_prefix_lookup = stub``), it keeps a wrapper of the stub that
    records, for every call, the stub's answer per key: the first ``hits`` keys it was
    handed HIT, the rest MISS. The scheduler's mock manager (``MagicMock``, left as the
    test built it otherwise) answers ``lookup`` from that record, falling back to its own
    ``return_value``; a ``side_effect`` the test set itself is left alone. Why: the stub
    claims chunks the mock manager denies, and this project's connector loads only what
    the manager confirms.
    """

    _STUB = "_vllm_suite_prefix_stub"
    _ANSWERS = "_vllm_suite_prefix_answers"

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self.method  # OffloadingConnectorScheduler._maximal_prefix_lookup(s, ...)
        stub = instance.__dict__.get(self._STUB)
        return stub if stub is not None else self.method.__get__(instance, owner)

    def __set__(self, instance: Any, stub: Callable[..., Any]) -> None:
        from vllm.v1.kv_offload.base import LookupResult

        answers: dict[Any, Any] = instance.__dict__.setdefault(self._ANSWERS, {})
        lookup = getattr(getattr(instance, "manager", None), "lookup", None)
        if isinstance(lookup, mock.NonCallableMock) and lookup.side_effect is None:
            lookup.side_effect = lambda key, req_context: answers.get(key, mock.DEFAULT)

        def stubbed(keys: Any, req_context: Any, *args: Any) -> Any:
            keys = list(keys)
            hits = stub(keys, req_context, *args)
            if hits is not None:  # None: deferred, nothing claimed
                for index, key in enumerate(keys):
                    answers[key] = LookupResult.HIT if index < hits else LookupResult.MISS
            return hits

        instance.__dict__[self._STUB] = stubbed

    def __delete__(self, instance: Any) -> None:
        instance.__dict__.pop(self._STUB, None)


def _substitute_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler

    from triton_offload.vllm.connector import (
        TritonOffloadingConnector,
        TritonOffloadingConnectorScheduler,
    )

    vllm_scheduler = scheduler.OffloadingConnectorScheduler  # vLLM's, before the swap below
    vllm_scheduler._maximal_prefix_lookup = _ConsistentPrefixStub(
        vllm_scheduler._maximal_prefix_lookup
    )
    scheduler.OffloadingConnectorScheduler = TritonOffloadingConnectorScheduler
    offloading_connector.OffloadingConnectorScheduler = TritonOffloadingConnectorScheduler
    offloading_connector.OffloadingConnector = TritonOffloadingConnector
    KVConnectorFactory._registry["OffloadingConnector"] = lambda: TritonOffloadingConnector


def _substitute_specs() -> None:
    from vllm.v1.kv_offload.cpu import spec as cpu_spec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering import spec as tiering_spec

    from triton_offload.vllm.spec import TritonOffloadingSpec, TritonTieringOffloadingSpec

    cpu_spec.CPUOffloadingSpec = TritonOffloadingSpec
    tiering_spec.TieringOffloadingSpec = TritonTieringOffloadingSpec
    OffloadingSpecFactory._registry["CPUOffloadingSpec"] = lambda: TritonOffloadingSpec
    OffloadingSpecFactory._registry["TieringOffloadingSpec"] = lambda: TritonTieringOffloadingSpec


def pytest_configure(config: pytest.Config) -> None:
    mode = _mode()
    allow_x86_cpu_without_triton()
    # Before any test module imports vLLM's names: the tests see this project's classes.
    if mode == "connector":
        _substitute_connector()
    else:
        _substitute_specs()
    config.stash[_EXPECTED_KEY] = expected_failures(mode)
    config.stash[_SEEN_KEY] = set()


_EXPECTED_KEY = pytest.StashKey[dict[str, str]]()
_SEEN_KEY = pytest.StashKey[set[str]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expected = config.stash[_EXPECTED_KEY]
    seen = config.stash[_SEEN_KEY]
    for item in items:
        reason = expected.get(item.nodeid)
        if reason is not None:
            seen.add(item.nodeid)
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


def pytest_terminal_summary(terminalreporter: object, config: pytest.Config) -> None:
    unseen = sorted(set(config.stash[_EXPECTED_KEY]) - config.stash[_SEEN_KEY])
    if unseen and not config.option.keyword and not config.option.markexpr:
        # A listed test that no longer exists is a stale entry: say so, loudly.
        reporter = terminalreporter
        reporter.write_line(  # type: ignore[attr-defined]
            f"vllm_suite_plugin: {len(unseen)} expected failure(s) not collected: {unseen}"
        )
