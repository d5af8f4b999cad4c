"""ComfyUI entry of the Qwen-Image-Edit LoRA node pack: exports the node mappings (no heavy work at import).

ComfyUI imports this directory as a package under its absolute path; the headless core beside it is put on
sys.path so the nodes can import `qwen_edit_core` (the pack is not pip-installed into ComfyUI's environment).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

#: the live training view (progress, loss curve, validation image on the training nodes), plain JavaScript
WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
