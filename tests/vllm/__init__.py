"""Tests of triton_offload/vllm: test_<module>.py for each module."""
