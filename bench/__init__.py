"""Microbenchmark harness (installed as ``triton_offload.bench``) and pytest-benchmark suites."""
