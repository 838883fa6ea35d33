"""Test-only custom nodes for the host tests (never installed by users): text -> CONDITIONING without a text
encoder, and a placeholder VAE.

Real text encoders are not available to the tests, so E2ETextConditioning turns its `text` into a deterministic
random context shaped as the `layout`'s encoder gives it: Wan's umt5 [1, 512, 4096]; HunyuanVideo's llama states
[1, 32, 4096] with a CLIP-L pooled [1, 768]; LTX-Video's T5 states [1, 128, 4096] with their attention mask.
Carnator's nodes read the prompt label from the `text` input of the node feeding `positive`, as they do with
CLIPTextEncode.

Nor is a real VAE: E2EPlaceholderVAE feeds nodes that require a VAE input but leave it unused (Wan 2.2's
Wan22ImageToVideoLatent without a start image); anything that does use it fails at once.
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


class _WeightlessVAE:
    """Every attribute read fails: a test that reaches for this VAE's encoder or decoder must fail, not pass on
    made-up pixels. AttributeError, so that probes such as hasattr or copy's dunder lookups see an empty object."""

    def __getattr__(self, name):
        raise AttributeError(f"E2EPlaceholderVAE has no weights: '{name}' was read, so this test needs a real VAE")


class E2EPlaceholderVAE:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    RETURN_TYPES = ("VAE",)
    FUNCTION = "load"
    CATEGORY = "testing"

    def load(self):
        return (_WeightlessVAE(),)


NODE_CLASS_MAPPINGS = {"E2ETextConditioning": E2ETextConditioning, "E2EPlaceholderVAE": E2EPlaceholderVAE}
NODE_DISPLAY_NAME_MAPPINGS = {"E2ETextConditioning": "E2E Text Conditioning (test fixture)",
                              "E2EPlaceholderVAE": "E2E Placeholder VAE (test fixture)"}
