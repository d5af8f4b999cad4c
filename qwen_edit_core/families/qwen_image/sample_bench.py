"""`qwen-edit bench sample`, the 2025 Qwen-Image family's tables: our sampler against diffusers'
QwenImageEditPipeline on the same components.

Tiny (CPU): both on the tiny model, the same control image, prompt, seed and steps; median time of each.
`--real-size` (GPU): the real transformer config with random bf16 weights (real-width one-layer encoders) at
1024^2 Edit, in one process: (1) one sampler step, cond + uncond, for the diffusers reference (two forwards
with the prompt mask, as the pipeline calls them) and for our sampler with one lever added at a time
(no mask when nothing is padded, cuDNN attention, compiled blocks, fp8 base); (2) a full
`--steps` edit (default 50) of the diffusers pipeline, of our plain sampler and of our fastest setting, with
the fast output's distance to the plain one (the quality guard). MFU is against a bf16 matmul peak measured
in the same run.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch
from PIL import Image

from qwen_edit_core import speed
from qwen_edit_core.families import family_of
from qwen_edit_core.model import encode
from qwen_edit_core.sample import sampler
from qwen_edit_core.model.devices import resolve_device

from qwen_edit_core.bench.common import (bench_components, bench_dtype, gib_text, matmul_peaks, median_time, peak_gib,
                                         print_table, reset_peak, sync)
from qwen_edit_core.bench.sample import eager_note, stage_times, stages_text, step_hygiene

log = logging.getLogger(__name__)

PROMPT, NEGATIVE = "make the sky purple", " "


def _pipeline(comps):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline
    te = comps.text_encoder
    return QwenImageEditPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(comps.scheduler_config),
                                 vae=comps.vae, text_encoder=te.model, tokenizer=te.processor.tokenizer,
                                 processor=te.processor, transformer=comps.transformer)


def _image(side: int) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8))


def _tiny(device: str, steps: int, repeats: int) -> str:
    dev = resolve_device(device, component="bench device")
    dtype = torch.float32
    comps = bench_components(False, dev, dtype)
    pipe = _pipeline(comps)
    image = _image(1024)

    def reference():
        pipe(image=image, prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=4.0, num_inference_steps=steps,
             generator=torch.Generator("cpu").manual_seed(0), output_type="np")

    rows = []
    reset_peak(dev)
    t_ref = median_time(reference, dev, repeats)
    rows.append(["diffusers QwenImageEditPipeline", "sequential", f"{t_ref:.3f}", gib_text(peak_gib(dev)), "1.00"])
    for mode in ("sequential", "batched"):
        settings = sampler.SampleSettings(num_inference_steps=steps, true_cfg_scale=4.0, negative_prompt=NEGATIVE,
                                          seed=0, cfg_mode=mode)
        reset_peak(dev)
        t = median_time(lambda: sampler.sample(comps, PROMPT, [image], settings), dev, repeats)
        rows.append(["qwen_edit_core sampler", mode, f"{t:.3f}", gib_text(peak_gib(dev)), f"{t_ref / t:.2f}"])
    title = f"sample: tiny transformer, 1024^2 control, {steps} steps, true CFG 4.0, {dev}, {dtype}"
    text = print_table(title, ["implementation", "cfg", "median s", "peak GiB", "speed vs reference"], rows)
    return text + "\n\n" + _fast_path(comps, image, dev, repeats)


def fast_path_settings() -> list[tuple[str, sampler.SampleSettings]]:
    """The reference edit (50 steps, true CFG 4, diffusers' schedule) and the few-step path (lightning, 4 steps,
    CFG 1: one transformer call per step, no negative prompt encoded)."""
    return [("50 steps, true CFG 4.0 (diffusers)", sampler.SampleSettings(
                num_inference_steps=50, true_cfg_scale=4.0, negative_prompt=NEGATIVE, seed=0)),
            ("4 steps, CFG 1 (lightning)", sampler.SampleSettings(
                num_inference_steps=4, true_cfg_scale=1.0, negative_prompt=NEGATIVE, seed=0, schedule="lightning"))]


def _fast_path(comps, image, dev, repeats: int) -> str:
    """End-to-end edit time (encode, denoise, decode) of the few-step path beside the 50-step true-CFG edit."""
    rows, reference = [], None
    for label, settings in fast_path_settings():
        t = median_time(lambda: sampler.sample(comps, PROMPT, [image], settings), dev, repeats)
        reference = reference or t
        rows.append([label, f"{t:.3f}", f"{reference / t:.2f}"])
    return print_table(f"fast path: end-to-end edit, tiny transformer, {dev}",
                       ["edit path", "median s", "speed vs 50-step true CFG"], rows)


def forward_flops(tokens: int, layers: int = 60, dim: int = 3072) -> float:
    """Model FLOPs of one transformer forward over `tokens` joint tokens (linears and attention)."""
    return 2 * layers * tokens * 12 * dim * dim + 4 * layers * tokens * tokens * dim


#: sampler levers, each added on top of the previous row (speed.configure_inference changes the model in place)
STEP_VARIANTS = ("ours, no mask", "+ cuDNN attention", "+ compiled blocks", "+ fp8 base")


def _apply_variant(name: str, comps, dev, settings: sampler.SampleSettings) -> sampler.SampleSettings:
    if name == "+ cuDNN attention":
        return dataclasses.replace(settings, attention="cudnn")
    if name in ("+ compiled blocks", "+ fp8 base"):
        # the previous row's graphs are of a form the model leaves: forget them, so this row's graphs stay within
        # a torch.compile without a per-call recompile_limit (torch 2.11: dynamo's 8 for every block graph together)
        torch._dynamo.reset()
    if name == "+ compiled blocks":
        speed.configure_inference(comps.transformer, dev, fp8=False, compile=True)
    elif name == "+ fp8 base":
        speed.configure_inference(comps.transformer, dev, fp8=True, compile=True)
    return settings


@dataclasses.dataclass
class _RealRun:
    """One real-size sampling bench: the components, the conditioning of the edit and the full edits so far."""
    dev: torch.device
    dtype: torch.dtype
    comps: object
    image: Image.Image
    cond: object
    latents: torch.Tensor
    full: bool
    full_rows: list = dataclasses.field(default_factory=list)
    outputs: dict = dataclasses.field(default_factory=dict)

    def full_edit(self, label: str, fn) -> None:
        """Time one whole edit, with where its time goes for our sampler's (`stage_times`); keep its output to
        compare with our plain sampler's."""
        reset_peak(self.dev)
        sync(self.dev)
        start = time.perf_counter()
        out, spent = stage_times(fn, self.dev, family_of(self.comps.transformer))
        total = time.perf_counter() - start
        where = stages_text(spent) if spent["denoising"] > 0 else "-"  # the pipeline calls none of our stages
        self.full_rows.append([label, f"{total:.2f}", gib_text(peak_gib(self.dev)), where])
        log.info("full edit %s", self.full_rows[-1])  # kept if a time limit cuts the run
        self.outputs[label] = np.asarray(out, dtype=np.float32).reshape(-1)


def _real_run(dev: torch.device, steps: int, layers: int | None, side: int, full: bool):
    """(the run, the plain sampler settings) of a random real-size transformer at `side`^2 (the text encoder's
    image area scaled with it: 384^2 at 1024^2, as the pipeline)."""
    dtype = bench_dtype(dev)
    comps = bench_components(True, dev, dtype, num_layers=layers)
    comps.transformer.eval()
    image = _image(side)
    settings = sampler.SampleSettings(num_inference_steps=steps, true_cfg_scale=4.0, negative_prompt=NEGATIVE,
                                      seed=0, vae_area=side * side, vl_area=384 * 384 * side * side // 1024**2)
    cond = sampler.build_conditioning(comps, PROMPT, [image], settings)
    latents = sampler.family_sampler(comps).initial_noise(0, cond.width, cond.height,
                                                          comps.transformer.config.in_channels // 4, dev, dtype)
    return _RealRun(dev, dtype, comps, image, cond, latents, full), settings


def _lever_rows(run: _RealRun, settings, repeats: int):
    """(rows [name, median s or failure, peak], reference s, settings with every lever) of one CFG step: the
    diffusers model as the pipeline calls it, then ours with each lever added in turn."""
    comps, cond, latents, dtype, dev = run.comps, run.cond, run.latents, run.dtype, run.dev
    t = torch.tensor(500.0, device=dev)

    def reference_step():
        for e in (cond.cond, cond.uncond):  # the pipeline passes its prompt mask (all ones here)
            hidden = torch.cat([latents, cond.control_tokens], dim=1)
            comps.transformer(hidden_states=hidden, timestep=t.expand(1).to(dtype) / 1000,
                              encoder_hidden_states=e.embeds, encoder_hidden_states_mask=e.mask,
                              img_shapes=[cond.img_shapes], return_dict=False)

    reset_peak(dev)
    t_ref = median_time(reference_step, dev, repeats)
    rows = [["diffusers model, prompt mask (as the pipeline)", t_ref, peak_gib(dev),
             speed.kernels_text(speed.kernels_ran(reference_step, dev))]]
    for name in STEP_VARIANTS:
        try:
            settings = _apply_variant(name, comps, dev, settings)
            denoiser = sampler._Denoiser(comps.transformer, cond, settings)
            with speed.attention_kernel(settings.attention):
                reset_peak(dev)
                s = median_time(lambda: denoiser(latents, t), dev, repeats, warmup=2)
                rows.append([name + eager_note(comps.transformer), s, peak_gib(dev),
                             speed.kernels_text(speed.kernels_ran(lambda: denoiser(latents, t), dev))])
            log.info("sampler step %s (reference %.3f s)", rows[-1], t_ref)  # kept if a time limit cuts the run
        except Exception as err:  # noqa: BLE001 - a failed lever is reported, the others still run
            log.exception("sampler lever %s failed", name)
            rows.append([name, f"failed: {type(err).__name__}: {err}"[:100], None, "-"])
        if name == "ours, no mask":
            rows.append(_aligned_row(run, settings, t, repeats))
            if run.full:
                run.full_edit("qwen_edit_core sampler, plain",
                              lambda s=settings: sampler.sample(comps, PROMPT, [run.image], s))
    return rows, t_ref, settings


def aligned(cond):
    """`cond` with each prompt cut to a multiple of 64 tokens (at least 64): the same step at lengths the kernels
    tile evenly, beside the real prompt's (what an odd length costs)."""
    def cut(embeds):
        if embeds is None:
            return None
        n = max(64, embeds.lengths[0] // 64 * 64)
        return encode.pad_embeddings([embeds.valid(0)[:n]])
    return dataclasses.replace(cond, cond=cut(cond.cond), uncond=cut(cond.uncond))


def _aligned_row(run: "_RealRun", settings, t, repeats: int) -> list:
    """The plain step (row "ours, no mask") with both prompts cut to a multiple of 64 tokens (`aligned`)."""
    cond = aligned(run.cond)
    denoiser = sampler._Denoiser(run.comps.transformer, cond, settings)
    lengths = "/".join(str(e.lengths[0]) for e in (cond.cond, cond.uncond) if e is not None)
    with speed.attention_kernel(settings.attention):
        reset_peak(run.dev)
        s = median_time(lambda: denoiser(run.latents, t), run.dev, repeats, warmup=2)
        kernels = speed.kernels_text(speed.kernels_ran(lambda: denoiser(run.latents, t), run.dev))
    return [f"ours, no mask, prompts cut to {lengths} tokens", s, peak_gib(run.dev), kernels]


def _euler_hygiene(run: _RealRun, settings) -> tuple[int, int]:
    """Host syncs and new CUDA segments of the whole Euler step as the loop runs it (guided velocity +
    scheduler update), with every lever on."""
    scheduler, timesteps, _ = sampler.family_sampler(run.comps).make_timesteps(run.comps.scheduler_config, settings,
                                                                               run.latents.shape[1], run.dev)
    denoiser = sampler._Denoiser(run.comps.transformer, run.cond, settings)
    state = {"latents": run.latents, "i": 0}

    def euler_step():  # as sampler.denoise's loop body: steps 1 (warm-up) and 2 (measured)
        t = timesteps[state["i"]]
        with speed.attention_kernel(settings.attention):
            velocity = denoiser(state["latents"], t)
        state["latents"] = scheduler.step(velocity, t, state["latents"], return_dict=False)[0].to(run.dtype)
        state["i"] += 1
    syncs, segments = step_hygiene(euler_step, run.dev)
    log.info("one Euler step with every lever: %d host syncs, %d new CUDA segments", syncs, segments)
    return syncs, segments


def _step_table(rows, t_ref: float, flops: float, peak_tflops: float, hygiene: tuple[int, int]) -> list[list]:
    table = []
    for name, s, peak, kernels in rows:
        if isinstance(s, str):
            table.append([name, s, "-", "-", "-", "-"])
        else:
            table.append([name, f"{s:.3f}", gib_text(peak), f"{100 * flops / s / peak_tflops / 1e12:.0f}%",
                          f"{t_ref / s:.2f}", kernels])
    syncs, segments = hygiene
    table.append(["one Euler step, every lever: host syncs / new CUDA segments", f"{syncs} / {segments}" if
                  syncs >= 0 else "- (CUDA only)", "-", "-", "-", "-"])
    return table


def _full_table(run: _RealRun, steps: int, side: int) -> str:
    base, plain = run.full_rows[0], run.outputs["qwen_edit_core sampler, plain"]
    for row in run.full_rows:
        row.insert(3, f"{float(base[1]) / float(row[1]):.2f}")
        row.append(f"{np.abs(run.outputs[row[0]] - plain).mean():.4f}" if run.outputs[row[0]].shape == plain.shape
                   else "-")
    return print_table(f"full edit: {steps} steps, true CFG 4.0, {side}^2, {run.dev}",
                       ["implementation", "s", "peak GiB", "speed vs pipeline", "where the seconds go",
                        "mean |output - plain| (0-1 image)"],
                       run.full_rows)


def _real(device: str, steps: int = 50, repeats: int = 3, *, layers: int | None = None, side: int = 1024,
          full: bool = True) -> str:
    """`layers`/`side` shrink the run for a smoke test of the plumbing (any device); `full=False` skips the
    full edits."""
    dev = resolve_device(device, component="bench device")
    if dev.type != "cuda" and layers is None:
        raise ValueError("--real-size needs a CUDA device: it measures the real-size transformer's GPU time "
                         "and memory")
    run, settings = _real_run(dev, steps, layers, side, full)
    peaks = matmul_peaks(dev, n=8192 if dev.type == "cuda" else 256)
    cond = run.cond
    tokens = [run.latents.shape[1] + cond.control_tokens.shape[1] + e.embeds.shape[1] for e in (cond.cond, cond.uncond)]
    flops = sum(forward_flops(n, layers or 60) for n in tokens)
    if full:
        pipe = _pipeline(run.comps)
        run.full_edit("diffusers QwenImageEditPipeline", lambda: pipe(
            image=run.image, prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=4.0, num_inference_steps=steps,
            generator=torch.Generator("cpu").manual_seed(0), output_type="np").images)
        fast = dataclasses.replace(settings, num_inference_steps=4, true_cfg_scale=1.0, schedule="lightning")
        run.full_edit("ours, lightning 4 steps, CFG 1",
                      lambda: sampler.sample(run.comps, PROMPT, [run.image], fast)[0].numpy())
    with torch.no_grad():
        rows, t_ref, settings = _lever_rows(run, settings, repeats)
        hygiene = _euler_hygiene(run, settings)
    if full:
        run.full_edit("qwen_edit_core sampler, all levers above",
                      lambda: sampler.sample(run.comps, PROMPT, [run.image], settings))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    text = print_table(
        f"sample step (cond + uncond): random real-size transformer ({layers or 60} blocks), {side}^2 Edit "
        f"({tokens[0]} / {tokens[1]} tokens), bf16, {dev} ({name}); MFU against the measured bf16 peak "
        f"{peaks['bf16']:.0f} TFLOP/s; step = {flops:.2e} FLOPs",
        ["implementation", "median s/step", "peak GiB", "MFU", "speed vs reference",
         "attention kernels (share of profiled step)"],
        _step_table(rows, t_ref, flops, peaks["bf16"], hygiene))
    return text + ("\n\n" + _full_table(run, steps, side) if full else "")


def run(real_size: bool = False, device: str = "cpu", steps: int = 4, repeats: int = 3) -> str:
    """This family's table(s): the tiny model's (CPU), or `--real-size`'s (GPU)."""
    return _real(device, steps, repeats) if real_size else _tiny(device, steps, repeats)
