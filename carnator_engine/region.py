"""Region-only resume: a hit's resumed steps push only the target tokens through the network.

The target tokens (the gate's target cells plus a halo of neighbouring tokens) are the only rows the transformer
blocks see during a region step. Their self-attention still sees the whole clip: the keys and values of every other
video token come from a full step of this request (the first resumed step, and the first step of a new expert),
captured per block and per forward of the step (cfg batches, or cond and uncond run apart). The other tokens' latent
is not computed at all: it follows the cached request's own flow line, from its checkpoint at the resume step to its
stored final latent (schedule.jump), so an entry needs nothing beyond what it already stores.

A runner's model reports to `RegionTokens` through the observer: `gather` before its first block, `scatter` after
its last one, and `self_attention` extends each block's keys and values. Everything here is pure torch.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def target_tokens(layout, target_mask: torch.Tensor, halo: tuple) -> torch.Tensor:
    """[L] bool over the token grid: tokens touching the latent target mask [F, H, W], dilated by `halo` tokens
    (frames, rows, cols): the ring a seam needs to be computed with its neighbours in view."""
    tokens = layout.tokens_from_latent_mask(target_mask.bool())
    grid = layout.token_grid((1, layout.latent_channels, *target_mask.shape))
    cells = tokens.reshape(grid).float()[None, None]
    if any(halo):
        kernel = tuple(2 * h + 1 for h in halo)
        cells = F.max_pool3d(cells, kernel_size=kernel, stride=1, padding=tuple(halo))
    return cells.flatten() > 0


def latent_mask_of_tokens(layout, tokens: torch.Tensor, latent_fhw) -> torch.Tensor:
    """[L] token mask -> [F, H, W] latent mask: the cells each marked token carries."""
    grid = layout.token_grid((1, layout.latent_channels, *latent_fhw))
    cells = tokens.reshape(grid).float()
    for dim, size in enumerate(layout.patch_size):
        cells = cells.repeat_interleave(int(size), dim=dim)
    f, h, w = (int(d) for d in latent_fhw)
    return cells[:f, :h, :w] > 0


class RegionTokens:
    """One region-only run's state on the observer: which tokens go through the blocks, and the keys and values of
    the rest, captured at full steps (`full_steps`) and attended to at every other step."""

    def __init__(self, target: torch.Tensor, full_steps: frozenset):
        self.target = target.bool().flatten()
        self.length = int(self.target.numel())
        self.kept = self.target.nonzero().flatten()
        self.others = (~self.target).nonzero().flatten()
        self.full_steps = frozenset(full_steps)
        self.active = False         # this step runs the target tokens only
        self.capturing = False      # this step runs every token and keeps the others' keys and values
        self.slot = -1              # which forward of the step (cond and uncond may run apart)
        # (block, slot) -> (keys, values, front): [B, heads, front + L_other, D], the other tokens' rows after `front`
        self.keys_values: dict = {}
        self.text_tokens: Optional[int] = None
        self.tokens_through_blocks = 0   # rows the first block received over the run (tests, benchmarks)
        self.missing = ""           # why a region step ran without the others' keys and values ("" if never)
        self._gathered: dict = {}
        self._indices: dict = {}

    # ---- the sampler's order ----

    def begin_step(self, step: int) -> None:
        full = step in self.full_steps or not self.keys_values
        self.capturing = full and len(self.others) > 0
        self.active = not full
        self.slot = -1
        self._gathered.clear()
        if self.capturing:
            self.keys_values.clear()

    def forward(self) -> None:
        self.slot += 1
        self._gathered.clear()

    # ---- the model's tokens ----

    def gather(self, hidden: torch.Tensor, text_tokens: Optional[int] = None) -> torch.Tensor:
        """[B, L(+T), C] -> the target rows (then the text rows of a joint model); counted for the tests."""
        self.text_tokens = text_tokens
        if not self.active:
            self.tokens_through_blocks += int(hidden.shape[1])
            return hidden
        out = hidden.index_select(1, self._index(hidden.device, with_text=hidden.shape[1] > self.length))
        self.tokens_through_blocks += int(out.shape[1])
        return out

    def gather_like(self, value):
        """A block argument with a token axis (rope tables, per-token modulation, a joint padding mask) cut to the
        rows `gather` kept; tuples and lists item by item; anything else unchanged. Memoised per forward."""
        if not self.active:
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(self.gather_like(item) for item in value)
        if not torch.is_tensor(value) or value.dim() < 2:
            return value
        key = (id(value), value.data_ptr(), tuple(value.shape))
        if key in self._gathered:
            return self._gathered[key][1]
        out = value
        joint = self.length + (self.text_tokens or 0)
        for dim in range(1, min(value.dim(), 3)):
            if value.shape[dim] == self.length:
                out = value.index_select(dim, self._index(value.device, with_text=False))
                break
            if self.text_tokens and value.shape[dim] == joint:
                out = value.index_select(dim, self._index(value.device, with_text=True))
                break
        self._gathered[key] = (value, out)   # the source is held so its id is not reused within the forward
        return out

    def scatter(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target rows (then text rows) back at their places in a [B, L(+T), C] tensor; the other rows are zero:
        the resume stage takes their latent from the cached request, never from this output."""
        if not self.active:
            return hidden
        kept = len(self.kept)
        text = int(hidden.shape[1]) - kept
        out = hidden.new_zeros(hidden.shape[0], self.length + text, *hidden.shape[2:])
        out.index_copy_(1, self._index(hidden.device, with_text=False), hidden[:, :kept])
        if text:
            out[:, self.length:] = hidden[:, kept:]
        return out

    def video_tokens(self) -> int:
        """The video rows a block carries in this step."""
        return len(self.kept) if self.active else self.length

    def _index(self, device, with_text: bool) -> torch.Tensor:
        """The kept rows' indices on `device` (then the text rows'), copied there once: a copy per block would stall
        the GPU's queue."""
        key = (str(device), with_text and bool(self.text_tokens), self.text_tokens)
        if key not in self._indices:
            index = self.kept.to(device)
            if key[1]:
                index = torch.cat([index, torch.arange(self.length, self.length + self.text_tokens, device=device)])
            self._indices[key] = index
        return self._indices[key]

    def _others(self, device) -> torch.Tensor:
        key = (str(device), "others")
        if key not in self._indices:
            self._indices[key] = self.others.to(device)
        return self._indices[key]

    # ---- self-attention ----

    def attention_inputs(self, block: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """(k, v) to attend with, [B, heads, L, D]: at a full step the other tokens' rows are kept; at a region step
        the step's own rows go in front of them (attention does not depend on the order of its keys), written into
        one buffer per block and forward that is reused from step to step."""
        key = (block, max(self.slot, 0))
        if self.capturing:
            index = self._others(k.device)
            self.keys_values[key] = (k.index_select(2, index), v.index_select(2, index), 0)
            return k, v
        if not self.active:
            return k, v
        held = self.keys_values.get(key)
        if held is None or held[0].shape[:2] != k.shape[:2] or held[0].shape[-1] != k.shape[-1] \
                or held[0].dtype != k.dtype:
            self.missing = self.missing or (f"block {block}, forward {key[1]}: no keys and values of the other tokens "
                                            "were captured for it; the target attended to itself only")
            return k, v
        keys, values, front = held
        rows = int(k.shape[2])
        if front != rows:      # the first region step of this block: room in front of the others' rows
            keys = torch.cat([k.new_empty(*k.shape[:2], rows, k.shape[-1]), keys[:, :, front:]], dim=2)
            values = torch.cat([v.new_empty(*v.shape[:2], rows, v.shape[-1]), values[:, :, front:]], dim=2)
            self.keys_values[key] = (keys, values, rows)
        keys[:, :, :rows].copy_(k)
        values[:, :, :rows].copy_(v)
        return keys, values
