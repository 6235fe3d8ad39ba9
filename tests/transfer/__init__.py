"""Tests of triton_offload/transfer: test_<module>.py for each module."""
