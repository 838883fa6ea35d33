"""Builds the tiny random Wan2.1 T2V test model with ComfyUI's own WanModel class and saves it.

Run with ComfyUI's python from the ComfyUI root: python make_tiny_wan.py OUT.safetensors [seed]
(3.3 M parameters, 13 MB; ComfyUI detects it as WAN21_T2V, see docs/HOST-NOTES.md).
"""
import os
import sys

out = os.path.abspath(sys.argv[1])
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
sys.argv = [sys.argv[0], "--cpu"]
sys.path.insert(0, os.getcwd())

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()

import comfy.ops  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from comfy.ldm.wan.model import WanModel  # noqa: E402

torch.manual_seed(seed)
model = WanModel(model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=256, ffn_dim=512, freq_dim=256,
                 text_dim=4096, out_dim=16, num_heads=2, num_layers=2, operations=comfy.ops.disable_weight_init)
with torch.no_grad():
    for name, param in model.named_parameters():  # disable_weight_init leaves them uninitialised
        if name.endswith(("norm_q.weight", "norm_k.weight", "norm3.weight")):
            param.fill_(1.0)
        elif name.endswith("bias") and "norm3" in name:
            param.zero_()
        else:
            param.normal_(0, 0.05)
os.makedirs(os.path.dirname(out), exist_ok=True)
safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out)
print(out)
