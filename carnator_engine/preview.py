"""Thumbnails for the cache browser: an RGB frame -> PNG bytes, with the standard library only."""
from __future__ import annotations

import struct
import zlib

import torch
import torch.nn.functional as F


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def thumbnail_png(frame: torch.Tensor, max_side: int = 128) -> bytes:
    """frame: [3, H, W] in [-1, 1]. Upscaled (nearest) or downscaled so the long side is max_side."""
    if frame.dim() != 3 or frame.shape[0] != 3:
        raise ValueError(f"a thumbnail needs an RGB frame [3, H, W], got {tuple(frame.shape)}")
    frame = frame.detach().float().cpu()
    height, width = frame.shape[1:]
    scale = max_side / max(height, width)
    size = (max(1, round(height * scale)), max(1, round(width * scale)))
    mode = "nearest" if scale >= 1 else "area"
    frame = F.interpolate(frame[None], size=size, mode=mode)[0]
    pixels = ((frame.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
    rows = b"".join(b"\x00" + row.tobytes() for row in pixels)
    header = struct.pack(">IIBBBBB", size[1], size[0], 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows, 6)) + _chunk(b"IEND", b"")
