"""The project's own small text-to-video DiT: Wan's block structure at toy scale.

Pixel-space clips (3 x frames x 32 x 32), patch (1, 4, 4), adaLN-modulated blocks with
self-attention over frame-major tokens, cross-attention to a small word-level text encoder, and
a velocity (flow-matching) head. It is small enough to sample on a CPU in well under a second,
and it is the model the evaluation world trains, so quality can be measured against ground truth.
Self-attention goes through the engine's GenerationObserver, exactly as the ComfyUI adapters do.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from .base import BackboneLayout

PAD, UNK = 0, 1


@dataclass
class TinyDiTConfig:
    vocabulary: list = field(default_factory=list)
    channels: int = 3
    frames: int = 8
    height: int = 32
    width: int = 32
    patch: tuple = (1, 4, 4)
    dim: int = 128
    heads: int = 4
    layers: int = 4
    text_layers: int = 2
    text_len: int = 16

    @property
    def layout(self) -> BackboneLayout:
        return BackboneLayout("carnator-tiny-dit", latent_channels=self.channels, patch_size=tuple(self.patch))

    @property
    def latent_shape(self) -> tuple:
        return (self.channels, self.frames, self.height, self.width)


def tokenize(prompts: list, vocabulary: list, length: int) -> torch.Tensor:
    index = {word: i + 2 for i, word in enumerate(vocabulary)}
    rows = []
    for prompt in prompts:
        ids = [index.get(word, UNK) for word in re.findall(r"[a-z]+", prompt.lower())][:length]
        rows.append(ids + [PAD] * (length - len(ids)))
    return torch.tensor(rows, dtype=torch.long)


def timestep_embedding(sigma: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=sigma.device) / half)
    angles = sigma.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class TextEncoder(nn.Module):
    def __init__(self, vocab_size: int, dim: int, length: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.position = nn.Parameter(torch.zeros(1, length, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor):
        padding = tokens == PAD
        # An empty prompt (the CFG uncond) keeps its first PAD token visible: attention over no keys
        # gives NaN in the encoder's eval fast path and on some SDPA backends.
        padding[:, 0] &= ~padding.all(-1)
        hidden = self.encoder(self.embed(tokens) + self.position, src_key_padding_mask=padding)
        return self.norm(hidden), padding


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.RMSNorm(dim // heads)
        self.k_norm = nn.RMSNorm(dim // heads)
        self.proj = nn.Linear(dim, dim)
        self.norm_cross = nn.LayerNorm(dim)
        self.cross_q = nn.Linear(dim, dim)
        self.cross_kv = nn.Linear(dim, 2 * dim)
        self.cross_proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.modulation = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def forward(self, x, time, context, context_padding, index, observer):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(time)[:, None].chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        q, k, v = rearrange(self.qkv(h), "b l (three h d) -> three b h l d", three=3, h=self.heads)
        q, k = self.q_norm(q), self.k_norm(k)
        attended = observer.self_attention(index, q, k, v) if observer is not None \
            else F.scaled_dot_product_attention(q, k, v)
        x = x + gate1 * self.proj(rearrange(attended, "b h l d -> b l (h d)"))

        cq = rearrange(self.cross_q(self.norm_cross(x)), "b l (h d) -> b h l d", h=self.heads)
        ck, cv = rearrange(self.cross_kv(context), "b t (two h d) -> two b h t d", two=2, h=self.heads)
        visible = ~context_padding[:, None, None, :]
        cross = F.scaled_dot_product_attention(cq, ck, cv, attn_mask=visible)
        x = x + self.cross_proj(rearrange(cross, "b h l d -> b l (h d)"))

        h = self.norm2(x) * (1 + scale2) + shift2
        x = x + gate2 * self.mlp(h)
        if observer is not None:
            observer.block_output(index, x)
        return x


class TinyVideoDiT(nn.Module):
    def __init__(self, config: TinyDiTConfig):
        super().__init__()
        if not config.vocabulary:
            raise ValueError("TinyDiTConfig.vocabulary is empty: give the words the model should understand")
        self.config = config
        c, dim = config, config.dim
        pt, ph, pw = c.patch
        self.grid = (c.frames // pt, c.height // ph, c.width // pw)
        self.text = TextEncoder(len(c.vocabulary) + 2, dim, c.text_len, c.text_layers, c.heads)
        self.patch_embed = nn.Linear(c.channels * pt * ph * pw, dim)
        self.frame_pos = nn.Parameter(torch.zeros(self.grid[0], dim))
        self.row_pos = nn.Parameter(torch.zeros(self.grid[1], dim))
        self.col_pos = nn.Parameter(torch.zeros(self.grid[2], dim))
        for p in (self.frame_pos, self.row_pos, self.col_pos):
            nn.init.normal_(p, std=0.02)
        self.time_mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(DiTBlock(dim, c.heads) for _ in range(c.layers))
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False)
        self.out_modulation = nn.Linear(dim, 2 * dim)
        self.head = nn.Linear(dim, c.channels * pt * ph * pw)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @property
    def layout(self) -> BackboneLayout:
        return self.config.layout

    def encode_prompts(self, prompts: list):
        tokens = tokenize(prompts, self.config.vocabulary, self.config.text_len)
        return self.text(tokens.to(self.frame_pos.device))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, text, observer=None) -> torch.Tensor:
        """x [B, C, F, H, W] at noise level sigma [B]; text = encode_prompts(...). Returns velocity."""
        context, padding = text
        pt, ph, pw = self.config.patch
        gf, gh, gw = self.grid
        tokens = rearrange(x, "b c (f pt) (h ph) (w pw) -> b (f h w) (c pt ph pw)", pt=pt, ph=ph, pw=pw)
        position = (self.frame_pos[:, None, None] + self.row_pos[None, :, None] + self.col_pos[None, None])
        hidden = self.patch_embed(tokens) + position.reshape(1, gf * gh * gw, -1)
        time = self.time_mlp(timestep_embedding(sigma, self.config.dim))
        region = getattr(observer, "region", None)
        if region is not None:      # a region-only resume: the target tokens alone go through the blocks
            hidden = region.gather(hidden)
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, time, context, padding, index, observer)
        if region is not None:
            hidden = region.scatter(hidden)
        shift, scale = self.out_modulation(time)[:, None].chunk(2, dim=-1)
        out = self.head(self.norm_out(hidden) * (1 + scale) + shift)
        return rearrange(out, "b (f h w) (c pt ph pw) -> b c (f pt) (h ph) (w pw)",
                         f=gf, h=gh, w=gw, pt=pt, ph=ph, pw=pw)

    def save(self, path: str) -> None:
        from safetensors.torch import save_file
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, path, metadata={"carnator_tiny_dit": json.dumps(asdict(self.config))})


def load_tiny_dit(path: str, device: str = "cpu") -> TinyVideoDiT:
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(path, framework="pt") as handle:
        metadata = handle.metadata() or {}
    if "carnator_tiny_dit" not in metadata:
        raise ValueError(f"{path} is not a Carnator tiny DiT checkpoint (no 'carnator_tiny_dit' metadata)")
    raw = json.loads(metadata["carnator_tiny_dit"])
    raw["patch"] = tuple(raw["patch"])
    model = TinyVideoDiT(TinyDiTConfig(**raw))
    state = {k: v.float() for k, v in load_file(path).items()}
    model.load_state_dict(state)
    return model.to(device).eval()
