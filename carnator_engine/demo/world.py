"""A procedural text-to-video world where the truth is known.

A clip shows one flat-coloured object (circle, square or triangle) moving in a straight line at a
constant speed over a plain background: [3, 8, 32, 32] in [-1, 1], the shape TinyVideoDiT expects.
Six attributes describe it completely except for the start position, which the seed draws:

    color       red green blue yellow magenta cyan
    shape       circle square triangle
    direction   left right up down
    background  black white gray
    size        small large
    speed       slow fast

Every object colour stands at least 0.87 (RGB in [0, 1]) from every background, and the colours at
least 1.0 from each other, so `analyze` reads each attribute back from pixels alone: that is how the
benchmarks score a generated clip. The request helpers at the end (`iteration_stream`,
`adversarial_pairs`) build the streams the quality benchmark replays.

Attributes travel as dicts ({"color": "red", ...}) at the API and as a LongTensor of value indices
[B, 6] (`encode`, order of ATTRIBUTES) inside the vectorised renderer and analyzer.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

FRAMES, HEIGHT, WIDTH = 8, 32, 32
TEXT_LEN = 16            # prompt tokens the demo model reads (TinyDiTConfig.text_len)
CLIP_SHAPE = (3, FRAMES, HEIGHT, WIDTH)

COLORS = {
    "red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0), "magenta": (1.0, 0.0, 1.0), "cyan": (0.0, 1.0, 1.0),
}
BACKGROUNDS = {"black": (0.0, 0.0, 0.0), "white": (1.0, 1.0, 1.0), "gray": (0.5, 0.5, 0.5)}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = ("left", "right", "up", "down")
SIZES = ("small", "large")
SPEEDS = ("slow", "fast")

ATTRIBUTES = ("color", "shape", "direction", "background", "size", "speed")
VALUES = {
    "color": tuple(COLORS), "shape": SHAPES, "direction": DIRECTIONS,
    "background": tuple(BACKGROUNDS), "size": SIZES, "speed": SPEEDS,
}
OPPOSITE_DIRECTION = {"left": "right", "right": "left", "up": "down", "down": "up"}
SPEED_ADVERB = {"slow": "slowly", "fast": "quickly"}

# Geometry (pixels). Half-extent of the object's bounding box by size, displacement per frame by
# speed. A large fast object (13 px wide, 15.4 px of travel) still fits a 32 px frame with a
# pixel to spare on each side.
SIZE_RADIUS = {"small": 3.5, "large": 6.5}
SPEED_PIXELS = {"slow": 0.8, "fast": 2.2}
# (dx, dy) per direction; y grows downwards as in the image.
DIRECTION_VECTOR = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}

# Prompt template: every word of it is in VOCABULARY.
PROMPT_TEMPLATE = "a {size} {color} {shape} moving {direction} {adverb} on a {background} background"
_PROMPT_WORDS = re.findall(r"[a-z]+", re.sub(r"\{\w+\}", " ", PROMPT_TEMPLATE))
VOCABULARY = sorted(set(_PROMPT_WORDS) | set(SPEED_ADVERB.values())
                    | {value for name, values in VALUES.items() if name != "speed" for value in values})

# Combinations the demo model never sees in training (every background, size and speed of these
# colour-shape-direction triples): its accuracy on them measures compositional generalisation.
HELDOUT_TRIPLES = (("magenta", "triangle", "up"), ("cyan", "square", "left"),
                   ("yellow", "circle", "down"), ("red", "triangle", "right"))

# Analyzer thresholds, between the rendered values above.
MASK_DISTANCE = 0.4      # a pixel this far (RGB, [0, 1]) from the background may belong to the object
CORE_DISTANCE = 0.7      # ... and this far, it votes for the object's colour
SIZE_SPLIT = 10.0        # bounding-box extent (px): small ~7, large ~13
SHAPE_TEMPLATE_EDGES = (1.0, 2.5)   # edge widths (px) of the shape templates the analyzer matches
SPEED_SPLIT = 1.5        # centroid speed (px/frame): slow 0.8, fast 2.2


def _table(mapping: dict, keys) -> torch.Tensor:
    return torch.tensor([mapping[k] for k in keys], dtype=torch.float32)


COLOR_RGB = _table(COLORS, VALUES["color"])                     # [6, 3]
BACKGROUND_RGB = _table(BACKGROUNDS, VALUES["background"])      # [3, 3]
RADIUS_PX = _table(SIZE_RADIUS, SIZES)                          # [2]
SPEED_PX = _table(SPEED_PIXELS, SPEEDS)                         # [2]
DIRECTION_XY = _table(DIRECTION_VECTOR, DIRECTIONS)             # [4, 2]


# ---------------------------------------------------------------------------------------------
# Attributes, prompts, codes


def prompt(attributes: dict) -> str:
    a = attributes
    return PROMPT_TEMPLATE.format(size=a["size"], color=a["color"], shape=a["shape"],
                                  direction=a["direction"], adverb=SPEED_ADVERB[a["speed"]],
                                  background=a["background"])


def parse_prompt(text: str) -> dict:
    """Attributes named by a prompt of this world (the inverse of `prompt`)."""
    words = re.findall(r"[a-z]+", text.lower())
    adverbs = {v: k for k, v in SPEED_ADVERB.items()}
    found = {}
    for i, word in enumerate(words):
        if word in adverbs:
            found["speed"] = adverbs[word]
        elif word in BACKGROUNDS and i + 1 < len(words) and words[i + 1] == "background":
            found["background"] = word
        else:
            for name in ("color", "shape", "direction", "size"):
                if word in VALUES[name]:
                    found[name] = word
    missing = [name for name in ATTRIBUTES if name not in found]
    if missing:
        raise ValueError(f"prompt {text!r} does not name: {', '.join(missing)}")
    return {name: found[name] for name in ATTRIBUTES}


def validate(attributes: dict) -> dict:
    for name in ATTRIBUTES:
        if attributes.get(name) not in VALUES[name]:
            raise ValueError(f"attribute {name!r} must be one of {VALUES[name]}, got {attributes.get(name)!r}")
    return {name: attributes[name] for name in ATTRIBUTES}


def encode(attributes_list) -> torch.Tensor:
    """List of attribute dicts -> LongTensor [B, 6] of value indices (order of ATTRIBUTES)."""
    rows = []
    for attributes in attributes_list:
        a = validate(attributes)
        rows.append([VALUES[name].index(a[name]) for name in ATTRIBUTES])
    return torch.tensor(rows, dtype=torch.long).reshape(-1, len(ATTRIBUTES))


def decode(codes: torch.Tensor) -> list:
    return [{name: VALUES[name][int(i)] for name, i in zip(ATTRIBUTES, row)} for row in codes.cpu()]


def all_combinations() -> list:
    codes = torch.cartesian_prod(*[torch.arange(len(VALUES[name])) for name in ATTRIBUTES])
    return decode(codes)


def is_heldout(attributes: dict) -> bool:
    return (attributes["color"], attributes["shape"], attributes["direction"]) in HELDOUT_TRIPLES


def heldout_mask(codes: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows whose colour-shape-direction triple is held out of training."""
    table = torch.zeros(len(COLORS), len(SHAPES), len(DIRECTIONS), dtype=torch.bool)
    for color, shape, direction in HELDOUT_TRIPLES:
        table[VALUES["color"].index(color), SHAPES.index(shape), DIRECTIONS.index(direction)] = True
    table = table.to(codes.device)
    return table[codes[:, 0], codes[:, 1], codes[:, 2]]


def _generator(seed: Optional[int], device="cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator


def sample_codes(batch: int, generator: Optional[torch.Generator] = None, device="cpu",
                 heldout: str = "include") -> torch.Tensor:
    """Uniform random attribute codes [batch, 6]; heldout: 'include', 'exclude' or 'only'."""
    if heldout not in ("include", "exclude", "only"):
        raise ValueError(f"heldout must be 'include', 'exclude' or 'only', got {heldout!r}")
    sizes = torch.tensor([len(VALUES[name]) for name in ATTRIBUTES], device=device)
    codes = (torch.rand(batch, len(ATTRIBUTES), generator=generator, device=device) * sizes).long()
    if heldout == "include":
        return codes
    if heldout == "only":
        triple = torch.randint(len(HELDOUT_TRIPLES), (batch,), generator=generator, device=device)
        fixed = encode([{"color": c, "shape": s, "direction": d, "background": "black", "size": "small",
                         "speed": "slow"} for c, s, d in HELDOUT_TRIPLES]).to(device)
        codes[:, :3] = fixed[triple, :3]
        return codes
    # Exclude: move a held-out row's direction to the next one (held-out triples never share a
    # colour-shape pair, so one move always leaves the held-out set).
    bad = heldout_mask(codes)
    codes[:, 2] = torch.where(bad, (codes[:, 2] + 1) % len(DIRECTIONS), codes[:, 2])
    return codes


def random_attributes(seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
                      heldout: str = "include") -> dict:
    generator = generator if generator is not None else _generator(seed)
    return decode(sample_codes(1, generator, heldout=heldout))[0]


# ---------------------------------------------------------------------------------------------
# Rendering


def _shape_coverage(centers: torch.Tensor, radius: torch.Tensor, height: int, width: int,
                    edge: float = 1.0) -> torch.Tensor:
    """Anti-aliased coverage of each shape (order of SHAPES): centers [B, F, 2] (x, y in pixels),
    radius [B, F] or [B, 1] (half the bounding box) -> [3, B, F, H, W] in [0, 1]; the edge ramps
    from 0 to 1 over `edge` pixels (1 renders; wider ones model a blurred generation)."""
    device = centers.device
    xs = torch.arange(width, dtype=torch.float32, device=device) + 0.5
    ys = torch.arange(height, dtype=torch.float32, device=device) + 0.5
    dx = xs[None, None, None, :] - centers[..., 0, None, None]                                  # [B, F, 1, W]
    dy = ys[None, None, :, None] - centers[..., 1, None, None]                                  # [B, F, H, 1]
    r = radius[..., None, None]
    circle = torch.sqrt(dx * dx + dy * dy) - r
    square = torch.maximum(dx.abs(), dy.abs()) - r
    # Upward-pointing isosceles triangle filling the same 2r x 2r box: apex (0, -r), base y = +r;
    # cut by the box so its anti-aliased apex and base corners end where the square's edges do.
    slant = (2.0 * dx.abs() - (dy + r)) / math.sqrt(5.0)
    triangle = torch.maximum(torch.maximum(dy - r, slant), square)
    signed = torch.stack(torch.broadcast_tensors(circle, square, triangle))
    return (0.5 - signed / edge).clamp(0.0, 1.0)


def render_codes(codes: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Vectorised renderer: codes [B, 6] (on any device) -> clips [B, 3, 8, 32, 32] in [-1, 1].

    The start position is uniform over the places from which the whole path stays in frame; the
    generator (on the codes' device) draws it. Edges are anti-aliased over one pixel.
    """
    device = codes.device
    color = COLOR_RGB.to(device)[codes[:, 0]]
    step = DIRECTION_XY.to(device)[codes[:, 2]] * SPEED_PX.to(device)[codes[:, 5], None]   # [B, 2]
    background = BACKGROUND_RGB.to(device)[codes[:, 3]]
    radius = RADIUS_PX.to(device)[codes[:, 4]]
    frame_size = torch.tensor([WIDTH, HEIGHT], dtype=torch.float32, device=device)
    centers = object_centers(step, radius, torch.zeros(2, device=device), frame_size, generator)
    canvas = background[:, :, None, None, None].expand(-1, -1, FRAMES, HEIGHT, WIDTH)
    return paint(canvas, color, codes[:, 1], centers, radius) * 2.0 - 1.0


def object_centers(step: torch.Tensor, radius: torch.Tensor, box_origin: torch.Tensor, box_size: torch.Tensor,
                   generator: Optional[torch.Generator]) -> torch.Tensor:
    """Centres [B, F, 2] (x, y in pixels) of objects moving `step` [B, 2] pixels a frame inside their box
    (top-left corner `box_origin`, extent `box_size`, each [2] or [B, 2]). The start is uniform over the places
    from which the whole path, anti-aliased edge included, stays in the box; the generator draws it."""
    travel = step * (FRAMES - 1)
    margin = (radius + 1.0)[:, None]   # the anti-aliased edge ends half a pixel short of the border
    low = box_origin + margin - travel.clamp(max=0)
    high = box_origin + box_size - margin - travel.clamp(min=0)
    start = low + torch.rand(step.shape[0], 2, generator=generator, device=step.device) * (high - low)
    t = torch.arange(FRAMES, dtype=torch.float32, device=step.device)
    return start[:, None, :] + step[:, None, :] * t[None, :, None]


def paint(canvas: torch.Tensor, color: torch.Tensor, shape: torch.Tensor, centers: torch.Tensor,
          radius: torch.Tensor, present: Optional[torch.Tensor] = None) -> torch.Tensor:
    """canvas [B, 3, F, H, W] in [0, 1] with one object per clip drawn over it: colour [B, 3], shape index [B],
    centres [B, F, 2], radius [B]; rows where `present` [B] is False stay as they are."""
    coverage = _shape_coverage(centers, radius[:, None], canvas.shape[-2], canvas.shape[-1])   # [3, B, F, H, W]
    coverage = coverage.gather(0, shape[None, :, None, None, None].expand(1, *coverage.shape[1:]))[0][:, None]
    if present is not None:
        coverage = coverage * present[:, None, None, None, None]
    return canvas * (1 - coverage) + color[:, :, None, None, None] * coverage


def render(attributes: dict, seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
           device="cpu") -> torch.Tensor:
    """One clip [3, 8, 32, 32] in [-1, 1]; the seed (or generator) draws the start position."""
    generator = generator if generator is not None else _generator(seed, device)
    return render_codes(encode([attributes]).to(device), generator)[0]


def render_batch(attributes_list, seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 device="cpu") -> torch.Tensor:
    generator = generator if generator is not None else _generator(seed, device)
    return render_codes(encode(attributes_list).to(device), generator)


def sample_batch(batch: int, generator: Optional[torch.Generator] = None, device="cpu", heldout: str = "include"):
    """Training data: (codes [B, 6], clips [B, 3, 8, 32, 32], prompts [B])."""
    codes = sample_codes(batch, generator, device, heldout)
    return codes, render_codes(codes, generator), [prompt(a) for a in decode(codes)]


def initial_noise(seeds, device="cpu") -> torch.Tensor:
    """The starting noise of requests with these seeds, [B, 3, 8, 32, 32]: the same on every device."""
    return torch.stack([torch.randn(CLIP_SHAPE, generator=_generator(s)) for s in seeds]).to(device)


# ---------------------------------------------------------------------------------------------
# Analyzer


def _nearest(colors: torch.Tensor, palette: torch.Tensor) -> torch.Tensor:
    """colors [..., 3], palette [K, 3] -> index [...] of the nearest entry."""
    return torch.cdist(colors.reshape(-1, 3), palette.to(colors.device)).argmin(-1).reshape(colors.shape[:-1])


def _first(any_mask: torch.Tensor) -> torch.Tensor:
    """any_mask [..., N] bool -> index of the first True (0 when none)."""
    return any_mask.float().argmax(-1).float()


def _extent(any_mask: torch.Tensor) -> torch.Tensor:
    """any_mask [..., N] bool -> number of cells from the first True to the last (0 when none)."""
    n = any_mask.shape[-1]
    first = any_mask.float().argmax(-1)
    last = n - 1 - any_mask.flip(-1).float().argmax(-1)
    return torch.where(any_mask.any(-1), last - first + 1, torch.zeros_like(first)).float()


def read_background(x: torch.Tensor) -> tuple:
    """x [B, 3, F, H, W] in [0, 1] -> (the border's median colour [B, 3], index [B] of the nearest background)."""
    border = torch.cat([x[..., 0, :], x[..., -1, :], x[..., 1:-1, 0], x[..., 1:-1, -1]], dim=-1)
    background_rgb = border.flatten(2).median(-1).values
    return background_rgb, _nearest(background_rgb, BACKGROUND_RGB)


@torch.no_grad()
def analyze_batch(clips: torch.Tensor, measurements: bool = False, size_split: float = SIZE_SPLIT):
    """Read the attributes back from clips [B, 3, 8, 32, 32] in [-1, 1].

    background: the border's median colour, nearest background; object: pixels far from it;
    colour: vote of the object's core pixels for the nearest palette colour; then the object's
    coverage (projection on the colour-minus-background axis) > 0.5 gives per-frame masks, whose
    bounding-box extent gives size, the best match of its coverage with each shape drawn in that box
    gives shape (frames vote), and the centroid track (least-squares
    slope) direction and speed. A clip with no object gets None for the object's attributes. size_split is
    the bounding-box extent (px) between small and large (world v2 reads its smaller objects with its own).
    Returns a list of dicts, and with measurements=True also a dict of the raw numbers [B].
    """
    x = ((clips.float() + 1.0) / 2.0).clamp(0.0, 1.0)
    batch, _, frames, height, width = x.shape
    background_rgb, background = read_background(x)
    offset = x - background_rgb[:, :, None, None, None]
    distance = offset.norm(dim=1)                                                                # [B, F, H, W]

    # Colour: votes of core pixels (or of all object pixels where none is that far).
    vote_of = _nearest(x.movedim(1, -1), COLOR_RGB)                                              # [B, F, H, W]
    core = distance > CORE_DISTANCE
    loose = distance > MASK_DISTANCE
    voters = torch.where(core.flatten(1).any(1)[:, None, None, None], core, loose)
    votes = (F.one_hot(vote_of, len(COLORS)) * voters[..., None]).flatten(1, 3).sum(1)            # [B, 6]
    has_object = votes.sum(1) > 0
    color = votes.argmax(1)

    # Coverage of the object colour: exact for rendered clips, tolerant of off-palette generations.
    axis = COLOR_RGB.to(x.device)[color] - background_rgb                                       # [B, 3]
    coverage = (offset * axis[:, :, None, None, None]).sum(1) / axis.square().sum(1).clamp(min=1e-6)[:, None, None, None]
    mask = (coverage > 0.5) & loose
    # Drop isolated pixels (no 8-neighbour in the mask): generation speckle, never the object.
    flat = mask.reshape(batch * frames, 1, height, width).float()
    neighbours = F.conv2d(flat, torch.ones(1, 1, 3, 3, device=x.device), padding=1) - flat
    mask = mask & (neighbours.reshape(batch, frames, height, width) > 0)

    area = mask.flatten(2).sum(-1).float()                                                       # [B, F]
    valid = area > 0
    rows_any, cols_any = mask.any(-1), mask.any(-2)
    top, rows = _first(rows_any), _extent(rows_any)
    left, cols = _first(cols_any), _extent(cols_any)
    nan = torch.full_like(area, float("nan"))

    def per_clip(value):   # median over the frames that show the object
        return torch.where(valid, value, nan).nanmedian(1).values

    extent = per_clip(torch.maximum(rows, cols))
    fill = per_clip(area / (rows * cols).clamp(min=1))
    # Shape: per frame, the best match (squared error) of the object's soft coverage with each
    # shape drawn in the object's bounding box, sharp or blurred; the frames vote.
    box_center = torch.stack([left + cols / 2, top + rows / 2], dim=-1)                          # [B, F, 2]
    soft = coverage.clamp(0.0, 1.0)[None]
    errors = torch.stack([
        (_shape_coverage(box_center, (rows + cols) / 4, height, width, edge) - soft).square().flatten(3).sum(-1)
        for edge in SHAPE_TEMPLATE_EDGES]).amin(0)                                              # [3, B, F]
    shape_votes = (F.one_hot(errors.argmin(0), len(SHAPES)) * valid[..., None]).sum(1)          # [B, 3]
    shape = shape_votes.argmax(1)
    shape_error = (errors * valid).sum(-1).T / valid.sum(1, keepdim=True).clamp(min=1)          # [B, 3]

    xs = torch.arange(width, dtype=torch.float32, device=x.device)
    ys = torch.arange(height, dtype=torch.float32, device=x.device)
    weight = area.clamp(min=1)
    cx = (mask.float() * xs).sum((-1, -2)) / weight
    cy = (mask.float() * ys[:, None]).sum((-1, -2)) / weight
    t = torch.arange(frames, dtype=torch.float32, device=x.device).expand(batch, frames)
    w = valid.float()
    n = w.sum(1).clamp(min=1)
    t_mean = (w * t).sum(1) / n
    centered = (t - t_mean[:, None]) * w
    denom = (centered * (t - t_mean[:, None])).sum(1).clamp(min=1e-6)
    vx = (centered * cx).sum(1) / denom
    vy = (centered * cy).sum(1) / denom
    enough_frames = valid.sum(1) >= 2

    horizontal = vx.abs() >= vy.abs()
    direction = torch.where(horizontal, torch.where(vx < 0, 0, 1), torch.where(vy < 0, 2, 3))
    speed = torch.where(torch.maximum(vx.abs(), vy.abs()) > SPEED_SPLIT, 1, 0)
    size = (extent > size_split).long()

    found = (valid.any(1) & has_object).tolist()
    moving = (valid.any(1) & has_object & enough_frames).tolist()
    read = torch.stack([color, shape, direction, background, size, speed], 1).tolist()   # one transfer
    results = []
    for row, is_found, is_moving in zip(read, found, moving):
        named = {name: VALUES[name][index] for name, index in zip(ATTRIBUTES, row)}
        for name in ("color", "shape", "size"):
            named[name] = named[name] if is_found else None
        for name in ("direction", "speed"):
            named[name] = named[name] if is_moving else None
        results.append(named)
    if measurements:
        numbers = {"extent": extent, "fill": fill, "shape_error": shape_error, "vx": vx, "vy": vy, "area": area.mean(1),
                   "frames_with_object": valid.sum(1), "background_rgb": background_rgb}
        return results, {k: v.cpu() for k, v in numbers.items()}
    return results


def analyze(clip: torch.Tensor) -> dict:
    """Attributes read back from one clip [3, 8, 32, 32] in [-1, 1] (see analyze_batch)."""
    return analyze_batch(clip[None])[0]


def all_right(read: dict, expected: dict) -> bool:
    return all(read[name] == expected[name] for name in ATTRIBUTES)


def made_wrong(read: dict, reference: dict, expected: dict) -> list:
    """Attributes a generation got wrong that the reference generation of the same request got right."""
    return [name for name in ATTRIBUTES if read[name] != expected[name] and reference[name] == expected[name]]


def attribute_accuracy(expected: list, read: list) -> dict:
    """Share of clips whose read attribute equals the expected one, per attribute and for 'all'."""
    if len(expected) != len(read):
        raise ValueError(f"{len(expected)} expected attribute sets but {len(read)} read")
    if not expected:
        raise ValueError("no clips to score")
    scores = {}
    for name in ATTRIBUTES:
        scores[name] = sum(e[name] == r[name] for e, r in zip(expected, read)) / len(expected)
    scores["all"] = sum(all(e[n] == r[n] for n in ATTRIBUTES) for e, r in zip(expected, read)) / len(expected)
    return scores


# ---------------------------------------------------------------------------------------------
# Request streams for the benchmarks


@dataclass
class Request:
    """One text-to-video request of the world: what is asked and the seed of its starting noise."""

    attributes: dict
    seed: int
    edited: Optional[str] = None     # the attribute changed from the previous request, if any
    tags: dict = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return prompt(self.attributes)

    def to_dict(self) -> dict:
        return {"attributes": dict(self.attributes), "prompt": self.prompt, "seed": self.seed,
                "edited": self.edited, **({"tags": dict(self.tags)} if self.tags else {})}


def edit(attributes: dict, name: str, generator: torch.Generator, value: Optional[str] = None) -> dict:
    """A copy of the attributes with one attribute set to another value (random unless given)."""
    if name not in ATTRIBUTES:
        raise ValueError(f"unknown attribute {name!r}; attributes are {ATTRIBUTES}")
    if value is None:
        others = [v for v in VALUES[name] if v != attributes[name]]
        value = others[int(torch.randint(len(others), (1,), generator=generator))]
    elif value not in VALUES[name]:
        raise ValueError(f"attribute {name!r} must be one of {VALUES[name]}, got {value!r}")
    changed = dict(attributes)
    changed[name] = value
    return changed


def _new_seed(generator: torch.Generator) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


def iteration_stream(n: int, seed: int = 0, restart_every: Optional[int] = None,
                     editable=ATTRIBUTES, one_seed_per_session: bool = False) -> list:
    """A user iterating on a prompt: each request changes one attribute of the previous one
    (chosen uniformly from `editable`) and draws a fresh noise seed; every `restart_every`
    requests (if given) a new random prompt starts a new session. With one_seed_per_session
    (ComfyUI's 'fixed' seed habit) every request keeps its session's first seed; the prompts are
    the same either way."""
    generator = _generator(seed)
    requests = []
    current = None
    for i in range(n):
        if current is None or (restart_every and i % restart_every == 0):
            current = random_attributes(generator=generator)
            edited = None
        else:
            edited = editable[int(torch.randint(len(editable), (1,), generator=generator))]
            current = edit(current, edited, generator)
        requests.append(Request(current, _new_seed(generator), edited))
    if one_seed_per_session:
        first = lambda i: i - i % restart_every if restart_every else 0  # noqa: E731
        requests = [Request(r.attributes, requests[first(i)].seed, r.edited) for i, r in enumerate(requests)]
    return requests


def adversarial_pairs(n: int, seed: int = 0, kinds=("direction", "color"), same_seed: bool = True) -> list:
    """Pairs of requests whose prompts differ by one word but whose videos differ everywhere it
    matters: the direction reversed (left<->right, up<->down) or the colour swapped. With
    same_seed the two share their starting noise, the hardest case for a reuse gate.
    Returns a list of (first, second) Requests, kinds taking turns."""
    generator = _generator(seed)
    pairs = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        first = random_attributes(generator=generator)
        if kind == "direction":
            second = edit(first, "direction", generator, OPPOSITE_DIRECTION[first["direction"]])
        else:
            second = edit(first, kind, generator)
        seed_a = _new_seed(generator)
        seed_b = seed_a if same_seed else _new_seed(generator)
        pairs.append((Request(first, seed_a, None, {"pair": i, "kind": kind}),
                      Request(second, seed_b, kind, {"pair": i, "kind": kind})))
    return pairs
