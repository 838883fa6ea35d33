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
