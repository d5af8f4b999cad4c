"""The embedding cache: content addressing, reuse, invalidation, damaged and stale entries, atomic writes,
killed and concurrent writers."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen_edit_core.data.cache import (CACHE_FORMAT_VERSION, CACHE_TENSORS, CacheKey, EmbeddingCache, component_identity,
                                  hash_file)

REPO = Path(__file__).resolve().parents[2]


def _key(**kw):
    base = dict(image_hashes=("a" * 64, "b" * 64), caption="make it blue", component_identity="c0ffee",
                vae_area=4096, vl_area=0, target_bucket=(64, 64), control_buckets=((64, 64),), template="edit",
                prefix_len=64, dtype="float32")
    return CacheKey(**{**base, **kw})


def _tensors(seed=0, h=8, w=8):
    """A consistent entry: latents (16, 1, h, w) and img_shapes in packed units (h / 2, w / 2)."""
    g = torch.Generator().manual_seed(seed)
    return {"target_latents": torch.randn(16, 1, h, w, generator=g),
            "control_latents_0": torch.randn(16, 1, 8, 8, generator=g),
            "prompt_embeds": torch.randn(5, 32, generator=g), "empty_prompt_embeds": torch.randn(3, 32, generator=g),
            "img_shapes": torch.tensor([[1, h // 2, w // 2], [1, 4, 4]])}


def _files(root):
    return sorted(p.relative_to(root).as_posix() for p in Path(root).rglob("*") if p.is_file())


def _recompute(cache, key):
    calls = []
    got, hit = cache.get_or_compute(key, lambda: calls.append(1) or _tensors(1))
    return hit, calls


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- keys -------------------------------------------------------------------------------------------------

def test_metadata_round_trip_and_stable_digest():
    key = _key()
    meta = key.to_metadata()
    assert all(isinstance(v, str) for v in meta.values())
    assert meta["caption"] == "make it blue" and meta["format_version"] == str(CACHE_FORMAT_VERSION)
    assert CacheKey.from_metadata(meta) == key
    # lists (as JSON or a caller gives them) normalize to tuples: same key, same digest
    listed = _key(image_hashes=["a" * 64, "b" * 64], target_bucket=[64, 64], control_buckets=[[64, 64]])
    assert listed == key and listed.digest() == key.digest() and hash(listed) == hash(key)
    # pinned (for a format-1 key): changing the canonical form silently orphans every cache on disk
    assert _key(format_version=1).digest() == "241b0cecde000b90079d0ffb7ec08514610f829dcfa5e64f18a6fbe74601da7f"


@pytest.mark.parametrize("bad", [dict(dtype="int64"), dict(dtype="float33"), dict(vae_area="4096"),
                                 dict(image_hashes="a" * 64), dict(image_hashes=("a" * 64,)),
                                 dict(target_bucket=(64, 64, 1)), dict(prefix_len=True)])
def test_malformed_keys_are_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        _key(**bad)


def test_from_metadata_refuses_missing_fields():
    meta = _key().to_metadata()
    del meta["prefix_len"]
    with pytest.raises(ValueError, match="prefix_len"):
        CacheKey.from_metadata(meta)


# --- round trip and reuse -----------------------------------------------------------------------------------

def test_round_trip_and_reuse_across_instances(tmp_path):
    key = _key()
    path = EmbeddingCache(tmp_path).put(key, _tensors())
    digest = key.digest()
    assert path == tmp_path / digest[:2] / f"{digest}.safetensors" == EmbeddingCache(tmp_path).path_for(key)
    other = EmbeddingCache(tmp_path)
    got, hit = other.get_or_compute(key, lambda: pytest.fail("must not recompute"))
    assert hit and _equal(got, _tensors())
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in got.values())
    assert other.stats() == {"hits": 1, "misses": 0, "recomputed": 0}
    with safe_open(str(path), framework="pt") as fh:
        assert CacheKey.from_metadata(fh.metadata()) == key and fh.metadata()["format_version"] == str(CACHE_FORMAT_VERSION)
    assert other.contains(key) and not other.contains(_key(caption="other"))


def test_put_stores_the_key_dtype_and_a_miss_returns_what_a_hit_returns(tmp_path):
    key = _key(dtype="bfloat16")
    tensors = _tensors()
    tensors["control_latents_0"] = tensors["control_latents_0"].transpose(2, 3)  # not contiguous
    tensors["img_shapes"] = tensors["img_shapes"].to(torch.int32)
    computed, hit = EmbeddingCache(tmp_path).get_or_compute(key, lambda: tensors)
    stored, hit2 = EmbeddingCache(tmp_path).get_or_compute(key, lambda: pytest.fail("must not recompute"))
    assert not hit and hit2 and _equal(computed, stored)
    assert stored["prompt_embeds"].dtype == torch.bfloat16 and stored["img_shapes"].dtype == torch.int64
    assert stored["control_latents_0"].is_contiguous()


def test_same_images_and_caption_hit_from_another_dataset(tmp_path):
    first, second = tmp_path / "set1", tmp_path / "set2"
    for folder in (first, second):
        folder.mkdir()
        (folder / "t.png").write_bytes(b"target bytes")
        (folder / "c.png").write_bytes(b"control bytes")
    keys = [_key(image_hashes=(hash_file(f / "t.png"), hash_file(f / "c.png"))) for f in (first, second)]
    cache = EmbeddingCache(tmp_path / "cache")
    cache.put(keys[0], _tensors())
    assert keys[0] == keys[1] and _equal(cache.get(keys[1]), _tensors())


# --- invalidation ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change", [dict(caption="make it red"), dict(image_hashes=("a" * 64, "c" * 64)),
                                    dict(component_identity="other"), dict(vae_area=8192), dict(vl_area=1),
                                    dict(target_bucket=(96, 64)), dict(control_buckets=((32, 64),)),
                                    dict(template="edit-plus"), dict(prefix_len=34), dict(dtype="bfloat16"),
                                    dict(format_version=CACHE_FORMAT_VERSION + 1)])
def test_every_key_field_changes_the_entry(tmp_path, change):
    cache = EmbeddingCache(tmp_path)
    cache.put(_key(), _tensors())
    changed = _key(**change)
    assert changed.digest() != _key().digest()
    assert cache.path_for(changed) != cache.path_for(_key()) and cache.get(changed) is None
    assert cache.get(_key()) is not None  # the old entry is untouched


def test_one_changed_image_byte_is_a_miss(tmp_path):
    image = tmp_path / "target.png"
    image.write_bytes(bytes(range(256)) * 10)
    cache = EmbeddingCache(tmp_path / "cache")
    cache.put(_key(image_hashes=(hash_file(image), "b" * 64)), _tensors())
    data = bytearray(image.read_bytes())
    data[1234] ^= 1
    image.write_bytes(bytes(data))
    assert cache.get(_key(image_hashes=(hash_file(image), "b" * 64))) is None


def test_writing_a_key_of_another_format_version_is_refused(tmp_path):
    with pytest.raises(ValueError, match="format"):
        EmbeddingCache(tmp_path).put(_key(format_version=CACHE_FORMAT_VERSION + 1), _tensors())


# --- damaged, stale and incomplete entries -----------------------------------------------------------------

@pytest.mark.parametrize("keep", [100, -1, 7])
def test_truncated_entry_is_removed_and_recomputed(tmp_path, caplog, keep):
    cache, key = EmbeddingCache(tmp_path), _key()
    path = cache.put(key, _tensors())
    path.write_bytes(path.read_bytes()[:keep])
    with caplog.at_level(logging.WARNING, logger="qwen_edit_core.data.cache"):
        assert not cache.contains(key) and not path.exists()
    assert "unreadable" in caplog.text
    cache.put(key, _tensors())
    path.write_bytes(path.read_bytes()[:keep])
    hit, calls = _recompute(cache, key)
    assert not hit and calls == [1] and cache.stats()["recomputed"] == 2
    assert _equal(cache.get(key), _tensors(1))


def _write_raw(cache, key, tensors, metadata):
    path = cache.path_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path, metadata=metadata)
    return path


def test_tampered_metadata_is_stale(tmp_path, caplog):
    cache, key = EmbeddingCache(tmp_path), _key()
    path = _write_raw(cache, key, _tensors(), _key(caption="something else").to_metadata())
    with caplog.at_level(logging.WARNING, logger="qwen_edit_core.data.cache"):
        assert cache.get(key) is None
    assert not path.exists() and "stale" in caplog.text and "caption" in caplog.text
    hit, calls = _recompute(cache, key)
    assert not hit and calls == [1]


@pytest.mark.parametrize("metadata", [None, {"format_version": "1"}, {**_key().to_metadata(), "format_version": "0"},
                                      {**_key().to_metadata(), "vae_area": "not json"}])
def test_missing_or_old_metadata_is_rejected(tmp_path, metadata):
    cache, key = EmbeddingCache(tmp_path), _key()
    path = _write_raw(cache, key, _tensors(), metadata)
    assert cache.get(key) is None and not path.exists() and cache.stats()["recomputed"] == 1


def _bad_entries():
    t = _tensors
    return {"missing control": {k: v for k, v in t().items() if k != "control_latents_0"},
            "missing empty prompt": {k: v for k, v in t().items() if k != "empty_prompt_embeds"},
            "extra control": {**t(), "control_latents_1": t()["control_latents_0"]},
            "wrong dtype": {**t(), "prompt_embeds": t()["prompt_embeds"].to(torch.float16)},
            "int latents": {**t(), "target_latents": t()["target_latents"].to(torch.int64)},
            "packed latents": {**t(), "target_latents": t()["target_latents"].reshape(16, 64)},
            "prompt rank": {**t(), "prompt_embeds": t()["prompt_embeds"][None]},
            "prompt widths": {**t(), "empty_prompt_embeds": torch.zeros(3, 31)},
            "channels": {**t(), "control_latents_0": torch.zeros(8, 1, 8, 8)},
            "img_shapes rows": {**t(), "img_shapes": torch.tensor([[1, 4, 4]])},
            "img_shapes values": {**t(), "img_shapes": torch.tensor([[1, 4, 4], [1, 2, 8]])},
            "img_shapes float": {**t(), "img_shapes": torch.tensor([[1.0, 4, 4], [1, 4, 4]])}}


@pytest.mark.parametrize("name", sorted(_bad_entries()))
def test_incomplete_or_malformed_entries_are_rejected_on_read_and_refused_on_write(tmp_path, name):
    cache, key = EmbeddingCache(tmp_path), _key()
    tensors = _bad_entries()[name]
    path = _write_raw(cache, key, tensors, key.to_metadata())
    assert not cache.contains(key) and not path.exists()
    _write_raw(cache, key, tensors, key.to_metadata())
    assert cache.get(key) is None and not path.exists() and cache.stats()["recomputed"] == 2
    if name not in ("wrong dtype", "img_shapes float"):  # put converts these; the rest it refuses
        with pytest.raises(ValueError, match="not written"):
            cache.put(key, tensors)
        assert _files(tmp_path) == []


def test_required_tensor_names():
    assert set(CACHE_TENSORS) == {"target_latents", "prompt_embeds", "empty_prompt_embeds", "img_shapes"}


# --- atomic writes ---------------------------------------------------------------------------------------------

def test_failed_rename_leaves_nothing(tmp_path, monkeypatch):
    cache, key = EmbeddingCache(tmp_path), _key()

    def boom(*a, **k):
        raise OSError("disk full")

    import qwen_edit_core.common.files as atomic
    monkeypatch.setattr(atomic.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        cache.put(key, _tensors())
    monkeypatch.undo()
    assert cache.get(key) is None and _files(tmp_path) == []


def test_failure_in_the_middle_of_writing_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch as st
    real = st.save_file

    def half_then_fail(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) // 2)
        raise OSError("no space left on device")

    monkeypatch.setattr(st, "save_file", half_then_fail)
    cache, key = EmbeddingCache(tmp_path), _key()
    with pytest.raises(OSError, match="no space"):
        cache.get_or_compute(key, _tensors)
    monkeypatch.undo()
    assert _files(tmp_path) == [] and cache.get(key) is None
    hit, calls = _recompute(cache, key)
    assert not hit and calls == [1]


# Child processes import only cache.py and atomic.py: the package's __init__ pulls in the whole facade (seconds).
_PRELUDE = """
import os, signal, sys, types
package = types.ModuleType("qwen_edit_core")
package.__path__ = [os.path.join(os.getcwd(), "qwen_edit_core")]
sys.modules["qwen_edit_core"] = package
from qwen_edit_core.data.cache import EmbeddingCache
from tests.data.test_cache import _key, _tensors
"""

_SELF_KILLING_WRITER = _PRELUDE + """
import safetensors.torch as st
real = st.save_file
def dying(tensors, path, metadata=None):
    real(tensors, path, metadata=metadata)
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 3)  # the kernel had only part of it when the process died
    os.kill(os.getpid(), signal.SIGKILL)
st.save_file = dying
EmbeddingCache(sys.argv[1]).put(_key(), _tensors(h=256, w=256))
"""


def _python(script, *args, **kw):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_writer_killed_mid_write_leaves_no_readable_entry(tmp_path):
    proc = _python(_SELF_KILLING_WRITER, tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    leftovers = _files(tmp_path)
    assert len(leftovers) == 1 and Path(leftovers[0]).name.startswith(".")  # only the hidden temporary file
    cache = EmbeddingCache(tmp_path)
    assert cache.get(_key()) is None and not cache.contains(_key())
    hit, calls = _recompute(cache, _key())
    assert not hit and calls == [1] and cache.stats()["recomputed"] == 0  # nothing bad was ever under the name


_PAUSING_WRITER = _PRELUDE + """
import safetensors.torch as st
real, count = st.save_file, [0]
def pausing(tensors, path, metadata=None):
    real(tensors, path, metadata=metadata)
    count[0] += 1
    if count[0] == 3:  # the third entry is whole in its temporary file, not yet renamed: hold there
        print("inside", path, flush=True)
        sys.stdin.readline()
st.save_file = pausing
cache, i = EmbeddingCache(sys.argv[1]), 0
while True:
    cache.put(_key(caption=f"sample {i}"), _tensors(i, h=128, w=128))
    print("wrote", i, flush=True)
    i += 1
"""


def test_sigkill_during_writes_leaves_only_whole_entries(tmp_path):
    """The kill lands inside the third write (the child says so and waits), never after a guessed delay."""
    proc = _python(_PAUSING_WRITER, tmp_path, stdin=subprocess.PIPE)
    lines = []
    while not lines or not lines[-1].startswith("inside"):
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-2000:]
        lines.append(line.strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert lines[:2] == ["wrote 0", "wrote 1"]
    cache = EmbeddingCache(tmp_path)
    entries = [p for p in tmp_path.rglob("*.safetensors") if not p.name.startswith(".")]
    hidden = [p for p in tmp_path.rglob("*") if p.is_file() and p.name.startswith(".")]
    assert len(entries) == 2 and len(hidden) == 1 and str(hidden[0]) == lines[-1].split(" ", 1)[1]
    for path in entries:
        with safe_open(str(path), framework="pt") as fh:
            key = CacheKey.from_metadata(fh.metadata())
        assert cache.get(key) is not None
    assert cache.get(_key(caption="sample 2")) is None
    assert cache.stats() == {"hits": 2, "misses": 1, "recomputed": 0}


_SAME_KEY_WRITER = _PRELUDE + """
cache = EmbeddingCache(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()  # start together
for _ in range(15):
    cache.put(_key(), _tensors(0, h=128, w=128))
"""


def test_concurrent_writers_of_one_key_never_expose_a_partial_file(tmp_path):
    writers = [_python(_SAME_KEY_WRITER, tmp_path, stdin=subprocess.PIPE) for _ in range(2)]
    for w in writers:
        assert w.stdout.readline().strip() == "ready", w.stderr.read()[-2000:]
    for w in writers:
        w.stdin.write("go\n")
        w.stdin.flush()
    cache, expected = EmbeddingCache(tmp_path), _tensors(0, h=128, w=128)
    while any(w.poll() is None for w in writers):
        got = cache.get(_key())
        assert got is None or _equal(got, expected)
    for w in writers:
        assert w.wait() == 0, w.stderr.read()[-2000:]
    assert cache.stats()["recomputed"] == 0 and cache.stats()["hits"] > 0
    assert _equal(cache.get(_key()), expected)
    assert [p for p in _files(tmp_path) if Path(p).name.startswith(".")] == []  # no temporary file left


# --- component identity ---------------------------------------------------------------------------------------

def test_component_identity_reads_configs_and_weight_sizes(tmp_path):
    comp = tmp_path / "vae"
    comp.mkdir()
    (comp / "config.json").write_text('{"z_dim": 16}')
    (comp / "model.safetensors").write_bytes(b"x" * 100)
    first = component_identity({"vae": comp})
    assert len(first) == 16
    os.utime(comp / "config.json", (1, 1))
    os.utime(comp / "model.safetensors", (1, 1))
    assert component_identity({"vae": comp}) == first  # mtime never counts
    (comp / "model.safetensors").write_bytes(b"y" * 100)  # same size: weights are not read
    assert component_identity({"vae": comp}) == first
    (comp / ".cache").mkdir()
    (comp / ".cache" / "model.safetensors.metadata").write_text("downloaded at noon")  # hidden: ignored
    assert component_identity({"vae": comp}) == first
    (comp / "model.safetensors").write_bytes(b"y" * 101)
    second = component_identity({"vae": comp})
    assert second != first
    (comp / "config.json").write_text('{"z_dim": 8}')
    assert component_identity({"vae": comp}) != second


def test_component_identity_of_tokenizers_single_files_and_absent_parts(tmp_path):
    model = tmp_path / "model"
    (model / "tokenizer").mkdir(parents=True)
    (model / "tokenizer" / "vocab.json").write_text('{"a": 0}')
    single = tmp_path / "qwen_image_vae.safetensors"
    single.write_bytes(b"z" * 10)
    paths = {"tokenizer": model / "tokenizer", "vae": single, "processor": model / "processor"}
    first = component_identity(paths)
    assert component_identity(dict(reversed(paths.items()))) == first  # order of the mapping does not matter
    (model / "tokenizer" / "vocab.json").write_text('{"b": 0}')
    second = component_identity(paths)
    single.write_bytes(b"z" * 11)
    third = component_identity(paths)
    (model / "processor").mkdir()
    (model / "processor" / "preprocessor_config.json").write_text("{}")
    assert len({first, second, third, component_identity(paths)}) == 4


def test_key_is_dataclass_of_plain_fields():
    assert [f.name for f in dataclasses.fields(CacheKey)] == [
        "image_hashes", "caption", "component_identity", "vae_area", "vl_area", "target_bucket", "control_buckets",
        "template", "prefix_len", "dtype", "format_version", "mask_hash", "family"]


def test_the_2025_familys_entries_keep_their_names_and_21_entries_get_their_own():
    """An empty `family` (the 2025 family) is left out of the hashed text, as an empty mask_hash is, so entries
    written before the field existed keep their names; a 2.1 key hashes it and differs."""
    import json
    key = _key()
    assert "family" not in json.loads(key.canonical())
    other = dataclasses.replace(key, family="qwen-image-2.1")
    assert json.loads(other.canonical())["family"] == "qwen-image-2.1" and other.digest() != key.digest()


# --- stored data: checksum and finite values ---------------------------------------------------------------------

def _flip_tensor_byte(path, offset_from_end=100):
    """Flip one byte inside the tensor data (the header, at the start, stays intact and valid)."""
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def test_flipped_bytes_inside_tensors_are_caught_and_recomputed(tmp_path, caplog):
    cache, key = EmbeddingCache(tmp_path), _key()
    path = cache.put(key, _tensors())
    _flip_tensor_byte(path)
    with safe_open(str(path), framework="pt") as fh:  # still a well-formed file with the right key
        assert CacheKey.from_metadata(fh.metadata()) == key
    with caplog.at_level(logging.WARNING, logger="qwen_edit_core.data.cache"):
        assert cache.get(key) is None
    assert "damaged" in caplog.text and "checksum" in caplog.text and not path.exists()
    hit, calls = _recompute(cache, key)
    assert not hit and calls == [1] and _equal(cache.get(key), _tensors(1))


def test_contains_verifies_the_data_unless_told_not_to(tmp_path):
    cache, key = EmbeddingCache(tmp_path), _key()
    path = cache.put(key, _tensors())
    _flip_tensor_byte(path)
    assert cache.contains(key, verify=False) and path.exists()  # the header alone looks fine
    assert not cache.contains(key) and not path.exists()


def test_non_finite_values_are_refused_on_write_and_on_read(tmp_path):
    from qwen_edit_core.data.cache import CHECKSUM_FIELD, tensors_checksum
    cache, key = EmbeddingCache(tmp_path), _key()
    bad = _tensors()
    bad["prompt_embeds"][1, 2] = float("nan")
    with pytest.raises(ValueError, match="prompt_embeds holds non-finite"):
        cache.put(key, bad)
    assert _files(tmp_path) == []
    path = _write_raw(cache, key, bad, {**key.to_metadata(), CHECKSUM_FIELD: tensors_checksum(bad)})
    assert cache.get(key) is None and not path.exists() and cache.stats()["recomputed"] == 1


def test_entries_without_a_checksum_are_recomputed(tmp_path):
    cache, key = EmbeddingCache(tmp_path), _key()
    path = _write_raw(cache, key, _tensors(), key.to_metadata())
    assert cache.get(key) is None and not path.exists()
    hit, calls = _recompute(cache, key)
    assert not hit and calls == [1]
