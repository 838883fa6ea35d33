"""The evaluation world: procedural clips whose truth is known, and the demo model trained on them.

`world` renders clips from attribute dicts, writes their prompts, reads attributes back from pixels
(`analyze`) and produces request streams for the benchmarks; `world2` does the same for scenes of two or
three objects (world v2); `train` fits the project's TinyVideoDiT on either. The trained weights ship beside
this file: `tiny_dit.safetensors` (world v1, `DEMO_WEIGHTS`) and `tiny_dit_v2.safetensors` (world v2).
"""
from __future__ import annotations

import os

DEMO_WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_dit.safetensors")
# How the shipped weights sample best (benchmarks/results/demo_model/demo_model_accuracy.json has the sweep).
DEMO_STEPS = 20
DEMO_GUIDANCE = 2.0

DEMO_WEIGHTS_V2 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_dit_v2.safetensors")
# Each world's shipped weights and the guidance they sample best at (their accuracy report's recommendation;
# world v2's weights are not trained yet, so its guidance is world v1's until they are measured).
DEMO_WORLDS = {"v1": {"weights": DEMO_WEIGHTS, "guidance": DEMO_GUIDANCE},
               "v2": {"weights": DEMO_WEIGHTS_V2, "guidance": DEMO_GUIDANCE}}

# The demo model's 4-step, guidance-1 student (demo/distill.py; its report in benchmarks/results/demo_model/): what the
# demo samples at few-step schedules, as a step-distilled LoRA is sampled.
FEW_STEP_WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_dit_4step.safetensors")
FEW_STEP_GUIDANCE = 1.0
