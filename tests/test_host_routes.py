"""The cache browser's routes inside a real ComfyUI server, with this repository installed as a custom node.

Skipped (with the reason) where no ComfyUI is found: COMFYUI_PATH, default /opt/ComfyUI. The server runs
on CPU from a temporary --base-directory (tests/comfy_host.py); nothing is written into the ComfyUI tree.
Run alone: python -m pytest tests/test_host_routes.py -v
"""
import json
import os
import urllib.parse

import pytest
import torch

import comfy_host

REASON = comfy_host.skip_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

PROMPTS = ("a red circle moving left on black background", "a blue square moving up on white background")


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny_model):
    from carnator_engine.euler import TinyDiTRunner
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.schedule import flow_sigmas
    from carnator_engine.store import CarnatorStore

    base = comfy_host.make_base(str(tmp_path_factory.mktemp("comfy_base")))
    store = CarnatorStore(comfy_host.default_store_dir(base), 64 << 20)  # the plugin's default store
    ids = []
    for seed, prompt in enumerate(PROMPTS):
        noise = torch.randn((1, 3, 8, 32, 32), generator=torch.Generator().manual_seed(seed))
        result = generate(TinyDiTRunner(tiny_model, prompt), noise, flow_sigmas(6), store,
                          CarnatorConfig(probe_steps=2), prompt=prompt, seed=seed,
                          model_name="wan2.1_t2v_1.3B_fp16.safetensors" if seed == 0 else "")
        ids.append(result.entry_id)
    with comfy_host.ComfyServer(base) as server:
        yield server, store, ids
    store.close()


def test_plugin_loaded_with_its_web_directory(host):
    server, _, _ = host
    status, extensions = server.json("GET", "/api/extensions")
    assert status == 200
    assert f"/extensions/{comfy_host.PLUGIN_DIR_NAME}/carnator.js" in extensions, server.log()[-3000:]
    status, content_type, body = server.request("GET", f"/extensions/{comfy_host.PLUGIN_DIR_NAME}/carnator.js")
    assert status == 200 and b"registerExtension" in body and "javascript" in content_type


@pytest.mark.parametrize("prefix", ["", "/api"])
def test_listing_stats_and_thumbnail(host, prefix, tiny_model):
    from carnator_engine.euler import TinyDiTRunner
    server, store, ids = host
    status, listing = server.json("GET", f"{prefix}/carnator/entries")
    assert status == 200, listing
    assert listing["directory"] == store.location
    by_id = {entry["id"]: entry for entry in listing["entries"]}
    assert set(ids) <= set(by_id)
    assert by_id[ids[0]]["prompt"] == PROMPTS[0] and by_id[ids[0]]["steps"] == 6
    # the model is named: its file name where the workflow says it, else a short fingerprint of its weights
    assert by_id[ids[0]]["model"] == "wan2.1_t2v_1.3B_fp16.safetensors"
    assert by_id[ids[1]]["model"] == TinyDiTRunner(tiny_model, "").model_fingerprint[:12]

    status, content_type, png = server.request("GET", f"{prefix}/carnator/entries/{ids[0]}/thumbnail")
    assert status == 200 and content_type == "image/png"
    assert png == store.thumbnail(ids[0]) and png.startswith(b"\x89PNG\r\n\x1a\n")

    status, stats = server.json("GET", f"{prefix}/carnator/stats")
    assert status == 200 and stats["entries"] >= 2 and stats["directory"] == store.location
    assert stats["stores"][0] == {"directory": store.location, "default": True}


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/carnator/entries/zzzz/thumbnail", 400),
    ("GET", "/carnator/entries/0123456789ABCDEF/thumbnail", 400),
    ("DELETE", "/carnator/entries/0123456789abcdef0", 400),
    ("DELETE", "/carnator/entries/%2E%2E%2F%2E%2E%2Fcache.db", 400),
    ("GET", "/carnator/entries/ffffffffffffffff/thumbnail", 404),
    ("DELETE", "/carnator/entries/ffffffffffffffff", 404),
])
def test_bad_and_unknown_ids(host, method, path, status):
    server, _, _ = host
    answer, body = server.json(method, path)
    assert answer == status, body
    assert body["status"] == status and body["error"]


def test_cache_parameter_cannot_open_other_paths(host, tmp_path):
    server, store, _ = host
    target = tmp_path / "must_not_be_created"
    attempts = ["/etc", "../../..", store.location + "/..", os.path.dirname(store.location), str(target),
                "relative/dir", store.location + "/../../user/carnator_cache/../.."]
    for attempt in attempts:
        query = urllib.parse.urlencode({"cache": attempt})
        for method, path in [("GET", "/carnator/entries"), ("GET", "/carnator/stats"),
                             ("POST", "/carnator/clear")]:
            status, body = server.json(method, f"{path}?{query}", {"confirm": True} if method == "POST" else None)
            assert status == 400, (attempt, path, body)
            assert "store" in body["error"]
    assert not target.exists()
    status, listing = server.json("GET", "/carnator/entries?" + urllib.parse.urlencode({"cache": store.location}))
    assert status == 200 and listing["entries"]


def test_delete_then_clear(host):
    server, store, ids = host
    status, body = server.json("DELETE", f"/carnator/entries/{ids[0]}")
    assert status == 200 and body == {"deleted": ids[0]}
    assert ids[0] not in {r.entry_id for r in store.records(include_corrupt=True)}
    status, body = server.json("DELETE", f"/carnator/entries/{ids[0]}")
    assert status == 404
    status, _, _ = server.request("GET", f"/carnator/entries/{ids[0]}/thumbnail")
    assert status == 404

    status, body = server.json("POST", "/carnator/clear")
    assert status == 400 and "confirm" in body["error"]
    status, body = server.json("POST", "/carnator/clear", {"confirm": True})
    assert status == 200 and body["deleted"] >= 1
    assert store.records(include_corrupt=True) == []
    status, listing = server.json("GET", "/carnator/entries")
    assert listing["entries"] == []
    assert json.loads(json.dumps(listing)) == listing


# where every_node_prompt puts each Carnator node with float inputs
NODE_IDS = {"CarnatorCache": "6", "CarnatorEarlyProbe": "7", "CarnatorCompatibilityGate": "9",
            "CarnatorTrajectoryResume": "10", "CarnatorSampler": "12"}


def test_every_float_input_of_every_node_is_refused_before_any_node_runs_when_nan_inf_or_out_of_range(host, tmp_path):
    """ComfyUI's own range check lets NaN through (every comparison with it is false); the node's own check comes
    when it runs, for the Gate and the Resume after the Early Probe's model calls. Every FLOAT input the server lists
    for a Carnator node is refused by the check of the prompt instead, with one error on that node naming the input
    and its range."""
    server, _, _ = host
    status, info = server.json("GET", "/api/object_info")
    assert status == 200
    floats = {(class_type, name): spec[1] for class_type, node_info in info.items() if class_type.startswith("Carnator")
              for group in ("required", "optional") for name, spec in node_info["input"].get(group, {}).items()
              if spec[0] == "FLOAT"}
    assert {class_type for class_type, _ in floats} == set(NODE_IDS) and len(floats) == 15
    for (class_type, name), spec in floats.items():
        node_id = NODE_IDS[class_type]
        for value in (float("nan"), float("inf"), -float("inf"), spec["max"] + 1, spec["min"] - 1):
            prompt = every_node_prompt(str(tmp_path / "cache"))
            prompt[node_id]["inputs"][name] = value
            status, answer = server.json("POST", "/api/prompt", {"prompt": prompt})
            assert status == 400, answer
            errors = answer["node_errors"].get(node_id, {}).get("errors", [])
            assert len(errors) == 1, (class_type, name, value, errors)
            assert f"input '{name}': {name}=" in errors[0]["details"] and "set a value in [" in errors[0]["details"]
        assert node_errors(server, every_node_prompt(str(tmp_path / "cache")), node_id) == ""
    assert not (tmp_path / "cache").exists()


def every_node_prompt(cache_dir: str) -> dict:
    """The staged chain and a Carnator Sampler beside it, every float input at a valid value."""
    prompt = staged_prompt(cache_dir)
    prompt["6"]["inputs"]["size_limit_gb"] = 1.0
    prompt["7"]["inputs"]["boundary_sigma"] = 0.875
    prompt["9"]["inputs"].update({name: 0.0 for name in (
        "max_hidden", "max_attention", "max_context", "cell_threshold", "max_target_fraction", "max_resume_fraction",
        "max_context_share", "few_step_resume_fraction")})
    prompt["10"]["inputs"]["attention_density"] = 0.5
    prompt["12"] = {"class_type": "CarnatorSampler", "inputs": {
        **{k: v for k, v in prompt["7"]["inputs"].items() if k != "block_size"}, "cache": ["6", 0], "risk": "balanced",
        "sparse_attention": True, "attention_density": 1.0}}
    prompt["13"] = {"class_type": "SaveLatent", "inputs": {"samples": ["12", 0], "filename_prefix": "carnator/latent"}}
    return prompt


def staged_prompt(cache_dir: str, **gate) -> dict:
    """API-format staged chain (Probe -> Lookup -> Gate -> Resume) at 4 steps; its loaders name files the server does
    not have, which only adds their own errors: ComfyUI checks every node of a prompt before running any."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "absent.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": "absent.safetensors", "type": "wan"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": PROMPTS[0], "clip": ["2", 0]}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["2", 0]}},
        "5": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": 64, "height": 64, "length": 9, "batch_size": 1}},
        "6": {"class_type": "CarnatorCache", "inputs": {"cache_dir": cache_dir, "size_limit_gb": 1.0}},
        "7": {"class_type": "CarnatorEarlyProbe", "inputs": {
            "model": ["1", 0], "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0], "seed": 1,
            "steps": 4, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "probe_steps": 0,
            "block_size": 0}},
        "8": {"class_type": "CarnatorSignatureCacheLookup", "inputs": {"cache": ["6", 0], "probe": ["7", 0],
                                                                       "limit": 3}},
        "9": {"class_type": "CarnatorCompatibilityGate", "inputs": {"probe": ["7", 0], "matches": ["8", 0],
                                                                    "risk": "balanced", **gate}},
        "10": {"class_type": "CarnatorTrajectoryResume", "inputs": {
            "cache": ["6", 0], "probe": ["7", 0], "decision": ["9", 0], "sparse_attention": True}},
        "11": {"class_type": "SaveLatent", "inputs": {"samples": ["10", 0], "filename_prefix": "carnator/latent"}},
    }


def node_errors(server, prompt: dict, node_id: str) -> str:
    """The errors ComfyUI's check of `prompt` gives node `node_id`, as one text; asserts nothing was queued."""
    status, answer = server.json("POST", "/api/prompt", {"prompt": prompt})
    assert status == 400, answer
    errors = answer["node_errors"].get(node_id, {}).get("errors", [])
    return "\n".join(f"{e['details']}: {e['message']}" for e in errors)


def test_inputs_are_refused_before_any_node_runs(host, tmp_path):
    """Through the HTTP API: a gate setting outside its real range, a cache_dir with a NUL byte or naming the user
    directory itself, and a folder holding another program's WAL-mode database are refused by ComfyUI's check of the
    prompt (400), before a probe could spend a model call; the folder is left exactly as it was."""
    from test_store_marker import folder_state, foreign_wal_database
    server, _, _ = host
    good = str(tmp_path / "new_cache")
    for name, value in (("few_step_resume_fraction", 1.0), ("max_resume_fraction", 1.5)):
        shown = node_errors(server, staged_prompt(good, **{name: value}), "9")
        assert f"input '{name}': {name}={value:g} is outside its range: set a value in [0, 0.999]" in shown, shown
    assert node_errors(server, staged_prompt(good, max_attention=0.5), "9") == ""   # in range: no error there
    for cache_dir, message in (("cache\x00dir", "holds the control character '\\x00' (U+0000) at character 6"),
                               ("cache\ndir", "holds the control character '\\n' (U+000A) at character 6"),
                               (".", "names ComfyUI's user directory itself"),
                               (str(foreign_wal_database(tmp_path / "their_app")), "not a Carnator store")):
        before = folder_state(tmp_path / "their_app")
        shown = node_errors(server, staged_prompt(cache_dir), "6")
        assert "input 'cache_dir'" in shown and message in shown, shown
        assert folder_state(tmp_path / "their_app") == before
    farm = staged_prompt("redis://localhost:6379/0")
    farm["6"]["inputs"]["blob_dir"] = str(tmp_path / "blobs\n")
    assert ("input 'blob_dir': blob_dir holds the control character '\\n' (U+000A)" in node_errors(server, farm, "6"))
    probe = staged_prompt(good)
    probe["7"]["inputs"]["block_size"] = 7   # the widget steps by 16; a prompt sent to the API can hold any number
    assert ("input 'block_size': block_size=7 is not a size the block-sparse attention tiles: use 16, 32, 64 or a "
            "multiple of 128 tokens, or 0 for the default" in node_errors(server, probe, "7"))
    assert not (tmp_path / "new_cache").exists()
