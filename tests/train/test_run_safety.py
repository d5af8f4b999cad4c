"""Small things a real multi-GPU run relies on: seeds, RNG state, fp32 flow maths, one empty prompt, the job
registry's device names, RoPE tables, DDP settings and validation on rank 0."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from conftest import train_config
from tolerances import TINY_TEXT_ENCODER_ROUNDINGS, assert_close_fp32


def test_per_sample_seeds_never_collide():
    from qwen_edit_core.train.batch import sample_generator
    # A weighted sum gave (step 1, micro 0, index 0) the seed of (step 0, micro 99, index 8).
    a, b = sample_generator(0, 1, 0, 0), sample_generator(0, 0, 99, 8)
    assert a.initial_seed() != b.initial_seed()
    assert not torch.equal(torch.randn(8, generator=a), torch.randn(8, generator=b))
    seeds = {sample_generator(7, s, m, i).initial_seed() for s in range(30) for m in range(30) for i in range(12)}
    assert len(seeds) == 30 * 30 * 12
    assert sample_generator(7, 3, 1, 2).initial_seed() == sample_generator(7, 3, 1, 2).initial_seed()


def test_checkpoint_rng_state_is_the_training_devices_generator(monkeypatch):
    """A run on cuda:1 saves and restores cuda:1's generator (LoRA dropout draws there), not the current
    device's (cuda:0), and never every GPU's; a resume on another GPU restores it onto that GPU."""
    from qwen_edit_core.train import checkpoint
    calls = []
    fake = torch.arange(16, dtype=torch.uint8)

    def everywhere():
        raise AssertionError("get_rng_state_all creates a CUDA context on every visible GPU")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", everywhere)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: everywhere())
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": calls.append(("get", device)) or fake)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": calls.append(("set", device, state)))
    state = checkpoint.rng_state(torch.device("cuda:1"))
    assert calls == [("get", 1)] and torch.equal(state["cuda"], fake)
    checkpoint.set_rng_state(state, "cuda:1")
    assert calls[1][:2] == ("set", 1) and torch.equal(calls[1][2], fake)
    checkpoint.set_rng_state(state, "cuda:2")  # resumed on another GPU: the saved generator goes there
    assert calls[2][:2] == ("set", 2)
    calls.clear()
    assert checkpoint.rng_state("cuda")["cuda_index"].item() == 0 and calls == [("get", 0)]  # bare: current one
    calls.clear()
    assert "cuda" not in checkpoint.rng_state("cpu") and calls == []  # a CPU run touches no GPU
    # A checkpoint of an earlier version (one row per visible GPU) restores the training device's row.
    checkpoint.set_rng_state({**state, "cuda": torch.stack([fake * 0, fake + 1, fake + 2, fake + 3])}, "cuda:3")
    assert calls[0][1] == 3 and torch.equal(calls[0][2], fake + 3)


def test_checkpoint_saves_the_generator_of_the_runs_device(tmp_path, monkeypatch):
    """The loop hands its training device to the checkpoint writer (which GPU's generator is saved)."""
    from qwen_edit_core.train import checkpoint
    asked = []
    monkeypatch.setattr(checkpoint, "rng_state", lambda device=None: asked.append(device) or {})
    checkpoint.save_checkpoint(tmp_path, 1, adapter={"a": torch.zeros(1)}, optimizer={}, state={},
                               write_lora=lambda path: path.write_bytes(b""), device=torch.device("cuda:1"))
    assert asked == [torch.device("cuda:1")]


def test_a_run_checkpoints_its_training_devices_generator(tiny_edit_dir, pairs_dir, tmp_path, monkeypatch):
    from qwen_edit_core import QwenImageEditTrainer
    from qwen_edit_core.train import checkpoint
    real, asked = checkpoint.rng_state, []
    monkeypatch.setattr(checkpoint, "rng_state", lambda device=None: asked.append(device) or real(device))
    QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", train={"max_steps": 1})).fit()
    assert asked == [torch.device("cpu")]


class _ZeroModel(torch.nn.Module):
    """Records the model input and predicts zeros (so the loss is the mean squared flow target)."""

    def __init__(self):
        super().__init__()
        self.inputs = []

    def forward(self, hidden_states, **kwargs):
        self.inputs.append(hidden_states)
        return (torch.zeros_like(hidden_states),)


def test_flow_target_and_noisy_input_are_formed_in_fp32_on_a_bf16_base(tiny_edit_dir, pairs_dir, tmp_path):
    from qwen_edit_core.sample import flow
    from qwen_edit_core.train.batch import collate, flow_loss, sample_generator
    from qwen_edit_core.families.qwen_image import encode
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(16, 1, 8, 8, generator=g) * 3
    item = {"target_latents": latents, "control_latents_0": torch.randn(16, 1, 8, 8, generator=g),
            "prompt_embeds": torch.randn(5, 32, generator=g), "empty_prompt_embeds": torch.randn(4, 32, generator=g),
            "img_shapes": torch.tensor([[1, 4, 4], [1, 4, 4]])}
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path, train={"timestep_sampling": "uniform"})
    batch = collate([item], [sample_generator(0, 0, 0, 0)], caption_dropout=0.0, control_dropout=0.0,
                    device=torch.device("cpu"), dtype=torch.bfloat16)
    model = _ZeroModel()
    loss, _ = flow_loss(model, batch, config, {})
    # The same draws by hand, in fp32: two dropout draws, the noise, then sigma.
    gen = sample_generator(0, 0, 0, 0)
    torch.rand((), generator=gen), torch.rand((), generator=gen)
    x0 = encode.pack(latents[None])[0]
    noise = torch.randn(x0.shape, generator=gen, dtype=torch.float32)
    sigma = flow.sample_sigmas(1, "uniform", generator=gen, device="cpu")
    assert loss.dtype == torch.float32
    # the same squares, their mean over the channels and over the tokens, summed in another order
    assert_close_fp32(loss, (noise - x0).pow(2).mean(), ops=sum(x0.shape), what="loss of a zero prediction")
    expected_input = ((1 - sigma) * x0 + sigma * noise).to(torch.bfloat16)
    assert model.inputs[0].dtype == torch.bfloat16
    assert torch.equal(model.inputs[0][0, : x0.shape[0]], expected_input)


def test_one_empty_prompt_for_caption_dropout_negative_prompt_and_predict(tiny_edit_dir, pairs_dir, tmp_path):
    from qwen_edit_core import QwenImageEditTrainer
    from qwen_edit_core.config import PredictConfig
    from qwen_edit_core.data.example_tensors import cache_key, encoder_identity
    from qwen_edit_core.families.templates import EMPTY_PROMPT
    from qwen_edit_core.sample.sampler import SampleSettings
    predict_default = inspect.signature(QwenImageEditTrainer.predict).parameters["negative_prompt"].default
    assert predict_default == SampleSettings().negative_prompt == PredictConfig().negative_prompt == EMPTY_PROMPT
    trainer = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path))
    example = trainer.dataset().examples[0]
    trainer.cache([example])
    settings = trainer.encode_settings("edit")
    entry = trainer._cache().get(cache_key(example, settings, encoder_identity(tiny_edit_dir)))
    trainer.config = train_config(tiny_edit_dir, pairs_dir, tmp_path, predict={"vae_area": 64 * 64})
    trainer.load_model(("text_encoder",))
    from qwen_edit_core.data.dataset import load_rgb
    negative, _ = trainer.encode_prompt(predict_default, load_rgb(example.controls[0]))
    # (encoded in a batch with the caption there, alone here: equal up to the padded batch's rounding)
    assert_close_fp32(entry["empty_prompt_embeds"], negative[0].float(), ops=TINY_TEXT_ENCODER_ROUNDINGS,
                      what="empty prompt encoded in a batch vs alone")


class _ParkedJob:
    """A job that never finishes (the registry only needs its name, device, config and status)."""

    finished = False

    def __init__(self, config, *, name=None, resume=None, **_):
        self.config, self.device = config, config.train.device
        self.name, self.output_dir = name or config.train.lora_name, config.train.output_dir

    def start(self):
        return self

    def status(self):
        return SimpleNamespace(step=0, total=1, state="training")


def test_job_registry_treats_cuda_and_cuda0_as_one_device(monkeypatch, tiny_edit_dir, pairs_dir, tmp_path):
    from qwen_edit_core import jobs
    monkeypatch.setattr(jobs, "TrainingJob", _ParkedJob)
    registry = jobs.JobRegistry()
    registry.start(train_config(tiny_edit_dir, pairs_dir, tmp_path / "a", train={"device": "cuda"}), name="a")
    with pytest.raises(jobs.JobBusyError, match="already runs on cuda"):
        registry.start(train_config(tiny_edit_dir, pairs_dir, tmp_path / "b", train={"device": "cuda:0"}), name="b")
    registry.start(train_config(tiny_edit_dir, pairs_dir, tmp_path / "c", train={"device": "cuda:1"}), name="c")
    assert len(registry.running()) == 2


def test_rope_tables_are_copied_to_the_device_once(tiny_edit_dir):
    from torch.overrides import TorchFunctionMode
    from qwen_edit_core.adapters import multires
    from qwen_edit_core.model.components import load_components
    from qwen_edit_core.model.devices import DevicePlan
    transformer = load_components(tiny_edit_dir, DevicePlan.from_mapping({}), which=("transformer",)).transformer
    multires.install(transformer)
    shapes = [[(1, 4, 4), (1, 4, 4)], [(1, 2, 4), (1, 2, 4), (8, 1, 1)]]

    class CountCopies(TorchFunctionMode):
        copies = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.Tensor.to and isinstance(out, torch.Tensor) and out.device != args[0].device:
                CountCopies.copies += 1
            return out

    counts = []
    for _ in range(3):
        CountCopies.copies = 0
        with CountCopies():
            image, text = transformer.pos_embed(shapes, device=torch.device("meta"), max_txt_seq_len=7)
        counts.append(CountCopies.copies)
    assert image.device.type == "meta" and text.shape[:2] == (2, 7)
    assert counts == [2, 0, 0]  # pos and neg tables once, then never again


def test_ddp_broadcasts_no_buffers_and_waits_long_enough_for_validation(monkeypatch, tiny_edit_dir, pairs_dir,
                                                                           tmp_path):
    import accelerate
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
    from qwen_edit_core.train import distributed
    made = {}

    class FakeAccelerator:
        def __init__(self, **kwargs):
            made.update(kwargs)
            self.process_index = 1

    monkeypatch.setattr(accelerate, "Accelerator", FakeAccelerator)
    monkeypatch.setenv("WORLD_SIZE", "2")
    distributed.Distributed(train_config(tiny_edit_dir, pairs_dir, tmp_path))
    handlers = {type(h): h for h in made["kwargs_handlers"]}
    assert handlers[DistributedDataParallelKwargs].broadcast_buffers is False
    assert handlers[DistributedDataParallelKwargs].find_unused_parameters is False  # every LoRA parameter is used
    assert handlers[InitProcessGroupKwargs].timeout >= distributed.COLLECTIVE_TIMEOUT


@pytest.mark.parametrize("is_main", [True, False])
def test_every_rank_waits_for_validation_at_a_barrier(tiny_edit_dir, pairs_dir, tmp_path, is_main):
    from qwen_edit_core.train.loop import after_step
    events = []
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path, train={"validation_every": 2})
    dist = SimpleNamespace(is_main=is_main, fsdp=False, world=1, sum_read=lambda t: t.tolist(),
                           barrier=lambda: events.append("barrier"))
    run = SimpleNamespace(config=config, step=2, dist=dist, losslog=None, transformer=torch.nn.Linear(1, 1),
                          lr_scheduler=SimpleNamespace(get_last_lr=lambda: [0.1]), pending=[],
                          step_skip=torch.tensor(0.0), drawn=[], ema=None, regions=None)
    after_step(run, torch.tensor(0.5), write_lora=None, progress=None,
               validate=lambda step: events.append("validate"))
    assert events == (["validate", "barrier"] if is_main else ["barrier"])


def test_data_parallel_broadcasts_only_the_lora_at_wrap(tiny_edit_dir, monkeypatch):
    """DDP broadcasts from rank 0, when it wraps the model, every parameter and buffer it is not told to ignore:
    `ignore_frozen` leaves the frozen base out (every process loaded it from the same files), so only the LoRA
    travels (a one-process gloo group here; the broadcast is the same call with more processes)."""
    import socket

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from qwen_edit_core.adapters import lora
    from qwen_edit_core.model.components import load_transformer
    from qwen_edit_core.train import distributed

    model = load_transformer(tiny_edit_dir, device=torch.device("cpu"), dtype=torch.float32)
    lora.inject_lora(model, lora.LoraSpec(rank=4, alpha=4.0, targets=lora.TARGET_PRESETS["attn"]))
    sent = []
    real = dist._broadcast_coalesced
    monkeypatch.setattr(dist, "_broadcast_coalesced", lambda group, tensors, *a: sent.extend(tensors) or
                        real(group, tensors, *a))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        assert distributed.ignore_frozen(model) > 0
        DistributedDataParallel(model, broadcast_buffers=False)
    finally:
        dist.destroy_process_group()
    trainable = {p.data_ptr() for p in model.parameters() if p.requires_grad}  # DDP sends detached views
    assert sent and {t.data_ptr() for t in sent} <= trainable, len(sent)
    assert sum(t.numel() for t in sent) == sum(p.numel() for p in model.parameters() if p.requires_grad)
