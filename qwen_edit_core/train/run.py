"""A training run from a Config, as plain stage functions: where the model's files are, how examples are encoded,
the cache stage, the LoRA to train, `fit` (cache or realtime -> train -> validation images) and the loss of one
batch. `QwenImageEditTrainer` (api.py) holds the loaded components between calls and delegates here.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from qwen_edit_core import speed
from qwen_edit_core.adapters import lora as lora_mod
from qwen_edit_core.config import Config
from qwen_edit_core.data.cache import EmbeddingCache
from qwen_edit_core.data.example_tensors import (EncodeSettings, buckets, build_cache, cache_key, encode_example,
                                                 encoder_identity, log_resizes)
from qwen_edit_core.model import components as comp
from qwen_edit_core.families import variants
from qwen_edit_core.model.devices import DevicePlan, resolve_dtype
from qwen_edit_core.model.weight_source import weight_source
from qwen_edit_core.train import cache_share, run_folder, sharding
from qwen_edit_core.train.heldout import Validations
from qwen_edit_core.train.distributed import local_device

log = logging.getLogger(__name__)


# -- the model's files and the encoding ------------------------------------------------------------------------
def model_files(config: Config) -> dict:
    """The single files and the ComfyUI installation of `model.*`, as load_components takes them:
    transformer_file, vae_file, text_encoder_file (bare names are looked up in model.comfyui_models_dir),
    comfyui_dir (model.comfyui_dir, else the installation holding model.comfyui_models_dir, if it is one) and
    transformer_fp8."""
    m = config.model
    files = {f"{name}_file": comp.resolve_model_file(getattr(m, f"{name}_file"), name, m.comfyui_models_dir)
             for name in ("transformer", "vae", "text_encoder")}
    comfyui = Path(m.comfyui_dir).expanduser() if m.comfyui_dir else comp.comfyui_dir_near(m.comfyui_models_dir)
    # Under FSDP an fp8 base cannot be sharded (train.sharding), nor can DoRA, LoKr or LoHa wrap one
    # (speed.adapter_no_fp8): a scaled-fp8 file is upcast, never kept.
    no_fp8 = sharding.is_sharded() or speed.adapter_no_fp8(m.lora.type, m.lora.dora) is not None
    fp8 = "upcast" if m.transformer_fp8 == "auto" and no_fp8 else m.transformer_fp8
    return {**files, "comfyui_dir": comfyui, "transformer_fp8": fp8}


def encode_settings(config: Config, variant: str) -> EncodeSettings:
    """How examples are encoded (areas, dtype) for a model variant (families/variants.py name)."""
    d = config.data
    return EncodeSettings(variant=variant, vae_area=d.vae_area, vl_area=d.vl_area,
                          dtype=resolve_dtype(config.model.dtype, component="model.dtype"),
                          convert_modes=d.convert_modes, control_size=d.control_size)


def open_cache(config: Config) -> EmbeddingCache:
    """The embedding cache of `cache.dir` (default: `train.output_dir`/cache)."""
    return EmbeddingCache(Path(config.cache.dir or str(Path(config.train.output_dir) / "cache")))


def cache_identity(config: Config, model_dir: Path) -> str:
    """The encoders' identity in cache keys (the VAE and the text encoder may come from their own files, the
    processor from ComfyUI's bundled tokenizer)."""
    files = model_files(config)
    return encoder_identity(model_dir, files["vae_file"], files["text_encoder_file"],
                            comp.processor_source(model_dir, files["comfyui_dir"]))


def encoder_plan(config: Config) -> DevicePlan:
    """Devices of the cache stage's encoders and of the trained transformer (this process's share). Under FSDP
    the levers it cannot take are refused here, before any weight loads (`sharding.check_levers`)."""
    sharding.check_levers(config)
    c = config.cache
    return DevicePlan.from_mapping({"text_encoder": local_device(c.text_encoder_device),
                                    "vae": local_device(c.vae_encoder_device),
                                    "transformer": local_device(config.train.device)}, dtype=config.model.dtype)


def lora_spec(config: Config, family=None) -> lora_mod.LoraSpec:
    """The LoRA to train, from `model.lora`; preset target names resolve to `family`'s modules (default: the
    configured model's family)."""
    lora = config.model.lora
    if family is None:
        model_dir = comp.resolve_model_dir(config.model.pretrained_model_name_or_path)
        family = variants.get(config.model.variant or comp.detect_variant(model_dir)).family
    targets = lora_mod.resolve_targets(lora.targets, family.lora_targets)
    return lora_mod.LoraSpec(rank=lora.rank, alpha=lora.alpha, targets=targets,
                             dropout=lora.dropout, init=lora.init, type=lora.type, dora=lora.dora)


def caption_counter(config: Config):
    """`count(text) -> tokens` of the configured text encoder's tokenizer alone (model.components
    .caption_token_counter: read locally, no weights), None when the model has none to read."""
    model_dir = comp.resolve_model_dir(config.model.pretrained_model_name_or_path)
    return comp.caption_token_counter(model_dir, model_files(config)["comfyui_dir"])


def load_examples(config: Config, on_pair=None):
    """The validated dataset of `data.folder` (data.dataset.load_dataset), every caption's tokens counted by the
    model's tokenizer alone, before any weight loads; `on_pair`: load_dataset's (the doctor's `PairMeasurer`)."""
    from qwen_edit_core.data.dataset import DatasetError, Problem, load_dataset
    d = config.data
    model_dir = comp.resolve_model_dir(config.model.pretrained_model_name_or_path)
    count = caption_counter(config)
    report = load_dataset(d.folder, skip_invalid=d.skip_invalid, convert_modes=d.convert_modes, count_tokens=count,
                          on_pair=on_pair)
    spec = variants.get(config.model.variant or comp.detect_variant(model_dir))
    if spec.max_controls is not None:
        over = [Problem(e.target, f"has {len(e.controls)} control images; a {spec.title} model takes "
                                  f"{spec.controls_text()}")
                for e in report.examples if len(e.controls) > spec.max_controls]
        if over:
            raise DatasetError(over, header=f"{len(over)} pair(s) in dataset {str(d.folder)!r} have more control "
                                            "images than the model takes:")
    return report


def _model(config: Config) -> tuple[Path, EncodeSettings]:
    model_dir = comp.resolve_model_dir(config.model.pretrained_model_name_or_path)
    return model_dir, encode_settings(config, config.model.variant or comp.detect_variant(model_dir))


# -- the cache stage -------------------------------------------------------------------------------------------
def run_cache(config: Config, examples: Sequence, encoders=None, *, progress=None, cancel=None) -> dict:
    """Encode every example missing from the cache (text encoder and VAE on `cache.text_encoder_device` /
    `cache.vae_encoder_device`, or the given `encoders` components when they hold both); returns
    {"total", "hits", "computed"}. Nothing is loaded when every entry is present. Under a multi-process launch each
    process encodes its share of the missing entries ("computed" counts this process's) and all wait for the
    whole cache (train/cache_share.py)."""
    model_dir, settings = _model(config)
    cache, identity = open_cache(config), cache_identity(config, model_dir)
    # `contains` validates each entry's header, so a damaged one is recomputed in this same run.
    missing = [ex for ex in examples if not cache.contains(cache_key(ex, settings, identity))]
    if not missing and cache_share.launch_world() == 1:
        log.info("cache: all %d entries present in %s; encoders not loaded", len(examples), cache.root)
        return {"total": len(examples), "hits": len(examples), "computed": 0}

    def encode(todo: list) -> dict:
        loaded = encoders
        if loaded is None or loaded.text_encoder is None or loaded.vae is None:
            loaded = comp.load_components(model_dir, encoder_plan(config), which=("vae", "text_encoder"),
                                          **model_files(config))
        return build_cache(loaded, todo, cache, settings, identity=identity, progress=progress, cancel=cancel)

    if cache_share.launch_world() == 1:
        return encode(list(examples))
    # each process of the launch encodes its share of what is missing and waits for the others
    done = cache_share.run_shared(missing, encode, cpu=config.train.device == "cpu")
    return {"total": len(examples), "hits": len(examples) - done["computed"], "computed": done["computed"]}


# -- the memory plan, before any weight loads ------------------------------------------------------------------
def training_plan(config: Config, device: torch.device, model_dir: Path, bucket_keys: Sequence,
                  spec: lora_mod.LoraSpec) -> speed.WeightPlan | None:
    """The transformer's memory plan for this run (speed.plan_training), made from the model's config, the LoRA,
    the longest bucket and the device's free memory before any weight is read, so the transformer loads straight
    into it (model/planned_load.py). In a process of an FSDP2 run, a plan that reads the transformer into host
    memory (`sharding.host_plan`): sharding then moves each block to the device and keeps this process's share.
    Both model families, every adapter kind: DoRA, LoKr and LoHa cannot take an fp8 base (`speed.adapter_no_fp8`
    says why), so their plan keeps bf16 and offloads blocks instead. None where the load-then-configure path stays:
    bitsandbytes `model.quantize` (it quantizes each weight as it loads: the model's dtype never fills the
    device; `speed.configure_training` then plans checkpointing alone, `speed.base_limits`)."""
    from qwen_edit_core.train.distributed import sequence_tokens
    if config.model.quantize != "none":
        return None
    files = model_files(config)
    source = weight_source(model_dir, files["transformer_file"], files["transformer_fp8"])
    device = torch.device(device)
    variant = config.model.variant or comp.detect_variant(model_dir)
    if sharding.is_sharded():
        return sharding.host_plan(resolve_dtype(config.model.dtype, component="model.dtype"))
    available = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    tokens = sequence_tokens(bucket_keys, variant, config.data.vl_area)  # the controls' vision tokens included
    return speed.plan_training(config.train, device, resolve_dtype(config.model.dtype, component="model.dtype"),
                               planned_sizes(source, spec), tokens, available=available,
                               already_fp8=source.keeps_fp8(device), no_fp8=speed.adapter_no_fp8(spec.type, spec.dora))


def planned_sizes(source, spec: lora_mod.LoraSpec) -> dict:
    """`speed.model_sizes` of the transformer with its LoRA and the mixed-resolution adapter, counted on a
    meta-device model (no weight read, no memory)."""
    from qwen_edit_core.adapters import multires
    from qwen_edit_core.model.planned_load import build_skeleton
    model = build_skeleton(source, fp8=False)
    with torch.inference_mode(False), torch.device("meta"), torch.random.fork_rng(devices=[]):  # RNG untouched
        lora_mod.inject_lora(model, spec)
    multires.install(model)
    return speed.model_sizes(model)


# -- fit -------------------------------------------------------------------------------------------------------
@dataclass
class FitInputs:
    """What `fit` trains on: the loaded components, one example's tensors by index, and the validation
    sample's tensors (None without validation)."""
    components: comp.Components
    load_item: Callable[[int], dict]
    validation: dict | None
    #: `load_item` only reads files (the cache): the loop may read the next batch while the current one trains
    read_ahead: bool = False


def _validation_example(config: Config, examples: Sequence, held: Sequence):
    """The validation picture as an example: `train.validation_image`; without one but with previews asked for
    (`train.validation_previews`), the first held-out (else training) pair, its caption unless
    `train.validation_prompt` is set (logged); None when the run does not sample previews."""
    t = config.train
    if not (t.validation_every and (t.validation_image or t.validation_previews)):
        return None
    if not t.validation_image:
        pair = (list(held) or list(examples))[0]
        log.info("validation: train.validation_image is not set; the previews sample pair %s's control image(s) with "
                 "%s", pair.name, "train.validation_prompt" if t.validation_prompt else "its caption")
        return replace(pair, name="validation", caption=t.validation_prompt or pair.caption, mask=None)
    from qwen_edit_core.train.validation import validation_example
    return validation_example(t.validation_image, t.validation_prompt, len(examples[0].controls))


def _loaded(config: Config, plan: DevicePlan, model_dir: Path, which: tuple[str, ...],
            shared: comp.Components | None, plan_weights: Callable[[], speed.WeightPlan | None] = lambda: None,
            ) -> comp.Components:
    """The components `which`: the `shared` ones where it holds them (nothing of those is loaded again), the
    rest loaded on the plan's devices, the transformer last, in the form `plan_weights()` plans (asked once the
    other components are loaded: the free memory it plans with is then what the transformer can have)."""
    missing = tuple(w for w in which if shared is None or getattr(shared, w) is None)
    others = tuple(w for w in missing if w != "transformer")
    comps = shared
    if others or comps is None:
        loaded = comp.load_components(model_dir, plan, which=others, **model_files(config))
        comps = loaded if comps is None else replace(comps, **{w: getattr(loaded, w) for w in others})
    if "transformer" in missing:
        loaded = comp.load_components(model_dir, plan, which=("transformer",),
                                      quantize_transformer=config.model.quantize, transformer_plan=plan_weights(),
                                      **model_files(config))
        comps = replace(comps, transformer=loaded.transformer)
    return comps


def _cached_inputs(config: Config, plan: DevicePlan, examples, val_example, model_dir: Path,
                   settings: EncodeSettings, shared: comp.Components | None = None,
                   plan_weights: Callable[[], speed.WeightPlan | None] = lambda: None) -> FitInputs:
    """Load only the transformer (or take the shared one); items and the validation sample come from the
    cache."""
    comps = _loaded(config, plan, model_dir, ("transformer",), shared, plan_weights)
    cache, identity = open_cache(config), cache_identity(config, model_dir)
    keys = [cache_key(ex, settings, identity) for ex in examples]

    def load_item(i: int) -> dict:
        tensors = cache.get(keys[i])
        if tensors is None:
            raise RuntimeError(f"cache entry of {examples[i].name} vanished from {cache.root}; run cache again")
        return tensors
    val = cache.get(cache_key(val_example, settings, identity)) \
        if val_example is not None else None
    return FitInputs(comps, load_item, val, read_ahead=True)


def _realtime_inputs(config: Config, plan: DevicePlan, examples, val_example, model_dir: Path,
                     settings: EncodeSettings, shared: comp.Components | None = None,
                     plan_weights: Callable[[], speed.WeightPlan | None] = lambda: None) -> FitInputs:
    """Load every component (or take the shared ones); items are encoded as the loop asks for them."""
    comps = _loaded(config, plan, model_dir, ("transformer", "vae", "text_encoder"), shared, plan_weights)
    val = encode_example(comps, val_example, settings) if val_example is not None else None
    return FitInputs(comps, lambda i: encode_example(comps, examples[i], settings), val)


def _inject(config: Config, transformer, spec: lora_mod.LoraSpec) -> None:
    """Inject the LoRA to train (seeded init), starting from `model.lora.init_from` when given."""
    # LoRA init draws from torch's global RNG: seed it, so the run does not depend on what loaded before.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.train.seed)
        lora_mod.inject_lora(transformer, spec)
    if config.model.lora.init_from:
        lora_mod.load_lora_into(transformer, lora_mod.read_lora_file(config.model.lora.init_from),
                                adapter_name="default", strength=1.0)
    if config.train.lora_format == "fused":  # refused before the first step, not at the first save
        lora_mod.check_fusable(transformer)


def fit(config: Config, *, encoders=None, shared: comp.Components | None = None,
        release: Callable[[], None] = lambda: None,
        ready: Callable[[comp.Components, lora_mod.LoraSpec], None] = lambda comps, spec: None,
        check: Callable[[Path, int], None] = lambda model_dir, n_examples: None,
        resume=None, progress=None, cancel=None, overwrite: bool = False):
    """Train a LoRA on `data.folder` (from the cache when `cache.enabled`, else encoding in real time) and write
    it to `train.output_dir`; returns loop.TrainResult.

    `encoders`: loaded components the cache stage may use; `release()` once the cache stage is done with them
    (the caller drops its reference, so they are freed before the transformer loads); `shared`: loaded
    components to train on instead of loading (the caller's, e.g. a ComfyUI graph's: trained as `speed.lend`'s
    copy, given back exactly as it was however the run ends); `ready(components, spec)` as soon as the LoRA is injected;
    `check(model_dir, n_examples)` before any weight loads (the facade's preflight); `overwrite`: another run's
    files in the output folder are moved aside instead of refusing the run (train.run_folder)."""
    from qwen_edit_core.train.checkpoint import lora_stack
    from qwen_edit_core.train.loop import resolve_resume, train
    out_dir = Path(config.train.output_dir)
    # the doctor measures each picture from the reader's one decode; its helper processes end however this ends
    with doctor_measurer(config) or nullcontext() as measured:
        examples, held = _split_heldout(config, list(load_examples(config, measured).examples), measured)
        model_dir, settings = _model(config)
        resume_path = run_folder.check_free(out_dir, resolve_resume(out_dir, resume), overwrite)
        plan = encoder_plan(config)  # every device (and under FSDP every lever) checked before any work
        stack = lora_stack(config.model.lora.stack, resume_path)
        val_example = _validation_example(config, examples, held)
        _checked(config, check, model_dir, examples, held, measured)
    run_id = run_folder.claim(out_dir, resume_path, overwrite, open_cache(config).root)
    if config.cache.enabled:
        run_cache(config, examples + held + ([val_example] if val_example else []), encoders or shared,
                  progress=progress, cancel=cancel)
        del encoders
        release()  # free the encoders before the transformer loads
    spec, keys = lora_spec(config, settings.family), [buckets(ex, settings) for ex in examples]
    inputs = (_cached_inputs if config.cache.enabled else _realtime_inputs)(
        config, plan, examples, val_example, model_dir, settings, shared,
        lambda: training_plan(config, plan.transformer, model_dir, keys, spec))  # before the transformer's weights
    if shared is not None:
        inputs = replace(inputs, components=_lent(inputs.components))
    comps, validator, metrics = _validators(config, inputs, held, plan, model_dir, settings, stack)
    with torch.inference_mode(False):
        try:
            _inject(config, comps.transformer, spec)
            if stack:
                # companions: active and frozen; saved files and checkpoints hold only "default"
                lora_mod.activate_with_trained(comps.transformer, stack)
            ready(comps, spec)
            log_resizes(examples, settings)
            result = train(config, comps.transformer, inputs.load_item, examples, keys,
                           scheduler_config=comps.scheduler_config,
                           write_lora=_lora_writer(config, comps.transformer, spec, model_dir),
                           out_dir=out_dir, resume=resume_path, progress=progress, cancel=cancel,
                           validate=Validations(validator, metrics) if metrics else validator, run_id=run_id,
                           read_ahead=inputs.read_ahead)
        finally:
            if shared is not None:
                _give_back(comps.transformer)
    return _with_validation(result, config, comps, validator, metrics, model_dir, plan)


def _with_validation(result, config: Config, comps: comp.Components, validator, metrics, model_dir: Path,
                     plan: DevicePlan):
    """`result` with the held-out metrics' rows and the validation pictures: training is over, so a VAE may
    load now to turn the validation latents into images."""
    result.validation_metrics = metrics.rows if metrics is not None else []
    if validator is not None and validator.latent_files:
        vae = comps.vae or comp.load_components(model_dir, plan, which=("vae",), **model_files(config)).vae
        result.validation_images = validator.decode_pending(vae)
    return result


def _lora_writer(config: Config, transformer, spec: lora_mod.LoraSpec, model_dir: Path):
    """write_lora(path, step): the run's LoRA file at `step`, in `train.lora_format`'s layout."""
    def write_lora(path: Path, step: int) -> None:
        lora_mod.save_lora(path, transformer, spec, base_identity=comp.model_identity(model_dir, config.model.variant),
                           steps=step,
                           layout=config.train.lora_format)
    return write_lora


def _lent(comps: comp.Components) -> comp.Components:
    """The caller keeps using its transformer: the run trains on a copy over the same weights (speed.lending)."""
    with torch.inference_mode(False):  # tensors the copy makes (plain attributes) must serve autograd
        return replace(comps, transformer=speed.lend(comps.transformer))


def _give_back(transformer) -> None:
    speed.give_back(transformer)
    log.info("training over: the shared transformer is given back as it was lent")


def _validators(config: Config, inputs: FitInputs, held: list, plan: DevicePlan, model_dir: Path,
                settings: EncodeSettings, stack):
    """(components, the validation image's Validator or None, the held-out pairs' metrics or None). With held-out
    pairs the VAE loads now (cached mode too): their pictures are decoded at each validation step."""
    comps, validator, metrics, out_dir = inputs.components, None, None, Path(config.train.output_dir)
    if held:
        comps = _loaded(config, plan, model_dir, ("transformer", "vae"), comps)
        metrics = _heldout_metrics(config, comps, held, model_dir, settings, out_dir)
    if inputs.validation is not None:
        from qwen_edit_core.train.validation import Validator, previews_from_config
        validator = Validator(comps, inputs.validation, out_dir, previews_from_config(config), stack=stack)
    return comps, validator, metrics


def _split_heldout(config: Config, examples: list, on_pair=None) -> tuple[list, list]:
    """(training pairs, held-out pairs) of `train.validation_pairs` (which needs train.validation_every); a held-out
    folder is read with load_dataset's `on_pair`."""
    from qwen_edit_core.data.dataset import load_dataset
    from qwen_edit_core.train.heldout import split_heldout
    t, d = config.train, config.data
    if not t.validation_pairs:
        return examples, []
    if not t.validation_every:
        raise ValueError(f"train.validation_pairs {t.validation_pairs!r} needs train.validation_every > 0 (the "
                         "held-out pairs are sampled at each validation step)")
    train_pairs, held = split_heldout(examples, t.validation_pairs, lambda folder: load_dataset(
        folder, skip_invalid=d.skip_invalid, convert_modes=d.convert_modes, on_pair=on_pair).examples)
    log.info("validation: %d held-out pair(s) kept out of training (%s)", len(held), ", ".join(e.name for e in held))
    return train_pairs, held


def _checked(config: Config, check: Callable[[Path, int], None], model_dir: Path, examples: list, held: list,
             measured=None):
    """The caller's preflight `check`, then the dataset doctor (`run_doctor`): all before any weight loads."""
    check(model_dir, len(examples))
    run_doctor(config, examples, held, measured)


def doctor_cache_dir(config: Config) -> Path | None:
    """Where the dataset doctor keeps its measures: the embedding cache's folder (`open_cache`; None with the cache
    off), which `qwen-edit doctor --config` shares."""
    return open_cache(config).root if config.cache.enabled else None


def doctor_measurer(config: Config):
    """The doctor's PairMeasurer for `load_dataset(on_pair=...)` (its cache: `doctor_cache_dir`), None when
    data.doctor is off."""
    if config.data.doctor == "off":
        return None
    from qwen_edit_core.data.doctor.runner import PairMeasurer
    return PairMeasurer(doctor_cache_dir(config))


def run_doctor(config: Config, examples: Sequence, held: Sequence, measured=None):
    """The dataset doctor on the training and held-out pairs (`data.doctor`): its summary logged ("warn"), or the
    run refused when it flags a pair ("refuse"); measures kept beside the embedding cache. `measured`: the
    `doctor_measurer` the dataset reader handed the pairs to (without it each picture is read again). Returns its
    report."""
    if config.data.doctor == "off":
        return None
    from qwen_edit_core.data.doctor import DoctorSettings, diagnose
    d = config.data
    settings = DoctorSettings(area=d.vae_area, pixel_aligned=d.pixel_aligned_edit, batch_size=d.batch_size)
    report = diagnose(examples, held, settings, measured=measured or doctor_measurer(config),
                      count_tokens=caption_counter(config))
    if report.findings and d.doctor == "refuse":
        raise ValueError(f"{report.summary()}\ndata.doctor is 'refuse': fix the pairs (qwen-edit doctor "
                         f"{d.folder} --fix NEW_FOLDER writes a fixed copy) or set data.doctor: warn")
    (log.warning if report.findings else log.info)("%s", report.summary())
    return report


def _heldout_metrics(config: Config, comps: comp.Components, held: list, model_dir: Path,
                     settings: EncodeSettings, out_dir: Path):
    """The held-out pairs' metrics callable: their tensors from the cache (or encoded now in realtime mode),
    sampled with the first validation preview's settings."""
    from qwen_edit_core.train.heldout import HeldOutMetrics, HeldOutPair
    from qwen_edit_core.train.validation import previews_from_config
    if config.cache.enabled:
        cache, identity = open_cache(config), cache_identity(config, model_dir)
        tensors = [cache.get(cache_key(ex, settings, identity)) for ex in held]
    else:
        tensors = [encode_example(comps, ex, settings) for ex in held]
    pairs = [HeldOutPair(ex, t) for ex, t in zip(held, tensors)]
    return HeldOutMetrics(comps, pairs, previews_from_config(config)[0].settings, out_dir)


def _release_shared(transformer) -> None:
    """Give a shared transformer back as it was lent: the trained adapter deleted (its LoRA is in its file),
    every adapter off, the training levers off (speed.release_training), eval mode, frozen."""
    from qwen_edit_core import speed
    lora_mod.remove_adapter(transformer, "default")
    speed.release_training(transformer)
    transformer.eval().requires_grad_(False)
    log.info("training done: the shared transformer is back to sampling (trained adapter removed)")


# -- one batch -------------------------------------------------------------------------------------------------
def batch_loss(config: Config, comps: comp.Components, items: Sequence, *, step: int = 0) -> torch.Tensor:
    """The loss of one batch: items holding cached tensors (dicts from the cache) train from them; dataset
    examples (`EditExample`) are encoded in real time by the loaded text encoder and VAE. Both give the same
    loss for the same batch and seed."""
    from qwen_edit_core.adapters import multires
    from qwen_edit_core.data.dataset import EditExample
    from qwen_edit_core.train.batch import collate, flow_loss, sample_generator
    comps.require("transformer")
    multires.install(comps.transformer)
    settings = encode_settings(config, config.model.variant or comps.variant)
    tensors = [encode_example(comps, item, settings) if isinstance(item, EditExample) else item for item in items]
    param = next(comps.transformer.parameters())
    gens = [sample_generator(config.train.seed, step, 0, j) for j in range(len(tensors))]
    batch = collate(tensors, gens, caption_dropout=config.data.caption_dropout_rate,
                    control_dropout=config.data.prompt_image_dropout_rate, device=param.device,
                    dtype=comps.transformer.img_in.weight.dtype, family=settings.family)
    loss, _ = flow_loss(comps.transformer, batch, config, comps.scheduler_config)
    return loss
