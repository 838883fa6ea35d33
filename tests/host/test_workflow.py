"""The shipped workflow (workflows/carnator_wan21_t2v.json): node types exist, links fit, widget values
match the nodes' inputs (Carnator's V3 nodes and the core ones, as the real host defines them)."""
from __future__ import annotations

import json

import pytest

import hostsetup
from workflowcheck import FRONTEND_ONLY, check_workflow

WORKFLOW = hostsetup.REPO / "workflows" / "carnator_wan21_t2v.json"
MODEL_FILES = {"unet_name", "clip_name", "clip_name1", "clip_name2", "vae_name", "ckpt_name", "lora_name",
               "image"}   # names of files the user downloads or brings (LoadImage's start image)


@pytest.fixture(scope="module")
def workflow():
    return json.loads(WORKFLOW.read_text())


def test_plugin_package_imports_without_the_host():
    """The package ComfyUI imports needs no ComfyUI to import (its node module is loaded by comfy_entrypoint)."""
    package = hostsetup.import_plugin_package()
    assert callable(package.comfy_entrypoint) and package.WEB_DIRECTORY == "./web"
    assert not hasattr(package, "NODE_CLASS_MAPPINGS")       # one node API: ComfyUI's versioned one


def test_workflow_core_nodes_exist_in_the_host(comfy, plugin, workflow):
    classes = comfy.NODE_CLASS_MAPPINGS
    missing = {n["type"] for n in workflow["nodes"]} - set(classes) - FRONTEND_ONLY
    assert missing == set()
    used = {n["type"] for n in workflow["nodes"] if n["type"].startswith("Carnator")}
    assert used == {"CarnatorCache", "CarnatorSampler"}
    expected = ["UNETLoader", "CLIPLoader", "CLIPTextEncode", "EmptyHunyuanLatentVideo", "CarnatorCache",
                "CarnatorSampler", "VAELoader", "VAEDecode", "SaveAnimatedWEBP"]
    assert set(expected) <= {n["type"] for n in workflow["nodes"]}
    assert [n for n in workflow["nodes"] if n["type"] == "CLIPLoader"][0]["widgets_values"][1] == "wan"
    # the optional step cache: ComfyUI's EasyCache between the model and the sampler, bypassed (mode 4) by default
    easy = [n for n in workflow["nodes"] if n["type"] == "EasyCache"]
    assert len(easy) == 1 and easy[0]["mode"] == 4
    links = {link[0]: link for link in workflow["links"]}
    sampler = [n for n in workflow["nodes"] if n["type"] == "CarnatorSampler"][0]
    assert links[sampler["inputs"][0]["link"]][1] == easy[0]["id"]
    assert [n["type"] for n in workflow["nodes"] if n["id"] == links[easy[0]["inputs"][0]["link"]][1]] == ["UNETLoader"]
    problems = check_workflow(workflow, classes, check_combos=lambda node_type, name: name not in MODEL_FILES)
    assert problems == []


def test_host_template_browser_lists_the_workflow(comfy, plugin):
    """ComfyUI 0.3.64 looks for example_workflows/, example/, examples/, workflow/ and workflows/ in each
    custom node: workflows/ is found, so no example_workflows/ mirror (it would list the workflow twice)."""
    aiohttp_web = pytest.importorskip("aiohttp.web")
    test_utils = pytest.importorskip("aiohttp.test_utils")
    import asyncio
    import os
    import folder_paths
    from app.custom_node_manager import CustomNodeManager
    _, install = plugin
    folder_paths.add_model_folder_path("custom_nodes", os.path.dirname(install))

    async def templates():
        app = aiohttp_web.Application()
        routes = aiohttp_web.RouteTableDef()
        CustomNodeManager().add_routes(routes, app, [(hostsetup.PLUGIN_DIR_NAME, install)])
        app.add_routes(routes)
        async with test_utils.TestClient(test_utils.TestServer(app)) as client:
            listing = await (await client.get("/workflow_templates")).json()
            served = await client.get(f"/api/workflow_templates/{hostsetup.PLUGIN_DIR_NAME}/carnator_wan21_t2v.json")
            return listing, served.status, await served.json(content_type=None)

    listing, status, served = asyncio.run(templates())
    assert sorted(listing.get(hostsetup.PLUGIN_DIR_NAME)) == [name[:-len(".json")] for name in WORKFLOWS]
    assert status == 200 and served == json.loads(WORKFLOW.read_text())


WORKFLOWS = sorted(path.name for path in (hostsetup.REPO / "workflows").glob("*.json"))


def test_one_workflow_per_backbone_and_a_staged_chain():
    assert WORKFLOWS == ["carnator_hunyuan_video_t2v.json", "carnator_ltxv_t2v.json",
                         "carnator_staged_chain_wan21.json", "carnator_wan21_4step_lora_t2v.json",
                         "carnator_wan21_t2v.json", "carnator_wan22_5b_t2v.json",
                         "carnator_wan22_a14b_4step_lora_t2v.json", "carnator_wan22_a14b_t2v.json",
                         "carnator_wan22_i2v_a14b.json"]


@pytest.mark.parametrize("name", WORKFLOWS)
def test_every_workflow_fits_the_host_and_our_nodes(comfy, plugin, name):
    shipped = json.loads((hostsetup.REPO / "workflows" / name).read_text())
    classes = comfy.NODE_CLASS_MAPPINGS
    assert {n["type"] for n in shipped["nodes"]} - set(classes) - FRONTEND_ONLY == set()
    assert check_workflow(shipped, classes, check_combos=lambda node_type, widget: widget not in MODEL_FILES) == []


@pytest.mark.parametrize("name", WORKFLOWS)
def test_every_workflow_resumes_as_the_nodes_do_by_default(comfy, plugin, name):
    """A shipped workflow's region_only widget holds the node's default: loading one must not turn it off."""
    from workflowcheck import widget_slots
    shipped = json.loads((hostsetup.REPO / "workflows" / name).read_text())
    ours = [n for n in shipped["nodes"] if n["type"] in ("CarnatorSampler", "CarnatorTrajectoryResume")]
    assert ours
    for node in ours:
        node_class = comfy.NODE_CLASS_MAPPINGS[node["type"]]
        slot = [s[0] for s in widget_slots(node_class)].index("region_only")
        default = node_class.INPUT_TYPES()["optional"]["region_only"][1]["default"]
        assert node["widgets_values"][slot] is default, (name, node["type"])


def test_image_to_video_workflow_feeds_the_start_image_through_wan_image_to_video(comfy, plugin):
    shipped = json.loads((hostsetup.REPO / "workflows" / "carnator_wan22_i2v_a14b.json").read_text())
    by_id = {n["id"]: n for n in shipped["nodes"]}
    links = {link[0]: link for link in shipped["links"]}

    def source(node, name):
        slot = next(i for i in node["inputs"] if i["name"] == name)
        link = links[slot["link"]]
        return by_id[link[1]]["type"], link[2]
    sampler = next(n for n in shipped["nodes"] if n["type"] == "CarnatorSampler")
    i2v = next(n for n in shipped["nodes"] if n["type"] == "WanImageToVideo")
    assert [source(sampler, name) for name in ("positive", "negative", "latent_image")] == [
        ("WanImageToVideo", 0), ("WanImageToVideo", 1), ("WanImageToVideo", 2)]
    assert source(i2v, "start_image") == ("LoadImage", 0) and source(i2v, "vae") == ("VAELoader", 0)
    assert source(sampler, "model")[0] == source(sampler, "low_noise_model")[0] == "ModelSamplingSD3"
