"""`qwen-edit`: tiny | sample | cache | train | pairs | doctor | demo | bench.

Errors a user can fix (bad path, device, size, prompt) print one line naming the input and exit with
status 2; no traceback from inside diffusers.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from qwen_edit_core.families import variants
from qwen_edit_core.families.templates import EMPTY_PROMPT

log = logging.getLogger("qwen_edit_core.cli")


#: (module, class) of the errors a user can fix; looked up only in modules already imported (`_user_errors`)
USER_ERRORS = (("qwen_edit_core.common.typed", "ConfigError"), ("qwen_edit_core.model.devices", "DeviceError"),
               ("qwen_edit_core.model.encode", "EncodeError"),
               ("qwen_edit_core.model.components", "ModelNotFoundError"),
               ("qwen_edit_core.model.single_file", "SingleFileError"), ("PIL", "UnidentifiedImageError"),
               ("qwen_edit_core.common.files", "OutputDirBusyError"),
               ("qwen_edit_core.common.files", "OutputWriteError"))


def _user_errors() -> tuple[type[BaseException], ...]:
    """The error classes that end in a one-line message. Taken from modules already imported: an error class
    can only have been raised once its module is loaded, and importing the rest here would pull in torch
    (seconds) just to report a config error."""
    found = tuple(getattr(sys.modules[module], name) for module, name in USER_ERRORS if module in sys.modules)
    return (*found, FileNotFoundError, FileExistsError, ValueError)


def cmd_tiny(args) -> None:
    if args.pretrained:
        from qwen_edit_core.toys.pretrain import Recipe, pretrain, pretrain_vae, recipe_for
        from qwen_edit_core.toys.toy import build_toy, weights_of
        if args.variant not in variants.toy_variants() or args.size != "tiny":
            raise ValueError(f"--pretrained builds the {' or '.join(variants.toy_variants())} variant at "
                             "size tiny; drop --size or pick one of those --variant values")
        family = variants.get(args.variant).family
        if args.train_vae and not family.toy.vae_trains_alone:
            raise ValueError(f"--train-vae: the toy {family.title}'s VAE is fitted with its transformer's build; "
                             "use --train")
        weights = Path(args.weights_dir) if args.weights_dir else weights_of(family)
        if args.train_vae:
            pretrain_vae(weights, Recipe(seed=args.seed, variant=args.variant))
        elif args.train or not (weights / "toy.json").is_file():
            pretrain(weights, recipe_for(args.variant, args.seed))
        out = build_toy(args.out_dir, weights)
        log.info("pretrained toy model written to %s (weights: %s)", out, weights)
        return
    from qwen_edit_core.model.tiny import build_tiny
    out = build_tiny(args.out_dir, variant=args.variant, seed=args.seed, size=args.size)
    log.info("tiny %s model (random weights) written to %s", args.variant, out)


def _progress_bar(total_desc: str):
    from tqdm import tqdm
    bar = None

    def update(event):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=event.total, desc=total_desc, unit="step", file=sys.stderr)
        bar.update(event.step - bar.n)
        if event.step >= event.total:
            bar.close()
    return update


def cmd_sample(args) -> None:
    from qwen_edit_core.config import load_config

    plan = {}
    if args.devices:
        from qwen_edit_core.model.devices import DevicePlan
        plan = DevicePlan.parse(args.devices).as_dict()
    files = {key: getattr(args, key) for key in ("transformer_file", "vae_file", "text_encoder_file",
                                                  "comfyui_models_dir", "comfyui_dir", "transformer_fp8")
             if getattr(args, key)}
    overrides = {"model": {"pretrained_model_name_or_path": args.model, **files},
                 "predict": {"devices": plan, "cfg_mode": args.cfg_mode, "dtype": args.dtype,
                             "uncond_device": args.uncond_device or "", "shift_mode": args.shift_mode,
                             **({"schedule": args.schedule} if args.schedule else {}),
                             **({"shift": args.shift} if args.shift is not None else {}),
                             **({"sigmas": args.sigmas} if args.sigmas else {}),
                             **({"kv_cache": False} if args.no_kv_cache else {}),
                             **({"fp8": True} if args.fp8 else {}), **({"compile": True} if args.compile else {}),
                             **({"attention": args.attention} if args.attention else {}),
                             **({"vae_area": args.vae_area} if args.vae_area else {}),
                             **({"vl_area": args.vl_area} if args.vl_area else {}),
                             **({"control_size": args.control_size} if args.control_size else {})}}
    if args.context_parallel > 1:
        from qwen_edit_core.sample import context_parallel
        plan["transformer"] = context_parallel.process_device(plan.get("transformer", "cpu"))
        overrides["predict"].update(context_parallel=args.context_parallel, cp_mode=args.cp_mode)
        context_parallel.init_process_group(args.context_parallel, plan["transformer"],
                                            cfg_split=args.cfg_mode == "split")
    config = load_config(args.config, overrides=overrides)
    with _cpu_threads(args):
        _sample(args, config)


def _sample(args, config) -> None:
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.model.encode import open_image
    images = [open_image(p, keep_alpha=True) for p in args.image]  # the 2025 family drops alpha as before
    trainer = QwenImageEditTrainer(config)
    loras = [_lora_arg(spec) for spec in args.lora or []]
    trainer.check_predict(loras=[path for path, _ in loras], out_file=args.out, num_inference_steps=args.steps,
                          true_cfg_scale=args.cfg, width=args.width, height=args.height,
                          images=images, prompts={"--prompt": args.prompt,
                                                  "--negative-prompt": args.negative_prompt or ""})  # before loading
    trainer.load_model()
    for path, strength in loras:
        trainer.load_lora(path, scale=strength)
    image = trainer.predict(images if len(images) > 1 else images[0], args.prompt,
                            negative_prompt=args.negative_prompt, num_inference_steps=args.steps,
                            true_cfg_scale=args.cfg, seed=args.seed, height=args.height, width=args.width,
                            output_type="pil", progress=_progress_bar("sample"))
    if int(os.environ.get("RANK", "0")) != 0 and args.context_parallel > 1:
        return  # every process computed the same image: the first one writes it
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)
    log.info("wrote %s (%dx%d, %s)", out, image.width, image.height, image.mode)


def _lora_arg(spec: str) -> tuple[str, float]:
    """--lora PATH or PATH:STRENGTH -> (path, strength)."""
    path, _, strength = spec.rpartition(":") if not Path(spec).is_file() and ":" in spec else (spec, "", "")
    try:
        return path, float(strength) if strength else 1.0
    except ValueError:
        raise ValueError(f"--lora {spec!r}: the strength after ':' must be a number") from None


@contextlib.contextmanager
def _cpu_threads(args):
    """torch's CPU threads for the command's work (`--threads`; 0: 1 on a small or busy machine, else the free
    cores: common/threads.py), set once the config is read (config errors are answered without torch)."""
    from qwen_edit_core.common.threads import torch_threads
    with torch_threads(args.threads) as count:
        log.debug("torch uses %d CPU thread(s)", count)
        yield


def cmd_cache(args) -> None:
    from qwen_edit_core.config import load_config
    config = load_config(args.config)
    from qwen_edit_core.api import QwenImageEditTrainer
    trainer = QwenImageEditTrainer(config)
    with _cpu_threads(args):
        stats = trainer.cache(progress=_progress_bar("cache"))
    log.info("cache: %(total)d entries, %(hits)d reused, %(computed)d computed", stats)


def cmd_train(args) -> None:
    from qwen_edit_core.config import load_config
    overrides = train_overrides(args)
    if args.preview:
        from qwen_edit_core.train.validation import parse_previews
        overrides.setdefault("train", {})["validation_previews"] = parse_previews(args.preview)
    config = load_config(args.config, overrides=overrides)
    with _cpu_threads(args):
        _train(args, config)


def _train(args, config) -> None:
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.common.progress import CancelToken, Interrupted, SignalStop
    trainer = QwenImageEditTrainer(config)
    resume = True if args.resume == "" else args.resume
    cancel = CancelToken()
    with SignalStop(cancel) as stop:  # SIGINT and SIGTERM: a checkpoint at the next step boundary
        result = trainer.fit(resume=resume, progress=stop.progress(_train_bar()), cancel=cancel,
                             overwrite=args.overwrite)
    log.info("training %s at step %d; LoRA: %s; loss plot: %s", result.state, result.step, result.lora_path,
             result.loss_plot)
    if result.state == "cancelled":
        saved = (f"the checkpoint of step {result.step} is saved; continue with --resume" if result.step
                 else "no training step had finished: nothing to save; run it again")
        raise Interrupted(stop.received or signal.SIGINT, saved)


#: `qwen-edit train` flags that override one config key each: (flag dest, section, key)
TRAIN_FLAGS = (("output_dir", "train", "output_dir"), ("max_steps", "train", "max_steps"),
               ("lora_name", "train", "lora_name"), ("validation_every", "train", "validation_every"),
               ("validation_pairs", "train", "validation_pairs"),
               ("ema_decay", "train", "ema_decay"), ("ema_validation", "train", "ema_validation"),
               ("mask_weight", "train", "mask_weight"), ("unmasked_weight", "train", "unmasked_weight"),
               ("bucket_grouping", "data", "bucket_grouping"), ("control_size", "data", "control_size"),
               ("pixel_aligned", "data", "pixel_aligned"),
               ("lora_type", "model", "lora.type"), ("dora", "model", "lora.dora"),
               ("lora_format", "train", "lora_format"))


def train_overrides(args) -> dict:
    """The config overrides of the `train` flags that were given (None = keep the config file's value); a dotted
    key nests (`lora.type` -> model: {lora: {type: ...}})."""
    overrides: dict = {}
    for dest, section, key in TRAIN_FLAGS:
        value = getattr(args, dest, None)
        if value is not None:
            *parents, last = key.split(".")
            node = overrides.setdefault(section, {})
            for parent in parents:
                node = node.setdefault(parent, {})
            node[last] = value
    return overrides


def _train_bar():
    from tqdm import tqdm
    bar = None

    def update(event):
        nonlocal bar
        if event.stage != "train":
            return
        if bar is None:
            bar = tqdm(total=event.total, initial=event.step - 1, desc="train", unit="step", file=sys.stderr)
        bar.update(event.step - bar.n)
        if event.loss is not None:  # read every logging.every steps
            bar.set_postfix(loss=f"{event.loss:.4f}")
        if event.step >= event.total:
            bar.close()
    return update


def cmd_pairs(args) -> None:
    if args.faults:
        from qwen_edit_core.data.doctor.faulty import write_faulty_dataset
        faulty = write_faulty_dataset(Path(args.folder), size=args.size, seed=args.seed, count=max(24, args.count))
        log.info("wrote the planted-fault dataset to %s and %s: %s", faulty.train, faulty.heldout,
                 ", ".join(f"{name} {kind}" for name, kind in sorted(faulty.faults.items())))
        return
    from qwen_edit_core.data.synthetic import write_pairs
    pairs = write_pairs(Path(args.folder), args.count, args.seed, args.edit, args.size)
    log.info("wrote %d %r pairs (%d px) to %s", len(pairs), args.edit, args.size, args.folder)


def cmd_doctor(args) -> None:
    """`qwen-edit doctor DATASET`: the dataset doctor's findings (one JSON object each with --json), the report
    picture in --out, the fixed copy in --fix; a training --config supplies what the options leave unsaid."""
    from qwen_edit_core.api import doctor_dataset, doctor_tokenizer
    from qwen_edit_core.data.doctor.runner import default_workers
    options = _doctor_options(args)
    held = options["held_out"]
    held = int(held) if isinstance(held, str) and held.isdigit() else held
    run = doctor_dataset(options["dataset"], held, pixel_aligned=options["pixel_aligned"], area=options["area"],
                         batch_size=options["batch_size"], out_dir=args.out, fix_dir=args.fix,
                         cache_dir=options["cache"], workers=args.workers or default_workers(),
                         count_tokens=options["count_tokens"] or doctor_tokenizer(args.model, args.comfyui_dir),
                         text_encoder=_doctor_text_encoder(args) if args.vlm else None)
    if args.json:
        if run.report.findings:
            print(run.report.json_lines())  # noqa: T201  (the command's output)
    else:
        log.info("%s", "\n".join([run.report.summary(limit=len(run.report.findings)), *run.report.statistics()]))
    if run.picture:
        log.info("report of the worst pairs: %s (picture: %s)", run.page, run.picture)
    for line in run.fixes:
        log.info("fixed %s", line)


def _doctor_text_encoder(args):
    """The text encoder `--vlm` asks: --model's (or --config's model and text-encoder file), on --vlm-device."""
    from qwen_edit_core.api import doctor_text_encoder
    if args.model or not args.config:
        return doctor_text_encoder(args.model, comfyui_dir=args.comfyui_dir, device=args.vlm_device)
    from qwen_edit_core.config import load_config
    from qwen_edit_core.train import run
    config = load_config(args.config)
    files = run.model_files(config)
    return doctor_text_encoder(config.model.pretrained_model_name_or_path, device=args.vlm_device,
                               text_encoder_file=files["text_encoder_file"], comfyui_dir=files["comfyui_dir"])


def _doctor_options(args) -> dict:
    """The doctor's dataset, held-out pairs, size settings, cache folder and tokenizer: the options', else the
    training --config's (data.folder, train.validation_pairs, data.*, the embedding cache's folder, the model's
    tokenizer when no --model is given)."""
    options = {"dataset": args.dataset, "held_out": args.held_out, "pixel_aligned": args.pixel_aligned,
               "area": args.area, "batch_size": args.batch_size or 1, "count_tokens": None,
               "cache": args.cache or Path(args.out) / "cache"}
    if not args.config:
        if not args.dataset:
            raise SystemExit("qwen-edit doctor: give the DATASET folder, or a training --config naming data.folder")
        return options
    from qwen_edit_core.config import load_config
    from qwen_edit_core.train import run
    config = load_config(args.config)
    d = config.data
    return {"dataset": args.dataset or d.folder, "held_out": args.held_out or config.train.validation_pairs or None,
            "pixel_aligned": args.pixel_aligned or d.pixel_aligned_edit, "area": args.area or d.vae_area,
            "batch_size": args.batch_size or d.batch_size,
            "cache": args.cache or run.doctor_cache_dir(config) or Path(args.out) / "cache",
            "count_tokens": None if args.model or args.comfyui_dir else run.caption_counter(config)}


def add_doctor_command(sub) -> None:
    """The `doctor` subcommand's arguments."""
    p = _command(sub, "doctor", "check what a dataset's pairs mean: swapped, misaligned, references out of order, "
                                "unchanged, duplicated or leaked pairs, masks, captions, sizes")
    p.add_argument("dataset", nargs="?", help="dataset folder (the layouts data.folder takes; default: --config's "
                                              "data.folder)")
    p.add_argument("--json", action="store_true", help="one JSON object per finding on stdout: pair, kind, figure, "
                                                       "fix, why")
    p.add_argument("--fix", metavar="OUT", help="write a fixed copy of the dataset to this new folder (the original "
                                                "is never changed)")
    p.add_argument("--out", default="doctor_out", help="folder for report.txt, report.html and report.png "
                   "(the worst pairs side by side: control, target, difference, finding)")
    p.add_argument("--held-out", help="held-out pairs as train.validation_pairs: N (the last N pairs) or a folder")
    p.add_argument("--pixel-aligned", action="store_true", help="the edit keeps every pixel in place "
                   "(data.pixel_aligned): --fix realigns shifted and zoomed targets")
    p.add_argument("--area", type=int, help="training pixel area (data.vae_area) for the upscale and bucket checks")
    p.add_argument("--batch-size", type=int, help="data.batch_size: buckets holding fewer pairs are flagged "
                                                  "(default: --config's, else 1)")
    p.add_argument("--cache", help="folder where the measures are kept by the files' content hashes, so that a "
                                   "second run measures only changed pairs (default: --config's embedding cache "
                                   "folder, else OUT/cache)")
    p.add_argument("--workers", type=int, help="processes measuring pairs (default: the CPUs, at most 4)")
    p.add_argument("--config", help="a training config: its data.folder, held-out pairs, data settings, cache folder "
                                    "and model's tokenizer serve where the options say nothing")
    p.add_argument("--model", help="model directory (or hub id already downloaded), tokenizer folder or text-encoder "
                                   "file whose tokenizer counts the captions' tokens (nothing is downloaded)")
    p.add_argument("--comfyui-dir", help="ComfyUI installation whose bundled Qwen2.5 tokenizer counts the captions' "
                                         "tokens")
    p.add_argument("--vlm", action="store_true", help="also ask the model's own text encoder (Qwen2.5-VL, from "
                   "--model or --config, local files only) whether each target shows its caption's edit applied to "
                   "its control; a no is a caption finding with its description as the proposed caption, and a pair "
                   "with no caption gets one proposed (which --fix writes) (slow)")
    p.add_argument("--vlm-device", default="cpu", help="device the --vlm text encoder runs on")
    p.set_defaults(func=cmd_doctor)


def cmd_demo(args) -> None:
    from qwen_edit_core.demo import run_demo
    cache_bar, train_bar = _progress_bar("cache"), _train_bar()
    run_demo(Path(args.out), steps=args.steps, variant=args.variant,
             progress=lambda event: cache_bar(event) if event.stage == "cache" else train_bar(event))


def cmd_bench(args) -> None:
    from qwen_edit_core.bench.command import run_bench
    run_bench(args)


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, except unset ones (None) and off switches."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _command(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand whose --help shows each option's default."""
    return sub.add_parser(name, help=help, description=help, formatter_class=_DefaultsHelp)


def _threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=0,
                   help="torch's CPU threads; 0: 1 on a machine of at most 4 cores or a busy one (load >= cores - 1), "
                        "else the cores the load leaves free")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen-edit", description=__doc__.splitlines()[0],
                                     formatter_class=_DefaultsHelp)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = _command(sub, "tiny", help="build the offline tiny model directory (random weights, or --pretrained)")
    p.add_argument("out_dir", help="directory to write (replaced if it holds a previous build)")
    p.add_argument("--variant", choices=variants.NAMES, default=variants.DEFAULT, help="pipeline variant")
    p.add_argument("--seed", type=int, default=0, help="weights seed (with --pretrained --train: the training seed)")
    p.add_argument("--size", choices=["tiny", "real-width"], default="tiny", help="layer widths")
    p.add_argument("--pretrained", action="store_true",
                   help="the pretrained toy model (trained VAE and transformer; the package's weights)")
    p.add_argument("--train", action="store_true",
                   help="with --pretrained: train the toy weights from scratch into --weights-dir first")
    p.add_argument("--weights-dir", default=None,
                   help="with --pretrained: toy weights folder (default: the package's toys/weights/<family>, the "
                        "family of --variant)")
    p.add_argument("--train-vae", action="store_true",
                   help="with --pretrained: retrain only the VAE's decoder into --weights-dir (its transformer and "
                        "the latents stay as they are)")
    p.set_defaults(func=cmd_tiny)

    p = _command(sub, "sample", help="edit an image with true CFG")
    _threads_option(p)
    p.add_argument("--model", required=True, help="diffusers-layout model directory")
    p.add_argument("--transformer-file", help="transformer as one safetensors file (ComfyUI diffusion_models)")
    p.add_argument("--transformer-fp8", choices=["auto", "keep", "upcast"],
                   help="a scaled-fp8 --transformer-file: keep its weights in fp8 or upcast them (auto: keep on "
                        "GPUs that compute in fp8)")
    p.add_argument("--vae-file", help="VAE as one safetensors file (ComfyUI's qwen_image_vae.safetensors)")
    p.add_argument("--text-encoder-file",
                   help="text encoder as one safetensors file (ComfyUI's text_encoders/qwen_2.5_vl_7b*.safetensors)")
    p.add_argument("--comfyui-models-dir",
                   help="ComfyUI models folder: the --*-file options may then be file names of its subfolders")
    p.add_argument("--comfyui-dir", help="ComfyUI installation whose bundled Qwen2.5 tokenizer serves "
                                         "--text-encoder-file when --model has no processor/")
    p.add_argument("--image", required=True, action="append", help="control image (repeat: Edit Plus; 2.1: up to 10)")
    p.add_argument("--prompt", required=True, help="edit instruction")
    p.add_argument("--negative-prompt", default=EMPTY_PROMPT, help="negative prompt of true CFG")
    p.add_argument("--steps", type=int, help="sampling steps (default: the schedule's, lightning 4; else 20)")
    p.add_argument("--cfg", type=float,
                   help="true CFG scale, <= 1 turns CFG off (default: the schedule's, lightning 1; else 4)")
    p.add_argument("--schedule", choices=["diffusers", "comfyui", "lightning"],
                   help="diffusers (default; dynamic shift), comfyui (what stock ComfyUI renders), lightning "
                        "(few-step LoRAs: fixed shift 3, 4 steps, CFG 1)")
    p.add_argument("--shift", type=float,
                   help="fixed shift replacing the schedule's (comfyui: ModelSamplingAuraFlow's)")
    p.add_argument("--sigmas",
                   help="explicit sigmas (their count is the steps), e.g. '1,0.75,0.5', or qwen21-dmd-6step")
    p.add_argument("--no-kv-cache", action="store_true",
                   help="Qwen-Image-2.1: no prefix K/V cache (slower, same image)")
    p.add_argument("--seed", type=int, default=0, help="noise seed")
    p.add_argument("--width", type=int, help="output width (default: the control's size at --vae-area)")
    p.add_argument("--height", type=int, help="output height (default: the control's size at --vae-area)")
    p.add_argument("--devices", help="text_encoder=cpu,vae=cpu,transformer=cuda:0")
    p.add_argument("--uncond-device", help="second transformer device for --cfg-mode split")
    p.add_argument("--cfg-mode", choices=["sequential", "batched", "split"], default="sequential",
                   help="how the two CFG branches run")
    p.add_argument("--shift-mode", choices=["dynamic", "fixed"], default="dynamic",
                   help="timestep shift: diffusers' (dynamic) or ComfyUI's (fixed)")
    p.add_argument("--dtype", default="float32", help="compute dtype (float32, bfloat16, float16)")
    p.add_argument("--vae-area", type=int,
                   help="pixel area of the control image for the VAE (default: the config's, 1024*1024)")
    p.add_argument("--vl-area", type=int, help="pixel area of control images for the VL (Edit Plus)")
    p.add_argument("--control-size", choices=["pipeline", "target"], help="predict.control_size: target resizes the "
                   "controls to the output size, the control's own when a multiple of 16 (pixel-aligned LoRAs)")
    p.add_argument("--config", help="YAML config whose predict section gives defaults")
    p.add_argument("--lora", action="append", help="LoRA file, optionally PATH:STRENGTH (repeat for several)")
    p.add_argument("--fp8", action="store_true", help="fp8 matmuls for the base's block linears (Ada/Hopper)")
    p.add_argument("--compile", action="store_true", help="compile each transformer block (~30 s once)")
    p.add_argument("--attention", choices=["auto", "cudnn", "flash", "efficient", "math", "flash3"],
                   help="attention kernel tried first (docs/MEMORY.md)")
    p.add_argument("--out", required=True, help="output image file (png)")
    p.add_argument("--context-parallel", type=int, default=1, metavar="N",
                   help="split the transformer's tokens over N processes started by `torchrun --nproc_per_node N`")
    p.add_argument("--cp-mode", choices=["ulysses", "ring"], default="ulysses",
                   help="context parallel: ulysses (all-to-all over heads) or ring (keys/values around the ring)")
    p.set_defaults(func=cmd_sample)

    p = _command(sub, "cache", help="precompute the embedding cache of a dataset")
    _threads_option(p)
    p.add_argument("config", help="YAML config (model, data, cache sections)")
    p.set_defaults(func=cmd_cache)

    p = _command(sub, "train", help="train a LoRA (Ctrl-C or SIGTERM saves a checkpoint and exits)")
    _threads_option(p)
    p.add_argument("config", help="YAML config")
    p.add_argument("--resume", nargs="?", const="", default=None,
                   help="resume from the run's latest checkpoint, or from the checkpoint/output dir given")
    p.add_argument("--output-dir", help="train.output_dir: the run's folder (LoRA, checkpoints, loss plot)")
    p.add_argument("--overwrite", action="store_true", help="a folder holding another run's LoRA or checkpoints: "
                   "move that run aside to FOLDER.replaced-TIME and start anew (without it such a run is refused)")
    p.add_argument("--max-steps", type=int, help="train.max_steps: optimizer steps of the run")
    p.add_argument("--lora-name", help="train.lora_name: the LoRA's file name, without .safetensors")
    p.add_argument("--lora-format", choices=["split", "fused"], help="train.lora_format: the file's MLP layout "
                   "where ComfyUI fuses it (Qwen-Image-2.1): split (diffusers, peft) or fused (ComfyUI's own)")
    p.add_argument("--validation-every", type=int,
                   help="train.validation_every: sample validation pictures every N steps")
    p.add_argument("--validation-pairs", type=lambda v: int(v) if v.isdigit() else v, help="train.validation_pairs: "
                   "keep the dataset's last N pairs (or a folder's) out of training; errors: validation/metrics.csv")
    p.add_argument("--ema-decay", type=float, help="train.ema_decay: keep an EMA of the LoRA (e.g. 0.999), saved "
                   "as NAME_ema.safetensors")
    p.add_argument("--ema-validation", action="store_true", default=None,
                   help="train.ema_validation: validation images use the EMA LoRA")
    p.add_argument("--mask-weight", type=float, help="train.mask_weight: loss weight inside the masks' edited "
                   "regions (pairs with NAME_mask.png or masks/NAME.png)")
    p.add_argument("--unmasked-weight", type=float, help="train.unmasked_weight: loss weight outside them")
    p.add_argument("--bucket-grouping", choices=["equal", "similar", "similar-count"],
                   help="data.bucket_grouping: similar-count batches neighbouring sizes with one number of control "
                   "images per batch; similar mixes control counts too")
    p.add_argument("--preview", action="append",
                   help="a validation preview (repeat for several, side by side): SCHEDULE [steps=N] [cfg=X] "
                        "[shift=S] [lora=FILE[:STRENGTH]] [label=TEXT], e.g. 'lightning steps=4 lora=l.safetensors'")
    p.add_argument("--control-size", choices=["pipeline", "target"],
                   help="data.control_size: target resizes every control to its target's size (pixel-aligned pairs)")
    p.add_argument("--pixel-aligned", action="store_true", default=None,
                   help="data.pixel_aligned: the edit keeps every pixel in place (the dataset doctor's fixes "
                   "realign shifted or zoomed targets)")
    p.add_argument("--lora-type", choices=["lora", "lokr", "loha"],
                   help="model.lora.type: the adapter to train (LoKr: Kronecker factors, LoHa: Hadamard product)")
    p.add_argument("--dora", action="store_true", default=None,
                   help="model.lora.dora: DoRA (a learned magnitude per output row; --lora-type lora only)")
    p.set_defaults(func=cmd_train)

    from qwen_edit_core.data.synthetic import DEMO_EDIT, EDITS
    p = _command(sub, "pairs", "write synthetic edit pairs (NAME_control.png, NAME.png, NAME.txt) to train on")
    p.add_argument("folder", help="dataset folder to write")
    p.add_argument("--count", type=int, default=16, help="number of pairs")
    p.add_argument("--edit", choices=[DEMO_EDIT[0], *EDITS], default=DEMO_EDIT[0], help="the edit (and caption)")
    p.add_argument("--size", type=int, default=128, help="picture side in pixels")
    p.add_argument("--seed", type=int, default=0, help="pictures seed")
    p.add_argument("--faults", action="store_true", help="the dataset doctor's planted-fault dataset instead: "
                   "FOLDER/train (invert the colors, at least 24 pairs, faults planted) and FOLDER/heldout")
    p.set_defaults(func=cmd_pairs)

    add_doctor_command(sub)

    p = _command(sub, "demo", help="teach the pretrained toy model a new edit as a LoRA; before/after pictures")
    p.add_argument("--out", default="demo_out", help="output folder")
    p.add_argument("--steps", type=int, default=250, help="LoRA training steps")
    p.add_argument("--variant", choices=variants.toy_variants(), default=variants.DEFAULT,
                   help="which toy model learns the edit: the Qwen-Image-Edit one or the Qwen-Image-2.1 one")
    p.set_defaults(func=cmd_demo)

    p = _command(sub, "bench", help="benchmarks (see BENCHMARKS.md)")
    p.add_argument("what",
                   choices="sample train batching threads soak memory activations attention doctor cache".split(),
                   help="which benchmark")
    p.add_argument("--real-size", action="store_true", help="real-size random transformer (GPU)")
    p.add_argument("--device", default="cpu", help="device to measure on")
    p.add_argument("--steps", type=int, default=4, help="sampling steps (sample) or training steps (train)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per variant")
    p.add_argument("--rounds", type=int, default=1, help="soak: rounds of every fault (random points, seeded)")
    p.add_argument("--variants", default="", help="train --real-size: comma-separated names of "
                   "qwen_edit_core/bench/train.py VARIANTS to run after the reference (default: all)")
    p.add_argument("--variant", choices=variants.NAMES, default=None,
                   help=f"memory: simulated variant (default {variants.DEFAULT}); sample: only its family's table(s) "
                   "(default: every family's)")
    p.add_argument("--size", type=int, default=1024, help="memory: the square edit's side in pixels")
    p.add_argument("--controls", type=int, default=None,
                   help="memory: control images, or 2.1 references (default 1 Edit and 2.1, 2 Plus)")
    p.add_argument("--budget-gb", type=float, default=None, help="memory: one budget (default 16, 24, 40, 80)")
    p.add_argument("--json", action="store_true", help="memory: one JSON object per plan instead of the table")
    p.add_argument("--pairs", type=int, default=200, help="cache: synthetic pairs to encode")
    p.add_argument("--processes", type=int, default=2, help="cache: processes to compare with one")
    p.add_argument("--comfyui", action="store_true", help="memory: the Train node's job on a card of --budget-gb "
                   "GiB (default 24), the graph's model from a ComfyUI file lent to it")
    p.add_argument("--file-dtype", choices=("fp8", "bf16"), default="fp8",
                   help="memory --comfyui: the ComfyUI transformer file the graph's model came from")
    p.add_argument("--sample", action="store_true", help="memory: sampling on a card of --budget-gb GiB (default 24 "
                   "and 48); Qwen-Image-2.1: with its prefix K/V cache planned, --controls references")
    p.add_argument("--fp8-copy", action="store_true", help="memory: the device bytes of the Sampling Speed node's "
                   "fp8 copy of the real-size --variant transformer, parking its input's bf16 linears and not")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", signal.SIGINT)
        log.error("%s: stopped (%s)", signal.Signals(signum).name,
                  getattr(err, "saved", "") or "before any training step: no checkpoint was needed; run it again")
        return 128 + signum
    except _user_errors() as err:
        if args.verbose:
            raise
        sys.stderr.write(f"qwen-edit {args.command}: error: {err}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
