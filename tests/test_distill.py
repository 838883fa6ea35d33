import json

import pytest
import torch

from carnator_engine.backbones.tiny_dit import load_tiny_dit
from carnator_engine.demo import DEMO_WEIGHTS, distill
from carnator_engine.schedule import flow_sigmas


def test_student_sigmas_are_teacher_sigmas():
    teacher = flow_sigmas(20, distill.SHIFT)
    grid = distill.student_grid(20, 4)
    assert grid == [0, 5, 10, 15, 20]
    torch.testing.assert_close(teacher[grid], flow_sigmas(4, distill.SHIFT))
    with pytest.raises(ValueError, match="--student-steps 6 must divide --teacher-steps 20"):
        distill.student_grid(20, 6)


def test_distill_smoke_writes_fp16_student_and_recipe(tmp_path):
    out = tmp_path / "student.safetensors"
    assert distill.main(["--smoke", "--device", "cpu", "--eval-steps", "4", "--out", str(out)]) == 0
    student = load_tiny_dit(str(out))
    assert student.config.vocabulary == load_tiny_dit(DEMO_WEIGHTS).config.vocabulary
    report = json.loads((tmp_path / "student.json").read_text())
    assert report["recipe"]["teacher_indices"] == [0, 5, 10, 15, 20]
    assert report["model"]["steps"] == 4 and report["model"]["guidance"] == 1.0
    assert set(report["evaluation"]["student_by_steps"]) == {"4"}
