"""Benchmarks: each prints its figures and the ratio to an anchor measured in the same run."""
