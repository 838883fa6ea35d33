"""A tiny Wan model as a GGUF file, the way ComfyUI-GGUF's "Unet Loader (GGUF)" reads quantized Wan weights.

Written with the `gguf` package (GGUFWriter, arch "wan", as ComfyUI-GGUF's convert tool writes it): the large
2-D weights quantized to Q8_0 (the gguf package's own quantizer) or Q6_K, a K-quant, whose quantizer the gguf
package does not implement (llama.cpp's C tool does): `quantize_q6_k` below packs blocks in ggml's Q6_K layout and
is checked against the gguf package's dequantizer. 1-D and small tensors and the modulation stay F32, as the convert
tool keeps them; the 5-D patch embedding is stored flattened with its shape in `comfy.gguf.orig_shape.*`.
"""
from __future__ import annotations

import numpy as np

BLOCK = 256                         # values per K-quant super-block
QUANTIZE_ABOVE = 1024               # the convert tool's QUANTIZATION_THRESHOLD


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """float32 [..., n*256] -> ggml Q6_K blocks as uint8 [..., n*210]: per block 128 bytes of low nibbles, 64 of high
    bit pairs, 16 int8 sub-block scales (16 values each) and an f16 super-block scale."""
    shape = values.shape
    x = values.reshape(-1, BLOCK).astype(np.float32)
    sub = x.reshape(-1, 16, 16)
    sub_scale = np.abs(sub).max(axis=2) / 31.0                                  # q in [-31, 31]
    d = (sub_scale.max(axis=1) / 127.0).astype(np.float16)
    d32 = d.astype(np.float32)
    scales = np.where(d32[:, None] > 0, np.round(sub_scale / np.maximum(d32[:, None], 1e-30)), 0).clip(-128, 127)
    step = (d32[:, None] * scales)[:, :, None]
    q = np.where(step != 0, np.round(sub / np.where(step != 0, step, 1)), 0).clip(-32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 128).astype(np.uint8)                                 # two halves of 128 values
    ql = np.concatenate([(q[:, :, 0:32] & 0xF) | ((q[:, :, 64:96] & 0xF) << 4),
                         (q[:, :, 32:64] & 0xF) | ((q[:, :, 96:128] & 0xF) << 4)], axis=2)   # [nb, 2, 64]
    qh = ((q[:, :, 0:32] >> 4) | ((q[:, :, 32:64] >> 4) << 2) | ((q[:, :, 64:96] >> 4) << 4)
          | ((q[:, :, 96:128] >> 4) << 6))                                      # [nb, 2, 32]
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), scales.astype(np.int8).view(np.uint8),
                             d.reshape(-1, 1).view(np.uint8)], axis=1)
    return blocks.reshape(*shape[:-1], shape[-1] // BLOCK * 210)


def write_wan_gguf(path: str, state_dict: dict, qtype_name: str) -> None:
    """Writes `state_dict` (name -> float torch tensor, ComfyUI's Wan key names) as a GGUF file of arch "wan"."""
    import gguf
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    writer = gguf.GGUFWriter(path=None, arch="wan")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, tensor in state_dict.items():
        data = tensor.detach().to("cpu").float().numpy()
        if data.ndim > 4:
            writer.add_array(f"comfy.gguf.orig_shape.{key}", tuple(int(d) for d in data.shape))
            data = data.reshape(data.shape[0], -1)
        quantize = data.ndim > 1 and data.size > QUANTIZE_ABOVE and ".modulation" not in key \
            and data.shape[-1] % BLOCK == 0
        if not quantize:
            writer.add_tensor(key, data, raw_dtype=gguf.GGMLQuantizationType.F32)
        elif qtype_name == "Q6_K":
            writer.add_tensor(key, quantize_q6_k(data), raw_dtype=qtype)
        else:
            writer.add_tensor(key, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
