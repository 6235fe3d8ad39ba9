"""The README and docs/ say what the code does: the library example runs as written, the
README's commands are CI's, every link lands on a page and heading that exist, every
`vllm serve` line is a configuration this backend and vLLM accept, and the keys table
lists exactly the keys that are accepted."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)


def test_library_example_runs_and_matches_its_comments() -> None:
    (example,) = _python_blocks(DOCS / "design.md")
    namespace: dict[str, object] = {}
    exec(compile(example, str(DOCS / "design.md"), "exec"), namespace)
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
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci
    assert commands[0].endswith("triton-offload bench")


def _anchor(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading: lower case, punctuation other than
    hyphens dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {_anchor(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_every_link_lands_on_a_page_and_heading_that_exist() -> None:
    checked = 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.is_file(), f"{page.name}: link to {target}: no such file"
            if anchor:
                assert anchor in _anchors(linked), f"{page.name}: link to {target}: no such heading"
            checked += 1
    assert checked >= 10  # the README links each docs page, the pages link each other


def test_every_docs_page_is_listed_in_the_readme() -> None:
    readme = README.read_text()
    for page in DOCS.glob("*.md"):
        assert f"(docs/{page.name})" in readme, f"README does not list docs/{page.name}"


def _serve_configs() -> list[tuple[str, dict[str, object]]]:
    found = []
    for page in PAGES:
        for line in page.read_text().splitlines():
            if line.strip().startswith("vllm serve"):
                words = shlex.split(line.strip())
                config = json.loads(words[words.index("--kv-transfer-config") + 1])
                found.append((page.name, config))
    return found


def test_every_serve_line_recomputes_on_failure_and_names_the_connector_module() -> None:
    configs = _serve_configs()
    assert any(name == "README.md" for name, _ in configs)
    for name, config in configs:
        assert config["kv_load_failure_policy"] == "recompute", (name, config)
        if config["kv_connector"] == "TritonOffloadingConnector":
            assert config["kv_connector_module_path"] == "triton_offload.vllm", (name, config)


def _documented_keys() -> list[str]:
    text = (DOCS / "vllm.md").read_text()
    section = text.split("\n## Keys\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)


def test_the_keys_table_lists_exactly_the_accepted_keys() -> None:
    pytest.importorskip("vllm")
    from triton_offload.vllm.compat import VLLM_EXTRA_CONFIG_KEYS
    from triton_offload.vllm.options import EXTRA_CONFIG_KEYS

    documented = _documented_keys()
    assert len(documented) == len(set(documented)), documented
    accepted = set(EXTRA_CONFIG_KEYS).union(*VLLM_EXTRA_CONFIG_KEYS.values())
    assert set(documented) == accepted


def test_every_serve_line_uses_only_accepted_keys() -> None:
    pytest.importorskip("vllm")
    from triton_offload.vllm.compat import VLLM_EXTRA_CONFIG_KEYS
    from triton_offload.vllm.options import check_known_keys

    for _page, config in _serve_configs():
        extra = config["kv_connector_extra_config"]
        assert isinstance(extra, dict)
        for release, keys in VLLM_EXTRA_CONFIG_KEYS.items():
            check_known_keys(extra, keys, ".".join(map(str, release)))
