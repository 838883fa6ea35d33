import json
import os
import re

import pytest
import torch

from carnator_engine.backbones.tiny_dit import load_tiny_dit, tokenize
from carnator_engine.demo import train, world2
from carnator_engine.demo.world2 import OBJECT_ATTRIBUTES, POSITIONS, VALUES, VOCABULARY


def _scenes(n=240, seed=0):
    generator = torch.Generator().manual_seed(seed)
    codes = world2.sample_codes(n, generator)
    return world2.decode(codes), world2.render_codes(codes, generator)


def _quadrant(position):
    x, y = world2.ORIGINS[POSITIONS.index(position)]
    return (..., slice(y, y + world2.QUADRANT), slice(x, x + world2.QUADRANT))


def test_analyzer_reads_every_rendered_scene_entirely_right():
    expected, clips = _scenes()
    read = world2.analyze_batch(clips)
    wrong = [(e, r) for e, r in zip(expected, read) if not world2.all_right(r, e)]
    assert not wrong, wrong[:2]
    assert world2.attribute_accuracy(expected, read) == {name: 1.0 for name in world2.SCORES + ("all",)}
    # Every value, position and object count was drawn, so nothing passes by always answering one thing.
    objects = [item for scene in expected for item in scene["objects"].values()]
    for name in OBJECT_ATTRIBUTES:
        assert {item[name] for item in objects} == set(VALUES[name])
    assert {s["background"] for s in expected} == set(VALUES["background"])
    assert {p for s in expected for p in s["objects"]} == set(POSITIONS)
    assert {len(s["objects"]) for s in expected} == {2, 3}


def test_analyzer_tolerates_generation_noise():
    expected, clips = _scenes(80, seed=1)
    noisy = clips + 0.1 * torch.randn(clips.shape, generator=torch.Generator().manual_seed(2))
    scores = world2.attribute_accuracy(expected, world2.analyze_batch(noisy))
    assert min(scores.values()) >= 0.9, scores


def test_blank_clip_has_no_objects():
    assert world2.analyze(torch.full(world2.CLIP_SHAPE, 0.0)) == {"background": "gray", "objects": {}}


def test_prompts_use_the_vocabulary_and_parse_back_in_any_order():
    expected, _ = _scenes(60, seed=4)
    for scene in expected:
        text = world2.prompt(scene)
        words = re.findall(r"[a-z]+", text)
        assert set(words) <= set(VOCABULARY) and len(words) <= world2.TEXT_LEN, text
        assert world2.parse_prompt(text) == scene
        assert world2.parse_prompt(world2.prompt(scene, order=list(scene["objects"])[::-1])) == scene
    with pytest.raises(ValueError, match="background"):
        world2.parse_prompt("a small red circle moving up in the top left")
    with pytest.raises(ValueError, match="objects"):
        world2.validate({"background": "black", "objects": {"top left": expected[0]["objects"].popitem()[1]}})


def test_training_tokens_match_the_tokenized_prompts():
    generator = torch.Generator().manual_seed(3)
    codes = world2.sample_codes(200, generator)
    scenes = world2.decode(codes)
    texts = [world2.prompt(s) for s in scenes]
    assert torch.equal(world2.prompt_token_ids(codes, VOCABULARY), tokenize(texts, VOCABULARY, world2.TEXT_LEN))
    # Shuffled object order: other token rows, each the tokenized prompt of the same scene in some order.
    shuffled = world2.prompt_token_ids(codes, VOCABULARY, generator=torch.Generator().manual_seed(5))
    words = {i + 2: w for i, w in enumerate(VOCABULARY)}
    assert not torch.equal(shuffled, tokenize(texts, VOCABULARY, world2.TEXT_LEN))
    for row, scene in zip(shuffled.tolist(), scenes):
        assert world2.parse_prompt(" ".join(words[i] for i in row if i)) == scene


def test_an_object_edit_changes_only_its_quadrant():
    scene = {"background": "white", "objects": {
        "top left": {"color": "red", "shape": "square", "direction": "right", "size": "large"},
        "bottom right": {"color": "blue", "shape": "circle", "direction": "up", "size": "small"}}}
    before = world2.render(scene, seed=7)
    assert torch.equal(before, world2.render(scene, seed=7)) and not torch.equal(before, world2.render(scene, seed=8))
    for kind, value in (("color", "green"), ("shape", "circle"), ("direction", "left"), ("size", "small")):
        edited, _, position = world2.edit(scene, kind, torch.Generator(), "top left", value)
        changed = (world2.render(edited, seed=7) != before).any(0).any(0)                          # [H, W]
        inside = torch.zeros_like(changed)
        inside[_quadrant(position)] = True
        assert changed.any() and not (changed & ~inside).any(), kind
    added = world2.edit(scene, "add", torch.Generator(), "top right")[0]
    changed = (world2.render(added, seed=7) != before).any(0).any(0)
    assert changed[_quadrant("top right")].any() and changed.sum() == changed[_quadrant("top right")].sum()


def test_objects_stay_inside_their_quadrants():
    _, clips = _scenes(200, seed=5)
    for position in POSITIONS:
        crop = clips[_quadrant(position)]
        border = torch.cat([crop[..., 0, :], crop[..., -1, :], crop[..., :, 0], crop[..., :, -1]], dim=-1)
        assert torch.equal(border.amin(-1), border.amax(-1)), position


def test_heldout_sampling():
    generator = torch.Generator().manual_seed(0)
    assert not world2.heldout_mask(world2.sample_codes(2000, generator, heldout="exclude")).any()
    only = world2.sample_codes(300, generator, heldout="only")
    assert world2.heldout_mask(only).any(1).all()
    assert all(2 <= len(s["objects"]) <= 3 and world2.is_heldout(s) for s in world2.decode(only))


def _flat_changes(a, b):
    fa, fb = world2.flatten(a), world2.flatten(b)
    return {name for name in fa if fa[name] != fb[name]}


def test_iteration_stream_makes_one_local_edit_at_a_time():
    stream = world2.iteration_stream(60, seed=3, restart_every=20)
    assert [r.to_dict() for r in stream] == [r.to_dict() for r in world2.iteration_stream(60, seed=3, restart_every=20)]
    assert stream[0].edited is None and stream[20].edited is None
    assert {r.edited for r in stream} >= {"color", "shape", "direction", "size", "background", "add", "remove", "move"}
    for i, (before, after) in enumerate(zip(stream, stream[1:]), 1):
        if i % 20 == 0:
            continue
        changes = _flat_changes(before.attributes, after.attributes)
        if after.edited == "background":
            assert changes == {"background"}
        else:   # one quadrant's object (two for a move)
            touched = {name.split(" ")[0] + " " + name.split(" ")[1] for name in changes}
            assert after.tags["position"] in touched and len(touched) == (2 if after.edited == "move" else 1)
        assert after.seed != before.seed
    fixed = world2.iteration_stream(40, seed=3, restart_every=20, one_seed_per_session=True)
    assert [r.seed for r in fixed] == [fixed[0].seed] * 20 + [fixed[20].seed] * 20
    assert [r.attributes for r in fixed] == [r.attributes for r in stream[:40]]


def test_adversarial_pairs_are_look_alikes_sharing_noise():
    pairs = world2.adversarial_pairs(12, seed=1, kinds=("direction", "shape", "move", "color"))
    assert {first.tags["kind"] for first, _ in pairs} == {"direction", "shape", "move", "color"}
    for first, second in pairs:
        kind, position = second.tags["kind"], second.tags["position"]
        assert first.seed == second.seed
        changes = _flat_changes(first.attributes, second.attributes)
        if kind == "move":
            assert position in changes and world2.NEIGHBOUR[position] in changes
        else:
            assert changes == {f"{position} {kind}"}
            old, new = first.attributes["objects"][position][kind], second.attributes["objects"][position][kind]
            if kind != "color":
                assert new == (world2.OPPOSITE_DIRECTION[old] if kind == "direction" else world2.LOOKALIKES[old])


def test_scores_count_a_missing_object_wrong_on_every_attribute():
    scene = {"background": "black", "objects": {
        "top left": {"color": "red", "shape": "square", "direction": "right", "size": "large"},
        "top right": {"color": "blue", "shape": "circle", "direction": "up", "size": "small"}}}
    missing = {"background": "black", "objects": {"top left": scene["objects"]["top left"]}}
    scores = world2.attribute_accuracy([scene], [missing])
    assert scores == {"background": 1.0, "objects": 0.0, "color": 0.5, "shape": 0.5, "direction": 0.5,
                      "size": 0.5, "all": 0.0}
    reference = {**scene, "background": "white"}          # the full generation missed the background only
    assert world2.made_wrong(missing, reference, scene) == ["top right"] + [f"top right {n}" for n in OBJECT_ATTRIBUTES]
    assert world2.all_right(scene, scene) and not world2.all_right(missing, scene)


def test_training_smoke_writes_world2_weights_and_report(tmp_path):
    out = tmp_path / "v2.safetensors"
    assert train.main(["--world", "v2", "--smoke", "--device", "cpu", "--out", str(out)]) == 0
    model = load_tiny_dit(str(out))
    assert model.config.vocabulary == VOCABULARY and model.config.text_len == world2.TEXT_LEN
    report = json.loads((tmp_path / "v2.json").read_text())
    assert report["training"]["world"] == "v2"
    assert report["evaluation"]["analyzer_on_ground_truth"]["all"] == 1.0
    assert set(report["accuracy"]) == set(world2.SCORES) | {"all", "mean"}


def _benchmark(name):
    """A module of benchmarks/, as the benchmarks import each other (trace.py through test_quality_smoke's loader,
    its name being the standard library's too)."""
    import importlib
    import sys
    from test_quality_smoke import _script
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return _script(name) if name in ("trace", "reports") else importlib.import_module(name)


def test_creator_trace_on_world2_paraphrases_and_edits_locally():
    creator_trace = _benchmark("creator_trace")
    trace = creator_trace.generate_trace(creator_trace.SceneWorld(), 300, seed=2, habit="fixed")
    again = creator_trace.generate_trace(creator_trace.SceneWorld(), 300, seed=2, habit="fixed")
    assert [(r.prompt, r.seed, r.tags) for r in trace] == [(r.prompt, r.seed, r.tags) for r in again]
    ops = {r.tags["op"] for r in trace}
    assert {"paraphrase", "edit", "nudge"} <= ops
    for request in trace:
        assert world2.parse_prompt(request.prompt) == request.attributes    # every wording names its scene
        parent = trace[request.tags["parent"]] if request.tags["parent"] is not None else None
        if request.tags["op"] == "paraphrase":
            assert request.prompt != world2.prompt(request.attributes)
        elif request.tags["op"] == "nudge":
            assert {n.rsplit(" ", 1)[1] for n in _flat_changes(parent.attributes, request.attributes)} == {"size"}
        elif request.tags["op"] == "edit":
            assert request.tags["changed"] in world2.EDITS and request.tags["changed"] != "size"
            assert _flat_changes(parent.attributes, request.attributes)


def test_trace_benchmark_runs_on_world2(tmp_path):
    from carnator_engine.backbones.tiny_dit import TinyDiTConfig, TinyVideoDiT
    weights = tmp_path / "v2.safetensors"   # an untrained model of world v2's words: the plumbing, not its accuracy
    TinyVideoDiT(TinyDiTConfig(vocabulary=VOCABULARY, text_len=world2.TEXT_LEN, dim=32, layers=1, heads=2)).save(
        str(weights))
    trace = _benchmark("trace")
    out = tmp_path / "trace.json"
    assert trace.main(["--world", "v2", "--weights", str(weights), "--requests", "3", "--pairs", "1", "--steps", "6",
                       "--probe-steps", "2", "--fewer-steps", "4", "--text-resume-step", "3", "--habits", "fixed",
                       "--methods", "carnator_balanced", "--out", str(out)]) == 0
    report = _benchmark("reports").read(str(out))
    assert report["results"]["fixed"]["no_reuse"]["model_calls_saved"] == 0
    assert set(report["results"]["fixed"]["no_reuse"]["per_attribute"]) == set(world2.SCORES)


def test_world_locality_benchmark_finds_world2_edits_more_local(tmp_path):
    locality = _benchmark("quality")
    out = tmp_path / "locality.json"
    assert locality.main(["locality", "--requests", "60", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["v2"]["all edits"]["edits"] == 59
    assert results["v2"]["color"]["tokens_changed"] <= 0.25            # one quadrant at most
    assert results["v2"]["all edits"]["tokens_changed"] < results["v1"]["all edits"]["tokens_changed"]
    same = torch.zeros(2, 3, 8, 32, 32)
    moved = same.clone()
    moved[1, 0, 0, 0, 0] = 1.0                                         # one pixel: one token of 512
    assert locality.changed_tokens(same, moved).tolist() == [0.0, 1 / 512]
