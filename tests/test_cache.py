"""The embedding cache: content addressing, reuse, invalidation, damaged and stale entries, atomic writes."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from qwen_edit_core.cache import CacheKey, EmbeddingCache, component_identity


def _key(**kw):
    base = dict(image_hashes=("a" * 64, "b" * 64), caption="make it blue", component_identity="c0ffee",
                vae_area=4096, vl_area=0, target_bucket=(64, 64), control_buckets=((64, 64),), template="edit",
                prefix_len=64, dtype="float32")
    return CacheKey(**{**base, **kw})


def _tensors(seed=0, big=False):
    g = torch.Generator().manual_seed(seed)
    h = 256 if big else 8
    return {"target_latents": torch.randn(16, 1, h, 8, generator=g),
            "control_latents_0": torch.randn(16, 1, 8, 8, generator=g),
            "prompt_embeds": torch.randn(5, 32, generator=g), "empty_prompt_embeds": torch.randn(3, 32, generator=g),
            "img_shapes": torch.tensor([[1, 4, 4], [1, 4, 4]])}


def test_round_trip_and_reuse_across_instances(tmp_path):
    key = _key()
    EmbeddingCache(tmp_path).put(key, _tensors())
    other = EmbeddingCache(tmp_path)
    got, hit = other.get_or_compute(key, lambda: pytest.fail("must not recompute"))
    assert hit and all(torch.equal(got[k], v) for k, v in _tensors().items())


@pytest.mark.parametrize("change", [dict(caption="make it red"), dict(image_hashes=("a" * 64, "c" * 64)),
                                    dict(component_identity="other"), dict(vae_area=8192), dict(vl_area=1),
                                    dict(target_bucket=(96, 64)), dict(control_buckets=((32, 64),)),
                                    dict(template="edit-plus"), dict(prefix_len=34), dict(dtype="bfloat16"),
                                    dict(format_version=2)])
def test_every_key_field_changes_the_entry(tmp_path, change):
    cache = EmbeddingCache(tmp_path)
    cache.put(_key(), _tensors())
    changed = _key(**change)
    assert changed.digest() != _key().digest() and cache.get(changed) is None


def _recompute(cache, key):
    calls = []
    got, hit = cache.get_or_compute(key, lambda: calls.append(1) or _tensors(1))
    return hit, calls


def test_truncated_entry_is_recomputed(tmp_path):
    cache, key = EmbeddingCache(tmp_path), _key()
    path = cache.put(key, _tensors())
    path.write_bytes(path.read_bytes()[:100])
    hit, calls = _recompute(cache, key)
    assert not hit and calls == [1] and cache.stats()["recomputed"] == 1
    assert torch.equal(cache.get(key)["prompt_embeds"], _tensors(1)["prompt_embeds"])


def test_stale_metadata_and_missing_tensor_are_rejected(tmp_path):
    cache, key = EmbeddingCache(tmp_path), _key()
    path = cache.path_for(key)
    path.parent.mkdir(parents=True)
    save_file(_tensors(), path, metadata=_key(caption="something else").to_metadata())
    assert cache.get(key) is None and not path.exists()
    partial = {k: v for k, v in _tensors().items() if k != "control_latents_0"}
    save_file(partial, path, metadata=key.to_metadata())
    assert cache.get(key) is None
    with pytest.raises(ValueError, match="missing tensors"):
        cache.put(key, {"target_latents": torch.zeros(1)})


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    cache, key = EmbeddingCache(tmp_path), _key()

    def boom(*a, **k):
        raise OSError("disk full")

    import qwen_edit_core.atomic as atomic
    monkeypatch.setattr(atomic.os, "replace", boom)
    with pytest.raises(OSError):
        cache.put(key, _tensors())
    assert cache.get(key) is None
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_sigkilled_writer_leaves_no_readable_corrupt_entry(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch
        import safetensors.torch as st
        from qwen_edit_core import cache as c
        real = st.save_file
        def dying(tensors, path, metadata=None):
            real(tensors, path, metadata=metadata)
            with open(path, "r+b") as fh:
                fh.truncate(1000)
            os.kill(os.getpid(), signal.SIGKILL)
        st.save_file = dying
        from tests.test_cache import _key, _tensors
        c.EmbeddingCache({str(tmp_path)!r}).put(_key(), _tensors(big=True))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(os.path.dirname(__file__)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    cache = EmbeddingCache(tmp_path)
    assert cache.get(_key()) is None  # only the temporary file exists; the entry name was never written
    hit, calls = _recompute(cache, _key())
    assert not hit and calls == [1]


def test_component_identity_reads_configs_and_weight_sizes(tmp_path):
    comp = tmp_path / "vae"
    comp.mkdir()
    (comp / "config.json").write_text('{"z_dim": 16}')
    (comp / "model.safetensors").write_bytes(b"x" * 100)
    first = component_identity({"vae": comp})
    os.utime(comp / "config.json", (1, 1))
    assert component_identity({"vae": comp}) == first
    (comp / "model.safetensors").write_bytes(b"y" * 100)  # same size: weights are not read
    assert component_identity({"vae": comp}) == first
    (comp / "model.safetensors").write_bytes(b"y" * 101)
    second = component_identity({"vae": comp})
    assert second != first
    (comp / "config.json").write_text('{"z_dim": 8}')
    assert component_identity({"vae": comp}) != second


def test_key_is_dataclass_of_plain_fields():
    assert {f.name for f in dataclasses.fields(CacheKey)} >= {"image_hashes", "caption", "dtype", "format_version"}
