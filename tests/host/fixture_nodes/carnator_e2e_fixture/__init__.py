"""Test-only custom nodes for the host tests (never installed by users): text -> CONDITIONING without a text
encoder, and a placeholder VAE.

Real text encoders are not available to the tests, so E2ETextConditioning turns its `text` into a deterministic
random context shaped as the `layout`'s encoder gives it: Wan's umt5 [1, 512, 4096]; HunyuanVideo's llama states
[1, 32, 4096] with a CLIP-L pooled [1, 768]; LTX-Video's T5 states [1, 128, 4096] with their attention mask.
Carnator's nodes read the prompt label from the `text` input of the node feeding `positive`, as they do with
CLIPTextEncode.

Nor is a real VAE: E2EPlaceholderVAE feeds nodes that require a VAE input but leave it unused (Wan 2.2's
Wan22ImageToVideoLatent without a start image); anything that does use it fails at once. E2EPixelVAE encodes
(only): it pools the pixels to the Wan VAEs' latent grid (4 frames per latent frame after the first, 8x8 pixels per
latent cell for Wan 2.1's 16 channels, 16x16 for Wan 2.2's 48) and projects the colours with a fixed random matrix,
so that the image-to-video nodes (WanImageToVideo, Wan22ImageToVideoLatent) get a latent that depends on the image.
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


class PixelPoolVAE:
    """encode(pixels [frames, H, W, 3] in [0, 1]) -> [1, channels, (frames - 1) // 4 + 1, H / cell, W / cell], as
    the Wan VAEs shape it; the values are a fixed function of the pixels, not a trained encoding."""

    def __init__(self, channels: int = 16):
        self.channels = channels
        self.cell = 8 if channels == 16 else 16
        self.projection = torch.randn(3, channels, generator=torch.Generator().manual_seed(channels))

    def encode(self, pixels):
        pixels = pixels[..., :3].to(torch.float32) * 2.0 - 1.0
        frames = [pixels[:1]] + [pixels[i:i + 4] for i in range(1, pixels.shape[0], 4)]
        pooled = torch.stack([f.mean(dim=0) for f in frames])                       # [F', H, W, 3]
        pooled = torch.nn.functional.avg_pool2d(pooled.movedim(-1, 1), self.cell)  # [F', 3, h, w]
        latent = torch.einsum("fchw,cd->dfhw", pooled, self.projection)
        return latent.unsqueeze(0)

    def decode(self, samples):
        raise RuntimeError("E2EPixelVAE only encodes: save the latent instead of decoding it")


class E2EPixelVAE:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"channels": ([16, 48], {"default": 16})}}

    RETURN_TYPES = ("VAE",)
    FUNCTION = "load"
    CATEGORY = "testing"

    def load(self, channels):
        return (PixelPoolVAE(int(channels)),)


NODE_CLASS_MAPPINGS = {"E2ETextConditioning": E2ETextConditioning, "E2EPlaceholderVAE": E2EPlaceholderVAE,
                       "E2EPixelVAE": E2EPixelVAE}
NODE_DISPLAY_NAME_MAPPINGS = {"E2ETextConditioning": "E2E Text Conditioning (test fixture)",
                              "E2EPlaceholderVAE": "E2E Placeholder VAE (test fixture)",
                              "E2EPixelVAE": "E2E Pixel VAE (test fixture)"}
