"""One compiled copy kernel for every job: no argument is specialized on its value.

Triton keys its kernel cache on each argument's type and, unless told otherwise, on a
tensor's 16-byte alignment and an int's ``== 1`` / divisibility by 16; an unannotated
int is i32 below 2**31 and i64 above. A job's pair table is often a slice (``pairs[3n:]``
is 16-byte aligned only for even n), so a specialized kernel recompiles (~1 s) the first
time a job of the other kind arrives, mid-serving.

The CPU test asks Triton's own argument binder (what ``kernel[grid](...)`` runs before
looking up its cache) for the specialization of jobs that differ in every such way, and
of the empty job ``warm_up`` launches. It runs in a subprocess with TRITON_INTERPRET=0:
the interpreter has no binder. The CUDA test counts the compiled kernels in the real
cache. The keyed page-sum variants are checked the same way: page sums, pair pages and
weights tables at any alignment bind as ``warm_up(checksum=True, keyed=True)`` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from triton_offload.kernels import copy_blocks


def job_arguments(device: torch.device) -> dict[str, tuple[object, ...]]:
    """Kernel arguments of jobs that differ in table alignment and scalar values.

    Every group is empty (zero offsets and tiles per pair), so on a GPU no byte moves
    whatever the other arguments say; the tables are long enough for 16 groups.
    """
    tiles = torch.zeros((4, 5), dtype=torch.int64, device=device)
    groups = torch.zeros((18, 2), dtype=torch.int64, device=device)
    pair_rows = torch.zeros((8, 3), dtype=torch.int64, device=device)
    offsets = torch.zeros(24, dtype=torch.int64, device=device)
    base = (tiles, groups, pair_rows, offsets[:17], 0x7F12_3456_7000, 4096, 2, 0)
    jobs: dict[str, tuple[object, ...]] = {"even slices": base}
    for n in (1, 2, 3):
        # Row n of the pair table starts 24n bytes in, entry n of the offsets 8n bytes in.
        jobs[f"pairs[{n}:], offsets[{n}:]"] = (
            tiles,
            groups,
            pair_rows[n:],
            offsets[n : n + 17],
            *base[4:],
        )
    jobs["sliced static tables"] = (tiles[1:], groups[1:], *base[2:])
    for name, index, value in [
        ("pool address 16", 4, 16),
        ("odd pool address", 4, 0x7F12_3456_7001),
        ("pool row of 1 byte", 5, 1),
        ("pool row of 32 bytes", 5, 32),
        ("pool row over 2 GiB", 5, 3 << 30),
        ("one group", 6, 1),
        ("16 groups", 6, 16),
        ("load direction", 7, 1),
    ]:
        jobs[name] = (*base[:index], value, *base[index + 1 :])
    jobs["warm_up's empty job"] = copy_blocks._empty_job(device)
    return jobs


def specializations() -> dict[str, str]:
    """Each job's specialization, as the binder of the compiled (not interpreted) kernel
    computes it for an sm_90 target."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = copy_blocks._copy_blocks_kernel
    assert isinstance(kernel, JITFunction), "interpreted"
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    found = {}
    for name, arguments in job_arguments(torch.device("cpu")).items():
        _, specialization, options = binder(
            *arguments, **copy_blocks._launch_options(copy_blocks.TILE_BYTES)
        )
        found[name] = json.dumps([list(spec) for spec in specialization] + [options])
    return found


def keyed_arguments(device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """The page-sum pointers of keyed launches: ``warm_up``'s one-word tensors, and slices
    of longer tables at every 8-byte alignment mod 32."""
    words = torch.zeros(64, dtype=torch.int64, device=device)
    found = {
        "warm_up's words": dict.fromkeys(
            ("page_sums_ptr", "pair_pages_ptr", "page_weights_ptr"),
            torch.zeros(1, dtype=torch.int64, device=device),
        )
    }
    for n in (0, 1, 2, 3):
        found[f"tables[{n}:]"] = {
            "page_sums_ptr": words[n:],
            "pair_pages_ptr": words[n + 1 :],
            "page_weights_ptr": words[n + 2 :],
        }
    return found


def keyed_specializations() -> dict[str, str]:
    """The specialization of every job of :func:`job_arguments` with every pointer set of
    :func:`keyed_arguments`, copying and read-only, for an sm_90 target."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = copy_blocks._copy_blocks_kernel
    assert isinstance(kernel, JITFunction), "interpreted"
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    found = {}
    cpu = torch.device("cpu")
    for name, arguments in job_arguments(cpu).items():
        for pointers_name, pointers in keyed_arguments(cpu).items():
            for write in (True, False):
                options = copy_blocks._launch_options(
                    copy_blocks.TILE_BYTES, checksum=True, write=write, keyed=True
                )
                _, specialization, bound = binder(*arguments, **pointers, **options)
                spec = json.dumps([list(item) for item in specialization] + [bound])
                found[f"{name}, {pointers_name}, write={write}"] = spec
    return found


def run_binder(which: str) -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run(
        [sys.executable, __file__, which],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found: dict[str, str] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


def test_every_job_binds_to_one_specialization() -> None:
    found = run_binder("plain")
    distinct = sorted(set(found.values()))
    assert len(distinct) == 1, "\n".join(
        f"{name}: {spec}" for name, spec in found.items() if spec != found["even slices"]
    )
    specialization = json.loads(distinct[0])[:-1]
    # No alignment or value attribute on any runtime argument, and fixed int types.
    assert [spec[0] for spec in specialization[:8]] == ["*i64"] * 4 + ["i64", "i64", "i32", "i32"]
    assert all(spec[1] in (None, "") for spec in specialization[:8]), specialization


def test_every_keyed_job_binds_as_warm_up_does() -> None:
    found = run_binder("keyed")
    for write in (True, False):
        specs = {name: spec for name, spec in found.items() if name.endswith(f"={write}")}
        warm = specs[f"warm_up's empty job, warm_up's words, write={write}"]
        assert all(spec == warm for spec in specs.values()), "\n".join(
            f"{name}: {spec}" for name, spec in specs.items() if spec != warm
        )
        # The page-sum pointers: int64 pointers with no alignment attribute.
        names = copy_blocks._copy_blocks_kernel.arg_names
        bound = json.loads(warm)
        for pointer in ("page_sums_ptr", "pair_pages_ptr", "page_weights_ptr"):
            assert bound[names.index(pointer)] in (["*i64", None], ["*i64", ""]), bound


def test_warm_up_does_nothing_without_cuda() -> None:
    # CPU jobs run under the interpreter (nothing to compile) or not at all.
    copy_blocks.warm_up("cpu")
    copy_blocks.warm_up(torch.device("cpu"))


@pytest.mark.cuda
def test_warm_up_compiles_the_kernel_every_job_uses() -> None:
    kernel = copy_blocks._copy_blocks_kernel
    copy_blocks.warm_up(torch.device("cuda"))
    torch.cuda.synchronize()
    cache = kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(cache)
    assert compiled >= 1
    # Launch each job of the CPU test on the GPU: none may add a compiled kernel.
    for arguments in job_arguments(torch.device("cuda")).values():
        kernel[(1,)](*arguments, **copy_blocks._launch_options(copy_blocks.TILE_BYTES))
    torch.cuda.synchronize()
    assert len(cache) == compiled


@pytest.mark.cuda
def test_keyed_warm_up_compiles_the_keyed_variants_every_job_uses() -> None:
    kernel = copy_blocks._copy_blocks_kernel
    device = torch.device("cuda")
    copy_blocks.warm_up(device, checksum=True, keyed=True)
    torch.cuda.synchronize()
    cache = kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(cache)
    assert compiled >= 3  # the plain copy, the keyed copy, the keyed read-only pass
    for arguments in job_arguments(device).values():
        for pointers in keyed_arguments(device).values():
            for write in (True, False):
                options = copy_blocks._launch_options(
                    copy_blocks.TILE_BYTES, checksum=True, write=write, keyed=True
                )
                kernel[(1,)](*arguments, **pointers, **options)
    torch.cuda.synchronize()
    assert len(cache) == compiled


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "plain"
    print(json.dumps(specializations() if which == "plain" else keyed_specializations()))
