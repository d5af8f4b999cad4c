"""Selective gradient checkpointing: which blocks recompute their activations in the backward pass."""

from __future__ import annotations

from torch.utils.checkpoint import checkpoint

def checkpointed_indices(n_blocks: int, n_checkpointed: int) -> list[int]:
    """Which blocks recompute their activations: the first `n_checkpointed` (their saved activations would
    live longest), or all when n_checkpointed < 0."""
    if n_checkpointed < 0 or n_checkpointed >= n_blocks:
        return list(range(n_blocks))
    return list(range(n_checkpointed))


def checkpoint_blocks(transformer, n_checkpointed: int) -> list[int]:
    """Recompute only `n_checkpointed` blocks (-1: all; 0: none) in the backward pass.

    Uses diffusers' own hook (`enable_gradient_checkpointing(gradient_checkpointing_func=...)`): the
    function is called for every block and runs it either under `torch.utils.checkpoint` or directly.
    """
    blocks = list(transformer.transformer_blocks)
    chosen = {id(blocks[i]) for i in checkpointed_indices(len(blocks), n_checkpointed)}

    def run_block(block, *args):
        if id(block) in chosen:
            return checkpoint(block.__call__, *args, use_reentrant=False)
        return block(*args)

    transformer.enable_gradient_checkpointing(gradient_checkpointing_func=run_block)
    return sorted(i for i, b in enumerate(blocks) if id(b) in chosen)
