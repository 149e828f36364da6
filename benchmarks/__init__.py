"""Benchmarks: torch beside aelastic on the same machine, in the same run."""
