"""Every node says what it does and every input says what it means (units, typical values), and the number
widgets keep the values people type (the ComfyUI frontend rounds FLOAT widgets)."""

from __future__ import annotations

import math

import pytest

import nodes

#: values people use, per FLOAT input name; every FLOAT input must be listed (its default is checked too)
TYPICAL = {
    "learning_rate": (1e-6, 1.5e-6, 5e-7, 3e-5, 5e-5, 1e-4, 2e-4, 1e-3),
    "alpha": (0.5, 1.0, 4.0, 8.0, 16.0, 32.0, 64.0),
    "true_cfg_scale": (1.0, 2.5, 3.5, 4.0, 7.5),
    "strength": (-1.0, 0.25, 0.5, 0.75, 0.8, 1.0, 1.25),
    "memory_budget_gb": (0.0, 16.0, 24.0, 48.0, 80.0),
    "shift": (0.0, 1.15, 1.73, 2.5, 3.0, 3.1, 5.0),
    "ema_decay": (0.0, 0.99, 0.995, 0.999, 0.9995, 0.9999),
    "mask_weight": (0.5, 1.0, 2.0, 5.0, 10.0),
    "unmasked_weight": (0.0, 0.1, 0.5, 1.0),
}


def _inputs(node_id):
    spec = nodes.NODE_CLASS_MAPPINGS[node_id].INPUT_TYPES()
    for group in ("required", "optional"):
        for name, value in spec.get(group, {}).items():
            yield name, value[0], (value[1] if len(value) > 1 else {})


def frontend_float(value: float, options: dict) -> float:
    """What the ComfyUI frontend stores for a typed FLOAT value (comfyui-frontend-package 1.27.10,
    useFloatWidget / onFloatValueChange, default settings): precision = max(0, -floor(log10(step))) decimals,
    round = the input's `round` or 10^-precision; Number((round(v / round) * round).toFixed(precision)),
    clamped to [min, max]."""
    step = options.get("step", 0.5)
    precision = max(0, -math.floor(math.log10(step)))
    rounding = options.get("round") or 10.0 ** -precision
    rounded = round(round(value / rounding) * rounding, precision)
    return min(max(rounded, options.get("min", 0.0)), options.get("max", 2048.0))


@pytest.mark.parametrize("node_id", sorted(nodes.NODE_CLASS_MAPPINGS))
def test_every_node_and_input_is_described(node_id):
    cls = nodes.NODE_CLASS_MAPPINGS[node_id]
    description = getattr(cls, "DESCRIPTION", "")
    assert isinstance(description, str) and len(description) >= 40, f"{node_id}: DESCRIPTION missing or too short"
    for name, _, options in _inputs(node_id):
        tooltip = options.get("tooltip", "")
        assert len(tooltip) >= 15, f"{node_id}.{name}: tooltip missing or too short ({tooltip!r})"


@pytest.mark.parametrize("node_id", sorted(nodes.NODE_CLASS_MAPPINGS))
def test_float_widgets_keep_the_values_people_use(node_id):
    for name, kind, options in _inputs(node_id):
        if kind != "FLOAT":
            continue
        assert name in TYPICAL, f"{node_id}.{name}: add its typical values to TYPICAL"
        for value in (*TYPICAL[name], options["default"]):
            stored = frontend_float(value, options)
            assert math.isclose(stored, value, rel_tol=1e-9, abs_tol=1e-12), \
                f"{node_id}.{name}: the frontend turns {value} into {stored} (step/round too coarse)"


def test_frontend_rounding_rule_catches_a_coarse_step():
    assert frontend_float(1e-6, {"step": 1e-5, "min": 1e-7, "max": 1.0}) == 1e-7  # the old learning-rate widget
    assert frontend_float(1e-6, {"step": 1e-7, "round": 1e-7, "min": 1e-7, "max": 1.0}) == 1e-6


@pytest.mark.parametrize("name, words", [("learning_rate", "1e-4"), ("rank", "16"), ("alpha", "rank"),
                                         ("steps", "steps"), ("true_cfg_scale", "4.0"), ("strength", "1.0")])
def test_tooltips_give_typical_values(name, words):
    found = [options["tooltip"] for node_id in nodes.NODE_CLASS_MAPPINGS for n, _, options in _inputs(node_id)
             if n == name]
    assert found and all(words in tip for tip in found), (name, found)


@pytest.mark.parametrize("node_id", sorted(nodes.NODE_CLASS_MAPPINGS))
def test_every_node_has_search_aliases(node_id):
    """Newer ComfyUI's node search also matches a node's SEARCH_ALIASES (the words people type for it)."""
    aliases = nodes.NODE_CLASS_MAPPINGS[node_id].SEARCH_ALIASES
    assert isinstance(aliases, list) and aliases, node_id
    assert all(isinstance(a, str) and a.strip() == a and a for a in aliases), aliases


@pytest.mark.parametrize("node_id", sorted(nodes.NODE_CLASS_MAPPINGS))
def test_text_boxes_are_labelled_and_none_looks_blank(node_id):
    """A multiline box shows its name only while empty: each has a placeholder that starts with its name, and
    no default is blank but not empty (a box holding " " shows neither text nor placeholder)."""
    for name, kind, options in _inputs(node_id):
        if kind != "STRING":
            continue
        default = options.get("default", "")
        assert default == "" or default.strip(), f"{node_id}.{name}: blank-looking default {default!r}"
        if options.get("multiline"):
            placeholder = options.get("placeholder", "").lower()
            assert placeholder.startswith(name.replace("_", " ").lower()), f"{node_id}.{name}: {placeholder!r}"


def test_a_blank_negative_prompt_is_the_reference_pipelines():
    """The Sampler's negative prompt box is empty by default and means the reference's " " (what diffusers'
    examples pass); anything with text is used as written."""
    from nodes.sample_nodes import _settings

    assert _settings().negative_prompt == " " and _settings(negative=" \n").negative_prompt == " "
    assert _settings(negative="blurry").negative_prompt == "blurry"


def test_the_live_view_labels_text_boxes_and_walks_subgraphs():
    """The frontend extension labels the pack's multiline boxes (a filled box still names itself) and
    refreshes the live view on nodes inside subgraphs too, through the frontend's link API (getInputNode)."""
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / "web" / "qwen_edit_jobs.js").read_text()
    assert "function labelTextBoxes" in script and "labelTextBoxes(node)" in script
    assert "node.subgraph" in script and "subgraphs" in script and "allNodes(app.rootGraph ?? app.graph?.rootGraph ?? app.graph)" in script
    assert "getInputNode" in script
