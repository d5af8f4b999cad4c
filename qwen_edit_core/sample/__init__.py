"""Sampling: flow-matching maths shared with training, and the true-CFG sampler."""
