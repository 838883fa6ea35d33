"""Test-only custom node for the host tests (never installed by users): text -> CONDITIONING without a text encoder.

Wan's real text encoder (umt5-xxl) is not available to the tests, so this node turns its `text` into a
deterministic random [1, 512, 4096] context. Carnator's nodes read the prompt label from the `text` input
of the node feeding `positive`, as they do with CLIPTextEncode.
"""
import hashlib

import torch


class E2ETextConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text": ("STRING", {"multiline": True, "default": ""}),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    CATEGORY = "testing"

    def encode(self, text, seed):
        digest = hashlib.sha256(f"{seed}|{text}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % (2 ** 63))
        return ([[torch.randn(1, 512, 4096, generator=generator), {}]],)


NODE_CLASS_MAPPINGS = {"E2ETextConditioning": E2ETextConditioning}
NODE_DISPLAY_NAME_MAPPINGS = {"E2ETextConditioning": "E2E Text Conditioning (test fixture)"}
