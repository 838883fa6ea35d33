"""Model fingerprints: a cache entry is only ever reused by the exact same weights.

LoRAs and other patches change the model, so a host adds its patch list to the fingerprint
(see hosts/comfyui.py); here we hash what a plain torch module holds.
"""
from __future__ import annotations

import hashlib

import torch


def hash_values(digest, tensor: torch.Tensor) -> None:
    """Adds a tensor's values to `digest` as float32 bytes. Hashed where they lie: a copy of a video's noise or a
    prompt's encoding (8 MB for Wan's) would cost most of what hashing it does, on every request."""
    digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy())


def module_fingerprint(module: torch.nn.Module, extra: str = "", sample_bytes: int = 1 << 16) -> str:
    """Hash of every parameter's name, shape, dtype and a strided sample of its values.

    Sampling keeps this fast for billion-parameter models while any real retraining, LoRA merge or
    dtype change still moves many sampled values.
    """
    digest = hashlib.sha256(extra.encode())
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        stride = max(1, flat.numel() * flat.element_size() // sample_bytes)
        hash_values(digest, flat[::stride])
    return digest.hexdigest()[:24]
