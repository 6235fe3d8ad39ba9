"""The faults ``triton-offload verify --inject`` can plant (testing aids; see
``triton_offload.verify.serving``). Kept free of torch so the command's flags are parsed,
and a typo refused, before anything heavy is imported."""

from __future__ import annotations

INJECTIONS = (
    "mamba-span-dcp",
    "no-mamba-round-down",
    "wrong-slot",
    "vllm-lookup",
    "no-seal-check",
)

__all__ = ["INJECTIONS"]
