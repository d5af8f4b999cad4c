"""Template thumbnails: ComfyUI's template browser shows `example_workflows/<name>.jpg` beside each
`<name>.json` (ComfyUI app/custom_node_manager.py serves the folder; the frontend asks for `<name>.jpg`).
Each thumbnail is the picture the workflow itself drew when it ran on the built-in toy model: the last
picture output node's picture in the graph's order (a validation edit, the edited image, the loss plot)."""

from __future__ import annotations

import shutil
from pathlib import Path

#: the template card is 256 px wide; the toy model's pictures are 128 px, so they are scaled up 2x
SIDE = 256


def output_picture(server, entry: dict) -> Path | None:
    """The file of the last picture in a prompt's history entry (output nodes in graph order), or None."""
    found = None
    for node_id in sorted(entry.get("outputs", {}), key=int):
        for image in entry["outputs"][node_id].get("images", []):
            found = server.base / image["type"] / image.get("subfolder", "") / image["filename"]
    return found


def write_thumbnail(picture: Path, target: Path) -> Path:
    """`picture` as a JPEG at `target`, fitted into SIDE x SIDE (nearest-neighbour so toy pixels stay sharp)."""
    from PIL import Image

    with Image.open(picture) as image:
        image = image.convert("RGB")
        scale = SIDE / max(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        target.parent.mkdir(parents=True, exist_ok=True)
        image.resize(size, Image.NEAREST if scale >= 1 else Image.LANCZOS).save(target, "JPEG", quality=90)
    return target


def keep_thumbnail(server, entry: dict, name: str, out: Path, install: Path | None) -> str:
    """Write `<out>/thumbnails/<name>.jpg` from the run's picture; copy it into `install` when given."""
    picture = output_picture(server, entry)
    if picture is None:
        raise AssertionError(f"{name}: the workflow drew no picture for its template thumbnail")
    made = write_thumbnail(picture, out / "thumbnails" / f"{name}.jpg")
    if install is not None:
        shutil.copyfile(made, install / made.name)
    return f"thumbnail {made} from {picture.name}"
