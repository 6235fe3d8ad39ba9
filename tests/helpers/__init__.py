"""Shared set-up the tests import (judges, harnesses, builders); never a test module."""
