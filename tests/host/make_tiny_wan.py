"""Saves the host tests' tiny random Wan2.1 T2V model (hostsetup.build_tiny_wan, ComfyUI's own WanModel)
into a folder, for a ComfyUI server started in another process (tests/comfy_host.py); with --all also a
two-expert Wan pair, a 48-channel Wan 2.2 TI2V 5B, a HunyuanVideo and an LTX-Video model, the
image-to-video Wan models (2.1 I2V and a 2.2 I2V A14B pair), and tiny LoRAs for the
Wan models in the loras folder beside it (the workflow runs).

Run with ComfyUI's python from the ComfyUI root: python make_tiny_wan.py DIRECTORY [--all]; prints the file
path (the Wan model's last).
"""
import os
import sys

directory = os.path.abspath(sys.argv[1])
every = "--all" in sys.argv[2:]
sys.argv = [sys.argv[0], "--cpu"]
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()

import hostsetup  # noqa: E402

if every:
    for name in (hostsetup.build_tiny_wan(directory, seed=11, name=hostsetup.TINY_WAN22_HIGH),
                 hostsetup.build_tiny_wan(directory, seed=12, name=hostsetup.TINY_WAN22_LOW),
                 hostsetup.build_tiny_wan(directory, seed=13, name=hostsetup.TINY_WAN22_5B, channels=48),
                 hostsetup.build_tiny_hunyuan(directory), hostsetup.build_tiny_ltxv(directory),
                 hostsetup.build_tiny_wan(directory, seed=14, name=hostsetup.TINY_WAN21_I2V, image_to_video="wan21"),
                 hostsetup.build_tiny_wan(directory, seed=15, name=hostsetup.TINY_WAN22_I2V_HIGH,
                                          image_to_video="wan22"),
                 hostsetup.build_tiny_wan(directory, seed=16, name=hostsetup.TINY_WAN22_I2V_LOW,
                                          image_to_video="wan22")):
        print(os.path.join(directory, name))
    loras = os.path.join(os.path.dirname(directory), "loras")     # models/loras beside models/diffusion_models
    for seed, name in enumerate(hostsetup.TINY_LORAS):
        print(os.path.join(loras, hostsetup.build_tiny_lora(loras, name, seed=21 + seed)))
print(os.path.join(directory, hostsetup.build_tiny_wan(directory)))
