"""CPU smoke runs at tiny size of benchmarks/gpu_backbones.py (Wan 2.2 A14B's two experts, HunyuanVideo and
LTX-Video through the ComfyUI adapter with the default gate: plumbing, JSON and table; not speed) and of
benchmarks/gate_transfer.py (per backbone one stored miss, then the default gate with no overrides answers nudged,
new-seed and new-text requests, each with the share of chance it was judged by; the real-size margins are measured
on the GPU). Skipped like every benchmark smoke test (tests/benchmark_smoke.py); the time limit only stops a hung run."""
from __future__ import annotations

import json
import os

from benchmark_smoke import ROOT, run_smoke, skip_without_comfyui

TIME_LIMIT_S = 600


def smoke(tmp_path, script, *arguments):
    """(the process, its JSON) of one benchmark's smoke run."""
    skip_without_comfyui()
    out = tmp_path / "out.json"
    proc = run_smoke([os.path.join(ROOT, "benchmarks", script), "--smoke", *arguments, "--out", str(out)], TIME_LIMIT_S)
    return proc, json.loads(out.read_text())


def test_gpu_backbones_smoke(tmp_path):
    proc, data = smoke(tmp_path, "gpu_backbones.py", "--steps", "10", "--probe", "2", "--resume", "5",
                       "--region-shares", "0.3,0.3")
    assert data["gate_overrides"] == {} and set(data["results"]) == {"wan2.2-a14b", "hunyuan-13b", "ltxv-2b"}
    assert data["fa4_installed"] is False and data["fa4_failure"] is None     # which kernel ran
    for name, res in data["results"].items():
        assert "error" not in res, res.get("error")
        assert res["miss"]["model_calls"] == 10 and res["miss"]["rel_diff_vs_plain"] < 1e-4, name
        assert res["hit"]["resume_step"] == 5 and res["hit"]["model_calls"] == 2 + 5, name
        assert res["hit"]["sparse_attend_calls"] > 0, name            # the cached plan ran
        assert not res["new_seed"]["reuse"], name
        assert {"speedup_vs_plain", "ideal", "peak_hit_vs_plain_pct"} <= set(res["summary"])
        # a share given twice is timed twice, the second named apart (the first pays a process's one-time costs)
        assert list(res["region"]) == ["region hit 30%", "region hit 30% #2"], name
    assert data["results"]["wan2.2-a14b"]["switch_step"] == 5
    assert "| backbone |" in proc.stdout


def test_gate_transfer_smoke(tmp_path):
    proc, data = smoke(tmp_path, "gate_transfer.py")
    assert data["gate_overrides"] == {}
    assert set(data["results"]) == {"wan2.1-1.3b", "wan2.2-a14b", "hunyuan-13b", "ltxv-2b"}
    for name, result in data["results"].items():
        assert "error" not in result, result.get("error")
        answers = {label: [a for a in result["requests"] if a["request"] == label]
                   for label in ("nudged noise", "nudged text", "new seed", "new text")}
        assert [len(group) for group in answers.values()] == [1, 1, 3, 2], name
        for answer in answers["nudged noise"] + answers["nudged text"]:
            assert answer["reuse"] and answer["numbers"]["context_share"] < 0.1, (name, answer)
        for answer in answers["new seed"]:
            assert not answer["reuse"], (name, answer)
    assert data["answered"] == 28 and "| share of chance |" in proc.stdout


def test_a_video_size_gives_each_backbone_the_latent_its_vae_makes():
    # --video lets a GPU run use more frames than the reduced defaults (the 2.2x goal needs the attention share
    # of longer clips); the defaults above are these sizes' latents, and a size the VAE cannot make is refused
    import pytest
    from test_quality_smoke import _script
    gb = _script("gpu_backbones")
    assert gb.video_latent("wan", 49, 480, 832) == gb.BACKBONES["wan2.2-a14b"]["latent"] == (1, 16, 13, 60, 104)
    assert gb.video_latent("hunyuan", 81, 480, 832) == (1, 16, 21, 60, 104)
    assert gb.video_latent("ltxv", 121, 704, 1216) == gb.BACKBONES["ltxv-2b"]["latent"] == (1, 128, 16, 22, 38)
    sized = gb.with_video(gb.BACKBONES, "257x704x1216")
    assert sized["ltxv-2b"]["latent"] == (1, 128, 33, 22, 38) and sized["wan2.2-a14b"]["latent"] == (1, 16, 65, 88, 152)
    assert gb.with_video(gb.BACKBONES, None) is gb.BACKBONES
    # 720p is Wan's size but not LTX-Video's (multiples of 32): a run of Wan alone takes it, the others keep theirs
    wan_only = gb.with_video(gb.BACKBONES, "49x720x1280", ["wan2.2-a14b"])
    assert wan_only["wan2.2-a14b"]["latent"] == (1, 16, 13, 90, 160) and wan_only["ltxv-2b"] == gb.BACKBONES["ltxv-2b"]
    for bad, message in (("80x480x832", r"1 \+ 4 k frames"), ("81x470x832", "multiples of 16"), ("81x480", "FRAMESx")):
        with pytest.raises(SystemExit, match=message):
            gb.with_video(gb.BACKBONES, bad)
