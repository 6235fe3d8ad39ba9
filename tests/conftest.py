"""Fixtures shared by the test modules in this folder (the interpreter recipe and the
``device`` fixture are the root ``conftest.py``'s).

Nothing here imports vLLM: every module in this folder is collected, and skips with a
reason, where vLLM cannot be imported.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def engines() -> Iterator[list[Any]]:
    """The ``tests/helpers/vllm_engine.py`` engines a test made, each closed after the test.

    A module whose engines are of another kind (``tests/system/test_vllm_engine_real.py``)
    defines its own ``engines``, which overrides this one there."""
    made: list[Any] = []
    yield made
    for engine in made:
        engine.close()


@pytest.fixture
def seal_key_file(tmp_path: Any) -> Any:
    """A seal key as an operator makes one: 32 random bytes, mode 0600."""
    import os

    path = tmp_path / "seal.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as key_file:
        key_file.write(os.urandom(32))
    return path
