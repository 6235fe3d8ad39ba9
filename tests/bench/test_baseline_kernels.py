"""The flat one-descriptor-per-page baseline kernel: byte-exact under the interpreter,
and it compiles for sm_90 (a GPU-only baseline must not first fail on the GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from triton_offload.bench.baseline_kernels import flat_copy, word_bytes_for


def _descriptors(
    src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]], page: int, shift: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    s = np.array([src.data_ptr() + shift + a * page for a, _ in pairs], dtype=np.int64)
    d = np.array([dst.data_ptr() + shift + b * page for _, b in pairs], dtype=np.int64)
    sizes = np.full(len(pairs), page - shift, dtype=np.int64)
    word = word_bytes_for(np.concatenate((s, d)), sizes)
    return torch.from_numpy(s), torch.from_numpy(d), torch.from_numpy(sizes), word


@pytest.mark.parametrize(
    ("page", "shift", "word"), [(4096, 0, 8), (1000, 0, 8), (1003, 0, 1), (4096, 3, 1)]
)
def test_flat_copy_is_byte_exact(page: int, shift: int, word: int) -> None:
    generator = torch.Generator().manual_seed(page + shift)
    src = torch.randint(0, 256, (9, page), dtype=torch.uint8, generator=generator)
    dst = torch.full((7, page), 0xA5, dtype=torch.uint8)
    source_before = src.clone()
    pairs = [(8, 0), (2, 5), (5, 3), (0, 6)]
    s, d, sizes, chosen = _descriptors(src, dst, pairs, page, shift)
    assert chosen == word
    flat_copy(s, d, sizes, word_bytes=chosen, max_page_bytes=page, num_programs=3)
    assert torch.equal(src, source_before)
    expected = torch.full_like(dst, 0xA5)
    for a, b in pairs:
        expected[b, shift:] = src[a, shift:]
    assert torch.equal(dst, expected)


def test_flat_copy_rejects_a_bad_word_size() -> None:
    empty = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="word_bytes 4"):
        flat_copy(empty, empty, empty, word_bytes=4, max_page_bytes=8)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton_offload.bench import baseline_kernels as bk
for word in (8, 1):
    source = triton.compiler.ASTSource(
        fn=bk._flat_copy_kernel,
        signature={"src_addresses": "*i64", "dst_addresses": "*i64", "sizes": "*i64",
                   "num_descriptors": "i32", "WORD_BYTES": "constexpr",
                   "CHUNK_WORDS": "constexpr"},
        constexprs={"WORD_BYTES": word, "CHUNK_WORDS": bk.FLAT_CHUNK_BYTES // word},
    )
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert ("ld.global.b64" if word == 8 else "ld.global.b8") in ptx, word
print("ok")
"""


def test_flat_kernel_compiles_for_sm90() -> None:
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
