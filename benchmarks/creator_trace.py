"""A creator's iteration trace: seeded, reproducible sessions of requests as a person makes them in ComfyUI.

A session starts with a first prompt (a new idea), then each request is one operation on the session's history:

    reroll       the same prompt again, another seed (a new take)
    repeat       the last request queued again unchanged (with the fixed seed habit: an exact repeat)
    nudge        a detail changed (the world's detail attributes: size, speed ...)
    edit         one main attribute changed (colour, shape, direction, background ...)
    paraphrase   the same scene in other words
    return       back to an earlier version of the session: its prompt and seed (loaded from its output's metadata)
    new_idea     a new scene within the same session

The operation mix and the session lengths are in `TraceMix`; docs/creator-trace.md says where each number comes
from (the published prompt-log studies of DiffusionDB, VidProM, Midjourney) and which ones are choices.

The seed habit decides the seeds, as ComfyUI's seed widget does: "fixed" keeps the session's seed for every request
(a reroll changes it by hand), "randomize" draws a new seed for every request; a return loads the earlier version's
seed either way (dragging an earlier output into ComfyUI restores its workflow, seed included).

The trace knows nothing of a world's internals: a world is anything with the four methods of `TraceWorld`
(`AttributeWorld` adapts a world of flat attributes such as carnator_engine/demo/world.py, `SceneWorld` world v2).
Its requests carry `attributes`, `prompt`, `seed` and `tags` (the operation, session, parent request): what
benchmarks/quality.py's runner reads.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch

OPERATIONS = ("reroll", "repeat", "nudge", "edit", "paraphrase", "return", "new_idea")
SEED_HABITS = ("fixed", "randomize")


class TraceWorld(Protocol):
    """What the trace needs of a world: scenes (JSON-able dicts), their prompts and edits of them."""

    def new_scene(self, generator: torch.Generator) -> dict: ...

    def prompt(self, scene: dict) -> str: ...

    def paraphrase(self, scene: dict, generator: torch.Generator) -> str:
        """Another wording of the same scene (never the plain prompt)."""

    def change(self, scene: dict, kind: str, generator: torch.Generator) -> tuple:
        """(changed scene, what changed) for kind 'edit' (a main attribute) or 'nudge' (a detail)."""


@dataclass(frozen=True)
class AttributeWorld:
    """A TraceWorld over flat attributes: name -> one of its values."""

    values: dict                                    # attribute -> its values
    details: tuple                                  # the attributes a nudge changes; an edit changes the others
    prompt_of: Callable[[dict], str]
    random_scene: Callable[[torch.Generator], dict]
    wordings: tuple = ()                            # other templates of the prompt: functions scene -> text

    def new_scene(self, generator):
        return dict(self.random_scene(generator))

    def prompt(self, scene):
        return self.prompt_of(scene)

    def paraphrase(self, scene, generator):
        if not self.wordings:
            raise ValueError("this world has no other wordings of its prompts: give AttributeWorld some")
        return self.wordings[_pick(len(self.wordings), generator)](scene)

    def change(self, scene, kind, generator):
        if kind not in ("edit", "nudge"):
            raise ValueError(f"kind must be 'edit' or 'nudge', got {kind!r}")
        names = [n for n in self.values if (n in self.details) == (kind == "nudge")]
        name = names[_pick(len(names), generator)]
        others = [v for v in self.values[name] if v != scene[name]]
        changed = dict(scene)
        changed[name] = others[_pick(len(others), generator)]
        return changed, name


def demo_world() -> AttributeWorld:
    """The evaluation world of carnator_engine/demo/world.py (one object: six attributes). Its other wordings use
    only words the demo model was trained on, in another order: a paraphrase the model can still read."""
    from carnator_engine.demo import world

    def adjectives_swapped(a):
        return (f"a {a['color']} {a['size']} {a['shape']} moving {a['direction']} {world.SPEED_ADVERB[a['speed']]} "
                f"on a {a['background']} background")

    def adverb_first(a):
        return (f"a {a['size']} {a['color']} {a['shape']} moving {world.SPEED_ADVERB[a['speed']]} {a['direction']} "
                f"on a {a['background']} background")

    return AttributeWorld(values=dict(world.VALUES), details=("size", "speed"), prompt_of=world.prompt,
                          random_scene=lambda generator: world.random_attributes(generator=generator),
                          wordings=(adjectives_swapped, adverb_first))


class SceneWorld:
    """The TraceWorld of carnator_engine/demo/world2.py (world v2: two or three objects, one per quadrant). A nudge
    resizes one object; an edit is one of world v2's other edits (an object's colour, shape or motion, the
    background, an object added, removed or moved), so most change a quarter of the clip; a paraphrase lists the
    objects in another order, which world v2's demo model was trained to read as the same scene."""

    def __init__(self):
        from carnator_engine.demo import world2
        self.world = world2

    def new_scene(self, generator):
        return self.world.random_scene(generator=generator)

    def prompt(self, scene):
        return self.world.prompt(scene)

    def paraphrase(self, scene, generator):
        usual = list(scene["objects"])
        orders = [list(order) for order in itertools.permutations(usual) if list(order) != usual]
        return self.world.prompt(scene, orders[_pick(len(orders), generator)])

    def change(self, scene, kind, generator):
        if kind not in ("edit", "nudge"):
            raise ValueError(f"kind must be 'edit' or 'nudge', got {kind!r}")
        kinds = ("size",) if kind == "nudge" else tuple(k for k in self.world.EDITS if k != "size")
        changed, made, _ = self.world.edit(scene, kinds[_pick(len(kinds), generator)], generator)
        return changed, made


@dataclass(frozen=True)
class TraceMix:
    """How often each operation follows a request within a session, and how long sessions are.

    Session lengths are log-normal (rounded, at least 1): median `session_median` requests, mean `session_mean`.
    """

    weights: dict = field(default_factory=lambda: {"reroll": 0.25, "repeat": 0.05, "nudge": 0.20, "edit": 0.25,
                                                   "paraphrase": 0.10, "return": 0.08, "new_idea": 0.07})
    session_median: float = 5.0
    session_mean: float = 10.0
    max_session: int = 60

    def validate(self) -> "TraceMix":
        unknown = set(self.weights) - set(OPERATIONS)
        if unknown or any(not w >= 0 for w in self.weights.values()) or not sum(self.weights.values()) > 0:
            raise ValueError(f"operation weights {self.weights} must be >= 0 over {OPERATIONS} with a positive sum")
        if not 1 <= self.session_median <= self.session_mean:
            raise ValueError(f"session median {self.session_median} and mean {self.session_mean}: need 1 <= median "
                             "<= mean")
        return self

    def probabilities(self) -> dict:
        total = sum(self.weights.values())
        return {op: self.weights.get(op, 0.0) / total for op in OPERATIONS}

    def session_length(self, generator: torch.Generator) -> int:
        mu = math.log(self.session_median)
        sigma = math.sqrt(2 * math.log(self.session_mean / self.session_median))
        draw = math.exp(mu + sigma * float(torch.randn(1, generator=generator)))
        return max(1, min(self.max_session, round(draw)))


@dataclass
class TraceRequest:
    """One request of the trace: what quality.py's runner reads (attributes, prompt, seed, tags)."""

    attributes: dict
    prompt: str
    seed: int
    tags: dict

    def to_dict(self) -> dict:
        return {"attributes": self.attributes, "prompt": self.prompt, "seed": self.seed, "tags": self.tags}


def _pick(n: int, generator: torch.Generator) -> int:
    return int(torch.randint(n, (1,), generator=generator))


def _new_seed(generator: torch.Generator) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


def _operation(probabilities: dict, generator: torch.Generator) -> str:
    ops = list(probabilities)
    weights = torch.tensor([probabilities[op] for op in ops], dtype=torch.float64)
    return ops[int(torch.multinomial(weights, 1, generator=generator))]


def generate_trace(world: TraceWorld, requests: int, seed: int = 0, habit: str = "randomize",
                   mix: Optional[TraceMix] = None) -> list:
    """`requests` TraceRequests of consecutive sessions. The same world, seed, habit and mix give the same trace;
    the two habits of one seed share every session's operations and scenes, only the seeds differ."""
    if habit not in SEED_HABITS:
        raise ValueError(f"seed habit must be one of {SEED_HABITS}, got {habit!r}")
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    mix = (mix or TraceMix()).validate()
    probabilities = mix.probabilities()
    # Two streams: the session plan (operations, scenes) and the seeds, so that both habits plan alike.
    plan, seeds = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1_000_003)
    trace = []
    session = 0
    while len(trace) < requests:
        length = mix.session_length(plan)
        history = []                       # this session's requests, as indices into trace
        session_seed = _new_seed(seeds)
        for step in range(min(length, requests - len(trace))):
            op = "new_idea" if step == 0 else _operation(probabilities, plan)
            last = trace[history[-1]] if history else None
            parent, changed = (history[-1] if history else None), None
            if op == "new_idea":
                scene, prompt, parent = world.new_scene(plan), None, None
            elif op in ("reroll", "repeat"):
                scene, prompt = last.attributes, last.prompt
            elif op == "paraphrase":
                scene = last.attributes
                prompt = world.paraphrase(scene, plan)
            elif op == "return":
                parent = history[_pick(len(history), plan)]
                scene, prompt = trace[parent].attributes, trace[parent].prompt
            else:
                scene, changed = world.change(last.attributes, op, plan)
                prompt = None
            prompt = prompt if prompt is not None else world.prompt(scene)
            # Seeds: the fixed habit keeps the session's seed, a reroll changes it by hand; randomize draws one per
            # request; a return loads the earlier version's seed in both (and the widget then holds it).
            fresh = _new_seed(seeds)       # drawn every request, used or not: the habits stay in step
            if op == "return":
                request_seed = session_seed = trace[parent].seed
            elif habit == "fixed":
                if op == "reroll":
                    session_seed = fresh
                request_seed = session_seed
            else:
                request_seed = fresh
            tags = {"op": op, "session": session, "step": step, "parent": parent}
            if changed is not None:
                tags["changed"] = changed
            trace.append(TraceRequest(dict(scene), prompt, request_seed, tags))
            history.append(len(trace) - 1)
        session += 1
    return trace


def trace_stats(trace: list) -> dict:
    """Counts of the trace: operations, sessions, exact repeats (same prompt and seed as an earlier request)."""
    seen, repeats = set(), 0
    ops = {op: 0 for op in OPERATIONS}
    for request in trace:
        ops[request.tags["op"]] += 1
        key = (request.prompt, request.seed)
        repeats += key in seen
        seen.add(key)
    sessions = len({request.tags["session"] for request in trace})
    return {"requests": len(trace), "sessions": sessions, "mean_session": len(trace) / sessions,
            "operations": ops, "exact_repeats": repeats,
            "unique_prompts": len({request.prompt for request in trace})}


__all__ = ["OPERATIONS", "SEED_HABITS", "TraceWorld", "AttributeWorld", "demo_world", "SceneWorld", "TraceMix",
           "TraceRequest", "generate_trace", "trace_stats"]
