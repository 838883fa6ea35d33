import argparse
import json
import sys

import pytest
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


def test_teacher_substeps_are_the_teachers_own_sigmas_for_a_4_step_student():
    student, teacher = flow_sigmas(4, distill.SHIFT).tolist(), flow_sigmas(20, distill.SHIFT)
    for index in range(4):
        span = distill.teacher_substeps(student[index], student[index + 1], 20)
        assert torch.allclose(torch.tensor(span), teacher[5 * index:5 * index + 6], atol=1e-6)
    assert len(distill.teacher_substeps(0.9, 0.0, 20)) - 1 == 15   # the rest of the way takes 15 teacher steps


def test_on_policy_targets_follow_the_teacher_from_the_students_state():
    teacher = load_tiny_dit(DEMO_WEIGHTS).eval()
    text = teacher.encode_prompts(["a red circle moving up on black"])
    empty = teacher.encode_prompts([""])
    noise = torch.randn((1,) + distill.world.CLIP_SHAPE, generator=torch.Generator().manual_seed(3))
    sigmas = flow_sigmas(4, distill.SHIFT).tolist()
    # x0: from the noise, the student's x0-hat is the end of the teacher's 20-step trajectory (the reflow target).
    v = distill.on_policy_target(teacher, noise, 1.0, sigmas[1], "onpolicy-x0", text, empty, 20, 2.0)
    end = distill.teacher_clips(teacher, noise, text, empty, 20, 2.0)
    assert torch.allclose(noise - v, end, atol=1e-4)
    # segment: a student step lands on the teacher's own state at the student's next sigma.
    v = distill.on_policy_target(teacher, noise, 1.0, sigmas[1], "onpolicy-segment", text, empty, 20, 2.0)
    state = distill.teacher_path(teacher, noise, flow_sigmas(20, distill.SHIFT)[:6].tolist(), text, empty, 2.0)
    assert torch.allclose(noise + (sigmas[1] - 1.0) * v, state, atol=1e-4)
    assert not torch.allclose(state, end, atol=1e-2)


def test_distill_smoke_trains_both_stages_of_an_on_policy_recipe(tmp_path):
    out = tmp_path / "student.safetensors"
    assert distill.main(["--smoke", "--device", "cpu", "--eval-steps", "4", "--teacher-eval", "", "--out", str(out),
                         "--target", "onpolicy-segment", "--reflow-minutes", "1", "--rollout-steps", "4"]) == 0
    report = json.loads((tmp_path / "student.json").read_text())
    assert report["recipe"]["target"] == "onpolicy-segment" and report["recipe"]["method"].startswith("on-policy")
    assert report["recipe"]["reflow_stage_steps"] == 1            # stage 1: one reflow step
    assert report["training"]["steps"] == 1 + 4                   # stage 2: one 4-step rollout
    assert report["training"]["student_rollouts"] == 2


def test_distill_sweep_variants_are_valid_distill_commands(tmp_path):
    from carnator_engine.demo import distill_sweep
    sweep = argparse.Namespace(out_dir=str(tmp_path), minutes=5.0, smoke=False, device=None)
    for name in distill_sweep.VARIANTS:
        args = distill.parse_args(distill_sweep.variant_arguments(name, sweep))
        assert args.target != "reflow" and args.minutes == 5.0 and args.out == str(tmp_path / f"{name}.safetensors")


def test_distill_sweep_runs_the_variants_at_once_and_names_the_best(tmp_path, monkeypatch):
    """Each variant a process (here a stand-in writing a report like distill.py's), all at once; a process past
    the deadline is stopped and reported, the others compared."""
    from carnator_engine.demo import distill_sweep
    gaps = {"x0_4step": 0.7, "segment_4step": 0.9}
    fake = ("import json, sys, time; out = sys.argv[sys.argv.index('--out') + 1]; all_ = {all_}; "
            "time.sleep(30 if all_ < 0 else 0); open(out, 'w').write('w'); "
            "s = lambda a: {{'random': {{'all': a, 'shape': a}}, 'heldout': {{'all': a, 'shape': a}}}}; "
            "json.dump({{'recipe': {{'target': 'x'}}, 'training': {{'steps': 1}}, 'evaluation': {{"
            "'teacher': {{'20 steps, guidance 2': s(0.9)}}, 'student_by_steps': {{'4': s(all_)}}}}}}, "
            "open(out.replace('.safetensors', '.json'), 'w'))")
    monkeypatch.setattr(distill_sweep, "variant_command", lambda name, args: [
        sys.executable, "-c", fake.format(all_=gaps.get(name, -1)), "--out", str(tmp_path / f"{name}.safetensors")])
    assert distill_sweep.main([str(tmp_path), "--minutes", "0.001", "--grace", "3"]) == 1
    summary = json.loads((tmp_path / "sweep.json").read_text())
    assert summary["best_at_4_steps_heldout"] == "segment_4step"
    assert summary["results"]["x0_4step"]["heldout_gap_points_at_4"] == 20.0
    assert summary["results"]["segment_mixed"]["failed"].startswith("stopped")
    assert len(list(tmp_path.iterdir())) == 6      # 2 x (weights, report), sweep.json, sweep_log.txt


def test_distill_sweep_names_an_unknown_variant(tmp_path, capsys):
    from carnator_engine.demo import distill_sweep
    with pytest.raises(SystemExit):
        distill_sweep.main([str(tmp_path), "--variants", "dmd"])
    assert "--variants 'dmd'" in capsys.readouterr().err
