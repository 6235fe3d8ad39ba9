"""The README's library example runs as written and prints what its comments claim."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_library_example_runs_and_matches_its_comments() -> None:
    (example,) = _python_blocks()
    namespace: dict[str, object] = {}
    exec(compile(example, str(README), "exec"), namespace)
    plan = namespace["plan"]
    engine = namespace["engine"]
    assert plan.store_reachable_chunks(1, storable_chunk_count=4) == [1, 3]  # type: ignore[attr-defined]
    assert plan.lookup(64, 0, present=[[True, True], [False, True, False, True]]) == 32  # type: ignore[attr-defined]
    # The example already drained get_finished(); a second store reports its own size.
    assert engine.submit_store("again", gpu_blocks=[[3, 7], [7]], host_blocks=[[0, 1], [2]])  # type: ignore[attr-defined]
    (result,) = engine.get_finished()  # type: ignore[attr-defined]
    assert result.success and result.transfer_size == 6912
    engine.shutdown()  # type: ignore[attr-defined]


def test_readme_commands_are_the_ci_commands() -> None:
    """The test command in the README is the one .ci/run executes, letter for letter."""
    commands = re.findall(r"```\n(python3 -m venv .*?)\n```", README.read_text())
    assert len(commands) == 2, commands
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci
    assert commands[0].endswith("triton-offload bench")
