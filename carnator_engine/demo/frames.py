"""PNG pictures of the evaluation world's clips, with captions, and no imaging library.

A clip [3, frames, height, width] in [-1, 1] becomes one strip of its frames, left to right, enlarged without
smoothing so every generated pixel stays visible. Captions use a 3x5 pixel font: the demo needs a few words and
numbers, not typography, and the engine stays pure torch.
"""
from __future__ import annotations

import struct
import zlib

import torch

FRAME_SCALE = 4          # each generated pixel becomes 4x4
TEXT_SCALE = 3           # each font pixel becomes 3x3
GAP = 4                  # pixels between frames and around the picture
BACKGROUND = 32          # the canvas' grey
INK = 235                # caption grey

# 3x5 glyphs, rows top to bottom, three pixels each. Captions are upper-cased; other characters show as spaces.
_GLYPHS = {
    "A": "010101111101101", "B": "110101110101110", "C": "011100100100011", "D": "110101101101110",
    "E": "111100110100111", "F": "111100110100100", "G": "011100101101011", "H": "101101111101101",
    "I": "111010010010111", "J": "001001001101010", "K": "101101110101101", "L": "100100100100111",
    "M": "101111111101101", "N": "110101101101101", "O": "010101101101010", "P": "110101110100100",
    "Q": "010101101110011", "R": "110101110101101", "S": "011100010001110", "T": "111010010010010",
    "U": "101101101101111", "V": "101101101101010", "W": "101101111111101", "X": "101101010101101",
    "Y": "101101010010010", "Z": "111001010100111",
    "0": "111101101101111", "1": "010110010010111", "2": "110001010100111", "3": "110001010001110",
    "4": "101101111001001", "5": "111100110001110", "6": "011100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001110",
    ".": "000000000000010", ",": "000000000010100", ":": "000010000010000", "-": "000000111000000",
    "/": "001001010100100", "(": "001010010010001", ")": "100010010010100", "%": "101001010100101",
    "=": "000111000111000", "+": "000010111010000",
}


def _glyph(char: str) -> torch.Tensor:
    bits = _GLYPHS.get(char, "0" * 15)
    return torch.tensor([int(b) for b in bits], dtype=torch.bool).view(5, 3)


def caption(text: str) -> torch.Tensor:
    """[height, width] bool mask of `text` (upper-cased), one blank column between letters."""
    columns = []
    for char in text.upper():
        columns += [_glyph(char), torch.zeros(5, 1, dtype=torch.bool)]
    mask = torch.cat(columns, dim=1) if columns else torch.zeros(5, 0, dtype=torch.bool)
    return mask.repeat_interleave(TEXT_SCALE, 0).repeat_interleave(TEXT_SCALE, 1)


def clip_strip(clip: torch.Tensor) -> torch.Tensor:
    """[3, frames, height, width] in [-1, 1] -> [H, W, 3] uint8: the frames side by side, enlarged."""
    if clip.dim() != 4 or clip.shape[0] != 3:
        raise ValueError(f"a clip is [3, frames, height, width], got {tuple(clip.shape)}")
    pixels = ((clip.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    pixels = pixels.repeat_interleave(FRAME_SCALE, 2).repeat_interleave(FRAME_SCALE, 3)
    _, frames, height, width = pixels.shape
    strip = torch.full((height, frames * (width + GAP) - GAP, 3), BACKGROUND, dtype=torch.uint8)
    for frame in range(frames):
        left = frame * (width + GAP)
        strip[:, left:left + width] = pixels[:, frame].permute(1, 2, 0)
    return strip


def picture(rows: list) -> torch.Tensor:
    """[H, W, 3] uint8 of captioned strips stacked top to bottom: rows are (caption text, clip or None)."""
    parts = []
    for text, clip in rows:
        mask = caption(text)
        line = torch.full((*mask.shape, 3), BACKGROUND, dtype=torch.uint8)
        line[mask] = INK
        parts.append(line)
        if clip is not None:
            parts.append(clip_strip(clip))
    width = max(part.shape[1] for part in parts) + 2 * GAP
    canvas = [torch.full((GAP, width, 3), BACKGROUND, dtype=torch.uint8)]
    for part in parts:
        padded = torch.full((part.shape[0], width, 3), BACKGROUND, dtype=torch.uint8)
        padded[:, GAP:GAP + part.shape[1]] = part
        canvas += [padded, torch.full((GAP, width, 3), BACKGROUND, dtype=torch.uint8)]
    return torch.cat(canvas, dim=0)


def png_bytes(image: torch.Tensor) -> bytes:
    """An 8-bit RGB PNG of `image` [H, W, 3] uint8."""
    height, width, _ = image.shape
    rows = image.contiguous().numpy()
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)     # filter type 0 (none) before each row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)   # 8 bits, RGB, deflate, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def write_png(path: str, image: torch.Tensor) -> None:
    with open(path, "wb") as handle:
        handle.write(png_bytes(image))
