"""The memory planner's promise, checked at real size on the CPU (bench/memory.py: the real 60-block
transformer, real token counts, the product's levers, LoRA and AdamW under FakeTensorMode). In the default
suite: the 16 GiB plan at 1024^2 Edit holds at most 16 GiB on the device, margin included, and the planner's
estimate is within 15% of it. Marked simulation (`make test-simulation`; one to fifteen minutes of CPU per plan): every budget (16, 24, 40, 80 GiB) for
Edit and Edit Plus with two controls, 512^2, 1536^2 and Edit-2511, the reference's measured setting, the
sampling levers and Qwen-Image-2.1 with 1, 3 and 10 references."""

from __future__ import annotations

import json

import pytest
import torch

from qwen_edit_core.bench import memory


@pytest.fixture(scope="module")
def plan_16():
    return memory.simulate_train("edit", 1024, budget_gb=16)


def test_16_gib_plan_fits_16_gib_at_real_size(plan_16):
    assert plan_16.image_tokens == 8192 and plan_16.text_tokens > 1400  # the real sequence, not a shrunk one
    assert plan_16.peak_device_gib <= 16.0, memory.table([plan_16])


def test_planner_estimate_is_within_15_percent_of_the_simulated_peak(plan_16):
    assert abs(plan_16.planner_estimate_gib - plan_16.peak_device_gib) <= 0.15 * plan_16.peak_device_gib, \
        memory.table([plan_16])


def test_offloaded_weights_leave_the_device_after_the_step(plan_16):
    assert plan_16.offloaded_resident_after_gib == 0.0, memory.table([plan_16])


JSON_FIELDS = ("plan", "budget_gib", "planner_estimate_gib", "peak_device_gib", "peak_host_gib", "flops_per_step")


def test_the_command_prints_one_json_object_per_plan(plan_16, monkeypatch, capsys):
    """`qwen-edit bench memory ... --json`: the options reach the simulator, and each plan is one line of JSON
    with the fields scripts read (the 16 GiB plan's own numbers: its offloaded blocks live in host memory)."""
    from qwen_edit_core.cli import main
    asked = {}

    def run(variant, side, controls, budgets, **kwargs):
        asked.update(variant=variant, side=side, controls=controls, budgets=tuple(budgets))
        return [plan_16]
    monkeypatch.setattr(memory, "run", run)
    assert not main(["bench", "memory", "--variant", "edit-plus", "--size", "512", "--controls", "2",
                     "--budget-gb", "16", "--json"])
    assert asked == {"variant": "edit-plus", "side": 512, "controls": 2, "budgets": (16.0,)}
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert set(JSON_FIELDS) <= set(row)
    assert row["plan"] == "train 16 GiB" and row["budget_gib"] == 16
    assert row["peak_device_gib"] == plan_16.peak_device_gib <= 16
    assert row["planner_estimate_gib"] == plan_16.planner_estimate_gib
    assert row["peak_host_gib"] > 5 and row["flops_per_step"] > 1e14  # 39 offloaded blocks; ~7e14 FLOPs


def test_a_21_step_runs_through_the_command_with_its_own_token_layout(monkeypatch, capsys):
    """`qwen-edit bench memory --variant image-2.1 --controls 2 --budget-gb 24 --json` runs the 2.1 training step
    (here on one real-width block, the widths and token counts real): two 1024^2 references and the target are
    4,096 latent tokens each, and the prompt's 2 x 1,024 vision slots become those references' tokens, leaving
    its text tokens; the LoRA's weights are the real 4096-wide block's."""
    import functools

    from qwen_edit_core.cli import main
    monkeypatch.setattr(memory, "simulate_train", functools.partial(memory.simulate_train, num_layers=1))
    assert not main(["bench", "memory", "--variant", "image-2.1", "--controls", "2", "--budget-gb", "24", "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1  # training plans only: sampling is simulated for the 2025 variants
    row = json.loads(lines[0])
    assert set(JSON_FIELDS) <= set(row)
    assert row["variant"] == "image-2.1" and row["controls"] == 2 and row["budget_gib"] == 24
    assert row["image_tokens"] == 3 * 64 * 64
    assert row["text_tokens"] == 3 + 2 * (4 + 1 + 1) + 40 + 5  # template, labels and vision marks, caption
    block = 12 * 4096 * 4096 * 2  # q, k, v, out (4 x 4096^2) and the MLP (3 x 4096 x 12288), bf16
    assert block < row["categories_gib"]["Parameter"] * 2**30 < block + 2**30  # + embeddings, LoRA
    assert row["peak_device_gib"] <= 24 and row["planner_estimate_gib"] <= 24 and row["flops_per_step"] > 1e13
    assert row["levers"].endswith("offloaded 0/1")


def test_the_21_prompt_layout_is_the_encoders():
    """The simulated 2.1 prompt: one vision slot per 32x32 pixels of each reference (Qwen3-VL's 16 px patches
    merged 2x2), in order, each reference's slots after its label; each slot stands for 2x2 latent tokens."""
    from qwen_edit_core.families.qwen_image_21 import fake_model as fake_model21
    slots = fake_model21.prompt_slots(3, 1024, 40)
    assert int(slots.sum()) == 3 * 1024 and slots.shape[0] == 3 * 1024 + 3 + 3 * 6 + 45
    runs = torch.diff(slots.int(), prepend=torch.zeros(1, dtype=torch.int32))
    assert int((runs == 1).sum()) == 3  # three separate slot runs: the references apart
    item = fake_model21.cache_item(1024, 3, 40)
    assert item["target_latents"].shape == (64, 1, 64, 64) and item["prompt_embeds"].shape == (slots.shape[0], 4096)
    assert int(item["prompt_slots"].sum()) * 4 == 3 * item["control_latents_0"][0].numel()


def test_21_sampling_is_refused_naming_what_is_simulated():
    with pytest.raises(ValueError, match="the sampling levers are simulated for the 2025 variants; 'image-2.1' "
                                         "samples with its prefix cache planned"):
        memory.simulate_sample("image-2.1", 1024, 1)


def test_one_simulated_forward_counts_every_weight_byte_and_the_attention_flops():
    """One real-width block at 1024^2 Edit, one forward (the `split` lever's share of a CFG step): the tracked
    parameters are the model's own bytes, and the FLOPs are the linears' 2 x tokens x weights plus fused
    attention's 4 x S^2 x width (QK^T and PV), which torch's counter misses on the CPU unless mapped."""
    result = memory.simulate_sample("edit", 1024, lever="split", num_layers=1)
    from qwen_edit_core.bench import fake_model
    model = fake_model.fake_transformer("edit", fake_model.fake_mode(), num_layers=1,
                                        lora=memory.lora_spec("attn"))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert result.categories_gib["Parameter"] == pytest.approx(weight_bytes / 2**30, abs=1e-3)
    n_img, n_txt, width = 2 * 64 * 64, result.text_tokens, 3072

    def tokens_of(name: str) -> int:
        if any(k in name for k in ("_mod", "time_text_embed", "norm_out")):
            return 1  # the timestep's modulation: one row
        return n_txt if any(k in name for k in ("add_", "txt_mlp", "txt_in")) else n_img
    linears = sum(2 * tokens_of(name) * m.weight.numel() for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and "lora" not in name)
    attention = 4 * (n_img + n_txt) ** 2 * width  # QK^T and PV, 2 x S^2 x head_dim x heads each
    # what is left out: the LoRA's rank-16 products and the elementwise work (well under 1%)
    assert result.flops_per_step == pytest.approx(linears + attention, rel=0.01)


def _checked_against_the_planner(result, budget: float) -> None:
    """A budget's simulated step: at most the budget (margin included), within 15% of the planner's estimate,
    no offloaded weight left on the device after it. The row is printed (`pytest -rA` shows it: BENCHMARKS.md's
    table)."""
    print(memory.table([result]))  # noqa: T201
    assert result.peak_device_gib <= budget, memory.table([result])
    assert abs(result.peak_device_gib - result.planner_estimate_gib) <= 0.15 * result.planner_estimate_gib, \
        memory.table([result])
    assert result.offloaded_resident_after_gib == 0.0, memory.table([result])


@pytest.mark.simulation  # a real-size step per budget: about a minute of CPU each
@pytest.mark.parametrize("budget", memory.BUDGETS)
@pytest.mark.parametrize("variant, controls", [("edit", 1), ("edit-plus", 2)])
def test_every_budgets_plan_fits_its_budget_at_real_size(variant, controls, budget):
    """1024^2 Edit and Edit Plus with two control images, budgets 16, 24, 40 and 80 GiB."""
    result = memory.simulate_train(variant, 1024, controls, budget_gb=budget)
    assert result.image_tokens == (1 + controls) * 64 * 64 and result.controls == controls
    _checked_against_the_planner(result, budget)


@pytest.mark.simulation
@pytest.mark.parametrize("variant, side, controls, budget", [("edit", 512, 1, 16), ("edit", 1536, 1, 24),
                                                             ("edit-2511", 1024, 2, 16)])
def test_other_sizes_and_edit_2511_fit_their_budget(variant, side, controls, budget):
    """512^2 and 1536^2 Edit (2,412 and 21,497 tokens: the planner's constants hold across sizes) and
    Edit-2511 (zero_cond_t: its timestep embedding doubles the modulation batch)."""
    result = memory.simulate_train(variant, side, controls, budget_gb=budget)
    assert result.image_tokens == (1 + controls) * (side // 16) ** 2
    _checked_against_the_planner(result, budget)


@pytest.mark.simulation
def test_the_references_setting_matches_its_measured_peak():
    """The setting measured on an H100 (BENCHMARKS.md, "Reference timings": LoRA on the image attention, every block
    checkpointed, bf16, 43.7 GiB): the tracked peak is within 10% of the measured one."""
    result = memory.simulate_train("edit", 1024, 1, 0.0, targets="attn-img")
    print(memory.table([result]))  # noqa: T201
    assert result.tracked_device_gib == pytest.approx(43.7, rel=0.10), memory.table([result])


@pytest.mark.simulation
def test_sampling_levers_peaks_at_one_megapixel():
    """One true-CFG denoising step of a 1 MP edit per sampling lever: the sequential step holds the weights and
    one forward's activations (measured on an H100: BENCHMARKS.md, "Reference timings"); fp8 halves the block weights;
    batching both branches holds a second forward's activations; split CFG and context parallelism run half of
    the work on each of two devices."""
    rows = {lever: memory.simulate_sample("edit", 1024, 1, lever) for lever in memory.SAMPLE_LEVERS}
    table = memory.table(list(rows.values()))
    print(table)  # noqa: T201
    sequential = rows["sequential"]
    assert sequential.tracked_device_gib == pytest.approx(38.9, rel=0.10), table
    assert rows["fp8"].peak_device_gib < sequential.peak_device_gib - 15, table
    assert sequential.peak_device_gib < rows["batched"].peak_device_gib < sequential.peak_device_gib + 5, table
    assert rows["split"].flops_per_step == pytest.approx(sequential.flops_per_step / 2, rel=0.01), table
    assert rows["context-parallel-2"].peak_device_gib < sequential.peak_device_gib, table
    assert rows["context-parallel-2"].flops_per_step < 0.6 * sequential.flops_per_step, table
    assert all(r.kind == "sample" and r.peak_device_gib < 80 for r in rows.values()), table


@pytest.mark.simulation  # a real-size 2.1 step: 1.5 (one reference) to 10 minutes (three, fp8) of CPU
@pytest.mark.parametrize("references", [1, 3])
def test_21_plans_fit_24_gib_at_real_size(references):
    """Qwen-Image-2.1 at 1024^2 with one and three references of 1024^2 (the real 32-block, 4096-wide transformer,
    `train.batch21`'s step): the planner's 24 GiB plan holds at most 24 GiB and its estimate is within 15%."""
    result = memory.simulate_train("image-2.1", 1024, references, budget_gb=24)
    assert result.image_tokens == (1 + references) * 64 * 64 and result.controls == references
    # the real 7 B transformer (13.3 GiB in bf16, half in fp8: an fp8 layer's weight is a buffer), on the device
    # or offloaded to pinned host memory
    assert result.categories_gib["Parameter"] + result.categories_gib["Buffer"] + result.peak_host_gib > 6.5
    _checked_against_the_planner(result, 24)


@pytest.mark.simulation  # 45,000 tokens: about 15 minutes of CPU
def test_21_with_ten_references_is_refused_24_gib_and_fits_its_plan():
    """Ten 1024^2 references (45,056 image tokens): the planner refuses 24 GiB, naming what even the smallest plan
    needs, and the simulated step of a plan it accepts (36 GiB: fp8, every block checkpointed, offloading) fits
    and is within 15% of its estimate; what it holds beside the weights alone (activations, working set, margin)
    exceeds 24 GiB, so no lever (each only moves or shrinks weights) could make 24 GiB fit."""
    with pytest.raises(ValueError, match="24 is too small: even an fp8 base with every block checkpointed and "
                                         "offloaded needs about 3"):
        memory.simulate_train("image-2.1", 1024, 10, budget_gb=24)
    result = memory.simulate_train("image-2.1", 1024, 10, budget_gb=36)
    assert result.image_tokens == 11 * 64 * 64
    _checked_against_the_planner(result, 36)
    non_weight = result.peak_device_gib - result.categories_gib["Parameter"] - result.categories_gib["Buffer"]
    assert non_weight > 24, memory.table([result])


def test_the_comfyui_path_runs_through_the_command(monkeypatch, capsys):
    """`qwen-edit bench memory --comfyui --variant edit-plus --controls 2 --json`: the Train node's job on a 24 GiB
    card with the fp8 file (here on one real-width block): one row, the graph's model lent, its fields there."""
    import functools

    from qwen_edit_core.bench import memory_comfyui
    from qwen_edit_core.cli import main
    monkeypatch.setattr(memory_comfyui, "simulate_comfyui", functools.partial(memory_comfyui.simulate_comfyui,
                                                                              num_layers=1))
    assert not main(["bench", "memory", "--comfyui", "--variant", "edit-plus", "--controls", "2", "--size", "512",
                     "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert set(JSON_FIELDS) | {"reserved_gib"} <= set(row)
    assert row["plan"] == "comfyui fp8 file, 24 GiB card" and row["budget_gib"] == 24
    assert row["reserved_gib"] == row["peak_device_gib"] <= 24
    assert row["levers"].startswith("fp8 on")


def test_the_node_budget_is_90_percent_of_the_card_less_the_cuda_context():
    from qwen_edit_core.bench.memory_comfyui import node_budget_gb
    assert 20.8 < node_budget_gb(24) < 21.6


@pytest.mark.simulation  # a training step of two real-width blocks: over a minute of CPU on a loaded machine
def test_the_comfyui_bf16_file_parks_the_lenders_linears_in_host_memory():
    """`--file-dtype bf16` (two real-width blocks, 512^2, a 3.5 GiB card, where the node's budget takes an fp8
    plan): the copy's fp8 layers replace the lender's bf16 linears, which are parked in host memory, so the
    device holds fp8 weights only and the row's host memory is the parked bf16 bytes."""
    from qwen_edit_core.bench import memory_comfyui
    row = memory_comfyui.simulate_comfyui("edit", 512, 1, 3.5, file_dtype="bf16", num_layers=2)
    assert row.levers.startswith("fp8 on") and row.plan == "comfyui bf16 file, 3.5 GiB card"
    linears = 2 * 339_000_000 * 2  # two blocks' linears in bf16, about all of a block's weights
    assert 0.9 * linears < row.peak_host_gib * 2**30 < 1.05 * linears
    assert row.categories_gib["Parameter"] * 2**30 < 0.6 * linears + 0.25 * 2**30  # fp8 blocks + embeddings, LoRA
    assert row.peak_device_gib <= row.budget_gib
    with pytest.raises(ValueError, match="--file-dtype 'fp16' is not accepted; accepted: fp8, bf16"):
        memory_comfyui.simulate_comfyui("edit", 512, 1, 3.5, file_dtype="fp16", num_layers=1)


def test_21_sampling_runs_through_the_command_with_its_prefix_cache_planned(monkeypatch, capsys, caplog):
    """`qwen-edit bench memory --sample --variant image-2.1 --controls 1 --budget-gb 24 --json` (here one real-width
    block, real token counts): one JSON row on stdout, announced on stderr before it runs, with the cache on the
    device, the planner's step peak within 10% of the simulated one and both within the card."""
    import functools
    import logging

    from qwen_edit_core.bench import memory_sample
    from qwen_edit_core.cli import main
    monkeypatch.setattr(memory_sample, "simulate_cached_sample",
                        functools.partial(memory_sample.simulate_cached_sample, num_layers=1))
    with caplog.at_level(logging.INFO, logger="qwen_edit_core.bench.memory_sample"):
        assert not main(["bench", "memory", "--sample", "--variant", "image-2.1", "--controls", "1", "--budget-gb",
                         "24", "--json"])
    assert "row 1/1: image-2.1 1024 px, 1 references, 24 GiB card" in caplog.text
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert set(JSON_FIELDS) | {"reserved_gib"} <= set(row)
    assert row["kind"] == "sample" and row["budget_gib"] == 24 and row["levers"].startswith("prefix cache device")
    assert abs(row["planner_estimate_gib"] - row["peak_device_gib"]) <= 0.1 * row["peak_device_gib"]
    assert row["reserved_gib"] == row["peak_device_gib"] <= 24 and row["peak_host_gib"] == 0


def test_bench_memory_announces_each_row_on_stderr_and_keeps_stdout_json(monkeypatch, capsys, caplog):
    """Minutes of CPU per row: each row is announced in the log (stderr) before it runs; stdout stays one JSON
    object per row."""
    import logging

    from qwen_edit_core.cli import main
    ran = []

    def fake_train(variant, side, controls, budget_gb=0.0, **kwargs):
        ran.append(budget_gb)
        assert f"row {len(ran)}/" in caplog.text  # announced before the row's work
        return memory.Simulated(plan=f"train {budget_gb:g} GiB", kind="train", variant=variant, size=side,
                                controls=1, image_tokens=1, text_tokens=1, budget_gib=budget_gb,
                                planner_estimate_gib=1.0, peak_device_gib=1.0, tracked_device_gib=1.0,
                                peak_host_gib=0.0, flops_per_step=1.0, roofline_s=1.0)
    monkeypatch.setattr(memory, "simulate_train", fake_train)
    with caplog.at_level(logging.INFO, logger="qwen_edit_core.bench.memory"):
        lines = memory.run("edit", 512, 1, (16, 24), reference=False, sample_levers=())
        assert [r.budget_gib for r in lines] == [16, 24]
        assert "row 2/2: edit 512 px x1, train, budget 24 GiB" in caplog.text
        ran.clear()
        caplog.clear()
        assert not main(["bench", "memory", "--size", "512", "--budget-gb", "16", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert ran == [16.0] and len(out) == 1 and json.loads(out[0])["plan"] == "train 16 GiB"


@pytest.mark.simulation  # 32 real-width blocks over up to 45,000 tokens: 5 to 15 minutes of CPU a row
@pytest.mark.parametrize("references,card", [(1, 24), (3, 24), (3, 48), (10, 48)])
def test_21_sampling_fits_its_card_with_the_prefix_cache_planned(references, card):
    """Qwen-Image-2.1 sampling with 1, 3 and 10 1024^2 references: the step fits the card, the cache plan's peak is
    within 10% of the simulated one, and a cache kept in host memory fits a 64 GB machine's share for it."""
    from qwen_edit_core.bench import memory_sample
    from qwen_edit_core.families.qwen_image_21 import prefix_cache, sample_memory
    row = memory_sample.simulate_cached_sample("image-2.1", 1024, references, card)
    assert row.peak_device_gib <= card, memory.table([row])
    assert abs(row.planner_estimate_gib - row.peak_device_gib) <= 0.1 * row.peak_device_gib, memory.table([row])
    assert row.peak_host_gib * 2**30 <= prefix_cache.HOST_HEADROOM * sample_memory.HOST_BYTES, memory.table([row])


@pytest.mark.simulation
def test_21_sampling_with_ten_references_is_refused_a_24_gib_card_naming_the_size():
    """Ten 1024^2 references in bf16 (45,164 tokens): even without the cache a step needs more than the sampler's
    20.8 GiB on a 24 GiB card, which it says before any step runs."""
    from qwen_edit_core.bench import memory_sample
    with pytest.raises(ValueError, match=r"does not fit 20.8 GiB.*needs about 21.\d GiB.*cache itself would be 40.\d"):
        memory_sample.simulate_cached_sample("image-2.1", 1024, 10, 24)


@pytest.mark.simulation  # 15 to 40 minutes of CPU a row
@pytest.mark.parametrize("path, variant, controls, budget", [
    ("comfyui", "edit", 1, 24), ("comfyui", "edit-plus", 2, 24), ("cli", "edit", 1, 24), ("cli", "edit", 1, 16),
    ("cli", "edit", 1, 12), ("dora", "edit", 1, 24)])
def test_the_users_paths_fit_their_card_and_a_64_gb_machine(path, variant, controls, budget):
    """BENCHMARKS.md, "The user's paths, simulated": the Train node's job on a 24 GiB card with the scaled-fp8 file
    (Edit, Edit Plus with two controls) and the command line at 24, 16 and 12 GiB (24 with DoRA too: bf16 and
    offload, no fp8). Each row's reserved peak fits
    its card, the planner is within 10% of the simulated peak, and its host memory (pinned as torch rounds it,
    parked weights) fits the share of a 64 GB machine docs/MEMORY.md ("What a machine needs") promises."""
    from qwen_edit_core.bench import memory_comfyui
    from qwen_edit_core.families.qwen_image_21 import prefix_cache, sample_memory
    row = memory_comfyui.simulate_comfyui(variant, 1024, controls, budget) if path == "comfyui" else \
        memory.simulate_train(variant, 1024, controls, budget_gb=budget, adapter="dora" if path == "dora" else "lora")
    assert row.reserved_gib <= budget and row.offloaded_resident_after_gib == 0.0, memory.table([row])
    assert abs(row.planner_estimate_gib - row.peak_device_gib) <= 0.1 * row.peak_device_gib, memory.table([row])
    assert row.peak_host_gib * 2**30 <= prefix_cache.HOST_HEADROOM * sample_memory.HOST_BYTES, memory.table([row])


@pytest.mark.simulation  # a training step of three real-width blocks: about a minute of CPU
def test_a_dora_row_runs_through_the_command_planned_in_bf16(monkeypatch, capsys):
    """`qwen-edit bench memory --budget-gb B --adapter dora --json` (here three real-width blocks at 512^2, a 3 GiB
    budget, which their bf16 weights alone nearly fill): DoRA cannot wrap an fp8 base, so the plan keeps bf16 and
    offloads blocks instead, and the step fits the budget, the planner within 10% of it."""
    import functools

    from qwen_edit_core.cli import main
    monkeypatch.setattr(memory, "simulate_train", functools.partial(memory.simulate_train, num_layers=3))
    assert not main(["bench", "memory", "--budget-gb", "3", "--adapter", "dora", "--size", "512", "--json"])
    row = json.loads(capsys.readouterr().out.strip())
    assert row["plan"] == "train 3 GiB, dora" and row["levers"].startswith("fp8 off, checkpointed 3/3, offloaded")
    assert not row["levers"].endswith("offloaded 0/3")
    assert row["peak_device_gib"] <= row["budget_gib"] == 3
    assert abs(row["planner_estimate_gib"] - row["peak_device_gib"]) <= 0.1 * row["peak_device_gib"]
