"""The launch-grid sweep's test case, checked interpreted (``tests/bench/test_grid_sweep.py``)
and compiled (``tests/kernels/test_copy_blocks_cuda.py``)."""

from __future__ import annotations

from triton_offload.bench import cases

# Pages over 16 KiB: more than one tile at every size the sweep offers. The attention
# pages are 16-byte multiples (the 16-byte path, where a launch at the wrong tile size
# drops bytes); the Mamba pages are odd (the narrow paths and the byte tail).
PAGE = 20 * 1024 + 48
ODD_PAGE = 20 * 1024 + 13
CASE = cases.Case(
    name="grid-check",
    description="one group, K/V pages over every tile size",
    groups=(
        cases.GroupShape("attention", "full_attention", 16, 1, (PAGE, PAGE), blocks_per_job=2),
        cases.GroupShape(
            "mamba", "mamba", 16, 1, (300, ODD_PAGE), blocks_per_job=1, mamba_cache_mode="align"
        ),
    ),
)
