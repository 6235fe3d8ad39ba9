"""Triton kernels and their thin launchers (installed as ``triton_offload.kernels``).

Nothing here imports the planner: data flows plan -> job spec -> launch tables -> kernel.
"""
