"""The evaluation world: procedural clips whose truth is known, and the demo model trained on them.

`world` renders clips from attribute dicts, writes their prompts, reads attributes back from pixels
(`analyze`) and produces request streams for the benchmarks; `train` fits the project's TinyVideoDiT
on it. The trained weights ship as `tiny_dit.safetensors` beside this file (see `DEMO_WEIGHTS`).
"""
from __future__ import annotations

import os

DEMO_WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_dit.safetensors")
# How the shipped weights sample best (benchmarks/results/demo_model/demo_model_accuracy.json has the sweep).
DEMO_STEPS = 20
DEMO_GUIDANCE = 2.0
