"""A second request in a fresh process, on the cache a host test filled (a ComfyUI restart).

argv: models_dir cache_dir request.pt custom_nodes_dir params_json. Prints one JSON line:
{"summary": <Carnator Sampler summary>, "calls": <real forward calls of the diffusion model>}.
"""
import json
import sys

import hostsetup


def main(models_dir, cache_dir, request_path, custom_nodes_dir, params_json):
    params = json.loads(params_json)
    path = hostsetup.comfyui_path()
    nodes = hostsetup.import_host(path)
    with hostsetup.host_nodes_module(path):
        hostsetup.load_plugin(nodes, custom_nodes_dir)
    import torch
    from comfy.patcher_extension import WrappersMP
    name = hostsetup.build_tiny_wan(models_dir)            # already there: registers the folder only
    model = nodes.NODE_CLASS_MAPPINGS["UNETLoader"]().load_unet(name, "default")[0].clone()
    calls = []

    def count(executor, *args, **kwargs):
        calls.append(1)
        return executor(*args, **kwargs)
    count.carnator_fingerprint = ""      # observes only, as conftest.CallCounter declares
    model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "carnator_test_counter", count)
    request = torch.load(request_path)
    cache = hostsetup.run_node(nodes.NODE_CLASS_MAPPINGS["CarnatorCache"], cache_dir, 1.0)[0]
    out = hostsetup.run_node(
        nodes.NODE_CLASS_MAPPINGS["CarnatorSampler"], model, cache, [[request["positive"], {}]], [[request["negative"], {}]], {"samples": request["samples"]},
        params["seed"], params["steps"], params["cfg"], "euler", "simple", params["probe_steps"], "balanced", True)
    print(json.dumps({"summary": json.loads(out.result[1]), "calls": len(calls)}))


if __name__ == "__main__":
    main(*sys.argv[1:6])
