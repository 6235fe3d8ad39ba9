"""Tests of kernels/ (triton_offload.kernels): test_<module>.py for each module."""
