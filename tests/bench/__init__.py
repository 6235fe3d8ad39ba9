"""Tests of bench/ (triton_offload.bench): test_<module>.py for each module."""
