import json

import torch

from carnator_engine.backbones.tiny_dit import load_tiny_dit
from carnator_engine.demo import DEMO_WEIGHTS, distill
from carnator_engine.schedule import flow_sigmas


def test_training_sigmas_mix_the_students_own_with_a_spread():
    sigma = distill.training_sigmas(4000, 4, torch.Generator().manual_seed(0), "cpu")
    own = flow_sigmas(4, distill.SHIFT)[:-1]
    on_grid = (sigma[:, None] == own[None]).any(1)
    assert 0.4 < on_grid.float().mean() < 0.6
    assert ((sigma > 0) & (sigma <= 1)).all()


def test_distill_smoke_writes_fp16_student_and_recipe(tmp_path):
    out = tmp_path / "student.safetensors"
    assert distill.main(["--smoke", "--device", "cpu", "--eval-steps", "4", "--out", str(out)]) == 0
    student = load_tiny_dit(str(out))
    assert student.config.vocabulary == load_tiny_dit(DEMO_WEIGHTS).config.vocabulary
    report = json.loads((tmp_path / "student.json").read_text())
    assert report["recipe"]["method"].startswith("reflow")
    assert report["model"]["steps"] == 4 and report["model"]["guidance"] == 1.0
    assert set(report["evaluation"]["student_by_steps"]) == {"4"}
