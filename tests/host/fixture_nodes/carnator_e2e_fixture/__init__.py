"""Test-only custom node for the host tests (never installed by users): text -> CONDITIONING without a text encoder.

Real text encoders are not available to the tests, so this node turns its `text` into a deterministic random
context shaped as the `layout`'s encoder gives it: Wan's umt5 [1, 512, 4096]; HunyuanVideo's llama states
[1, 32, 4096] with a CLIP-L pooled [1, 768]; LTX-Video's T5 states [1, 128, 4096] with their attention mask.
Carnator's nodes read the prompt label from the `text` input of the node feeding `positive`, as they do with
CLIPTextEncode.
"""
import hashlib

import torch


class E2ETextConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text": ("STRING", {"multiline": True, "default": ""}),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31})},
                "optional": {"layout": (["wan", "hunyuan_video", "ltxv"], {"default": "wan"})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    CATEGORY = "testing"

    def encode(self, text, seed, layout="wan"):
        digest = hashlib.sha256(f"{seed}|{text}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % (2 ** 63))
        tokens = {"wan": 512, "hunyuan_video": 32, "ltxv": 128}[layout]
        options = {"hunyuan_video": lambda: {"pooled_output": torch.randn(1, 768, generator=generator)},
                   "ltxv": lambda: {"attention_mask": torch.ones(1, 1, tokens)}}.get(layout, dict)()
        return ([[torch.randn(1, tokens, 4096, generator=generator), options]],)


NODE_CLASS_MAPPINGS = {"E2ETextConditioning": E2ETextConditioning}
NODE_DISPLAY_NAME_MAPPINGS = {"E2ETextConditioning": "E2E Text Conditioning (test fixture)"}
