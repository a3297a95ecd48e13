"""A training script that always fails at start (for the tests of jobs that cannot go on)."""

raise RuntimeError("this script always fails")
