"""World v2: scenes of two or three objects, each in its own quadrant, where an edit changes part of a clip.

The clip has world v1's shape ([3, 8, 32, 32] in [-1, 1]) and palette. The frame is cut into four 16 x 16
quadrants (POSITIONS); a scene puts two or three objects in distinct quadrants over one background. Each
object has its own colour, shape, motion direction and size and moves at one slow speed inside its quadrant,
so it never leaves it:

    background              black white gray                       (one per scene)
    position                top left, top right, bottom left, bottom right
    color                   red green blue yellow magenta cyan     (per object)
    shape                   circle square triangle
    direction               left right up down
    size                    small large

An edit of one object (its colour, shape, size or motion), or an object added or removed, changes one
quadrant, a quarter of the clip; a background edit changes every pixel around the objects. Look-alike
edits differ by one word but change what must not be reused: a direction reversed ("left" vs "right"),
a square turned into a circle, an object moved to the quadrant beside it ("top left" vs "top right").

A scene travels as a dict at the API,

    {"background": "gray", "objects": {"top left": {"color": "red", "shape": "circle",
                                                    "direction": "up", "size": "small"}, ...}}

and as a LongTensor [B, 17] of value indices inside the vectorised renderer, analyzer and trainer:
column 0 the background, then (color, shape, direction, size) for each position in POSITIONS order, -1
where the quadrant is empty. `analyze` reads every object back from the pixels (world v1's analyzer on each
quadrant); `flatten` turns a scene into the flat attributes that `attribute_accuracy`, `all_right` and
`made_wrong` score, with the same meaning as world v1's. `iteration_stream` and `adversarial_pairs` build
the request streams the quality benchmark replays, as world v1's do.
"""
from __future__ import annotations

import functools
import re
from typing import Optional

import torch

from . import world
from .world import (BACKGROUND_RGB, BACKGROUNDS, CLIP_SHAPE, COLOR_RGB, COLORS, DIRECTION_XY, DIRECTIONS,  # noqa: F401
                    FRAMES, HEIGHT, OPPOSITE_DIRECTION, SHAPES, WIDTH, _generator, _new_seed, initial_noise)

POSITIONS = ("top left", "top right", "bottom left", "bottom right")
QUADRANT = 16                                    # pixels; quadrant i has its corner at ORIGINS[i]
ORIGINS = ((0, 0), (16, 0), (0, 16), (16, 16))   # (x, y)
SIZES = ("small", "large")
OBJECT_ATTRIBUTES = ("color", "shape", "direction", "size")
VALUES = {"background": tuple(BACKGROUNDS), "color": tuple(COLORS), "shape": SHAPES, "direction": DIRECTIONS,
          "size": SIZES}
COLUMNS = 1 + len(POSITIONS) * len(OBJECT_ATTRIBUTES)   # 17
MIN_OBJECTS, MAX_OBJECTS = 2, 3

# Geometry (pixels): half-extent by size and one speed. A large object (10 px) travelling 7 frames x 0.5 px
# fits its 16 px quadrant with the anti-aliased edge half a pixel short of each side; a small one is as large
# as world v1's small objects, so shapes stay as legible as there.
SIZE_RADIUS = {"small": 3.5, "large": 5.0}
SPEED = 0.5
SIZE_SPLIT = 8.5          # analyzer: bounding-box extent (px) between small (~7) and large (~10)
RADIUS_PX = torch.tensor([SIZE_RADIUS[s] for s in SIZES])

# Prompt: one phrase per object, joined by "and", then the background. Every word is in VOCABULARY.
OBJECT_PHRASE = "a {size} {color} {shape} moving {direction} in the {position}"
JOIN = "and"
BACKGROUND_PHRASE = "on a {background} background"
_TEMPLATE_WORDS = re.findall(r"[a-z]+", re.sub(r"\{\w+\}", " ", OBJECT_PHRASE + " " + BACKGROUND_PHRASE))
VOCABULARY = sorted(set(_TEMPLATE_WORDS) | {JOIN} | {w for p in POSITIONS for w in p.split()}
                    | {v for values in VALUES.values() for v in values})
OBJECT_WORDS = len(OBJECT_PHRASE.split()) + 1      # 10: a position is two words
TEXT_LEN = MAX_OBJECTS * OBJECT_WORDS + (MAX_OBJECTS - 1) + len(BACKGROUND_PHRASE.split())   # 36

# Colour-shape-position triples never shown in training: accuracy on them measures compositional
# generalisation. No two share a colour-position pair, so changing the shape always leaves the set.
HELDOUT_TRIPLES = (("magenta", "triangle", "top left"), ("cyan", "square", "bottom right"),
                   ("yellow", "circle", "top right"), ("red", "triangle", "bottom left"))
# Scores that attribute_accuracy reports besides "all" (the whole scene right, world v1's "all six right").
SCORES = ("background", "objects") + OBJECT_ATTRIBUTES


# ---------------------------------------------------------------------------------------------
# Scenes, prompts, codes


def validate(scene: dict) -> dict:
    """A checked copy of a scene, objects in POSITIONS order."""
    if scene.get("background") not in VALUES["background"]:
        raise ValueError(f"scene background must be one of {VALUES['background']}, got {scene.get('background')!r}")
    objects = scene.get("objects")
    if not isinstance(objects, dict) or not MIN_OBJECTS <= len(objects) <= MAX_OBJECTS:
        raise ValueError(f"scene objects must map {MIN_OBJECTS} to {MAX_OBJECTS} positions to objects, got {objects!r}")
    checked = {}
    for position in POSITIONS:
        if position not in objects:
            continue
        for name in OBJECT_ATTRIBUTES:
            if objects[position].get(name) not in VALUES[name]:
                raise ValueError(f"object {name!r} at {position!r} must be one of {VALUES[name]}, "
                                 f"got {objects[position].get(name)!r}")
        checked[position] = {name: objects[position][name] for name in OBJECT_ATTRIBUTES}
    unknown = set(objects) - set(POSITIONS)
    if unknown:
        raise ValueError(f"scene positions must be among {POSITIONS}, got {sorted(unknown)}")
    return {"background": scene["background"], "objects": checked}


def prompt(scene: dict, order=None) -> str:
    """The scene's prompt; objects in POSITIONS order unless `order` (a list of its positions) says otherwise:
    every order describes the same scene, the way a user may write it."""
    scene = validate(scene)
    order = list(scene["objects"]) if order is None else list(order)
    if sorted(order) != sorted(scene["objects"]):
        raise ValueError(f"order must list the scene's positions {list(scene['objects'])}, got {order}")
    phrases = [OBJECT_PHRASE.format(position=p, **scene["objects"][p]) for p in order]
    return f" {JOIN} ".join(phrases) + " " + BACKGROUND_PHRASE.format(background=scene["background"])


_PHRASE_PATTERN = re.compile(r"\b" + OBJECT_PHRASE.replace("{position}", r"(?P<position>\w+ \w+)")
                             .replace("{", "(?P<").replace("}", r">\w+)"))
_BACKGROUND_PATTERN = re.compile(BACKGROUND_PHRASE.replace("{background}", r"(?P<background>\w+)") + "$")


def parse_prompt(text: str) -> dict:
    """The scene a prompt of this world describes (the inverse of `prompt`, in any object order)."""
    text = " ".join(re.findall(r"[a-z]+", text.lower()))
    background = _BACKGROUND_PATTERN.search(text)
    objects = {m["position"]: {name: m[name] for name in OBJECT_ATTRIBUTES} for m in _PHRASE_PATTERN.finditer(text)}
    if background is None:
        raise ValueError(f"prompt {text!r} names no background ('... {BACKGROUND_PHRASE}')")
    return validate({"background": background["background"], "objects": objects})


def encode(scenes) -> torch.Tensor:
    """List of scenes -> LongTensor [B, 17] (background, then 4 attributes per position, -1 where empty)."""
    rows = []
    for scene in scenes:
        scene = validate(scene)
        row = [VALUES["background"].index(scene["background"])]
        for position in POSITIONS:
            item = scene["objects"].get(position)
            row += [VALUES[n].index(item[n]) if item else -1 for n in OBJECT_ATTRIBUTES]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long).reshape(-1, COLUMNS)


def decode(codes: torch.Tensor) -> list:
    scenes = []
    for row in codes.cpu().tolist():
        objects = {}
        for slot, position in enumerate(POSITIONS):
            values = row[1 + 4 * slot:5 + 4 * slot]
            if values[0] >= 0:
                objects[position] = {n: VALUES[n][i] for n, i in zip(OBJECT_ATTRIBUTES, values)}
        scenes.append({"background": VALUES["background"][row[0]], "objects": objects})
    return scenes


def _slots(codes: torch.Tensor) -> torch.Tensor:
    """codes [B, 17] -> [B, 4 positions, 4 attributes]."""
    return codes[:, 1:].reshape(-1, len(POSITIONS), len(OBJECT_ATTRIBUTES))


def heldout_mask(codes: torch.Tensor) -> torch.Tensor:
    """[B, 4] bool: objects whose colour-shape-position triple is held out of training."""
    table = torch.zeros(len(COLORS), len(SHAPES), len(POSITIONS), dtype=torch.bool)
    for color, shape, position in HELDOUT_TRIPLES:
        table[VALUES["color"].index(color), SHAPES.index(shape), POSITIONS.index(position)] = True
    slots = _slots(codes)
    present = slots[..., 0] >= 0
    position = torch.arange(len(POSITIONS), device=codes.device).expand_as(present)
    return table.to(codes.device)[slots[..., 0].clamp(min=0), slots[..., 1].clamp(min=0), position] & present


def is_heldout(scene: dict) -> bool:
    return bool(heldout_mask(encode([scene])).any())


def sample_codes(batch: int, generator: Optional[torch.Generator] = None, device="cpu",
                 heldout: str = "include") -> torch.Tensor:
    """Uniform random scenes [batch, 17]: two or three objects (even odds) in random distinct quadrants, every
    attribute uniform. heldout: 'include', 'exclude' (no held-out object) or 'only' (one object held out)."""
    if heldout not in ("include", "exclude", "only"):
        raise ValueError(f"heldout must be 'include', 'exclude' or 'only', got {heldout!r}")
    count = MIN_OBJECTS + (torch.rand(batch, generator=generator, device=device) < 0.5).long()
    rank = torch.rand(batch, len(POSITIONS), generator=generator, device=device).argsort(-1).argsort(-1)
    present = rank < count[:, None]                                                          # [B, 4]
    sizes = torch.tensor([len(VALUES[n]) for n in OBJECT_ATTRIBUTES], device=device)
    slots = (torch.rand(batch, len(POSITIONS), len(OBJECT_ATTRIBUTES), generator=generator, device=device)
             * sizes).long()
    background = (torch.rand(batch, generator=generator, device=device) * len(BACKGROUNDS)).long()
    if heldout == "only":   # the first present object becomes a held-out triple placed at its position
        triple = torch.randint(len(HELDOUT_TRIPLES), (batch,), generator=generator, device=device)
        fixed = torch.tensor([[VALUES["color"].index(c), SHAPES.index(s), POSITIONS.index(p)]
                              for c, s, p in HELDOUT_TRIPLES], device=device)[triple]
        rows = torch.arange(batch, device=device)
        first = present.float().argmax(-1)
        present[rows, first] = present[rows, fixed[:, 2]]   # keep the count: drop one only if the triple's is new
        present[rows, fixed[:, 2]] = True
        slots[rows, fixed[:, 2], :2] = fixed[:, :2]
    slots = torch.where(present[..., None], slots, torch.full_like(slots, -1))
    codes = torch.cat([background[:, None], slots.flatten(1)], 1)
    if heldout == "exclude":
        bad = heldout_mask(codes)
        slots = _slots(codes).clone()
        slots[..., 1] = torch.where(bad, (slots[..., 1] + 1) % len(SHAPES), slots[..., 1])
        codes = torch.cat([codes[:, :1], slots.flatten(1)], 1)
    return codes


def random_scene(seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 heldout: str = "include") -> dict:
    generator = generator if generator is not None else _generator(seed)
    return decode(sample_codes(1, generator, heldout=heldout))[0]


@functools.lru_cache(maxsize=8)   # once per model and device, not at every training step
def _word_ids(vocabulary: tuple, device) -> dict:
    index = {word: i + 2 for i, word in enumerate(vocabulary)}   # tiny_dit.tokenize: 0 PAD, 1 UNK
    missing = set(VOCABULARY) - set(index)
    if missing:
        raise ValueError(f"the model's vocabulary lacks world v2's words {sorted(missing)}")

    def ids(words):
        return torch.tensor([index[w] for w in words], device=device)
    return {"values": {n: ids(VALUES[n]) for n in VALUES}, "word": lambda w: index[w],
            "positions": torch.stack([ids(p.split()) for p in POSITIONS])}


def prompt_token_ids(codes: torch.Tensor, vocabulary: list, length: int = TEXT_LEN,
                     generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Token ids [B, length] of the scenes' prompts, as tiny_dit.tokenize gives for `prompt(scene, order)`, built
    on the codes' device for training. Objects come in POSITIONS order, or in a random order per scene when a
    generator is given (so the model learns that every order names the same scene)."""
    device = codes.device
    words = _word_ids(tuple(vocabulary), device)
    slots = _slots(codes)
    batch, present = codes.shape[0], slots[..., 0] >= 0
    safe = slots.clamp(min=0)
    value = {n: words["values"][n][safe[..., i]] for i, n in enumerate(OBJECT_ATTRIBUTES)}      # [B, 4] each
    full = lambda word: torch.full((batch, len(POSITIONS)), words["word"](word), device=device)  # noqa: E731
    # One phrase per position: a join slot, then the OBJECT_PHRASE words.
    phrase = torch.stack([full(JOIN), full("a"), value["size"], value["color"], value["shape"], full("moving"),
                          value["direction"], full("in"), full("the"),
                          *words["positions"].T[:, None, :].expand(2, batch, -1)], -1)           # [B, 4, 11]
    order = torch.arange(len(POSITIONS), device=device).expand(batch, -1)
    if generator is not None:
        order = torch.rand(batch, len(POSITIONS), generator=generator, device=device).argsort(-1)
    phrase, present = phrase.gather(1, order[..., None].expand_as(phrase)), present.gather(1, order)
    first = present & (present.cumsum(1) == 1)
    keep = present[..., None].expand_as(phrase).clone()
    keep[..., 0] &= ~first                                                                     # no "and" first
    tail = torch.stack([full("on")[:, 0], full("a")[:, 0], words["values"]["background"][codes[:, 0]],
                        full("background")[:, 0]], -1)                                         # [B, 4]
    tokens = torch.cat([phrase.flatten(1), tail], 1)
    keep = torch.cat([keep.flatten(1), torch.ones_like(tail, dtype=torch.bool)], 1)
    # Pack the kept words to the front in order (a stable sort on "dropped"), pad with 0 (tokenize's PAD).
    packed_order = (~keep).long().sort(dim=1, stable=True).indices
    tokens = torch.where(keep, tokens, torch.zeros_like(tokens)).gather(1, packed_order)
    if tokens.shape[1] < length:
        tokens = torch.cat([tokens, tokens.new_zeros(batch, length - tokens.shape[1])], 1)
    return tokens[:, :length]


# ---------------------------------------------------------------------------------------------
# Rendering


def render_codes(codes: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Vectorised renderer: codes [B, 17] (on any device) -> clips [B, 3, 8, 32, 32] in [-1, 1]. Each object
    starts uniformly where its whole path stays in its quadrant; the generator draws every quadrant's start,
    empty ones too, so an edit of one object leaves the others where they were."""
    device, batch = codes.device, codes.shape[0]
    slots = _slots(codes)
    canvas = BACKGROUND_RGB.to(device)[codes[:, 0]][:, :, None, None, None].expand(-1, -1, FRAMES, HEIGHT, WIDTH)
    box = torch.tensor([QUADRANT, QUADRANT], dtype=torch.float32, device=device)
    for slot, origin in enumerate(ORIGINS):
        present = slots[:, slot, 0] >= 0
        item = slots[:, slot].clamp(min=0)
        radius = RADIUS_PX.to(device)[item[:, 3]]
        step = DIRECTION_XY.to(device)[item[:, 2]] * SPEED
        centers = world.object_centers(step, radius, torch.tensor(origin, dtype=torch.float32, device=device),
                                       box, generator)
        canvas = world.paint(canvas, COLOR_RGB.to(device)[item[:, 0]], item[:, 1], centers, radius, present)
    return canvas * 2.0 - 1.0


def render_batch(scenes, seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 device="cpu") -> torch.Tensor:
    """Clips [B, 3, 8, 32, 32] in [-1, 1] of these scenes; the seed (or generator) draws the start positions."""
    generator = generator if generator is not None else _generator(seed, device)
    return render_codes(encode(scenes).to(device), generator)


def render(scene: dict, **seeding) -> torch.Tensor:
    """One clip [3, 8, 32, 32]; seed, generator and device as for render_batch."""
    return render_batch([scene], **seeding)[0]


# ---------------------------------------------------------------------------------------------
# Analyzer and scores


@torch.no_grad()
def analyze_batch(clips: torch.Tensor) -> list:
    """Read every scene back from clips [B, 3, 8, 32, 32] in [-1, 1]: the background from the frame's border
    (as world v1 reads it), each object with world v1's analyzer on its quadrant; a quadrant
    where that finds no object is empty."""
    batch = clips.shape[0]
    backgrounds = world.read_background(((clips.float() + 1.0) / 2.0).clamp(0.0, 1.0))[1].tolist()
    crops = torch.stack([clips[..., y:y + QUADRANT, x:x + QUADRANT] for x, y in ORIGINS], 1)     # [B, 4, 3, F, h, w]
    reads = world.analyze_batch(crops.flatten(0, 1), size_split=SIZE_SPLIT)
    scenes = []
    for b in range(batch):
        objects = {}
        for slot, position in enumerate(POSITIONS):
            read = reads[b * len(POSITIONS) + slot]
            if read["color"] is not None:
                objects[position] = {name: read[name] for name in OBJECT_ATTRIBUTES}
        scenes.append({"background": VALUES["background"][backgrounds[b]], "objects": objects})
    return scenes


def analyze(clip: torch.Tensor) -> dict:
    """The scene read back from one clip [3, 8, 32, 32] in [-1, 1] (see analyze_batch)."""
    return analyze_batch(clip[None])[0]


def flatten(scene: dict) -> dict:
    """A scene as flat attributes: 'background', and per position '<position>' (True when an object is there)
    and '<position> <attribute>' (None where empty), so two scenes compare key by key."""
    flat = {"background": scene["background"]}
    for position in POSITIONS:
        item = scene["objects"].get(position)
        flat[position] = item is not None
        for name in OBJECT_ATTRIBUTES:
            flat[f"{position} {name}"] = item[name] if item else None
    return flat


def all_right(read: dict, expected: dict) -> bool:
    """The whole scene right: background, which quadrants hold objects, and every attribute of every object."""
    return flatten(read) == flatten(expected)


def made_wrong(read: dict, reference: dict, expected: dict) -> list:
    """Flat attributes a generation got wrong that the reference generation of the same request got right."""
    read, reference, expected = flatten(read), flatten(reference), flatten(expected)
    return [name for name in expected if read[name] != expected[name] and reference[name] == expected[name]]


def attribute_accuracy(expected: list, read: list) -> dict:
    """Scores of read scenes against the requested ones: 'background' and 'objects' (the occupied quadrants
    exactly right) per scene; color, shape, direction, size per requested object (an object not found there
    counts wrong); 'all' the share of scenes entirely right (all_right), world v1's 'all six right'."""
    if len(expected) != len(read):
        raise ValueError(f"{len(expected)} expected scenes but {len(read)} read")
    if not expected:
        raise ValueError("no clips to score")
    pairs = list(zip(expected, read))
    objects = [(item, r["objects"].get(position)) for e, r in pairs for position, item in e["objects"].items()]
    scores = {"background": sum(e["background"] == r["background"] for e, r in pairs) / len(pairs),
              "objects": sum(set(e["objects"]) == set(r["objects"]) for e, r in pairs) / len(pairs)}
    for name in OBJECT_ATTRIBUTES:
        scores[name] = sum(got is not None and got[name] == item[name] for item, got in objects) / len(objects)
    scores["all"] = sum(all_right(r, e) for e, r in pairs) / len(pairs)
    return scores


# ---------------------------------------------------------------------------------------------
# Request streams for the benchmarks


class Request(world.Request):
    """One request of world v2: the scene (in `attributes`, as world v1's requests name theirs) and the seed."""

    @property
    def prompt(self) -> str:
        return prompt(self.attributes)


EDITS = ("color", "shape", "direction", "size", "background", "add", "remove", "move")


def _choice(options, generator: torch.Generator):
    options = list(options)
    return options[int(torch.randint(len(options), (1,), generator=generator))]


def _other(values, current, generator: torch.Generator):
    return _choice([v for v in values if v != current], generator)


def edit(scene: dict, kind: str, generator: torch.Generator, position: Optional[str] = None,
         value: Optional[str] = None) -> tuple:
    """(edited copy, kind made, position touched or None) of a scene with one edit of `kind` (EDITS): an
    object attribute set to another value, the background changed, an object added in an empty quadrant or
    removed (keeping two to three: an 'add' to a full scene removes one, a 'remove' from a scene of two adds
    one), or moved to an empty quadrant (`value` names it). Object, quadrant and value are random unless given."""
    scene = validate(scene)
    objects = dict(scene["objects"])
    empty = [p for p in POSITIONS if p not in objects]
    if kind == "background":
        background = value or _other(VALUES["background"], scene["background"], generator)
        return {**scene, "background": background}, kind, None
    if kind == "add" or (kind == "remove" and len(objects) == MIN_OBJECTS):
        kind = "add" if len(objects) < MAX_OBJECTS else "remove"
    if kind == "add":
        position = position or _choice(empty, generator)
        objects[position] = {n: _choice(VALUES[n], generator) for n in OBJECT_ATTRIBUTES}
    elif kind == "remove":
        position = position or _choice(objects, generator)
        del objects[position]
    elif kind == "move":
        source = position or _choice(objects, generator)
        position = value or _choice(empty, generator)
        objects[position] = objects.pop(source)
    elif kind in OBJECT_ATTRIBUTES:
        position = position or _choice(objects, generator)
        new = value or _other(VALUES[kind], objects[position][kind], generator)
        objects[position] = {**objects[position], kind: new}
    else:
        raise ValueError(f"unknown edit {kind!r}; edits are {EDITS}")
    return validate({**scene, "objects": objects}), kind, position


def iteration_stream(n: int, seed: int = 0, restart_every: Optional[int] = None, editable=EDITS,
                     one_seed_per_session: bool = False) -> list:
    """A user iterating on a scene, as world.iteration_stream: each request makes one edit (kind uniform over
    `editable`; tags name the quadrant touched) and draws a fresh seed, a new random scene every
    `restart_every` requests; one_seed_per_session keeps each session's first seed."""
    generator = _generator(seed)
    requests, current, first_seed = [], None, None
    for i in range(n):
        tags = {}
        if current is None or (restart_every and i % restart_every == 0):
            current, edited = random_scene(generator=generator), None
            new_seed = _new_seed(generator)
            first_seed = new_seed
        else:
            current, edited, position = edit(current, _choice(editable, generator), generator)
            tags = {"position": position} if position else {}
            new_seed = _new_seed(generator)
        requests.append(Request(current, first_seed if one_seed_per_session else new_seed, edited, tags))
    return requests


LOOKALIKES = {"square": "circle", "circle": "square", "triangle": "square"}
NEIGHBOUR = {"top left": "top right", "top right": "top left", "bottom left": "bottom right",
             "bottom right": "bottom left"}


def adversarial_pairs(n: int, seed: int = 0, kinds=("direction", "shape", "move"), same_seed: bool = True) -> list:
    """Pairs of requests whose prompts differ by one word but whose clips differ where it matters: one
    object's direction reversed, its square turned into a circle (circle into square, triangle into square),
    its colour swapped ("color", as in world v1), or the object moved to the quadrant beside it ("top left" ->
    "top right"). With same_seed the two share their starting noise. Returns (first, second) Requests, kinds
    taking turns."""
    generator = _generator(seed)
    pairs = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        first = random_scene(generator=generator)
        if kind == "move":   # a first scene with the neighbouring quadrant free
            movable = [p for p in first["objects"] if NEIGHBOUR[p] not in first["objects"]]
            while not movable:
                first = random_scene(generator=generator)
                movable = [p for p in first["objects"] if NEIGHBOUR[p] not in first["objects"]]
            position = _choice(movable, generator)
            second = edit(first, "move", generator, position, NEIGHBOUR[position])[0]
        else:
            position = _choice(first["objects"], generator)
            current = first["objects"][position][kind]
            new = {"direction": OPPOSITE_DIRECTION, "shape": LOOKALIKES}.get(kind, {}).get(current)   # colour: any
            second = edit(first, kind, generator, position, new)[0]
        seed_a = _new_seed(generator)
        seed_b = seed_a if same_seed else _new_seed(generator)
        tags = {"pair": i, "kind": kind, "position": position}
        pairs.append((Request(first, seed_a, None, tags), Request(second, seed_b, kind, dict(tags))))
    return pairs
