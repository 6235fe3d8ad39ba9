"""Ahead-of-time compile of the copy kernel for sm_90 / sm_80 and checks on its PTX.

Triton compiles to PTX (and, with its bundled ptxas, to a cubin) without a GPU. The
compile runs in a subprocess with TRITON_INTERPRET=0: under the interpreter the module's
``@triton.jit`` functions are interpreted objects that cannot be compiled.

What is checked: the aligned path moves 16-byte words (``ld.global.v4.b32`` /
``st.global.v4.b32``, or ``v2.b64`` or wider) - a pointer built from an integer carries
no alignment, so losing the ``tl.multiple_of`` hints shows up here as 4- or 8-byte
accesses; nothing spills to local memory; and no barrier (shared-memory shuffle) sits
between a load and its store. The register count from ``ptxas -v`` is
printed (run with ``-s`` to see it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

WIDE_LOAD = re.compile(r"ld\.global(?:\.[a-z]+)*\.v(?:4\.b32|2\.b64|4\.b64|8\.b32)")
WIDE_STORE = re.compile(r"st\.global(?:\.[a-z]+)*\.v(?:4\.b32|2\.b64|4\.b64|8\.b32)")
LOCAL_MEMORY = re.compile(r"\.local\b|ld\.local|st\.local")


def compile_kernel(capability: int, out_dir: str) -> dict[str, object]:
    """Compile the kernel for ``sm_<capability>``; write its PTX; return ptxas's counts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton_offload.kernels import copy_blocks as cb

    assert isinstance(cb._copy_blocks_kernel, triton.runtime.JITFunction), "interpreted"
    # Same types the launcher produces at run time: tables are int64 tensors (16-byte
    # aligned allocations), the pool address is a 64-bit int, small ints are i32.
    signature = {
        "tile_table_ptr": "*i64",
        "group_table_ptr": "*i64",
        "pairs_ptr": "*i64",
        "group_offsets_ptr": "*i64",
        "pool_address": "i64",
        "pool_row_bytes": "i32",
        "num_groups": "i32",
        "direction": "i32",
        "TILE_BYTES": "constexpr",
        "NARROW_BYTES": "constexpr",
    }
    source = triton.compiler.ASTSource(
        fn=cb._copy_blocks_kernel,
        signature=signature,
        constexprs={"TILE_BYTES": cb.TILE_BYTES, "NARROW_BYTES": cb.NARROW_BYTES},
        attrs={(i,): [["tt.divisibility", 16]] for i in range(4)},
    )
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": cb.NUM_WARPS},
    )
    ptx = compiled.asm["ptx"]
    ptx_path = Path(out_dir) / f"copy_blocks_sm{capability}.ptx"
    ptx_path.write_text(ptx)
    arch = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE)
    assert arch is not None
    # The ptxas Triton itself assembles this architecture with: Triton 3.9 emits PTX 9.x
    # for sm_90, which only its newer bundled ptxas accepts (3.6 uses the legacy one).
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(capability).path
    result = subprocess.run(
        [str(ptxas), "-v", f"-arch={arch.group(1)}", str(ptx_path), "-o", os.devnull],
        capture_output=True,
        text=True,
        check=True,
    )
    registers = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", result.stderr)
    return {
        "ptx": str(ptx_path),
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": sum(int(s) for s in spills),
        "has_cubin": bool(compiled.asm.get("cubin")),
        "ptxas": result.stderr.strip(),
    }


def _compile_in_subprocess(capability: int, out_dir: Path) -> dict[str, object]:
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run(
        [sys.executable, __file__, str(capability), str(out_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("capability", [90, 80])
def test_aligned_path_uses_16_byte_accesses_without_spills(capability: int, tmp_path: Path) -> None:
    info = _compile_in_subprocess(capability, tmp_path)
    ptx = Path(str(info["ptx"])).read_text()
    print(
        f"sm_{capability}: {info['registers']} registers, {info['spill_bytes']} spill bytes; "
        f"ptxas: {info['ptxas']}"
    )
    widths = sorted(set(re.findall(r"(?:ld|st)\.global(?:\.[a-z]+)*(?:\.v\d)?\.[bu]\d+", ptx)))
    print(f"sm_{capability} global accesses: {widths}")
    assert WIDE_LOAD.search(ptx), "no 16-byte global load on the aligned path"
    assert WIDE_STORE.search(ptx), "no 16-byte global store on the aligned path"
    assert not LOCAL_MEMORY.search(ptx), "local memory (spills) in the PTX"
    # A copy needs no shared memory: a barrier means a layout shuffle between a load and
    # its store (load and store given different per-thread widths).
    assert "bar.sync" not in ptx, "shared-memory shuffle between load and store"
    # The 8 KiB tile is 4 x 16 bytes per thread at 4 warps: four loads and four stores.
    assert len(WIDE_LOAD.findall(ptx)) >= 4 and len(WIDE_STORE.findall(ptx)) >= 4
    assert info["spill_bytes"] == 0
    assert info["has_cubin"]
    assert isinstance(info["registers"], int) and info["registers"] > 0


if __name__ == "__main__":
    print(json.dumps(compile_kernel(int(sys.argv[1]), sys.argv[2])))
