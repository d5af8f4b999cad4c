"""`qwen-edit bench sample`'s Qwen-Image-2.1 table: for CFG 1 and true CFG it times the denoising loop with the
prefix K/V cache (the default) and without, and prints the speed-up beside the cached result's distance to the
uncached one (fp32: equal up to rounding). The table's form is asserted, never a timing."""

from __future__ import annotations

import re

from qwen_edit_core.families.qwen_image_21 import sample_bench as sample21
from qwen_edit_core.families.qwen_image_21 import sampler as sampler21

from tolerances import TINY_FORWARD_ROUNDINGS, assert_close_fp32

STEPS = 2


def test_prints_the_prefix_cache_speed_up_with_equal_results(monkeypatch):
    finals, denoise = {}, sampler21.denoise

    def keep_final(components, cond, settings):  # the bench's last latent of each row
        finals[settings.true_cfg_scale, settings.kv_cache] = denoise(components, cond, settings)
        return finals[settings.true_cfg_scale, settings.kv_cache]

    monkeypatch.setattr(sampler21, "denoise", keep_final)
    table = sample21.run(steps=STEPS, repeats=1, side=128)
    lines = table.splitlines()
    assert "prefix K/V cache (default) vs none" in lines[0] and "speed-up" in lines[1]
    rows = [[cell.strip() for cell in line.split("|")] for line in lines[3:]]
    assert [(r[0], r[1]) for r in rows] == [("1.0", "off"), ("1.0", "on"), ("4.0", "off"), ("4.0", "on")]
    for cfg_row in rows[1::2]:
        off, on = finals[float(cfg_row[0]), False], finals[float(cfg_row[0]), True]
        assert re.fullmatch(r"\d+\.\d\d", cfg_row[4]) and float(cfg_row[4]) > 0  # the speed-up, printed
        assert cfg_row[5] == f"{(on - off).abs().max():.1e}"  # the printed distance is the latents'
        # the cache keeps the prefix's keys and values instead of recomputing them: the same sums, which the
        # attention over a shorter query reduces in another order, so the final latents (no VAE) differ by the
        # rounding of one transformer forward per step
        assert_close_fp32(on, off, ops=STEPS * TINY_FORWARD_ROUNDINGS, what=f"cached latent, cfg {cfg_row[0]}")


def test_a_variant_runs_only_its_familys_table_and_none_runs_every_familys(monkeypatch):
    from qwen_edit_core import cli
    from qwen_edit_core.bench import sample
    from qwen_edit_core.families.qwen_image import sample_bench as sample2025
    calls = []
    monkeypatch.setattr(sample21, "run", lambda **kw: calls.append(("2.1", kw)) or "")
    monkeypatch.setattr(sample2025, "run", lambda **kw: calls.append(("2025", kw)) or "")
    monkeypatch.setattr(sample, "run", lambda **kw: calls.append(("every", kw)) or "")
    cli.main(["bench", "sample", "--variant", "image-2.1", "--steps", "2", "--repeats", "1"])
    cli.main(["bench", "sample", "--variant", "edit", "--steps", "2"])  # the default family's, named: its table alone
    cli.main(["bench", "sample", "--steps", "2"])
    assert [c[0] for c in calls] == ["2.1", "2025", "every"]
    assert calls[0][1]["steps"] == 2 and calls[0][1]["repeats"] == 1
