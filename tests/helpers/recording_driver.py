"""A recording stand-in for CUDA's ``cuMemcpyBatchAsync``, moving host bytes.

It reads the descriptor arrays through the pointers the binding passes, so what a test
checks is exactly what a driver would receive (``tests/transfer/test_batch_copy.py``,
``tests/vllm/test_canonical.py``).
"""

from __future__ import annotations

import ctypes
from typing import Any

from triton_offload.transfer import batch_copy


class RecordingDriver:
    """cuMemcpyBatchAsync's nine arguments in, host memmoves out; every call recorded."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail_at = fail_at

    def __call__(
        self, dsts, srcs, sizes, count, attrs, attrs_idx, num_attrs, fail_idx, stream
    ) -> int:
        def array(pointer: int) -> list[int]:
            return list((ctypes.c_uint64 * count).from_address(pointer))

        attributes = batch_copy.MemcpyAttributes.from_address(attrs)
        call = {
            "dsts": array(dsts),
            "srcs": array(srcs),
            "sizes": array(sizes),
            "count": count,
            "order": attributes.srcAccessOrder,
            "attr_index": ctypes.c_size_t.from_address(attrs_idx).value,
            "num_attrs": num_attrs,
            "stream": stream,
        }
        self.calls.append(call)
        if self.fail_at is not None:
            ctypes.c_size_t.from_address(fail_idx).value = self.fail_at
            return 1  # CUDA_ERROR_INVALID_VALUE
        for dst, src, size in zip(call["dsts"], call["srcs"], call["sizes"], strict=True):
            ctypes.memmove(dst, src, size)
        return 0
