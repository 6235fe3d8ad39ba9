"""Behavioural suites across the layers (faults, interrupts, real engine and tiers, docs)."""
