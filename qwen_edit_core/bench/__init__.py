"""Benchmarks (`qwen-edit bench ...`): each prints our variants against a reference run in the same process."""
