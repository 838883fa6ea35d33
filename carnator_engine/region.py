"""Region-only resume: a hit's resumed steps push only the target tokens through the network.

The target tokens (the gate's target cells plus a halo of neighbouring tokens) are the only rows the transformer
blocks see during a region step. Their self-attention still sees the whole clip: the keys and values of every other
video token come from a full step of this request (the first resumed step, the first step of a new expert, and the
refreshes at the cached entry's checkpoints: resume.region_only_steps), captured per block and per forward of the
step (cfg batches, or cond and uncond run apart). The other tokens' latent is not computed at all: they end as the
cached generation's final latent.

With the cached generation's block-sparse connectivity (`reach`, CarnatorConfig.region_sparse_keys), the target
attends only to the key rows its query blocks reach in each block's table (attention.connectivity.reached_key_rows):
only those rows are kept, moved and attended to. A joint model's text queries (HunyuanVideo) still attend to the
whole clip, so there every row is kept and only the target's attention is cut.

A runner's model reports to `RegionTokens` through the observer: `gather` before its first block, `scatter` after
its last one, and `attend` runs a region step's self-attention (`attention_inputs` keeps and extends each block's
keys and values). Where those keys and values live (pinned host memory, streamed to the GPU block by block, or
resident) is kept_kv.py's job; when not even streaming fits, or a region step runs out of GPU memory, the region
steps stop and the rest runs whole-clip (`fallback` says why).
Everything here is pure torch.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .gate import RegionFallback
from .attention import fa4 as fa4_attention
from .kept_kv import KeptKeysValues


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
    the whole clip, captured at full steps (`full_steps`) and attended to at every other step. `memory` and `margin`
    bound the GPU memory they take, `eight_bit` keeps them in 8 bits, `kernel` dequantizes them with a Triton kernel
    (kept_kv.KeptKeysValues)."""

    def __init__(self, target: torch.Tensor, full_steps: frozenset, memory=None, margin: float = 0.05,
                 reach: Optional[dict] = None, eight_bit: bool = False, kernel: bool = False, fa4: bool = False):
        self.target = target.bool().flatten()
        self.length = int(self.target.numel())
        self.kept = self.target.nonzero().flatten()
        self.others = (~self.target).nonzero().flatten()
        self.full_steps = frozenset(full_steps)
        self.active = False         # this step runs the target tokens only
        self.capturing = False      # this step runs every token and keeps the whole clip's keys and values
        self.slot = -1              # which forward of the step (cond and uncond may run apart)
        # (block, slot) -> the whole clip's keys and values [B, heads, L(+T), D], the target's rows rewritten each step
        self.keys_values = KeptKeysValues(memory, margin, eight_bit, kernel)
        self.fa4 = fa4              # the target's attention on FlashAttention-4 where it runs (attend)
        # block -> the video key rows the target reaches (None: every row); no entry: every row, as without tables
        self.reach = dict(reach or {})
        self.text_tokens: Optional[int] = None
        self.tokens_through_blocks = 0   # rows the first block received over the run (tests, benchmarks)
        self.cut_steps: set = set()   # the steps that ran the target tokens only
        self.missing = ""           # why a region step ran without the others' keys and values ("" if never)
        self.failed = ""            # how the region steps failed, if they did (resume: whole clip from step k)
        self.fallback: Optional[RegionFallback] = None   # why the region steps stopped and the rest ran whole-clip
        self._gathered: dict = {}
        self._indices: dict = {}

    # ---- the sampler's order ----

    def begin_step(self, step: int) -> None:
        self.slot = -1
        self._gathered.clear()
        if self.fallback:
            self.capturing = self.active = False
            return
        full = step in self.full_steps or not len(self.keys_values)
        self.capturing = full and len(self.others) > 0
        self.active = not full
        if self.capturing:
            self.keys_values.release()
        elif self.active and not self.keys_values.planned:
            why = self.keys_values.plan(len(self.kept) / self.length)
            if why:
                self.stop(why)
        if self.active:
            self.cut_steps.add(step)

    @property
    def region_steps_run(self) -> int:
        return len(self.cut_steps)

    def stop(self, why: RegionFallback) -> None:
        """No more region steps: the rest of the run goes through every token (its keys and values are freed)."""
        self.fallback = self.fallback or why
        self.keys_values.release()
        self.capturing = self.active = False

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

    def _on_device(self, key: tuple, make) -> torch.Tensor:
        """`make()`'s index tensor for `key`, made and copied to its device once: a copy per block would stall the
        GPU's queue."""
        if key not in self._indices:
            self._indices[key] = make()
        return self._indices[key]

    def _with_text(self, rows: torch.Tensor, text: int, device) -> torch.Tensor:
        """`rows` then `text` joint text rows after the video's, on `device`."""
        return torch.cat([rows, torch.arange(self.length, self.length + text)]).to(device)

    def _index(self, device, with_text: bool) -> torch.Tensor:
        """The kept rows' indices on `device` (then the text rows')."""
        return self._rows(device, self.text_tokens if with_text else 0)

    def _rows(self, device, text: int) -> torch.Tensor:
        """Where a region step's attention rows go in the whole clip's: the kept tokens, then `text` joint text rows
        after the video (those a padding mask left)."""
        return self._on_device((str(device), "rows", text), lambda: self._with_text(self.kept, text, device))

    def _reached(self, block: int, device, text: int) -> Optional[torch.Tensor]:
        """The video key rows the target reaches in `block` (then `text` joint text rows) on `device`, or None where
        it attends to every row."""
        rows = self.reach.get(block)
        if rows is None:
            return None
        return self._on_device((str(device), "reached", block, text), lambda: self._with_text(rows, text, device))

    def _kept_rows(self, block: int, device) -> Optional[torch.Tensor]:
        """Where the target's rows sit among the reached rows that `block` keeps alone (None: it keeps every row)."""
        rows = self.reach.get(block)
        if rows is None:
            return None
        # the target's own blocks are reached: each target row is found
        return self._on_device((str(device), "kept among reached", block),
                               lambda: torch.searchsorted(rows, self.kept).to(device))

    # ---- self-attention ----

    def attention_inputs(self, block: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """(k, v) to attend with, [B, heads, L, D]: at a full step the whole clip's are kept; at a region step the
        step's own rows are written into the kept ones at their places (the other tokens' rows stay as captured).
        Without text rows, a block with reached rows keeps and returns those rows alone."""
        key = (block, max(self.slot, 0))
        if self.capturing:
            rows = self._reached(block, k.device, 0) if k.shape[2] == self.length else None
            why = self.keys_values.capture(key, k, v) if rows is None else \
                self.keys_values.capture(key, k.index_select(2, rows), v.index_select(2, rows))
            if why:
                self.stop(why)
            return k, v
        if not self.active:
            return k, v
        held = self.keys_values.fetch(key)
        text = int(k.shape[2]) - len(self.kept)
        compact = self._kept_rows(block, k.device) if text == 0 else None
        rows = self.length + text if compact is None else len(self.reach[block])
        if held is None or held[0].shape[:2] != k.shape[:2] or held[0].shape[-1] != k.shape[-1] \
                or held[0].dtype != k.dtype or held[0].shape[2] != rows:
            self.missing = self.missing or (f"block {block}, forward {key[1]}: no keys and values of the other tokens "
                                            "were captured for it; the target attended to itself only")
            return k, v
        keys, values = held
        index = self._rows(k.device, text) if compact is None else compact
        keys.index_copy_(2, index, k)
        values.index_copy_(2, index, v)
        return keys, values

    def attend(self, block: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dense,
               host_sdpa: bool = False) -> torch.Tensor:
        """A region step's self-attention, [B, heads, target(+text), D]: `dense(q, k, v)` over the keys and values
        of attention_inputs. A joint model's text queries attend to every row; its target's to the rows it reaches
        and the text's. With `fa4` on, FlashAttention-4 stands in for `dense` where it runs and `host_sdpa` says
        `dense` is torch's SDPA (the same exact attention, in a faster kernel; another node's kernel stays)."""
        keys, values = self.attention_inputs(block, q, k, v)
        if self.fa4 and host_sdpa:
            dense = fa4_attention.dense_or(dense)
        kept = len(self.kept)
        text = int(k.shape[2]) - kept       # text keys (a padding mask may have dropped some of the text queries')
        if q.shape[2] == kept or self.reach.get(block) is None or keys.shape[2] != self.length + text:
            return dense(q, keys, values)
        reached = self._reached(block, keys.device, text)
        target = dense(q[:, :, :kept], keys.index_select(2, reached), values.index_select(2, reached))
        return torch.cat([target, dense(q[:, :, kept:], keys, values)], dim=2)
