"""UI-format workflows (what the editor saves, `nodes` + `links`) to API-format prompts, the way ComfyUI's
frontend does it for the Queue button: widget values are assigned to the node's widget inputs in schema
order (required, then optional), skipping sockets; an INT input with a "control after generate" widget
(`control_after_generate` true, or a `seed`/`noise_seed` input that does not set it false) has one extra
value after its own. Links become `[source_id, slot]`. Reads the schemas from the server's /object_info."""

from __future__ import annotations

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")


def _is_widget(spec) -> bool:
    kind, options = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
    if options.get("forceInput"):
        return False
    return isinstance(kind, list) or kind in WIDGET_TYPES


def _has_control(name: str, spec) -> bool:
    options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if spec[0] != "INT":
        return False
    if "control_after_generate" in options:
        return bool(options["control_after_generate"])
    return name in ("seed", "noise_seed")


def widget_names(schema: dict) -> list[tuple[str, bool]]:
    """(input name, has a control widget after it) for each widget input of a node schema, in order."""
    names = []
    for group in ("required", "optional"):
        for name, spec in (schema.get("input", {}).get(group) or {}).items():
            if _is_widget(spec):
                names.append((name, _has_control(name, spec)))
    return names


def to_api(workflow: dict, object_info: dict) -> dict:
    """The API prompt of a UI workflow (muted/bypassed nodes and nodes without a schema, e.g. notes, left out)."""
    links = {link[0]: link for link in workflow.get("links", [])}
    prompt = {}
    for node in workflow["nodes"]:
        schema = object_info.get(node["type"])
        if schema is None or node.get("mode", 0) in (2, 4):
            continue
        inputs, values = {}, list(node.get("widgets_values") or [])
        if isinstance(node.get("widgets_values"), dict):
            values = list(node["widgets_values"].values())
        position = 0
        for name, control in widget_names(schema):
            if position < len(values):
                inputs[name] = values[position]
            position += 2 if control else 1
        for socket in node.get("inputs", []):
            if socket.get("link") is not None:
                _, src, slot, *_ = links[socket["link"]]
                inputs[socket["name"]] = [str(src), slot]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def set_inputs(prompt: dict, class_type: str, **values) -> dict:
    """A copy of `prompt` with `values` set on every node of `class_type`."""
    out = {k: {**v, "inputs": dict(v["inputs"])} for k, v in prompt.items()}
    for node in out.values():
        if node["class_type"] == class_type:
            node["inputs"].update(values)
    return out
