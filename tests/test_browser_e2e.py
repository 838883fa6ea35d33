"""End to end in headless Chromium: a real ComfyUI (CPU) with the plugin; a workflow running a tiny Wan2.1
model through the Carnator Sampler is queued three times from the web UI (a miss that stores an entry,
another seed, then the first request again: an exact repeat of the first entry), the decision shows on the
node and still does after a page reload, then the Carnator sidebar tab lists the first entry (prompt, thumbnail, its hit), deletes it from the
UI, then "Clear all" (cancelled once, confirmed once) empties the store.

Needs the host (COMFYUI_PATH, default /opt/ComfyUI), Chromium (CARNATOR_CHROMIUM, default /usr/bin/chromium),
node and playwright-core (cd tests/browser && npm install); skipped with the reason otherwise.
CARNATOR_SCREENSHOTS=DIR copies the screenshots there (benchmarks/results/screenshots holds the committed ones).
"""
import json
import os
import shutil
import subprocess

import pytest

import comfy_host

HERE = os.path.dirname(os.path.abspath(__file__))
BROWSER_DIR = os.path.join(HERE, "browser")
CHROMIUM = os.environ.get("CARNATOR_CHROMIUM", "/usr/bin/chromium")
NODE = shutil.which("node")
FIXTURE_NODES = os.path.join(HERE, "host", "fixture_nodes", "carnator_e2e_fixture")
PROMPT = "a red circle moving left on a black background"


def _skip_reason():
    reason = comfy_host.skip_reason()
    if reason:
        return reason
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CARNATOR_CHROMIUM)"
    if NODE is None:
        return "node is not installed"
    if not os.path.isdir(os.path.join(BROWSER_DIR, "node_modules", "playwright-core")):
        return "playwright-core is not installed (cd tests/browser && npm install)"
    return None


REASON = _skip_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def workflow(model_name: str) -> dict:
    """API-format prompt: tiny Wan -> Carnator Sampler (10 steps, probe 2) -> SaveLatent. Node 6 decides.

    10 steps leave a balanced-risk hit room to save >= 2 steps (resume at step 5); with 6 it never could."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": model_name, "weight_dtype": "default"}},
        "2": {"class_type": "E2ETextConditioning", "inputs": {"text": PROMPT, "seed": 1}},
        "3": {"class_type": "E2ETextConditioning", "inputs": {"text": "blurry, static", "seed": 2}},
        "4": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": 64, "height": 64, "length": 9, "batch_size": 1}},
        "5": {"class_type": "CarnatorCache", "inputs": {"cache_dir": "", "size_limit_gb": 1.0}},
        "6": {"class_type": "CarnatorSampler", "inputs": {
            "model": ["1", 0], "cache": ["5", 0], "positive": ["2", 0], "negative": ["3", 0],
            "latent_image": ["4", 0], "seed": 42, "steps": 10, "cfg": 5.0, "sampler_name": "euler",
            "scheduler": "simple", "probe_steps": 2, "risk": "balanced", "sparse_attention": True}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": "carnator_e2e/latent"}},
    }


def seed_user_settings(base: str) -> None:
    """A fresh ComfyUI user would first see the template browser, which covers the sidebar."""
    folder = os.path.join(base, "user", "default")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "comfy.settings.json"), "w") as handle:
        json.dump({"Comfy.TutorialCompleted": True}, handle)


def test_cache_browser_and_decision_in_chromium(tmp_path):
    from carnator_engine.store import CarnatorStore

    base = comfy_host.make_base(str(tmp_path / "base"), extra_nodes=(FIXTURE_NODES,))
    model_path = comfy_host.build_tiny_wan(base)
    seed_user_settings(base)
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with comfy_host.ComfyServer(base) as server:
        status, info = server.json("GET", "/api/object_info/CarnatorSampler")
        assert status == 200 and "CarnatorSampler" in info, "the plugin's nodes did not load:\n" + server.log()[-3000:]
        config = {
            "url": server.url, "screenshots": str(shots), "userDataDir": str(tmp_path / "chromium-profile"),
            "chromium": CHROMIUM, "expectPrompt": PROMPT, "workflow": workflow(os.path.basename(model_path)),
            "queueCount": 3, "decisionNode": "6", "reloadCheck": True, "clearAll": True, "timeoutMs": 120000,
            # run 2: other noise, a new request; run 3: the first request again (the new cache size limit only
            # makes ComfyUI run the Carnator Sampler rather than answer from its own output cache)
            "changesBeforeRun": {"2": [{"node": "6", "widget": "seed", "value": 43}],
                                 "3": [{"node": "6", "widget": "seed", "value": 42},
                                       {"node": "5", "widget": "size_limit_gb", "value": 1.5}]},
        }
        config_path = tmp_path / "e2e.json"
        config_path.write_text(json.dumps(config))
        run = subprocess.run([NODE, os.path.join(BROWSER_DIR, "e2e.mjs"), str(config_path)], cwd=BROWSER_DIR,
                             capture_output=True, text=True, timeout=900)
        server_log = server.log()
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"e2e.mjs printed no result (rc {run.returncode}):\n{run.stderr[-3000:]}\n{server_log[-3000:]}"
    result = json.loads(lines[-1])
    assert run.returncode == 0 and "error" not in result, \
        f"{result.get('error')}\n{run.stderr[-3000:]}\nserver:\n{server_log[-3000:]}"

    # run 1: a miss, stored; run 2 (other noise) is a request of its own, stored too; run 3 repeats run 1
    # exactly: its stored result, no model call, nothing new stored. The node shows the last decision.
    requests = [d for d in result["decisions"] if not d.get("write_done")]   # updates once a write is done
    first, second, third = requests
    assert all(d["stored_as"] in (first["stored_as"], second["stored_as"]) and not d["store_pending"]
               for d in result["decisions"] if d.get("write_done"))
    assert first["node"] == "6" and first["reuse"] is False and first["steps"] == 10 and first["stored_as"]
    # the widget shows the deciding reasons under the verdict (format.js decisionLines), as the node's text does
    assert first["why"] == ("no earlier generation of this model, shape and schedule is in the cache; the cache "
                            "holds no generation yet"), first["reasons"]
    assert second["stored_as"] and second["stored_as"] != first["stored_as"] and not second["exact_repeat"]
    assert third["exact_repeat"] is True and third["entry_id"] == first["stored_as"], third["reasons"]
    assert third["model_calls"] == 0 and third["stored_as"] is None
    assert result["decision"]["entry_id"] == first["stored_as"] and result["decision"]["exact_repeat"]
    assert result["badge"] == "REPEAT · 0 model calls"
    assert result["widgetText"].startswith(f"REPEAT: the stored result of entry {first['stored_as']}")
    # a page reload keeps the node's last decision on display (the node's properties, saved with the workflow)
    assert result["afterReload"] == {"badge": result["badge"], "widgetText": result["widgetText"]}

    # the sidebar listed the first entry with its prompt, thumbnail and hit; its delete button removed it
    assert result["entryId"] == first["stored_as"] and result["promptText"] == PROMPT
    assert "0 hits · 1 exact repeat · " in result["entryText"], result["entryText"]   # run 3, counted as the CLI does
    assert result["thumbnail"]["width"] > 0 and result["thumbnail"]["height"] > 0
    assert result["deleteStatus"] == 200 and result["remaining"] == 1
    assert result["entryId"] not in result["listedAfter"] and len(result["listedAfter"]) == 1  # the server agrees
    # "Clear all" asked first: cancelling kept the last entry, confirming removed it
    assert result["cleared"]["keptAfterCancel"] == 1 and result["cleared"]["clearStatus"] == 200
    assert result["cleared"]["left"] == 0 and result["cleared"]["stats"].startswith("0 entries")
    store = CarnatorStore(comfy_host.default_store_dir(base), 1 << 30)
    try:
        assert store.records(include_corrupt=True) == []
    finally:
        store.close()
    ours = [e for e in result["consoleErrors"] if "carnator" in e.lower()]
    assert not ours, ours

    target = os.environ.get("CARNATOR_SCREENSHOTS")
    if target:
        os.makedirs(target, exist_ok=True)
        for path in result["screenshots"]:
            shutil.copy(path, os.path.join(target, os.path.basename(path)))
