"""CUDA caches with an interpreted kernel module are refused before anything launches:
the interpreter would dereference device addresses on the host."""

from __future__ import annotations

import pytest

from triton_offload.transfer.copiers import load_kernels


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_cuda_caches_need_the_compiled_kernel(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from triton_offload.kernels import copy_blocks

    monkeypatch.setattr(copy_blocks, "_INTERPRETED", True)
    with pytest.raises(ValueError, match=f"backend '{backend}' on CUDA caches needs the compiled"):
        load_kernels(backend, cuda=True)
    monkeypatch.setattr(copy_blocks, "_INTERPRETED", False)
    assert load_kernels(backend, cuda=True) is copy_blocks
