"""What a training run holds on its device (speed/device_use.py), measured with stand-ins on the CPU."""

import socket

import torch

from qwen_edit_core.speed.device_use import run_storages


def test_a_sharded_runs_storages_are_its_shards():
    """FSDP2 turns the frozen weights into DTensors, whose own storage has no data pointer: the run's storages are
    their local shards (the step's progress event reads them with every step)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert all(type(p).__name__ == "DTensor" for p in model.parameters())
        found = run_storages(model, None, torch.device("cpu"))
        shards = [p.to_local() for p in model.parameters()]
    finally:
        dist.destroy_process_group()
    assert found == {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in shards}
    assert sum(found.values()) >= (4 * 4 + 4 + 4 * 2 + 2) * 4
