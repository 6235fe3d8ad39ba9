"""Tests of triton_offload/planner: test_<module>.py for each module."""
