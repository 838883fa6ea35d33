"""Image-to-video through ComfyUI's HTTP API: a real server (CPU) with Carnator and the test fixture nodes runs
LoadImage -> WanImageToVideo -> Carnator Sampler on a tiny Wan 2.2 I2V A14B pair (the shipped I2V workflow's
graph), with two start images and one prompt. The start image decides the bucket: the second image is a miss that
names it, and each image's exact repeat returns its own stored result with no model call.
"""
import re

import pytest

import comfy_host
from test_browser_e2e import FIXTURE_NODES

REASON = comfy_host.skip_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
PROMPT = "the fox turns its head and trots out of frame"


def i2v_prompt(image_file: str, size_limit_gb: float) -> dict:
    hostsetup = comfy_host.hostsetup
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": hostsetup.TINY_WAN22_I2V_HIGH, "weight_dtype": "default"}},
        "2": {"class_type": "UNETLoader", "inputs": {"unet_name": hostsetup.TINY_WAN22_I2V_LOW, "weight_dtype": "default"}},
        "3": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["1", 0], "shift": 8.0}},
        "4": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["2", 0], "shift": 8.0}},
        "6": {"class_type": "E2ETextConditioning", "inputs": {"text": PROMPT, "seed": 1}},
        "7": {"class_type": "E2ETextConditioning", "inputs": {"text": "blurry, static", "seed": 2}},
        "11": {"class_type": "E2EPixelVAE", "inputs": {"channels": 16}},
        "15": {"class_type": "LoadImage", "inputs": {"image": image_file}},
        "8": {"class_type": "WanImageToVideo", "inputs": {
            "positive": ["6", 0], "negative": ["7", 0], "vae": ["11", 0], "start_image": ["15", 0],
            "width": 64, "height": 64, "length": 9, "batch_size": 1}},
        "9": {"class_type": "CarnatorCache", "inputs": {"cache_dir": "", "size_limit_gb": size_limit_gb}},
        "10": {"class_type": "CarnatorSampler", "inputs": {
            "model": ["3", 0], "cache": ["9", 0], "positive": ["8", 0], "negative": ["8", 1], "latent_image": ["8", 2],
            "seed": 42, "steps": 10, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple", "probe_steps": 2,
            "risk": "balanced", "sparse_attention": True, "low_noise_model": ["4", 0], "switch_step": 5}},
        "12": {"class_type": "SaveLatent", "inputs": {"samples": ["10", 0], "filename_prefix": "carnator_i2v/latent"}},
    }


def test_two_start_images_one_prompt_through_the_http_api(tmp_path):
    base = comfy_host.make_base(str(tmp_path / "base"), extra_nodes=(FIXTURE_NODES,))
    comfy_host.build_tiny_wan(base, every=True)
    images = {kind: comfy_host.write_start_image(base, f"carnator_test_{kind}.png", kind) for kind in ("sunset", "forest")}
    with comfy_host.ComfyServer(base) as server:
        def run(kind, size_limit_gb):
            status, queued = server.json("POST", "/api/prompt", {"prompt": i2v_prompt(images[kind], size_limit_gb)})
            assert status == 200, queued
            history = server.wait_history(queued["prompt_id"])
            assert history["status"]["status_str"] == "success", f"{history['status']}\n{server.log()[-4000:]}"
            return history["outputs"]["10"]["text"][0]

        # a new size limit makes ComfyUI run the Sampler again instead of answering from its own output cache
        sunset = run("sunset", 1.0)
        repeat = run("sunset", 1.5)
        forest = run("forest", 1.0)
        forest_repeat = run("forest", 1.5)
    assert sunset.startswith("Carnator MISS") and "10 of 10 steps run, 10 model calls" in sunset, sunset
    stored = re.search(r"stored as (\w+)", sunset).group(1)
    assert repeat.startswith(f"Carnator REPEAT: every input matches entry {stored}") and " 0 model calls" in repeat
    assert forest.startswith("Carnator MISS") and "differs in start image" in forest, forest
    forest_stored = re.search(r"stored as (\w+)", forest).group(1)
    assert forest_stored != stored
    assert forest_repeat.startswith(f"Carnator REPEAT: every input matches entry {forest_stored}"), forest_repeat
