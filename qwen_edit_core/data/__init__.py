"""Training data: folders of pairs (discovery, validation, buckets), one example's tensors, the on-disk cache."""
