"""Registers, spills and shared memory of the copy kernel as compiled on this device.

One compile per tile size the grid sweep tries (``grid_sweep.TILE_SIZES``): the kernel's
register count sets how many programs an SM holds beside the forward pass
(``MAX_PROGRAMS_PER_SM`` assumes ~72 registers per thread), and a spill would put
every tile through local memory. Read from Triton's compiled kernel once loaded on the
device (``n_regs``, ``n_spills``), and from ``cuobjdump -res-usage`` of its cubin where
a ``cuobjdump`` is found (on the PATH, or the one Triton ships).

    python -m triton_offload.bench.kernel_resources --out DIR

Writes ``kernel-resources.txt`` (and the cubins) into DIR. Without CUDA nothing is
compiled for a device and the file says so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


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
        before = _compiled(kernel)
        copy_blocks.warm_up(device, tile)
        torch.cuda.synchronize(device)
        fresh = [k for key, k in _compiled(kernel).items() if key not in before]
        if not fresh:
            lines.append(f"tile {tile} B: no new compile (already in the cache this run)")
            continue
        for compiled in fresh:
            if hasattr(compiled, "_init_handles"):
                compiled._init_handles()  # loads the module: n_regs / n_spills are set then
            metadata = compiled.metadata
            lines.append(
                f"tile {tile} B: n_regs {getattr(compiled, 'n_regs', '?')} "
                f"n_spills {getattr(compiled, 'n_spills', '?')} "
                f"shared {getattr(metadata, 'shared', '?')} B "
                f"num_warps {getattr(metadata, 'num_warps', '?')}"
            )
            cubin = compiled.asm.get("cubin") if hasattr(compiled, "asm") else None
            if isinstance(cubin, bytes):
                path = out / f"copy_blocks_tile{tile}.cubin"
                lines += _resource_usage(cubin, path, tool)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from triton_offload.bench.grid_sweep import TILE_SIZES

    args.out.mkdir(parents=True, exist_ok=True)
    lines = report(args.out, TILE_SIZES)
    (args.out / "kernel-resources.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
