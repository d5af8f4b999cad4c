"""The synthetic pairs (the demo's and the Synthetic Demo Dataset node's): writing the same pairs again leaves every
file as it is, and other pairs replace the files whole, so a training job reading the folder never sees a file
rewritten under it or half written."""

from __future__ import annotations

from qwen_edit_core.data import synthetic
from qwen_edit_core.data.dataset import load_dataset


def test_the_same_pairs_leave_the_files_and_others_replace_them_whole(tmp_path, monkeypatch):
    from qwen_edit_core.common import files

    folder = tmp_path / "pairs"
    synthetic.write_pairs(folder, 3, seed=0)
    first = {p.name: (p.stat().st_ino, p.read_bytes()) for p in folder.iterdir()}
    written = []
    real = files.write_bytes
    monkeypatch.setattr(files, "write_bytes", lambda path, data: written.append(path.name) or real(path, data))
    synthetic.write_pairs(folder, 3, seed=0)
    assert written == [] and {p.name: (p.stat().st_ino, p.read_bytes()) for p in folder.iterdir()} == first
    synthetic.write_pairs(folder, 3, seed=1)  # other pictures, same caption: each picture replaced by a rename
    assert sorted(written) == sorted(n for n in first if n.endswith(".png"))
    assert all(p.stat().st_ino != first[p.name][0] for p in folder.glob("*.png"))
    assert len(load_dataset(folder).examples) == 3
