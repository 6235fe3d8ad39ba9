"""The test suite: one folder per package layer, tests/system for behavioural suites."""
