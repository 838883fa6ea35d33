"""Checks of a ComfyUI UI-format workflow against node classes: types, links and widget values."""
from __future__ import annotations

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SEED_CONTROLS = {"fixed", "increment", "decrement", "randomize"}
FRONTEND_ONLY = {"MarkdownNote", "Note", "Reroute"}      # nodes of the web app, not of the Python server


def _spec(entry):
    kind = entry[0]
    options = entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {}
    return kind, options


def inputs_of(node_class):
    """[(name, kind, options, is_widget, required)] in INPUT_TYPES order (required, then optional)."""
    info = node_class.INPUT_TYPES()
    found = []
    for section in ("required", "optional"):
        for name, entry in (info.get(section) or {}).items():
            kind, options = _spec(entry)
            widget = (isinstance(kind, (list, tuple)) or kind in WIDGET_TYPES) and not options.get("forceInput")
            found.append((name, kind, options, widget, section == "required"))
    return found


def widget_slots(node_class):
    """The widgets_values layout: one slot per widget input, plus the control_after_generate value of seeds."""
    slots = []
    for name, kind, options, widget, _ in inputs_of(node_class):
        if not widget:
            continue
        slots.append((name, kind, options))
        if kind == "INT" and (options.get("control_after_generate") or name in ("seed", "noise_seed")):
            slots.append((name + " control_after_generate", "CONTROL", {}))
        if options.get("image_upload"):      # the frontend's upload button (LoadImage) saves its own value
            slots.append((name + " upload", "UPLOAD", {}))
    return slots


def check_workflow(workflow: dict, classes: dict, check_combos=lambda node_type, name: True) -> list:
    """Problems found (empty = fine). `classes` maps the node types to check; other types are left alone."""
    problems = []
    nodes = {n["id"]: n for n in workflow["nodes"]}
    if len(nodes) != len(workflow["nodes"]):
        problems.append("duplicate node ids")
    if workflow.get("version") != 0.4:
        problems.append(f"version {workflow.get('version')} (expected 0.4)")
    if workflow.get("last_node_id") != max(nodes) or workflow.get("last_link_id") != max(
            (link[0] for link in workflow["links"]), default=0):
        problems.append("last_node_id / last_link_id do not match the nodes and links")
    for link in workflow["links"]:
        link_id, source, source_slot, target, target_slot, kind = link
        out = nodes[source]["outputs"][source_slot]
        into = nodes[target]["inputs"][target_slot]
        if out["type"] != kind or into["type"] != kind or link_id not in (out["links"] or []) or into["link"] != link_id:
            problems.append(f"link {link_id} does not match its ends")
    for node in workflow["nodes"]:
        node_type, label = node["type"], f"node {node['id']} ({node['type']})"
        for slot in node.get("inputs", []):
            if slot.get("link") is not None and not any(link[0] == slot["link"] for link in workflow["links"]):
                problems.append(f"{label}: input {slot['name']} names a missing link")
        node_class = classes.get(node_type)
        if node_class is None:
            continue
        outputs = [o["type"] for o in node.get("outputs", [])]
        if outputs != [str(t) for t in node_class.RETURN_TYPES]:
            problems.append(f"{label}: outputs {outputs} but the class returns {list(node_class.RETURN_TYPES)}")
        linked = [(n, str(k), required) for n, k, _, widget, required in inputs_of(node_class) if not widget]
        given = {i["name"]: i for i in node.get("inputs", []) if "widget" not in i}
        order = [i["name"] for i in node.get("inputs", []) if "widget" not in i]
        if order != [n for n, _, _ in linked if n in given]:
            problems.append(f"{label}: inputs {order} are not the class's inputs {[n for n, _, _ in linked]} in order")
        for name, kind, required in linked:
            slot = given.get(name)
            if slot is not None and slot["type"] != kind:
                problems.append(f"{label}: input {name} has type {slot['type']}, the class takes {kind}")
            if required and (slot is None or slot.get("link") is None):
                problems.append(f"{label}: required input {name} is not connected")
        slots = widget_slots(node_class)
        values = node.get("widgets_values", [])
        # one value per widget, optional ones included: a shipped workflow missing its last values loads with the
        # node's defaults there, not with the values it means (and a newer widget could shift the others)
        if len(values) != len(slots):
            problems.append(f"{label}: {len(values)} widget values for {len(slots)} widgets "
                            f"({[s[0] for s in slots]})")
            continue
        for (name, kind, options), value in zip(slots, values):
            if kind == "CONTROL":
                ok = value in SEED_CONTROLS
            elif kind == "UPLOAD":
                ok = value == "image"
            elif isinstance(kind, (list, tuple)) or kind == "COMBO":
                choices = kind if isinstance(kind, (list, tuple)) else options.get("options", [])
                ok = not check_combos(node_type, name) or value in choices
            elif kind == "INT":
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif kind == "FLOAT":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            elif kind == "BOOLEAN":
                ok = isinstance(value, bool)
            else:
                ok = isinstance(value, str)
            if ok and kind in ("INT", "FLOAT"):
                ok = options.get("min", value) <= value <= options.get("max", value)
            if not ok:
                problems.append(f"{label}: widget {name} = {value!r} does not fit {kind}")
    return problems
