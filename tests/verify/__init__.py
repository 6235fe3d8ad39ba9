"""Tests of triton_offload/verify: test_<module>.py for each module."""
