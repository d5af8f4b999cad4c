"""The one module that touches ComfyUI (comfy.*, folder_paths, server). Imported lazily; outside ComfyUI
(tests, scripts) every function falls back to a plain, documented behaviour."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

QWEN_EDIT_FOLDER = "qwen_edit"


def in_comfy() -> bool:
    try:
        import folder_paths  # noqa: F401
        return True
    except ImportError:
        return False


def register_folders() -> None:
    """Register `models/qwen_edit` for diffusers-layout model directories (idempotent)."""
    if not in_comfy():
        return
    import folder_paths
    if QWEN_EDIT_FOLDER not in folder_paths.folder_names_and_paths:
        folder_paths.add_model_folder_path(QWEN_EDIT_FOLDER, os.path.join(folder_paths.models_dir, QWEN_EDIT_FOLDER))


def model_dirs() -> list[str]:
    """Diffusers-layout model directories under every registered `qwen_edit` folder."""
    if not in_comfy():
        return []
    import folder_paths
    register_folders()
    found = []
    for root in folder_paths.get_folder_paths(QWEN_EDIT_FOLDER):
        if os.path.isdir(root):
            found += sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "model_index.json")))
    return found


def model_dir_path(name: str) -> Path | None:
    if not in_comfy():
        return None
    import folder_paths
    for root in folder_paths.get_folder_paths(QWEN_EDIT_FOLDER):
        if os.path.isfile(os.path.join(root, name, "model_index.json")):
            return Path(root) / name
    return None


def default_model_root() -> Path:
    """Where the built-in tiny model is built: models/qwen_edit in ComfyUI, else ~/.cache/qwen-edit."""
    if in_comfy():
        import folder_paths
        return Path(folder_paths.models_dir) / QWEN_EDIT_FOLDER
    return Path(os.environ.get("QWEN_EDIT_HOME", Path.home() / ".cache" / "qwen-edit"))


def folder_files(kind: str, suffix: str = "") -> list[str]:
    """Files of a ComfyUI model folder ("diffusion_models", "vae", "loras"...), optionally by suffix."""
    if not in_comfy():
        return []
    import folder_paths
    return [f for f in folder_paths.get_filename_list(kind) if f.endswith(suffix)]


def folder_file_path(kind: str, name: str) -> Path:
    """Full path of a file of a ComfyUI model folder (or `name` itself outside ComfyUI)."""
    if not in_comfy():
        return Path(name)
    import folder_paths
    return Path(folder_paths.get_full_path_or_raise(kind, name))


def comfyui_dir() -> Path | None:
    """The running ComfyUI's installation (the folder holding its `comfy` package, where it keeps its bundled
    tokenizers, comfy/text_encoders/qwen25_tokenizer/); None outside ComfyUI."""
    if not in_comfy():
        return None
    import comfy
    return Path(list(comfy.__path__)[0]).resolve().parent


def loras_dir() -> Path:
    if not in_comfy():
        return Path(os.environ.get("QWEN_EDIT_LORAS", Path.cwd() / "loras"))
    import folder_paths
    return Path(folder_paths.get_folder_paths("loras")[0])


def output_dir() -> Path:
    if not in_comfy():
        return Path(os.environ.get("QWEN_EDIT_OUTPUT", Path.cwd() / "output"))
    import folder_paths
    return Path(folder_paths.get_output_directory())


def input_dir() -> Path:
    if not in_comfy():
        return Path.cwd()
    import folder_paths
    return Path(folder_paths.get_input_directory())


class _NoBar:
    def update_absolute(self, value, total=None, preview=None):
        pass


def progress_bar(total: int, node_id=None):
    """ComfyUI's ProgressBar (it also raises on a user interrupt) or a no-op."""
    if not in_comfy():
        return _NoBar()
    import comfy.utils
    return comfy.utils.ProgressBar(total, node_id=node_id)


def interrupt_requested() -> bool:
    if not in_comfy():
        return False
    import comfy.model_management
    return comfy.model_management.processing_interrupted()


def raise_if_interrupted() -> None:
    if in_comfy():
        import comfy.model_management
        comfy.model_management.throw_exception_if_processing_interrupted()


def free_device_memory(device: str) -> bool:
    """Ask ComfyUI to unload every model it loaded on `device` (a torch device name; "cuda" is "cuda:0") and
    empty the CUDA cache, before a training job needs the memory: `comfy.model_management.free_memory` with
    more bytes than any device has (what its own `unload_all_models` does for its default device), then
    `soft_empty_cache`. Our pack's components are not ComfyUI models and stay. Returns whether ComfyUI was
    asked (not outside ComfyUI, not for the CPU)."""
    import torch
    target = torch.device(device)
    if not in_comfy() or target.type == "cpu":
        return False
    if target.index is None:
        target = torch.device(target.type, 0)
    import comfy.model_management
    unloaded = comfy.model_management.free_memory(1e30, target)
    comfy.model_management.soft_empty_cache()
    log.info("asked ComfyUI to free %s: %d of its models unloaded", target, len(unloaded or ()))
    return True


def prompt_server():
    """The running ComfyUI server (`server.PromptServer.instance`), or None outside one."""
    if not in_comfy():
        return None
    try:
        from server import PromptServer
    except ImportError:
        return None
    return getattr(PromptServer, "instance", None)


def send_event(event: str, data: dict, *, broadcast: bool = False) -> None:
    """A custom websocket event to the ComfyUI frontend: to the client that queued the running prompt, or to
    every connected client with `broadcast` (jobs outlive the prompt that started them); no-op outside."""
    server = prompt_server()
    if server is None:
        return
    try:
        server.send_sync(event, data, None if broadcast else server.client_id)
    except Exception:  # noqa: BLE001 - progress events must never break a run
        log.debug("could not send %s", event, exc_info=True)


def other_prompts_queued() -> bool:
    """True when ComfyUI's queue holds a prompt besides the running one (a waiting node should let it run)."""
    server = prompt_server()
    if server is None:
        return False
    return server.prompt_queue.get_tasks_remaining() > 1
