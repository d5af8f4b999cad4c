"""Regional compile: each transformer block compiled on its own."""

from __future__ import annotations

from typing import Sequence

def compile_blocks(transformer, skip: Sequence[int] = (), mode: str | None = None) -> int:
    """Compile each transformer block (not the whole model: 60 identical blocks compile once, ~30 s).

    `skip`: block indices left eager (offloaded blocks, whose forward hooks move weights). Returns the count.
    """
    skipped = set(skip)
    count = 0
    for i, block in enumerate(transformer.transformer_blocks):
        if i not in skipped:
            block.compile(fullgraph=True, dynamic=False, mode=mode)
            count += 1
    return count
