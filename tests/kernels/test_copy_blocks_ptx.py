"""Ahead-of-time compile of the copy kernel for sm_90 / sm_80 and checks on its PTX.

Triton compiles to PTX (and, with its bundled ptxas, to a cubin) without a GPU. The
compile runs in a subprocess with TRITON_INTERPRET=0: under the interpreter the module's
``@triton.jit`` functions are interpreted objects that cannot be compiled. The argument
types and attributes come from Triton's own binder run on the arguments ``warm_up``
launches (the ones every job compiles to: no argument is specialized), so this is the
kernel a job runs.

What is checked, per architecture:

- page data moves in 16-byte accesses (``v4.b32``): a pointer built from an integer
  carries no alignment, so losing the ``tl.multiple_of`` hints shows up as 4-byte ones;
- every data access carries the evict-first hints (``L1::evict_first`` and an
  ``L2::cache_hint`` whose policy is ``createpolicy ... L2::evict_first``), and the
  table loads (the only 64-bit scalar loads: 8-byte words move as ``v2.b32``) none;
- two items in flight: on the 16-byte path of the item loop, the next item's eight
  table loads sit between the current item's data loads and its stores, and the stores'
  addresses do not depend on them;
- nothing spills to local memory, and no barrier (shared-memory shuffle) sits between a
  load and its store;
- the keyed page-sum variants (``KEYED``: the copy with keyed sums and its read-only
  pass, as ``warm_up(checksum=True, keyed=True)`` binds them) compile too, without
  spills, their data accesses still evict-first and their weight loads (64-bit, like
  the table words) unhinted: every page re-reads the weights table, so it should stay
  cached.

The register count from ``ptxas -v`` is printed (run with ``-s`` to see it).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

WIDE_LOAD = re.compile(r"ld\.global(?:\.[\w:]+)*\.v(?:4\.b32|2\.b64|4\.b64|8\.b32)\b")
WIDE_STORE = re.compile(r"st\.global(?:\.[\w:]+)*\.v(?:4\.b32|2\.b64|4\.b64|8\.b32)\b")
LOCAL_MEMORY = re.compile(r"\.local\b|ld\.local|st\.local")
# One PTX instruction: optional guard predicate, opcode with modifiers, operands.
INSTRUCTION = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)\s*(.*?);\s*(?://.*)?$")
LABEL = re.compile(r"^(\$L__\w+):")
REGISTER = re.compile(r"%[a-z]+\d+")
TABLE_ROW_LOADS = 8  # one pair row (3 words) and one tile row (5 words) per item
# Kernel variants compiled here: the plain copy (what every job without checksums runs),
# and the keyed page-sum copy and read-only pass.
VARIANTS = ("plain", "keyed", "keyed-read-only")


def compile_kernel(capability: int, out_dir: str, variant: str = "plain") -> dict[str, object]:
    """Compile the kernel for ``sm_<capability>``; write its PTX; return ptxas's counts."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    from triton_offload.kernels import copy_blocks as cb

    kernel = cb._copy_blocks_kernel
    assert isinstance(kernel, triton.runtime.JITFunction), "interpreted"
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    arguments: dict[str, object] = {}
    if variant == "plain":
        arguments.update(cb._launch_options(cb.TILE_BYTES))
    else:
        # warm_up's keyed launch: every page-sum pointer bound, none specialized.
        words = torch.zeros(1, dtype=torch.int64)
        arguments.update(page_sums_ptr=words, pair_pages_ptr=words, page_weights_ptr=words)
        write = variant == "keyed"
        arguments.update(cb._launch_options(cb.TILE_BYTES, checksum=True, write=write, keyed=True))
    _, specialization, options = binder(*cb._empty_job(torch.device("cpu")), **arguments)
    names = [param.name for param in kernel.params]
    source = triton.compiler.ASTSource(
        fn=kernel,
        signature={name: spec[0] for name, spec in zip(names, specialization, strict=True)},
        constexprs={
            name: spec[1]
            for name, spec in zip(names, specialization, strict=True)
            if spec[0] == "constexpr"
        },
        attrs={
            (i,): backend.parse_attr(spec[1])
            for i, spec in enumerate(specialization)
            if spec[0] != "constexpr" and isinstance(spec[1], str)
        },
    )
    compiled = triton.compile(source, target=target, options=options)
    ptx = compiled.asm["ptx"]
    ptx_path = Path(out_dir) / f"copy_blocks_{variant}_sm{capability}.ptx"
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
        "triton": triton.__version__,
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": sum(int(s) for s in spills),
        "has_cubin": bool(compiled.asm.get("cubin")),
        "ptxas": result.stderr.strip(),
    }


@functools.cache
def compiled(capability: int, variant: str = "plain") -> tuple[dict[str, object], str]:
    """Compile once per architecture and variant for the whole module (each compile takes
    seconds)."""
    assert variant in VARIANTS, variant
    out_dir = tempfile.mkdtemp(prefix=f"copy_blocks_{variant}_sm{capability}_")
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run(
        [sys.executable, __file__, str(capability), out_dir, variant],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    return info, Path(str(info["ptx"])).read_text()


def instructions(ptx: str) -> list[tuple[int, str, list[str]]]:
    """(line number, opcode with modifiers, operands) of every instruction of the PTX."""
    found = []
    for number, line in enumerate(ptx.splitlines()):
        match = INSTRUCTION.match(line)
        if match and not line.lstrip().startswith((".", "//")):
            operands = [op.strip() for op in re.split(r",(?![^{]*})", match.group(2)) if op]
            found.append((number, match.group(1), operands))
    return found


def is_data_access(opcode: str) -> bool:
    """Page data, as opposed to table words: every global access but the 64-bit scalars."""
    return opcode.startswith(("ld.global", "st.global")) and not opcode.endswith(".b64")


def two_items_in_flight(ptx: str) -> tuple[int, list[str]]:
    """On the 16-byte path: (table loads between the data loads and the first store,
    problems found). The loads must be the next item's: inside a loop, after this item's
    data loads, before its stores, and feeding none of the stores' addresses."""
    code = instructions(ptx)
    lines = ptx.splitlines()
    first_store = next(i for i, (_, op, _) in enumerate(code) if WIDE_STORE.fullmatch(op))
    wide_loads = [i for i, (_, op, _) in enumerate(code[:first_store]) if WIDE_LOAD.fullmatch(op)]
    problems = []
    if not wide_loads:
        return 0, ["no 16-byte load before the first 16-byte store"]
    window = code[wide_loads[-1] + 1 : first_store + 4]
    table = [
        (op, ops) for _, op, ops in window if op.startswith("ld.global") and op.endswith(".b64")
    ]
    # Registers computed from the table loads of the window (forward taint, straight line).
    tainted = set()
    for _, op, ops in window:
        if op.startswith("ld.global") and op.endswith(".b64"):
            tainted.update(REGISTER.findall(ops[0]))
            continue
        if op.startswith("st.global"):
            address = REGISTER.findall(ops[0])
            if tainted.intersection(address):
                problems.append(f"a 16-byte store address depends on a table load: {op} {ops}")
            continue
        if ops and tainted.intersection(REGISTER.findall(" ".join(ops[1:]))):
            tainted.update(REGISTER.findall(ops[0]))
    # The window must sit in a loop: a label before the data loads that a branch after
    # the stores jumps back to.
    load_line, store_line = code[wide_loads[0]][0], code[first_store][0]
    labels = {
        match.group(1): number
        for number, line in enumerate(lines)
        if (match := LABEL.match(line)) and number < load_line
    }
    back_edges = [
        ops[0]
        for number, op, ops in code
        if op.startswith("bra") and number > store_line and ops and ops[0] in labels
    ]
    if not back_edges:
        problems.append("the 16-byte path is not inside a loop")
    return len(table), problems


@pytest.mark.parametrize("capability", [90, 80])
def test_page_data_moves_in_hinted_16_byte_accesses(capability: int) -> None:
    info, ptx = compiled(capability)
    print(
        f"triton {info['triton']} sm_{capability}: {info['registers']} registers, "
        f"{info['spill_bytes']} spill bytes; ptxas: {info['ptxas']}"
    )
    code = instructions(ptx)
    widths = sorted({op for _, op, _ in code if op.startswith(("ld.global", "st.global"))})
    print(f"sm_{capability} global accesses: {widths}")
    wide_loads = [op for _, op, _ in code if WIDE_LOAD.fullmatch(op)]
    wide_stores = [op for _, op, _ in code if WIDE_STORE.fullmatch(op)]
    # The 8 KiB tile is 4 x 16 bytes per thread at 4 warps: four loads and four stores.
    assert len(wide_loads) >= 4, "no 16-byte global loads on the aligned path"
    assert len(wide_stores) >= 4, "no 16-byte global stores on the aligned path"
    data = [(op, ops) for _, op, ops in code if is_data_access(op)]
    assert data
    policies = set(re.findall(r"createpolicy\.fractional\.L2::evict_first\.b64\s+(%rd\d+)", ptx))
    for op, ops in data:
        assert "L1::evict_first" in op and "L2::cache_hint" in op, f"unhinted data access {op}"
        assert ops[-1] in policies, f"{op} uses cache policy {ops[-1]}, not an evict-first one"
    table = [op for _, op, _ in code if op.startswith("ld.global") and op.endswith(".b64")]
    assert table and all(op == "ld.global.b64" for op in table), f"hinted table load: {table}"


@pytest.mark.parametrize("capability", [90, 80])
def test_next_items_table_rows_load_before_this_items_stores(capability: int) -> None:
    _, ptx = compiled(capability)
    table_loads, problems = two_items_in_flight(ptx)
    assert not problems, problems
    assert table_loads >= TABLE_ROW_LOADS, (
        f"{table_loads} table loads between the 16-byte loads and stores, expected "
        f"{TABLE_ROW_LOADS} (the next item's pair and tile rows)"
    )


def loop_ptx(between: str) -> str:
    """A hand-written item loop: a 16-byte load, ``between``, a 16-byte store, back edge."""
    return f"""
$L__BB0_2:
	add.s64 	%rd10, %rd1, %rd2;
	ld.global.v4.b32 {{ %r1, %r2, %r3, %r4 }}, [ %rd10 + 0 ];
{between}
	st.global.v4.b32 [ %rd11 + 0 ], {{ %r1, %r2, %r3, %r4 }};
	@%p1 bra 	$L__BB0_2;
"""


def test_in_flight_judge_on_hand_written_loops() -> None:
    rows = "\n".join(f"\tld.global.b64 {{ %rd{20 + k} }}, [ %rd3 + {8 * k} ];" for k in range(8))
    # The next item's rows, the store addressed from this item's registers: accepted.
    assert two_items_in_flight(loop_ptx(rows + "\n\tadd.s64 %rd11, %rd1, %rd4;")) == (8, [])
    # The store address computed from the rows just loaded: they are this item's rows.
    count, problems = two_items_in_flight(loop_ptx(rows + "\n\tadd.s64 %rd11, %rd20, %rd4;"))
    assert count == 8 and problems and "depends on a table load" in problems[0]
    # No rows between the data load and store (the one-item-in-flight kernel).
    assert two_items_in_flight(loop_ptx("\tadd.s64 %rd11, %rd1, %rd4;")) == (0, [])
    # Straight-line code, no back edge.
    straight = loop_ptx(rows + "\n\tadd.s64 %rd11, %rd1, %rd4;").replace("@%p1 bra", "// ")
    assert two_items_in_flight(straight)[1] == ["the 16-byte path is not inside a loop"]


@pytest.mark.parametrize("capability", [90, 80])
def test_no_spills_no_shared_memory_shuffle(capability: int) -> None:
    info, ptx = compiled(capability)
    assert not LOCAL_MEMORY.search(ptx), "local memory (spills) in the PTX"
    # A copy needs no shared memory: a barrier means a layout shuffle between a load and
    # its store (load and store given different per-thread widths).
    assert "bar.sync" not in ptx, "shared-memory shuffle between load and store"
    assert info["spill_bytes"] == 0
    assert info["has_cubin"]
    assert isinstance(info["registers"], int) and info["registers"] > 0


@pytest.mark.parametrize("variant", ["keyed", "keyed-read-only"])
@pytest.mark.parametrize("capability", [90, 80])
def test_keyed_variants_compile_with_hinted_data_and_cached_weights(
    capability: int, variant: str
) -> None:
    info, ptx = compiled(capability, variant)
    print(
        f"triton {info['triton']} sm_{capability} {variant}: {info['registers']} registers, "
        f"{info['spill_bytes']} spill bytes"
    )
    assert info["has_cubin"]
    assert info["spill_bytes"] == 0 and not LOCAL_MEMORY.search(ptx), "spills"
    code = instructions(ptx)
    policies = set(re.findall(r"createpolicy\.fractional\.L2::evict_first\.b64\s+(%rd\d+)", ptx))
    data = [(op, ops) for _, op, ops in code if is_data_access(op)]
    assert data
    for op, ops in data:
        assert "L1::evict_first" in op and "L2::cache_hint" in op, f"unhinted data access {op}"
        assert ops[-1] in policies, f"{op} uses cache policy {ops[-1]}, not an evict-first one"
    stores = [op for op, _ in data if op.startswith("st.global")]
    assert bool(stores) == (variant == "keyed"), f"{variant}: stores {stores}"
    # 64-bit loads: the table words, the pair's page and the weights, all unhinted. Each
    # thread weighs its 16 words of a full 16-byte-path tile (8 KiB over 128 threads) with
    # one 64-bit weight each, beyond the plain kernel's table loads.
    wide = [op for _, op, _ in code if op.startswith("ld.global") and op.endswith(".b64")]
    assert all("evict" not in op and "cache_hint" not in op for op in wide), wide
    _, plain = compiled(capability)
    plain_wide = [
        op for _, op, _ in instructions(plain) if op.startswith("ld.global") and op.endswith(".b64")
    ]
    assert len(wide) >= len(plain_wide) + 16, (len(wide), len(plain_wide))
    # The item's sum: one relaxed 64-bit add (``red`` when its result is unused).
    atomics = [op for _, op, _ in code if op.startswith(("atom.global", "red.global"))]
    assert atomics and all(".add.u64" in op for op in atomics), atomics


if __name__ == "__main__":
    variant = sys.argv[3] if len(sys.argv) > 3 else "plain"
    print(json.dumps(compile_kernel(int(sys.argv[1]), sys.argv[2], variant)))
