"""Benchmarks run by `dsv4 bench …`: side-by-side tables with ratios, never timed assertions."""
