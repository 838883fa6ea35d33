"""Saves the host tests' tiny random Wan2.1 T2V model (hostsetup.build_tiny_wan, ComfyUI's own WanModel)
into a folder, for a ComfyUI server started in another process (tests/comfy_host.py).

Run with ComfyUI's python from the ComfyUI root: python make_tiny_wan.py DIRECTORY; prints the file path.
"""
import os
import sys

directory = os.path.abspath(sys.argv[1])
sys.argv = [sys.argv[0], "--cpu"]
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()

import hostsetup  # noqa: E402

print(os.path.join(directory, hostsetup.build_tiny_wan(directory)))
