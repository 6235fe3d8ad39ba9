"""Tests of triton_offload/cli: test_<module>.py for each module."""
