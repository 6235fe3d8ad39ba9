"""Registers, spills and shared memory of the copy kernel as compiled on this device.

One compile per tile size the grid sweep tries (``grid_sweep.TILE_SIZES``) and kernel
variant (``VARIANTS``: the plain copy, the copy with page checksums, and the read-only
checksum pass): the kernel's register count sets how many programs an SM holds beside
the forward pass (``MAX_PROGRAMS_PER_SM`` assumes ~72 registers per thread), and a
spill would put every tile through local memory. Read from Triton's compiled kernel
once loaded on the device (``n_regs``, ``n_spills``), and from ``cuobjdump -res-usage``
of its cubin where a ``cuobjdump`` is found (on the PATH, or the one Triton ships).

    python -m triton_offload.bench.kernel_resources --out DIR

Writes ``kernel-resources.txt`` (and the cubins) into DIR. Without CUDA nothing is
compiled for a device and the file says so.

    python -m triton_offload.bench.kernel_resources --out DIR --target sm_90 [--module F]

needs no GPU: compiles ahead of time for that architecture (``triton.compile`` with a
``GPUTarget``, as tests/kernels/test_copy_blocks_ptx.py does) and reads the counts from ``ptxas -v``
(Triton's bundled ptxas); the PTX files land in DIR. ``--module`` compiles the kernel of
another copy of ``kernels/copy_blocks.py`` (e.g. ``git show HEAD:kernels/copy_blocks.py
> /tmp/old.py``) to compare before and after a change; variants that copy lacks are
skipped. Run without ``TRITON_INTERPRET=1`` (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

#: (name, launch_copy's checksum options): the kernels a serving process may compile
#: (``warm_up(..., checksum=True)`` compiles all three).
VARIANTS: tuple[tuple[str, dict[str, bool]], ...] = (
    ("plain", {}),
    ("checksum", {"checksum": True, "write": True}),
    ("checksum read-only", {"checksum": True, "write": False}),
)


def _supports(module: ModuleType, options: dict[str, bool]) -> bool:
    """Whether the module's kernel has the variant (a copy from before the checksum has
    only the plain one)."""
    return not options or "CHECKSUM" in module._copy_blocks_kernel.arg_names


def _variant_launch(
    module: ModuleType, device: torch.device, tile: int, options: dict[str, bool]
) -> tuple[tuple[object, ...], dict[str, object]]:
    """Arguments and keyword arguments of the empty job ``warm_up`` launches, for the
    variant ``options``: the kernel every job of that variant binds to."""
    kwargs: dict[str, object] = dict(module._launch_options(tile, **options))
    if options:
        words = torch.zeros(1, dtype=torch.int64, device=device)
        kwargs.update(page_sums_ptr=words, pair_pages_ptr=words)
    return module._empty_job(device), kwargs


def _compiled(kernel: Any) -> dict[int, Any]:
    """``id -> compiled kernel`` of every variant in the JIT function's device caches.

    Each cache entry is a tuple whose first item maps specialization keys to compiled
    kernels (Triton 3.4 to 3.9).
    """
    found: dict[int, Any] = {}
    for entry in kernel.device_caches.values():
        for compiled in entry[0].values():
            found[id(compiled)] = compiled
    return found


def find_cuobjdump() -> str | None:
    """A ``cuobjdump`` on the PATH, else the one in Triton's NVIDIA backend, else None."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.is_file() and os.access(bundled, os.X_OK) else None


def _resource_usage(cubin: bytes, path: Path, tool: str | None) -> list[str]:
    path.write_bytes(cubin)
    if tool is None:
        return ["  cuobjdump: not found (neither on the PATH nor in Triton's backend)"]
    try:
        done = subprocess.run(
            [tool, "-res-usage", str(path)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return [f"  cuobjdump -res-usage failed: {error}"]
    lines = (done.stdout + done.stderr).strip().splitlines()
    return [f"  cuobjdump: {line.strip()}" for line in lines if line.strip()]


def report(out: Path, tiles: tuple[int, ...]) -> list[str]:
    """One block of lines per tile size; the cubins are written into ``out``."""
    if not torch.cuda.is_available():
        return ["not compiled: no CUDA device here (the counts are read on the device)"]
    from triton_offload.kernels import copy_blocks

    if copy_blocks._INTERPRETED:
        return ["not compiled: TRITON_INTERPRET=1 was set when the kernels were imported"]
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    tool = find_cuobjdump()
    lines = [f"device {props.name} sm_{props.major}{props.minor}; cuobjdump {tool or 'none'}"]
    kernel = copy_blocks._copy_blocks_kernel
    for tile in tiles:
        for name, options in VARIANTS:
            label = f"tile {tile} B {name}"
            before = _compiled(kernel)
            args, kwargs = _variant_launch(copy_blocks, device, tile, options)
            with torch.cuda.device(device):
                kernel[(1,)](*args, **kwargs)
            torch.cuda.synchronize(device)
            fresh = [k for key, k in _compiled(kernel).items() if key not in before]
            if not fresh:
                lines.append(f"{label}: no new compile (already in the cache this run)")
                continue
            for compiled in fresh:
                if hasattr(compiled, "_init_handles"):
                    compiled._init_handles()  # loads the module: n_regs / n_spills set then
                metadata = compiled.metadata
                lines.append(
                    f"{label}: n_regs {getattr(compiled, 'n_regs', '?')} "
                    f"n_spills {getattr(compiled, 'n_spills', '?')} "
                    f"shared {getattr(metadata, 'shared', '?')} B "
                    f"num_warps {getattr(metadata, 'num_warps', '?')}"
                )
                cubin = compiled.asm.get("cubin") if hasattr(compiled, "asm") else None
                if isinstance(cubin, bytes):
                    slug = name.replace(" ", "-")
                    path = out / f"copy_blocks_tile{tile}_{slug}.cubin"
                    lines += _resource_usage(cubin, path, tool)
    # warm_up must have compiled what jobs run: after it, no variant compiles again.
    before = _compiled(kernel)
    for tile in tiles:
        copy_blocks.warm_up(device, tile, checksum=True)
    torch.cuda.synchronize(device)
    extra = len(_compiled(kernel)) - len(before)
    lines.append(f"warm_up(checksum=True) after the variants: {extra} new compile(s) (want 0)")
    return lines


def load_module(path: Path | None) -> ModuleType:
    """The package's copy_blocks, or the copy of it at ``path`` (a separate module)."""
    if path is None:
        from triton_offload.kernels import copy_blocks

        return copy_blocks
    spec = importlib.util.spec_from_file_location(f"_copy_blocks_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and Triton look modules up by name
    spec.loader.exec_module(module)
    return module


def compile_ahead(
    module: ModuleType, capability: int, tile: int, options: dict[str, bool], ptx_path: Path
) -> dict[str, Any]:
    """Compile one variant for ``sm_<capability>`` without a GPU; ptxas's counts.

    The argument types and attributes come from Triton's own binder run on the
    arguments ``warm_up`` launches (as in tests/kernels/test_copy_blocks_ptx.py), so this is the
    kernel a job runs. Returns registers, spill bytes (stores + loads), shared bytes and
    the ``ptxas -v`` text.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = module._copy_blocks_kernel
    assert isinstance(kernel, triton.runtime.JITFunction), "interpreted: unset TRITON_INTERPRET"
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    args, kwargs = _variant_launch(module, torch.device("cpu"), tile, options)
    _, specialization, compile_options = binder(*args, **kwargs)
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
    compiled = triton.compile(source, target=target, options=compile_options)
    ptx = compiled.asm["ptx"]
    ptx_path.write_text(ptx)
    arch = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE)
    assert arch is not None
    done = subprocess.run(
        [
            str(get_ptxas(capability).path),
            "-v",
            f"-arch={arch.group(1)}",
            str(ptx_path),
            "-o",
            os.devnull,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    registers = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", done.stderr)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": sum(int(n) for n in spills),
        # Triton's own count: its shared memory is dynamic, which ptxas -v does not report.
        "shared_bytes": getattr(compiled.metadata, "shared", None),
        "ptxas": " ".join(done.stderr.split()),
    }


def report_ahead(
    out: Path, tiles: tuple[int, ...], target: str, module_path: Path | None
) -> list[str]:
    """``--target sm_XY``: one line per tile size and variant, compiled without a GPU."""
    import triton

    match = re.fullmatch(r"sm_(\d+)", target)
    if match is None:
        raise SystemExit(f"--target {target!r}: expected sm_<capability>, e.g. sm_90")
    capability = int(match.group(1))
    module = load_module(module_path)
    if not isinstance(module._copy_blocks_kernel, triton.runtime.JITFunction):
        return ["not compiled: TRITON_INTERPRET=1 was set when the kernels were imported"]
    source = module_path or Path(module.__file__ or "copy_blocks.py")
    lines = [f"ahead of time for sm_{capability}, triton {triton.__version__}, {source}"]
    for tile in tiles:
        for name, options in VARIANTS:
            label = f"tile {tile} B {name}"
            if not _supports(module, options):
                lines.append(f"{label}: not in this kernel")
                continue
            ptx_path = out / f"copy_blocks_sm{capability}_tile{tile}_{name.replace(' ', '-')}.ptx"
            info = compile_ahead(module, capability, tile, options, ptx_path)
            lines.append(
                f"{label}: registers {info['registers']} spill bytes {info['spill_bytes']} "
                f"shared {info['shared_bytes']} B"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--target",
        help="compile ahead of time for this architecture (e.g. sm_90), no GPU needed",
    )
    parser.add_argument(
        "--module",
        type=Path,
        help="with --target: compile the kernel of this copy of kernels/copy_blocks.py",
    )
    args = parser.parse_args(argv)
    from triton_offload.bench.grid_sweep import TILE_SIZES

    if args.module is not None and args.target is None:
        parser.error("--module needs --target")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.target is not None:
        lines = report_ahead(args.out, TILE_SIZES, args.target, args.module)
    else:
        lines = report(args.out, TILE_SIZES)
    (args.out / "kernel-resources.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
