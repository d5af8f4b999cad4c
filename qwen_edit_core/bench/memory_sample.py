"""`qwen-edit bench memory --sample`: sampling simulated as bench.memory simulates training, on a card of a given
size, for a family whose sampler plans memory of its own (Qwen-Image-2.1's prefix K/V cache: its family's
`sample_memory` stage); the 2025 variants' sampling levers are bench.memory's `simulate_sample`.

The sampler's budget on a card is the one it takes by itself on CUDA: 90% of the free memory plus the weights
(`speed.free_memory_budget_gb`, the CUDA context not free). The row's `budget_gib` is the card; its planner estimate
is the cache plan's step peak; `peak_host_gib` is the host memory the cache takes as torch's host allocator pins it.
"""

from __future__ import annotations

import dataclasses
import logging

from qwen_edit_core.bench import fake_model as fm
from qwen_edit_core.bench import memory
from qwen_edit_core.families import variants

log = logging.getLogger(__name__)

#: the cards the rows are simulated on by default (GiB)
CARDS = (24, 48)


def sampler_budget_gb(card_gib: float) -> float:
    """The sampler's own budget on an empty card of `card_gib` GiB holding the transformer: 90% of its free memory
    plus the weights there; the CUDA context (speed.planner.MARGIN_FIXED) is not free."""
    from qwen_edit_core.speed import planner
    return planner.free_memory_budget_gb(int(card_gib * memory.GIB) - planner.MARGIN_FIXED, 0)


def simulate_cached_sample(variant: str, side: int = 1024, controls: int | None = None, card_gib: float = 24.0, *,
                           num_layers: int | None = None) -> memory.Simulated:
    """Two CFG steps of `variant`'s sampler (the first fills its cache, the second reads it) on a `card_gib` card."""
    family = variants.get(variant).family
    try:
        stage = family.stage("sample_memory")
    except NotImplementedError:
        raise ValueError(f"bench memory --sample --variant {variant}: its family samples without a cache to plan; "
                         "its sampling levers are in `qwen-edit bench memory` without --sample") from None
    controls = fm.default_controls(variant) if controls is None else controls
    mode = fm.fake_mode(variant)
    model = fm.fake_transformer(variant, mode, lora=memory.lora_spec("attn", variant), num_layers=num_layers)
    tracker, flops = fm.Tracker(), fm.GlobalFlops()
    tracker.track_external(model)
    plan, host = stage.simulate(model, mode, tracker, flops, side=side, references=controls,
                                       budget_gb=sampler_budget_gb(card_gib))
    result = memory._result(f"sample, {card_gib:g} GiB card", "sample", variant, side, controls,
                            (1 + controls) * (side // 16) ** 2, fm.text_tokens(variant, side, controls), card_gib,
                            plan.peak_bytes / memory.GIB, tracker, flops, model, None)
    levers = (f"prefix cache {plan.place} ({plan.bytes / memory.GIB:.1f} GiB bf16, "
              f"{' + '.join(map(str, plan.tokens))} tokens)")
    return dataclasses.replace(result, peak_host_gib=host / memory.GIB, levers=levers)


def plans_its_cache(variant: str) -> bool:
    """Whether `variant`'s family has a sampler cache to plan (a `sample_memory` stage)."""
    try:
        variants.get(variant).family.stage("sample_memory")
    except NotImplementedError:
        return False
    return True


def report(variant: str, side: int = 1024, controls: int | None = None, card_gib: float | None = None, *,
           as_json: bool = False) -> str:
    """`qwen-edit bench memory --sample`'s output: one row per card (`CARDS`, or `card_gib`) for a family whose
    sampler plans a cache; for the others, bench.memory's sampling levers. Each row is announced on stderr (the
    log) before its minutes of CPU."""
    results = []
    if plans_its_cache(variant):
        cards = CARDS if card_gib is None else (card_gib,)
        for i, card in enumerate(cards, 1):
            log.info("bench memory --sample: row %d/%d: %s %d px, %s references, %g GiB card", i, len(cards),
                     variant, side, controls if controls is not None else fm.default_controls(variant), card)
            results.append(simulate_cached_sample(variant, side, controls, card))
    else:
        for i, lever in enumerate(memory.SAMPLE_LEVERS, 1):
            log.info("bench memory --sample: row %d/%d: sampling lever %s", i, len(memory.SAMPLE_LEVERS), lever)
            results.append(memory.simulate_sample(variant, side, controls, lever))
    return memory.render(results, as_json)
