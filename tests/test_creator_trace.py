"""The creator trace (benchmarks/creator_trace.py): reproducible, its operation mix and session lengths as configured,
seeds as each ComfyUI seed habit makes them, and world-agnostic (any world with the four TraceWorld methods)."""
from __future__ import annotations

import os
import statistics
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import creator_trace as ct  # noqa: E402
from carnator_engine.demo import world  # noqa: E402


def _dicts(trace):
    return [request.to_dict() for request in trace]


def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    first = ct.generate_trace(ct.demo_world(), 300, seed=4, habit="fixed")
    assert _dicts(first) == _dicts(ct.generate_trace(ct.demo_world(), 300, seed=4, habit="fixed"))
    assert _dicts(first) != _dicts(ct.generate_trace(ct.demo_world(), 300, seed=5, habit="fixed"))
    shorter = ct.generate_trace(ct.demo_world(), 120, seed=4, habit="fixed")
    assert _dicts(shorter) == _dicts(first[:120])           # --requests N is a prefix of the longer trace


def test_operations_and_session_lengths_follow_the_mix():
    mix = ct.TraceMix()
    trace = ct.generate_trace(ct.demo_world(), 2500, seed=0, habit="randomize", mix=mix)
    later = [r for r in trace if r.tags["step"] > 0]       # a session's first request is always a new idea
    expected = mix.probabilities()
    for op in ct.OPERATIONS:
        share = sum(r.tags["op"] == op for r in later) / len(later)
        assert abs(share - expected[op]) < 0.03, (op, share, expected[op])
    lengths = [sum(1 for r in trace if r.tags["session"] == s) for s in range(trace[-1].tags["session"])]
    assert 4 <= statistics.median(lengths) <= 6                  # median 5 (log-normal, rounded)
    assert 7 <= statistics.mean(lengths) <= 11                   # mean 10 before the cap at 60 requests


def test_each_operation_does_what_it_says():
    trace = ct.generate_trace(ct.demo_world(), 600, seed=1, habit="fixed")
    for i, request in enumerate(trace):
        op, parent = request.tags["op"], request.tags["parent"]
        assert request.attributes == world.parse_prompt(request.prompt)     # every wording names its scene
        if op == "new_idea":
            assert parent is None
            continue
        before = trace[parent]
        changed = [name for name in world.ATTRIBUTES if request.attributes[name] != before.attributes[name]]
        if op in ("reroll", "repeat", "return"):
            assert request.prompt == before.prompt and changed == []
        elif op == "paraphrase":
            assert request.prompt != world.prompt(request.attributes) and changed == []
        else:
            assert changed == [request.tags["changed"]]
            assert (changed[0] in ("size", "speed")) == (op == "nudge")
        if op == "return":
            assert parent < i and request.seed == before.seed


def test_seed_habits_fixed_keeps_the_session_seed_randomize_draws_one_per_request():
    fixed = ct.generate_trace(ct.demo_world(), 500, seed=2, habit="fixed")
    fresh = ct.generate_trace(ct.demo_world(), 500, seed=2, habit="randomize")
    assert [r.prompt for r in fixed] == [r.prompt for r in fresh]             # the same sessions, only seeds differ
    for previous, request in zip(fixed, fixed[1:]):
        if request.tags["session"] == previous.tags["session"] and request.tags["op"] not in ("reroll", "return"):
            assert request.seed == previous.seed
        if request.tags["op"] == "repeat":
            assert (request.prompt, request.seed) == (previous.prompt, previous.seed)   # an exact repeat
    repeats = {habit: ct.trace_stats(trace)["exact_repeats"] for habit, trace in (("fixed", fixed), ("fresh", fresh))}
    returns = sum(r.tags["op"] == "return" for r in fresh)
    assert repeats["fresh"] <= returns < repeats["fixed"]      # randomize repeats only what a return reloads


class _TwoObjectWorld:
    """A world of another shape (two objects): the trace needs only the four TraceWorld methods."""

    def new_scene(self, generator):
        return {"objects": [int(torch.randint(5, (1,), generator=generator)) for _ in range(2)]}

    def prompt(self, scene):
        return " and ".join(f"object {o}" for o in scene["objects"])

    def paraphrase(self, scene, generator):
        return " with ".join(f"object {o}" for o in scene["objects"])

    def change(self, scene, kind, generator):
        objects = list(scene["objects"])
        objects[0 if kind == "edit" else 1] = (objects[0 if kind == "edit" else 1] + 1) % 5
        return {"objects": objects}, f"object {0 if kind == 'edit' else 1}"


def test_any_world_with_the_interface_gets_a_trace():
    trace = ct.generate_trace(_TwoObjectWorld(), 200, seed=3, habit="randomize")
    assert len(trace) == 200 and {r.tags["op"] for r in trace} == set(ct.OPERATIONS)
    assert all(r.prompt.startswith("object") for r in trace)


def test_bad_arguments_are_refused_with_the_input_named():
    with pytest.raises(ValueError, match="seed habit must be one of"):
        ct.generate_trace(ct.demo_world(), 5, habit="increment")
    with pytest.raises(ValueError, match="requests must be >= 1"):
        ct.generate_trace(ct.demo_world(), 0)
    with pytest.raises(ValueError, match="operation weights"):
        ct.generate_trace(ct.demo_world(), 5, mix=ct.TraceMix(weights={"teleport": 1.0}))
    with pytest.raises(ValueError, match="session median"):
        ct.TraceMix(session_median=12, session_mean=10).validate()
