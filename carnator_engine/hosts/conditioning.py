"""Fingerprints of a ComfyUI request's conditioning: the whole of it (the exact-repeat key) and its start image
(part of the bucket).

Image-to-video puts the start image into the request outside the prompt: WanImageToVideo (Wan 2.1 I2V, Wan 2.2
I2V A14B) sets `concat_latent_image` and `concat_mask` (and `clip_vision_output` with a CLIP vision encoder) on
both conditionings; Wan22ImageToVideoLatent (Wan 2.2 TI2V 5B) writes the image into the first latent frame and
gives the LATENT a `noise_mask` that keeps it. A cached trajectory of one start image is never a valid start for
another (the image fixes the first frame and the layout), so the start image belongs to the bucket, not only to
the repeat key: a hit then only ever resumes a generation of the same image, whatever the prompt.
"""
from __future__ import annotations

import hashlib
from typing import Optional

import torch

from ..fingerprint import hash_values

# conditioning options that carry an image (or its mask / CLIP vision encoding) rather than the prompt's text
IMAGE_OPTIONS = ("concat_latent_image", "concat_mask", "concat_mask_index", "concat_image", "clip_vision_output",
                 "reference_latents", "time_dim_concat", "ref_latent", "guiding_frame_index")


def _digest(digest, value, depth: int = 0) -> None:
    """Adds the whole of a conditioning's data (tensors and options such as timestep ranges or masks): two
    values must never be taken for one another."""
    if depth > 8:
        digest.update(b"<deep>")
    elif torch.is_tensor(value):
        digest.update(f"T{tuple(value.shape)}{value.dtype}".encode())
        if value.numel():
            hash_values(digest, value.reshape(-1))
    elif value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        digest.update(repr(value).encode())
    elif isinstance(value, (list, tuple)):
        digest.update(f"[{len(value)}".encode())
        for item in value:
            _digest(digest, item, depth + 1)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            digest.update(str(key).encode())
            _digest(digest, value[key], depth + 1)
    else:
        # an object holding data (CLIP vision's Output: image_embeds, penultimate_hidden_states...): its class and
        # its attributes, so two encodings of two images differ
        digest.update(getattr(value, "__qualname__", type(value).__qualname__).encode())
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict) and not callable(value):
            _digest(digest, attributes, depth + 1)


def conditioning_fingerprint(positive, negative, seed: int) -> str:
    """The request's own inputs besides its noise: both conditionings whole (tensors and options such as
    timestep ranges or masks) and the seed, which stochastic samplers draw their step noise from."""
    digest = hashlib.sha256(f"seed={int(seed)}".encode())
    for conditioning in (positive, negative):
        _digest(digest, conditioning)
    return digest.hexdigest()


def start_image_fingerprint(positive, negative, latent_image: Optional[torch.Tensor] = None,
                            noise_mask: Optional[torch.Tensor] = None) -> str:
    """A digest of the request's start image as the model sees it ("" for text-to-video): the image options of
    every conditioning entry, and the latent the model reads (`latent_image`, given only for a model that reads
    it) when it is not empty, with the noise mask that keeps part of it."""
    digest = hashlib.sha256(b"start-image")
    found = False
    for name, conditioning in (("positive", positive), ("negative", negative)):
        for index, entry in enumerate(conditioning or ()):
            options = entry[1] if isinstance(entry, (list, tuple)) and len(entry) > 1 else {}
            for key in IMAGE_OPTIONS:
                if isinstance(options, dict) and options.get(key) is not None:
                    found = True
                    digest.update(f"{name}[{index}].{key}".encode())
                    _digest(digest, options[key])
    if noise_mask is not None or (latent_image is not None and bool(latent_image.any())):
        found = True
        digest.update(b"latent")
        _digest(digest, noise_mask)
        _digest(digest, latent_image)
    return digest.hexdigest()[:24] if found else ""


__all__ = ["conditioning_fingerprint", "start_image_fingerprint", "IMAGE_OPTIONS"]
