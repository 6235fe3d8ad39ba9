"""CUDA caches with an interpreted kernel module are refused before anything launches:
the interpreter would dereference device addresses on the host."""

from __future__ import annotations

import pytest

from triton_offload.engine import TransferEngine


@pytest.mark.parametrize(("backend", "refused"), [("triton", True), ("auto", True), ("dma", False)])
def test_cuda_caches_need_the_compiled_kernel(
    backend: str, refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from triton_offload.kernels import copy_blocks

    monkeypatch.setattr(copy_blocks, "_INTERPRETED", True)
    engine = object.__new__(TransferEngine)
    engine.cuda = True
    if refused:
        with pytest.raises(
            ValueError, match=f"backend '{backend}' on CUDA caches needs the compiled"
        ):
            engine._import_kernels(backend)
    else:
        assert engine._import_kernels(backend) is copy_blocks
    monkeypatch.setattr(copy_blocks, "_INTERPRETED", False)
    assert engine._import_kernels(backend) is copy_blocks
