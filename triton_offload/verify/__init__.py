"""End-to-end check: a cold prefill and an offload hit must give identical tokens and logits.

``model`` holds a tiny deterministic hybrid model (attention, sliding-window attention,
Mamba-style layers) over a paged cache with simulated DCP; ``serving`` drives it with the
library's public pieces (``plan_offload``, ``HostBlockManager``, ``TransferEngine``);
``command`` is ``triton-offload verify``.
"""
