"""Benchmarks run by `qwen-edit bench ...`: each prints our number beside a reference run in the same process."""
