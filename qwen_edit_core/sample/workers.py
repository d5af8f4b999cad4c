"""A pool of worker processes that run the transformer context-parallel, one worker per device, for a process
that samples on its own (the ComfyUI Sampler node's `parallel` option, or a script).

The pool starts once: each worker is a fresh `python -m qwen_edit_core.sample.workers` (not multiprocessing's
"spawn", which would run the host's main script again in every worker: ComfyUI's main.py does not survive
that), talking to the pool over a private socket pair with multiprocessing's Connection. It receives the
transformer pickled as `torch.multiprocessing` shares tensors (CPU tensors through shared memory, CUDA ones
through CUDA IPC), moves it to its device, joins a process group of the workers alone (a file rendezvous, no
port) and splits the tokens among them with sample.context_parallel (Ulysses). A call of the pool sends the same
inputs to every worker; the workers run one context-parallel forward together and the first one sends the
output back. The pool is called like the transformer and carries its `config`, so the sampler's loop (CFG,
scheduler, previews, cancellation) stays in the calling process and the pool stands in for
`components.transformer`.

Every exchange waits on the sockets (no polling); a worker's error or exit closes the pool and raises
`WorkerError` with the worker's traceback; `close()` (also at interpreter exit, and when a pool is garbage
collected) asks each worker to stop and waits for it. Workers exit on their own when the socket to the calling
process closes, so none outlives it.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
import weakref
from multiprocessing import connection, current_process
from pathlib import Path

import torch

log = logging.getLogger(__name__)

#: devices for a pool (comma-separated, e.g. "cuda:0,cuda:1", or "cpu,cpu" to try it on the CPU); default: every
#: visible CUDA GPU
DEVICES_ENV = "QWEN_EDIT_PARALLEL_DEVICES"


class WorkerError(RuntimeError):
    """A worker of a TransformerPool failed or exited; the pool is closed."""


def parallel_devices(environ=None) -> list[str]:
    """The devices a pool runs on: $QWEN_EDIT_PARALLEL_DEVICES when set, else every visible CUDA GPU; fewer than
    two is refused (`check_devices`)."""
    environ = os.environ if environ is None else environ
    listed = environ.get(DEVICES_ENV, "").strip()
    if listed:
        return check_devices([d.strip() for d in listed.split(",") if d.strip()])
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return check_devices([f"cuda:{i}" for i in range(count)])


def check_devices(devices) -> list[str]:
    """`devices` as a list, once it holds at least two entries and no GPU twice ("cpu" may repeat: workers on
    the CPU share its cores, for trying the pool without GPUs)."""
    devices = [str(torch.device(d)) for d in devices]
    if len(devices) < 2:
        found = f"{len(devices)} ({', '.join(devices)})" if devices else "0 (no CUDA GPU)"
        raise ValueError(f"parallel sampling runs one worker per device and needs at least 2 devices; this machine "
                         f"has {found}: turn parallel off, or list the devices in ${DEVICES_ENV} (e.g. "
                         "cuda:0,cuda:1)")
    gpus = [d for d in devices if d != "cpu"]
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"parallel devices {', '.join(devices)} name a GPU twice; give each GPU once")
    return devices


#: where torch.multiprocessing puts the CPU tensors it shares (POSIX shared memory, a tmpfs on Linux)
SHM_DIR = "/dev/shm"


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    """Free bytes of the shared-memory filesystem, None where there is none (not Linux)."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def host_tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's CPU tensors not yet in shared memory: what sending it to the workers puts there (CUDA
    tensors go through CUDA IPC handles and take none)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())
               if t.device.type == "cpu" and not t.is_shared()}  # already shared: already counted as used
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check_shared_memory(module: torch.nn.Module, free: int | None = None) -> None:
    """Refuse, before any worker starts, a model whose CPU weights do not fit into the free shared memory
    (`free`: default /dev/shm's; Docker gives containers 64 MB unless told otherwise)."""
    free = shm_free_bytes() if free is None else free
    needed = host_tensor_bytes(module)
    if free is None or needed <= free:
        return
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    raise ValueError(f"parallel sampling shares the model's {gib(needed)} of CPU weights with its workers through "
                     f"{SHM_DIR}, which has {gib(free)} free: give the container more shared memory (docker run "
                     f"--shm-size={int(needed * 1.1 / 2**30) + 1}g, or a Memory-medium emptyDir on {SHM_DIR} in "
                     "Kubernetes), load the transformer on a GPU (shared through CUDA IPC, no shared memory), or "
                     "turn parallel off")


class TransformerPool:
    """`transformer` run context-parallel by one worker process per device (`mode`: sample.context_parallel's
    "ulysses" or "ring"; `attention`: the fused attention kernel the workers try first, speed.ATTENTION_KERNELS).
    Called like the transformer; `close()` when done (or use it as a context manager)."""

    def __init__(self, transformer: torch.nn.Module, devices, mode: str = "ulysses", attention: str = "auto"):
        from torch.multiprocessing import reductions

        reductions.init_reductions()  # tensors pickle as torch.multiprocessing shares them (done once by torch)
        self.config = transformer.config
        self.devices = check_devices(devices)
        check_shared_memory(transformer)
        self._dir = tempfile.mkdtemp(prefix="qwen-edit-pool-")
        rendezvous = os.path.join(self._dir, "rendezvous")
        self._conns, self.processes = [], []
        for rank in range(len(self.devices)):
            conn, process = _start_worker()
            self._conns.append(conn)
            self.processes.append(process)
        self._finalizer = weakref.finalize(self, _shutdown, self.processes, self._conns, self._dir)
        try:
            for rank, (conn, device) in enumerate(zip(self._conns, self.devices)):
                # The worker fetches shared CPU tensors from this process's resource sharer, which admits
                # processes holding this process's authentication key.
                conn.send_bytes(bytes(current_process().authkey))
                conn.send((rank, len(self.devices), device, mode, attention, rendezvous, transformer))
        except OSError as err:
            self._abort()
            raise WorkerError(f"a parallel worker exited while receiving the model: {err}") from err
        self.pids = self._gather()
        # Every worker is in the group now and nothing reads the rendezvous file again: remove it at once, so no
        # folder is left behind even when this process is killed.
        shutil.rmtree(self._dir, ignore_errors=True)
        log.info("parallel pool: %d workers on %s (PIDs %s)", len(self.devices), ", ".join(self.devices),
                 ", ".join(map(str, self.pids)))

    def __call__(self, *, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 img_shapes, encoder_hidden_states_mask: torch.Tensor | None = None, attention_kwargs=None,
                 return_dict: bool = False):
        """One context-parallel forward over the workers, with the transformer's keyword arguments; returns
        (output,) on `hidden_states`' device (or diffusers' Transformer2DModelOutput with `return_dict`)."""
        if self.closed:
            raise WorkerError("this parallel pool is closed; start a new one")
        if attention_kwargs:
            raise ValueError("a parallel pool runs diffusers' own attention: attention_kwargs (the multi-resolution "
                             "adapter's) are not passed to its workers")
        inputs = {"hidden_states": hidden_states, "timestep": timestep, "encoder_hidden_states": encoder_hidden_states,
                  "encoder_hidden_states_mask": encoder_hidden_states_mask}
        request = {k: v.detach().cpu() if v is not None else None for k, v in inputs.items()}
        request["img_shapes"] = img_shapes
        for conn in self._conns:
            conn.send(("forward", request))
        output = self._gather()[0].to(hidden_states.device)
        if return_dict:
            from diffusers.models.modeling_outputs import Transformer2DModelOutput
            return Transformer2DModelOutput(sample=output)
        return (output,)

    def _gather(self) -> list:
        """One reply from every worker, in rank order; a worker's error or exit closes the pool and raises."""
        replies, pending = {}, {conn: rank for rank, conn in enumerate(self._conns)}
        while pending:
            for conn in connection.wait(list(pending)):
                rank = pending.pop(conn)
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    code = self.processes[rank].wait()
                    kind, value = "error", f"the worker exited (exit code {code}; its output is on stderr)"
                if kind == "error":
                    self._abort()
                    raise WorkerError(f"parallel worker {rank} on {self.devices[rank]} failed:\n{value}")
                replies[rank] = value
        return [replies[rank] for rank in range(len(self._conns))]

    def _abort(self) -> None:
        """Stop every worker at once (the others may wait in a collective for the failed one), then close."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        self.close()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Ask every worker to stop, wait for it, and free the rendezvous folder (idempotent)."""
        self._finalizer()

    def __enter__(self) -> "TransformerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _start_worker() -> tuple[connection.Connection, subprocess.Popen]:
    """A fresh Python running this module's `main`, and the Connection to it (one end of a socket pair)."""
    ours, theirs = socket.socketpair()
    root = str(Path(__file__).resolve().parents[2])  # the folder holding qwen_edit_core
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    process = subprocess.Popen([sys.executable, "-m", "qwen_edit_core.sample.workers", str(theirs.fileno())],
                               pass_fds=[theirs.fileno()], env=env, cwd=root)
    theirs.close()  # ours alone stays open here: the worker's exit reads as EOF
    return connection.Connection(ours.detach()), process


def _shutdown(processes, conns, folder: str) -> None:
    for conn in conns:
        try:
            conn.send(("close", None))
        except OSError:
            pass  # the worker is gone already
    for process, conn in zip(processes, conns):
        process.wait()
        conn.close()
    shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> None:
    """A worker's entry (`python -m qwen_edit_core.sample.workers FD`): FD is its end of the socket pair."""
    import importlib

    from torch.multiprocessing import reductions

    reductions.init_reductions()  # the model's shared tensors unpickle through these
    importlib.import_module("diffusers.models")  # while the pool sends the model, not after it
    conn = connection.Connection(int((argv or sys.argv)[1]))
    try:
        current_process().authkey = conn.recv_bytes()
        args = conn.recv()
    except EOFError:
        return  # the pool closed before this worker started
    _worker(conn, *args)
    # Served, group destroyed, socket closed: leave without the interpreter's teardown, as multiprocessing's own
    # children do (os._exit after their target). A gloo thread torch has not joined by then can abort the process
    # in its C++ destructors ("terminate called without an active exception", exit code -6) after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(conn, rank: int, world: int, device: str, mode: str, attention: str, rendezvous: str,
            transformer: torch.nn.Module) -> None:
    """A worker's life: ready the transformer and the group, then serve forwards until told to close."""
    import torch.distributed as dist

    from qwen_edit_core.sample import context_parallel

    try:
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        transformer = transformer.to(device).eval()
        dist.init_process_group(context_parallel.group_backend(device), init_method=f"file://{rendezvous}",
                                rank=rank, world_size=world)
        context_parallel.enable(transformer, world, mode)
        conn.send(("ready", os.getpid()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        _serve(conn, transformer, rank, device, attention)
    finally:
        dist.destroy_process_group()
        conn.close()


@torch.no_grad()
def _serve(conn, transformer: torch.nn.Module, rank: int, device: torch.device, attention: str) -> None:
    """Run each forward request; the first worker replies with the output, the others with None."""
    from qwen_edit_core import speed

    while True:
        try:
            kind, request = conn.recv()
        except (EOFError, OSError):
            return  # the calling process is gone
        if kind == "close":
            return
        try:
            inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in request.items()}
            with speed.attention_kernel(attention):
                output = transformer(**inputs, return_dict=False)[0]
            conn.send(("done", output.cpu() if rank == 0 else None))
        except Exception:
            conn.send(("error", traceback.format_exc()))


# -- the pool a host keeps (the ComfyUI node pack) --------------------------------------------------------------
#: key -> (weak reference to the transformer, its pool, the finalizer that closes the pool when the transformer goes)
_POOLS: dict = {}


def shared_pool(transformer: torch.nn.Module, devices, *, mode: str = "ulysses", attention: str = "auto",
                tag=()) -> TransformerPool:
    """The running pool for this transformer object, devices, mode, attention kernel and `tag` (e.g. the LoRA
    stack active when it started: the workers hold the transformer as it was then), started on first use and
    reused after. One pool at a time: a new key closes the previous pool (each worker holds a copy of the
    model on its device). The pool closes when its transformer is garbage collected, or by `close_pool_of` when
    the host frees or offloads the transformer's weights."""
    key = (id(transformer), tuple(check_devices(devices)), mode, attention, tag)
    entry = _POOLS.get(key)
    if entry is not None and entry[0]() is transformer and not entry[1].closed:
        return entry[1]
    close_pools()
    pool = TransformerPool(transformer, key[1], mode, attention)
    # The workers' copies (one per GPU, or a mapping of the shared CPU weights) would keep the model's memory in
    # use after the host dropped it: they go with it.
    _POOLS[key] = (weakref.ref(transformer), pool, weakref.finalize(transformer, pool.close))
    return pool


def close_pool_of(module: torch.nn.Module) -> bool:
    """Close the pool `shared_pool` started for `module` (its workers exit and their copies of it are freed), for
    a host that frees or offloads `module`'s weights; returns whether one was running. The next `shared_pool`
    starts a new one."""
    pools = [pool for ref, pool, _ in list(_POOLS.values()) if ref() is module and not pool.closed]
    for pool in pools:
        pool.close()
    return bool(pools)


def close_pools() -> None:
    """Close every pool `shared_pool` started."""
    for _, pool, finalizer in list(_POOLS.values()):
        finalizer.detach()
        pool.close()
    _POOLS.clear()


atexit.register(close_pools)


if __name__ == "__main__":
    main()
