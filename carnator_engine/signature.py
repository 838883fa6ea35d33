"""Early Signature: what the model itself says about a request after the first few steps.

Three views, each cheap to record and compare:
- `hidden`: every transformer block's output, mean-pooled over tokens, at each probe step
  (the model's semantic reading of prompt + noise);
- `denoised`: the denoised estimate x0-hat after the last probe step on a coarse space-time grid
  (layout, colours and motion already decided by the noise and prompt); its per-cell difference
  is also what localizes target regions;
- `attention`: the pooled block-to-block self-attention map of each block at the last probe step
  (the structure sparse attention will rely on).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention.sparse import pooled_block_attention

HIDDEN_FEATURES = 64
ATTENTION_GRID = 16


@dataclass
class EarlySignature:
    hidden: torch.Tensor     # [probe_steps, blocks, HIDDEN_FEATURES]
    denoised: torch.Tensor   # [C, Tg, Hg, Wg]
    attention: torch.Tensor  # [blocks, g, g], rows sum to 1

    def __post_init__(self):
        """A malformed signature (from the engine API, or stored bytes that parse as tensors) is refused here with
        what is wrong, not later with a shape error from deep inside a lookup."""
        shapes = {"hidden": (3, "[probe_steps, blocks, features]"),
                  "denoised": (4, "[channels, frames, height, width]"),
                  "attention": (3, "[blocks, g, g]")}
        for name, (dims, layout) in shapes.items():
            value = getattr(self, name)
            if not torch.is_tensor(value) or not value.is_floating_point():
                kind = f"dtype {value.dtype}" if torch.is_tensor(value) else type(value).__name__
                raise ValueError(f"Early Signature: {name} is a {kind}, not a floating-point tensor {layout}: build "
                                 "signatures with SignatureRecorder (the probe)")
            if value.dim() != dims:
                raise ValueError(f"Early Signature: {name} has shape {list(value.shape)}, not {layout}: build "
                                 "signatures with SignatureRecorder (the probe)")
        if self.hidden.shape[-1] != HIDDEN_FEATURES or min(self.hidden.shape[:2]) < 1 or self.denoised.numel() < 1:
            raise ValueError(f"Early Signature: hidden has shape {list(self.hidden.shape)} and denoised "
                             f"{list(self.denoised.shape)}: hidden needs {HIDDEN_FEATURES} features and both must be "
                             "non-empty: build signatures with SignatureRecorder (the probe)")
        if self.attention.shape[-1] != self.attention.shape[-2]:
            raise ValueError(f"Early Signature: attention has shape {list(self.attention.shape)}, not square "
                             "[blocks, g, g]: build signatures with SignatureRecorder (the probe)")

    def to_tensors(self, prefix: str = "signature.") -> dict:
        return {prefix + name: getattr(self, name).contiguous() for name in ("hidden", "denoised", "attention")}

    @classmethod
    def from_tensors(cls, tensors: dict, prefix: str = "signature.") -> "EarlySignature":
        return cls(*(tensors[prefix + name].float() for name in ("hidden", "denoised", "attention")))

    def compatible_with(self, other: "EarlySignature") -> bool:
        return not self.difference(other)

    def difference(self, other: "EarlySignature") -> str:
        """What keeps the two signatures from being compared, as a reader would name it ("" when nothing does)."""
        views = (("probe steps", self.hidden.shape[0], other.hidden.shape[0]),
                 ("transformer blocks recorded", self.hidden.shape[1], other.hidden.shape[1]),
                 ("denoised estimate grid", tuple(self.denoised.shape[1:]), tuple(other.denoised.shape[1:])),
                 ("latent channels", self.denoised.shape[0], other.denoised.shape[0]),
                 ("attention maps recorded", self.attention.shape[0], other.attention.shape[0]),
                 ("attention summary blocks a side", self.attention.shape[-1], other.attention.shape[-1]))
        return "; ".join(f"{name} ({mine} here, {theirs} there)" for name, mine, theirs in views if mine != theirs)


def _reduce_features(pooled: torch.Tensor) -> torch.Tensor:
    """[C] -> [HIDDEN_FEATURES] by averaging channel groups: keeps entries small for any width."""
    return F.adaptive_avg_pool1d(pooled[None, None], HIDDEN_FEATURES)[0, 0]


class SignatureRecorder:
    """Collects the three views while the probe steps run (see GenerationObserver)."""

    def __init__(self, probe_steps: int, block_size: int, grid: tuple = (8, 8, 8)):
        if probe_steps < 1:
            raise ValueError(f"probe_steps must be >= 1, got {probe_steps}")
        self.probe_steps = probe_steps
        self.block_size = block_size
        self.grid = grid
        self.hidden: dict = {}
        self.attention: dict = {}
        self.denoised_grid = None

    @property
    def last_step(self) -> int:
        return self.probe_steps - 1

    # Views stay on the model's device until signature(): a device-to-host copy per block would
    # synchronise the GPU 30 times a step and cost more than the probe's own recording.
    def block_output(self, step: int, block_index: int, hidden: torch.Tensor) -> None:
        if step < self.probe_steps:
            pooled = hidden.detach().mean(dim=tuple(range(hidden.dim() - 1)), dtype=torch.float32)
            self.hidden[(step, block_index)] = _reduce_features(pooled)

    def self_attention(self, step: int, block_index: int, q: torch.Tensor, k: torch.Tensor) -> None:
        if step == self.last_step:
            pooled = pooled_block_attention(q, k, self.block_size)
            size = min(ATTENTION_GRID, pooled.shape[0])
            coarse = F.adaptive_avg_pool2d(pooled[None, None], size)[0, 0]
            self.attention[block_index] = coarse / coarse.sum(-1, keepdim=True)

    def denoised_size(self, latent_shape) -> int:
        """How many numbers the signature's coarse x0-hat of a [B, C, T, H, W] latent holds (0 for another shape)."""
        return latent_shape[-4] * math.prod(self._denoised_grid(latent_shape)) if len(latent_shape) >= 4 else 0

    def _denoised_grid(self, latent_shape) -> tuple:
        return tuple(min(g, s) for g, s in zip(self.grid, latent_shape[-3:]))

    def denoised(self, step: int, denoised: torch.Tensor) -> None:
        if step == self.last_step:
            grid = self._denoised_grid(denoised.shape)
            self.denoised_grid = F.adaptive_avg_pool3d(denoised.detach().float().mean(0, keepdim=True), grid)[0]

    def signature(self) -> EarlySignature:
        if self.denoised_grid is None or not self.hidden:
            raise RuntimeError("the probe did not run its steps: no signature was recorded "
                               "(is the backbone adapter attached to the model?)")
        blocks = sorted({b for _, b in self.hidden})
        hidden = torch.stack([torch.stack([self.hidden[(s, b)] for b in blocks]) for s in range(self.probe_steps)])
        attention = torch.stack([self.attention[b] for b in sorted(self.attention)]) if self.attention \
            else torch.zeros(0, 1, 1)
        return EarlySignature(hidden=hidden.cpu(), denoised=self.denoised_grid.cpu(), attention=attention.cpu())


@dataclass
class SignatureDistance:
    hidden: float        # 1 - mean cosine of pooled block states
    denoised: float      # RMS difference of the coarse x0-hat, in noise units
    attention: float     # mean total-variation distance of attention rows
    cell_map: torch.Tensor  # [Tg, Hg, Wg] per-cell RMS x0-hat difference over channels, in noise units
    chance: float        # the RMS x0-hat difference of two unrelated estimates of this model and shape

    def as_dict(self) -> dict:
        return {"hidden": round(self.hidden, 5), "denoised": round(self.denoised, 5),
                "attention": round(self.attention, 5), "chance": round(self.chance, 5)}


def chance_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The RMS difference of two coarse x0-hat grids [C, Tg, Hg, Wg] if their cells were matched at random: per
    channel, var(a) + var(b) + (mean a - mean b)^2 over cells. Two estimates that agree no better than unrelated
    ones (another seed on a model whose early estimate is still noise-like, where pooling leaves only chance
    differences of a few hundredths) sit near 1x this; the model's own spread across cells is the unit, so the
    gate's share of it means the same on every backbone and size."""
    a, b = a.flatten(1), b.flatten(1)
    spread = a.var(1, unbiased=False) + b.var(1, unbiased=False) + (a.mean(1) - b.mean(1)).pow(2)
    return spread.mean().sqrt().item()


def signature_distance(a: EarlySignature, b: EarlySignature) -> SignatureDistance:
    if not a.compatible_with(b):
        raise ValueError("signatures have different shapes: they come from different models or latent sizes")
    hidden = 1.0 - F.cosine_similarity(a.hidden, b.hidden, dim=-1).mean().item()
    # Differences are measured against the noise the sampler starts from (unit variance in the latent space
    # every flow-matching model samples in), not against the clips' own magnitude: a clip near zero (a
    # mid-gray scene in pixel space, a latent near its channel means) would make every small difference
    # look large and mark the whole clip as target region.
    diff = a.denoised - b.denoised
    denoised = diff.pow(2).mean().sqrt().item()
    cell_map = diff.pow(2).mean(0).sqrt()
    if a.attention.numel():
        attention = 0.5 * (a.attention - b.attention).abs().sum(-1).mean().item()
    else:
        attention = 0.0
    return SignatureDistance(hidden=hidden, denoised=denoised, attention=attention, cell_map=cell_map,
                             chance=chance_distance(a.denoised, b.denoised))


def shortlist_scores(query: EarlySignature, others: list) -> list:
    """index.rank_score of `query` against each of `others` (same shapes), in one batched pass: how a lookup
    orders its shortlist before the exact distances (signature_distance) of the few it keeps."""
    if not others:
        return []
    def unit(x):   # plain ops: F.cosine_similarity costs several times more on a busy CPU
        return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    cosine = (unit(query.hidden)[None] * unit(torch.stack([o.hidden for o in others]))).sum(-1)
    scores = 1.0 - cosine.flatten(1).mean(1)
    diff = query.denoised[None] - torch.stack([o.denoised for o in others])
    scores = scores + diff.pow(2).flatten(1).mean(1).sqrt()
    if query.attention.numel():
        tv = 0.5 * (query.attention[None] - torch.stack([o.attention for o in others])).abs().sum(-1)
        scores = scores + 0.5 * tv.flatten(1).mean(1)
    return scores.tolist()
