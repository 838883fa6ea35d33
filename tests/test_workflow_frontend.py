"""The shipped workflow loaded by the real ComfyUI frontend (headless Chromium, a CPU server with the plugin):
every node type is known, and the API prompt the web app builds from it gives each Carnator input the value
the workflow means (the frontend, not our own reading of widgets_values, decides that mapping). Then that very
prompt runs on the server, its Carnator nodes untouched: only the model files it names (Wan 2.1 1.3B, umT5, the
VAE) are swapped for the tests' tiny Wan and a test conditioning node, and the clip is made small.

Needs the host (COMFYUI_PATH), Chromium, node and playwright-core (cd tests/browser && npm install);
skipped with the reason otherwise.
"""
import json
import os
import subprocess

import pytest

import comfy_host
from test_browser_e2e import BROWSER_DIR, CHROMIUM, FIXTURE_NODES, NODE, REASON, seed_user_settings

pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
WORKFLOW = os.path.join(comfy_host.ROOT, "workflows", "carnator_wan21_t2v.json")


def run_on_the_server(server, prompt: dict, model_name: str) -> dict:
    """Queues the frontend's prompt with the model files swapped for test ones; returns its history entry."""
    prompt = json.loads(json.dumps(prompt))
    prompt["1"]["inputs"]["unet_name"] = model_name
    for node_id, seed in (("3", 1), ("4", 2)):            # CLIPTextEncode (umT5) -> a test conditioning node
        prompt[node_id] = {"class_type": "E2ETextConditioning",
                           "inputs": {"text": prompt[node_id]["inputs"]["text"], "seed": seed}}
    del prompt["2"]                                         # the CLIPLoader has nothing left to feed
    prompt["5"]["inputs"].update(width=64, height=64, length=9)
    for node_id in ("8", "9", "10"):                         # no VAE: save the latent instead of a video
        del prompt[node_id]
    prompt["12"] = {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": "carnator/wf"}}
    status, queued = server.json("POST", "/api/prompt", {"prompt": prompt})
    assert status == 200, queued
    return server.wait_history(queued["prompt_id"])


def test_frontend_reads_the_workflow_as_meant_and_runs_it(tmp_path):
    from carnator_engine.store import CarnatorStore

    base = comfy_host.make_base(str(tmp_path / "base"), extra_nodes=(FIXTURE_NODES,))
    model_name = os.path.basename(comfy_host.build_tiny_wan(base))
    seed_user_settings(base)
    with open(WORKFLOW) as handle:
        workflow = json.load(handle)
    with comfy_host.ComfyServer(base) as server:
        config = {"url": server.url, "workflow": workflow, "userDataDir": str(tmp_path / "profile"),
                  "chromium": CHROMIUM, "timeoutMs": 120000}
        (tmp_path / "config.json").write_text(json.dumps(config))
        run = subprocess.run([NODE, os.path.join(BROWSER_DIR, "load_workflow.mjs"), str(tmp_path / "config.json")],
                             cwd=BROWSER_DIR, capture_output=True, text=True, timeout=600)
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        assert lines, f"no result (rc {run.returncode}):\n{run.stderr[-3000:]}\n{server.log()[-3000:]}"
        result = json.loads(lines[-1])
        assert "error" not in result, result["error"]
        history = run_on_the_server(server, result["prompt"], model_name)
        server.json("GET", "/carnator/entries")   # returns once the server's background write is done
        server_log = server.log()
    assert history["status"]["status_str"] == "success", json.dumps(history["status"])[-3000:] + server_log[-3000:]
    shown = history["outputs"]["7"]["text"][0]
    assert shown.startswith("Carnator MISS (balanced)") and "30 of 30 steps run, 30 model calls" in shown, shown
    store = CarnatorStore(comfy_host.default_store_dir(base), 1 << 30)   # the workflow's cache_dir "" = the default
    try:
        assert [r.steps for r in store.records()] == [30]
    finally:
        store.close()
    assert result["missing"] == []
    prompt = result["prompt"]
    sampler = prompt["7"]
    assert sampler["class_type"] == "CarnatorSampler"
    assert sampler["inputs"] == {
        "model": ["1", 0], "cache": ["6", 0], "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0],
        "seed": 12345, "steps": 30, "cfg": 6.0, "sampler_name": "euler", "scheduler": "simple", "probe_steps": 3,
        "risk": "balanced", "sparse_attention": True, "attention_density": 1.0,
        "switch_step": 0, "boundary_sigma": 0.875, "region_only": False}           # widgets added since the workflow was saved: defaults
    assert prompt["6"] == {"class_type": "CarnatorCache", "inputs": {"cache_dir": "", "size_limit_gb": 8.0, "blob_dir": ""},
                           "_meta": prompt["6"].get("_meta")}
    assert result["nodes"]["7"]["widgets"]["control_after_generate"] == "fixed"
    assert prompt["5"]["inputs"] == {"width": 832, "height": 480, "length": 33, "batch_size": 1}
    assert prompt["2"]["inputs"]["type"] == "wan"
    assert prompt["10"]["class_type"] == "SaveAnimatedWEBP" and prompt["10"]["inputs"]["images"] == ["9", 0]
    assert "11" not in prompt                                   # the note stays in the web app
    ours = [e for e in result["consoleErrors"] if "carnator" in e.lower()]
    assert not ours, ours


# ---- every shipped workflow: read by the frontend, then run through the HTTP API with tiny models ----------------

WORKFLOWS = sorted(name for name in os.listdir(os.path.join(comfy_host.ROOT, "workflows")) if name.endswith(".json"))
FIXTURE_NODES = os.path.join(comfy_host.ROOT, "tests", "host", "fixture_nodes", "carnator_e2e_fixture")
LOADERS = {"CLIPLoader", "DualCLIPLoader", "VAEDecode", "SaveAnimatedWEBP"}   # no tiny files for these
TINY_MODELS = {   # the workflow's diffusion models (UNETLoader / CheckpointLoaderSimple nodes by id) -> tiny ones
    "carnator_wan21_t2v.json": {"1": comfy_host.hostsetup.TINY_WAN},
    "carnator_staged_chain_wan21.json": {"1": comfy_host.hostsetup.TINY_WAN},
    "carnator_wan22_a14b_t2v.json": {"1": comfy_host.hostsetup.TINY_WAN22_HIGH, "2": comfy_host.hostsetup.TINY_WAN22_LOW},
    "carnator_hunyuan_video_t2v.json": {"1": comfy_host.hostsetup.TINY_HUNYUAN},
    "carnator_ltxv_t2v.json": {"1": comfy_host.hostsetup.TINY_LTXV},
    "carnator_wan22_5b_t2v.json": {"1": comfy_host.hostsetup.TINY_WAN22_5B},
    "carnator_wan21_4step_lora_t2v.json": {"1": comfy_host.hostsetup.TINY_WAN, "12": comfy_host.hostsetup.TINY_LORAS[0]},
    "carnator_wan22_i2v_a14b.json": {"1": comfy_host.hostsetup.TINY_WAN22_I2V_HIGH,
                                     "2": comfy_host.hostsetup.TINY_WAN22_I2V_LOW},
    "carnator_wan22_a14b_4step_lora_t2v.json": {"1": comfy_host.hostsetup.TINY_WAN22_HIGH,
                                                "2": comfy_host.hostsetup.TINY_WAN22_LOW,
                                                "15": comfy_host.hostsetup.TINY_LORAS[1],
                                                "16": comfy_host.hostsetup.TINY_LORAS[2]},
}
# The sampler settings each workflow runs with here (default: 10 steps, probe 2, the experts' switch at 5); the
# few-step ones keep their own schedule and automatic probe, the A14B one its 2+2 split.
SCHEDULES = {"carnator_wan21_4step_lora_t2v.json": {"steps": 4, "probe_steps": 0},
             "carnator_wan22_a14b_4step_lora_t2v.json": {"steps": 4, "probe_steps": 0, "switch_step": 2}}
LAYOUTS = {"carnator_hunyuan_video_t2v.json": "hunyuan_video", "carnator_ltxv_t2v.json": "ltxv"}
START_IMAGE = "carnator_test_start_image.png"     # LoadImage's file, written into the server's input folder


def tiny_prompt(prompt: dict, name: str, cache_dir: str) -> dict:
    """The frontend's API prompt for `name`, runnable here: tiny diffusion models, the test fixture's conditioning
    instead of text encoders, tiny LoRAs, a small latent and 10 steps (probe 2, switch 5) unless SCHEDULES says
    otherwise, SaveLatent instead of decoding.
    A VAE loader becomes the fixture's placeholder VAE: Wan 2.2's latent node requires one but, with no start
    image, never uses it (the placeholder fails any use); where a start image is loaded, the fixture's
    pixel-pooling VAE encodes it (16 latent channels, as Wan 2.1's VAE)."""
    start_image = any(node["class_type"] == "LoadImage" for node in prompt.values())
    out = {}
    for node_id, node in prompt.items():
        kind, inputs = node["class_type"], dict(node["inputs"])
        if kind in LOADERS:
            continue
        if kind == "VAELoader":
            kind, inputs = ("E2EPixelVAE", {"channels": 16}) if start_image else ("E2EPlaceholderVAE", {})
        elif kind == "LoadImage":
            inputs = {"image": START_IMAGE}
        elif kind in ("UNETLoader", "CheckpointLoaderSimple"):
            kind, inputs = "UNETLoader", {"unet_name": TINY_MODELS[name][node_id], "weight_dtype": "default"}
        elif kind == "CLIPTextEncode":
            kind, inputs = "E2ETextConditioning", {"text": inputs["text"], "seed": int(node_id),
                                                   "layout": LAYOUTS.get(name, "wan")}
        elif kind in ("EmptyHunyuanLatentVideo", "EmptyLTXVLatentVideo", "Wan22ImageToVideoLatent", "WanImageToVideo"):
            inputs.update(width=64, height=64, length=9)
        elif kind == "CarnatorCache":
            inputs["cache_dir"] = cache_dir
        elif kind == "LoraLoaderModelOnly":
            inputs["lora_name"] = TINY_MODELS[name][node_id]
        elif kind in ("CarnatorSampler", "CarnatorEarlyProbe"):
            inputs.update(SCHEDULES.get(name) or dict(steps=10, probe_steps=2,
                                                      **({"switch_step": 5} if "low_noise_model" in inputs else {})))
        if kind in ("CarnatorSampler", "CarnatorTrajectoryResume"):
            out["900"] = {"class_type": "SaveLatent", "inputs": {"samples": [node_id, 0],
                                                                 "filename_prefix": f"carnator_wf/{name[:-5]}"}}
        out[node_id] = {"class_type": kind, "inputs": inputs}
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("workflows")
    base = comfy_host.make_base(str(root / "base"), extra_nodes=(FIXTURE_NODES,))
    comfy_host.build_tiny_wan(base, every=True)
    comfy_host.write_start_image(base, START_IMAGE, "sunset")
    seed_user_settings(base)
    # PyTorch attention on the CPU too: the default sub-quadratic one rejects LTX-Video's text mask
    with comfy_host.ComfyServer(base, extra_args=("--use-pytorch-cross-attention",)) as server:
        yield server, root


def carnator_text(history: dict) -> list:
    return [text for output in history.get("outputs", {}).values() for text in output.get("text", [])
            if text.startswith("Carnator ")]


@pytest.mark.parametrize("name", WORKFLOWS)
def test_every_workflow_loads_in_the_frontend_and_runs_with_tiny_models(served, name):
    server, root = served
    with open(os.path.join(comfy_host.ROOT, "workflows", name)) as handle:
        workflow = json.load(handle)
    config = {"url": server.url, "workflow": workflow, "userDataDir": str(root / f"profile-{name}"),
              "chromium": CHROMIUM, "timeoutMs": 120000}
    (root / f"{name}.config.json").write_text(json.dumps(config))
    run = subprocess.run([NODE, os.path.join(BROWSER_DIR, "load_workflow.mjs"), str(root / f"{name}.config.json")],
                         cwd=BROWSER_DIR, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (rc {run.returncode}):\n{run.stderr[-3000:]}\n{server.log()[-3000:]}"
    result = json.loads(lines[-1])
    assert "error" not in result and result["missing"] == [], result.get("error") or result["missing"]
    assert not [e for e in result["consoleErrors"] if "carnator" in e.lower()]
    if name not in TINY_MODELS:
        return
    prompt = tiny_prompt(result["prompt"], name, str(root / "caches" / name))
    runs = []
    for size in (1.0, 1.5):    # the same request again (a new size limit makes ComfyUI run it, not its output cache)
        for node in prompt.values():
            if node["class_type"] == "CarnatorCache":
                node["inputs"]["size_limit_gb"] = size
        status, queued = server.json("POST", "/api/prompt", {"prompt": prompt, "client_id": "carnator-workflows"})
        assert status == 200, queued
        history = server.wait_history(queued["prompt_id"], timeout=600)
        assert history["status"]["status_str"] == "success", f"{history['status']}\n{server.log()[-4000:]}"
        runs.append(carnator_text(history))
    # a miss, stored; then its exact repeat answered with no model call (the staged chain's Early Probe has the
    # cache connected, so it too runs no probe step)
    assert any(text.startswith("Carnator MISS") for text in runs[0]), runs[0]
    assert any(text.startswith("Carnator REPEAT") and " 0 model calls" in text for text in runs[1]), runs[1]
