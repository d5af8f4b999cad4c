"""The dataset doctor's checks the planted-fault dataset does not exercise, each on a few made-up measures: captions
that differ only by a generator's trailing noise or name a picture the pair lacks, sizes (upscaled targets,
controls of another aspect, buckets of one pair), references that copy each other or have a wildly different
aspect, and a mask that marks nothing at the training size."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from qwen_edit_core.data.doctor import captions, references, regions, sizes
from qwen_edit_core.data.doctor.findings import CheckResult, DoctorSettings, Measured
from qwen_edit_core.data.examples import EditExample


def _pair(name: str, caption: str = "invert the colors", controls: int = 1, **measures) -> Measured:
    example = EditExample(name, Path(f"{name}.png"), tuple(Path(f"{name}_control_{k}.png") for k in range(controls)),
                          caption, (64, 64), ((64, 64),) * controls)
    values = {"target_size": (512, 512), "control_sizes": ((512, 512),) * controls, "source": 0,
              # unrelated pictures: hashes about half of whose 64 bits differ
              "hashes": tuple((0x9E3779B97F4A7C15 * (k + 1)) % 2 ** 64 for k in range(controls + 1)), **measures}
    return Measured(name, example, SimpleNamespace(**values))


def _found(result: CheckResult) -> list[tuple]:
    return [(f.pair, f.kind, f.figure, f.fix) for f in result.findings]


def test_captions_differing_only_by_trailing_noise_or_naming_a_missing_picture():
    pairs = [_pair("a", "make it red, seed 1234"), _pair("b", "make it red, seed 99"), _pair("c", "make it red"),
             _pair("d", "put image 2 on the left"), _pair("e", "put image 2 on the left", controls=2)]
    found = _found(captions.check(pairs, DoctorSettings(), count_tokens=len))
    assert found == [("a", "caption", "seed 1234", "caption: 'make it red'"),
                     ("b", "caption", "seed 99", "caption: 'make it red'"), ("d", "caption", 2, None)]
    assert "differs from 2 other(s) only by the trailing 'seed 1234'" in captions.check(pairs, DoctorSettings(
        )).findings[0].why


def test_sizes_upscaled_targets_controls_of_another_aspect_and_lone_buckets():
    pairs = [_pair(f"p{i}") for i in range(3)] + [_pair("small", target_size=(128, 128), control_sizes=((128, 128),)),
                                                  _pair("wide", control_sizes=((768, 512),)),
                                                  _pair("tall", target_size=(256, 1024), control_sizes=((256, 1024),))]
    result = sizes.check(pairs, DoctorSettings(area=512 * 512, batch_size=2))
    assert sorted(_found(result)) == [("small", "size", 4.0, None),  # 4 times per side to reach 512 x 512
                                      ("tall", "size", 1, None),  # alone in its bucket, a batch holds 2
                                      ("wide", "size", 1.5, "crop control 1 to the target's aspect")]
    assert result.stats["buckets"] == {"512x512": 5, "256x1024": 1}


def test_a_reference_copying_another_and_one_of_a_wildly_different_aspect():
    copied = _pair("copied", controls=3, reference_ncc=(0.9, 0.2, 0.2),
                   hashes=(0, 0xFFFFFFFF, 0xFFFF0000FFFF0000, 0xFFFF0000FFFF0001))  # control 3: control 2 but a bit
    odd = _pair("odd", controls=2, control_sizes=((512, 512), (1536, 256)), reference_ncc=(0.9, 0.2))
    result = CheckResult()
    references._copies_and_aspects(copied, result)
    references._copies_and_aspects(odd, result)
    assert _found(result) == [("copied", "duplicate", 1, "drop control 3"), ("odd", "size", 6.0, None)]


def test_a_mask_that_marks_nothing_at_the_training_size():
    pairs = [_pair("empty", mask_area=0.0, change_inside=0.0, change_outside=40.0),
             _pair("good", mask_area=0.5, change_inside=80.0, change_outside=1.0), _pair("none", mask_area=None)]
    assert _found(regions.check(pairs, DoctorSettings())) == [
        ("empty", "mask", 0.0, "paint the edited region, or remove the mask")]
