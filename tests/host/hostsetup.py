"""The real ComfyUI host for Carnator's host tests: import it on the CPU, build a tiny Wan 2.1 model with
ComfyUI's own WanModel class, and load this repository the way ComfyUI loads a custom node.

Used by conftest.py and by restart_request.py (a second process on the same cache). Only host tests
import this module, so host-free tests never import comfy.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_COMFYUI = "/opt/ComfyUI"
PLUGIN_DIR_NAME = "comfyui-carnator"
TINY_WAN = "carnator_test_tiny_wan21_t2v.safetensors"
TINY_WAN22_HIGH, TINY_WAN22_LOW = "carnator_test_wan22_high.safetensors", "carnator_test_wan22_low.safetensors"
TINY_WAN22_5B = "carnator_test_wan22_5b.safetensors"

_host: dict = {}

if str(REPO) not in sys.path:
    sys.path.append(str(REPO))   # carnator_engine, as the plugin's root __init__ makes it importable


def comfyui_path() -> str:
    return os.path.abspath(os.environ.get("COMFYUI_PATH", DEFAULT_COMFYUI))


def host_present(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "comfy", "model_patcher.py")) and \
        os.path.isfile(os.path.join(path, "nodes.py"))


def _is_host_nodes(module, path: str) -> bool:
    return os.path.abspath(getattr(module, "__file__", "") or "") == os.path.join(path, "nodes.py")


@contextlib.contextmanager
def host_nodes_module(path: str):
    """While active, `import nodes` is ComfyUI's nodes.py, even if this repo's `nodes` package was imported
    as a top-level package by a host-free test of the same session; the previous modules come back after."""
    stashed = {name: module for name, module in sys.modules.items()
               if (name == "nodes" or name.startswith("nodes.")) and not _is_host_nodes(module, path)}
    for name in stashed:
        del sys.modules[name]
    if "nodes" in _host:
        sys.modules["nodes"] = _host["nodes"]
    try:
        yield
    finally:
        if stashed:
            for name in [n for n in sys.modules if n == "nodes" or n.startswith("nodes.")]:
                del sys.modules[name]
            sys.modules.update(stashed)


def import_host(path: str):
    """Imports ComfyUI from `path`, forced onto the CPU, with its extra nodes; returns its `nodes` module."""
    if "nodes" in _host:
        return _host["nodes"]
    if path not in sys.path:
        sys.path.insert(0, path)
    argv = sys.argv
    sys.argv = [argv[0] if argv else "carnator-tests", "--cpu"]
    try:
        import comfy.options
        comfy.options.enable_args_parsing()
        import comfy.cli_args  # noqa: F401  (parses --cpu here, not pytest's arguments)
    finally:
        sys.argv = argv
    import torch
    torch.set_num_threads(min(2, torch.get_num_threads()))
    import utils.extra_config  # noqa: F401  (as main.py does, before comfy puts comfy/ on sys.path)
    with host_nodes_module(path):
        import nodes
        _host["nodes"] = nodes
        asyncio.run(nodes.init_builtin_extra_nodes())
    return nodes


TINY_WAN21_I2V = "carnator_test_wan21_i2v.safetensors"
TINY_WAN22_I2V_HIGH, TINY_WAN22_I2V_LOW = "carnator_test_wan22_i2v_high.safetensors", "carnator_test_wan22_i2v_low.safetensors"


def build_tiny_wan(directory: str, seed: int = 0, name: str = TINY_WAN, layers: int = 2, channels: int = 16,
                   image_to_video: str = "") -> str:
    """A dim-256 Wan 2.1 T2V model (2 blocks unless told) with random weights, saved where UNETLoader finds it
    (Wan 2.2 A14B's experts are this class too: two of them, other seeds, are a tiny two-expert pair). With
    48 latent channels in and out, ComfyUI's model detection loads it as Wan 2.2 TI2V 5B (WAN22_T2V).
    image_to_video "wan21": 36 input channels (latent, image latent, mask) and the CLIP vision projection, as
    Wan 2.1 I2V (WAN21_I2V); "wan22": 36 input channels without it, as Wan 2.2 I2V A14B's experts."""
    import safetensors.torch
    import folder_paths
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        weights = tiny_wan_state_dict(seed, layers, channels, image_to_video)
        safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()}, path)
    folder_paths.add_model_folder_path("diffusion_models", directory)
    return name


def tiny_wan_state_dict(seed: int = 0, layers: int = 2, channels: int = 16, image_to_video: str = "") -> dict:
    """The weights of build_tiny_wan's model (ComfyUI's WanModel, random, with unit norms)."""
    import torch
    import comfy.ops
    from comfy.ldm.wan.model import WanModel
    generator = torch.Generator().manual_seed(seed)
    model = WanModel(model_type="i2v" if image_to_video == "wan21" else "t2v", patch_size=(1, 2, 2),
                     in_dim=channels + 20 if image_to_video else channels, dim=256, ffn_dim=512,
                     freq_dim=256, text_dim=4096, out_dim=channels, num_heads=2, num_layers=layers,
                     operations=comfy.ops.disable_weight_init)
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if key.endswith(("norm_q.weight", "norm_k.weight", "norm3.weight")):
                parameter.fill_(1.0)
            elif key.endswith("norm3.bias"):
                parameter.zero_()
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.state_dict()


def build_tiny_wan_gguf(directory: str, qtype: str, seed: int = 0) -> str:
    """build_tiny_wan's model (same seed, same weights before quantization) as a GGUF file of `qtype` (Q8_0, or the
    K-quant Q6_K) where ComfyUI-GGUF's Unet Loader (GGUF) finds it (the diffusion_models folder)."""
    import folder_paths
    from tiny_gguf import write_wan_gguf
    os.makedirs(directory, exist_ok=True)
    name = f"carnator_test_tiny_wan21_{qtype}.gguf"
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        write_wan_gguf(path, tiny_wan_state_dict(seed), qtype)
    folder_paths.add_model_folder_path("diffusion_models", directory)
    return name


PEERS = Path(os.environ.get("CARNATOR_PEERS", REPO.parent / "shared" / "peers"))


def peer_missing(name: str) -> str:
    """Why the peer node pack `name` (ComfyUI-GGUF, ComfyUI-KJNodes) cannot be installed here ("" when it can)."""
    if not (PEERS / name / "__init__.py").is_file():
        return f"no {name} at {PEERS / name} (set CARNATOR_PEERS to the folder holding the peer node packs)"
    return ""


def install_peer(nodes, custom_nodes_dir: str, name: str):
    """Copies the peer node pack `name` into custom_nodes (the shared copy is read-only) and loads it with ComfyUI's
    own custom-node loader, as a user's install would be; returns its module."""
    return install_pack(nodes, PEERS / name, os.path.join(custom_nodes_dir, name))


def install_pack(nodes, source, target: str):
    """Copies the node pack folder `source` to `target` (a folder in a custom_nodes) and loads it from there with
    ComfyUI's own custom-node loader, as a user's install would be; returns its module."""
    import shutil
    if not os.path.isdir(target):
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"))
        os.chmod(target, 0o755)
    module_name = target.replace(".", "_x_")
    if module_name not in sys.modules:
        if not asyncio.run(nodes.load_custom_node(target, ignore=set(), module_parent="custom_nodes")):
            raise RuntimeError(f"ComfyUI's loader refused the node pack at {target}: see the log above")
    return sys.modules[module_name]


TINY_LORAS = ("carnator_test_wan_4step_lora.safetensors", "carnator_test_wan22_high_4step_lora.safetensors",
              "carnator_test_wan22_low_4step_lora.safetensors")


def build_tiny_lora(directory: str, name: str = TINY_LORAS[0], seed: int = 21, rank: int = 4) -> str:
    """A rank-4 LoRA for the tiny Wan (dim 256) on every block's self-attention q and v, in the lora_up/lora_down
    layout step-distillation LoRAs ship in, saved where LoraLoaderModelOnly finds it (the loras folder)."""
    import safetensors.torch
    import torch
    import folder_paths
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        generator = torch.Generator().manual_seed(seed)
        tensors = {}
        for block in range(2):
            for part in ("q", "v"):
                key = f"diffusion_model.blocks.{block}.self_attn.{part}"
                tensors[f"{key}.lora_up.weight"] = torch.randn(256, rank, generator=generator) * 0.05
                tensors[f"{key}.lora_down.weight"] = torch.randn(rank, 256, generator=generator) * 0.05
        safetensors.torch.save_file(tensors, path)
    folder_paths.add_model_folder_path("loras", directory)
    return name


TINY_LTXV = "carnator_test_tiny_ltxv.safetensors"


def build_tiny_ltxv(directory: str, seed: int = 0) -> str:
    """A 2-block LTX-Video model (inner dim 64, 128 latent channels) with random weights; its shape travels in
    the safetensors metadata, which ComfyUI's model detection reads."""
    import json
    import safetensors.torch
    import torch
    import comfy.ops
    import folder_paths
    from comfy.ldm.lightricks.model import LTXVModel
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, TINY_LTXV)
    if not os.path.exists(path):
        config = dict(in_channels=128, cross_attention_dim=64, attention_head_dim=32, num_attention_heads=2,
                      caption_channels=4096, num_layers=2)
        model = LTXVModel(**config, operations=comfy.ops.disable_weight_init)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    parameter.fill_(1.0)
                else:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
        safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path,
                                    metadata={"config": json.dumps({"transformer": config})})
    folder_paths.add_model_folder_path("diffusion_models", directory)
    return TINY_LTXV


TINY_HUNYUAN = "carnator_test_tiny_hunyuan_video.safetensors"
HUNYUAN_TEXT = (32, 4096)       # tokens, width of the llama text encoder's hidden states (tiny: few tokens)


def build_tiny_hunyuan(directory: str, seed: int = 0, in_channels: int = 16, name: str = TINY_HUNYUAN) -> str:
    """A HunyuanVideo (ComfyUI's own class) with one double-stream and one single-stream block, hidden size 256
    (2 heads of 128, as detection assumes), CLIP-pooled vector and guidance inputs, random weights. in_channels 33
    or 32 give the I2V and SkyReels I2V variants."""
    import safetensors.torch
    import torch
    import comfy.ops
    import folder_paths
    from comfy.ldm.hunyuan_video.model import HunyuanVideo
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        model = HunyuanVideo(image_model="hunyuan_video", in_channels=in_channels, out_channels=16, vec_in_dim=768,
                             context_in_dim=HUNYUAN_TEXT[1], hidden_size=256, mlp_ratio=4.0, num_heads=2, depth=1,
                             depth_single_blocks=1, axes_dim=[16, 56, 56], theta=256, patch_size=[1, 2, 2],
                             qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False,
                             operations=comfy.ops.disable_weight_init)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for key, parameter in model.named_parameters():
                if "norm" in key and key.endswith(("weight", "scale")):
                    parameter.fill_(1.0)
                else:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
        safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    folder_paths.add_model_folder_path("diffusion_models", directory)
    return name


def hunyuan_conditioning(seed: int, scale: float = 1.0, padded: int = 0):
    """CONDITIONING as ComfyUI's HunyuanVideo text encoders shape it: llama hidden states [1, tokens, 4096] with
    the CLIP-L pooled output [1, 768]; `padded` trailing tokens are masked out (attention_mask), as the encoder
    does when a batch pads a prompt."""
    import torch
    generator = torch.Generator().manual_seed(seed)
    tokens, width = HUNYUAN_TEXT
    options = {"pooled_output": torch.randn(1, 768, generator=generator)}
    if padded:
        mask = torch.ones(1, tokens, dtype=torch.long)
        mask[:, tokens - padded:] = 0
        options["attention_mask"] = mask
    return [[torch.randn(1, tokens, width, generator=generator) * scale, options]]


def load_plugin(nodes, custom_nodes_dir: str):
    """Loads this repository with ComfyUI's own custom-node loader, from a folder named like an install."""
    os.makedirs(custom_nodes_dir, exist_ok=True)
    link = os.path.join(custom_nodes_dir, PLUGIN_DIR_NAME)
    if not os.path.exists(link):
        os.symlink(REPO, link, target_is_directory=True)
    if not asyncio.run(nodes.load_custom_node(link, ignore=set(), module_parent="custom_nodes")):
        raise RuntimeError(f"ComfyUI's loader refused the plugin at {link}: see the log above")
    return sys.modules[link.replace(".", "_x_")], link


def run_node(node_class, *args, unique_id=None, prompt=None, **inputs):
    """Runs a V3 node as ComfyUI's executor does: on a clone of its class holding the hidden inputs, with every input
    by name (positional `args` follow the schema's input order). Returns the node's io.NodeOutput."""
    from comfy_api.latest import io
    names = [i.id for i in node_class.define_schema().inputs]
    if len(args) > len(names):
        raise TypeError(f"{node_class.__name__} takes {len(names)} inputs, got {len(args)}")
    hidden = {io.Hidden.unique_id: unique_id, io.Hidden.prompt: prompt}
    return node_class.PREPARE_CLASS_CLONE(hidden).EXECUTE_NORMALIZED(**dict(zip(names, args)), **inputs)


def shown_text(output) -> str:
    """The text a node shows on itself in the web UI (its ui output's "text")."""
    return output.ui.as_dict()["text"][0]


def conditioning(seed: int, scale: float = 1.0):
    """CONDITIONING as Wan's umT5 text encoder shapes it: [[tensor [1, 512, 4096], {}]]."""
    import torch
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, 512, 4096, generator=generator) * scale, {}]]


def empty_video_latent(nodes, width: int = 128, height: int = 128, length: int = 17) -> dict:
    """EmptyHunyuanLatentVideo, the core node Wan 2.1 workflows use: [1, 16, (length-1)//4+1, h/8, w/8]."""
    node = nodes.NODE_CLASS_MAPPINGS["EmptyHunyuanLatentVideo"]
    if hasattr(node, "generate"):
        return node().generate(width, height, length, 1)[0]
    import torch  # a later ComfyUI where the node moved to the V3 API
    return {"samples": torch.zeros(1, 16, (length - 1) // 4 + 1, height // 8, width // 8)}


def import_plugin_package(name: str = "carnator_plugin_under_test"):
    """This repository imported as a package from its root __init__.py, as ComfyUI's loader does, without
    ComfyUI: the import must not need the host."""
    import importlib.util
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "__init__.py", submodule_search_locations=[str(REPO)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


FIXTURE_NODES = REPO / "tests" / "host" / "fixture_nodes" / "carnator_e2e_fixture"
WRAPPER_PACK = REPO / "tests" / "host" / "fixture_nodes" / "carnator_wrapper_pack"


def fixture_module():
    """The test fixture node pack (E2ETextConditioning, E2EPixelVAE, ...) imported in this process."""
    import importlib.util
    name = "carnator_e2e_fixture_in_process"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, FIXTURE_NODES / "__init__.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def start_image(kind: str, size: int = 128):
    """IMAGE [1, size, size, 3] in [0, 1]: "sunset" (a warm vertical gradient with a disc) or "forest" (a green
    horizontal gradient with stripes): two start images an image-to-video request could begin from."""
    import torch
    ramp = torch.linspace(0.0, 1.0, size)
    y, x = torch.meshgrid(ramp, ramp, indexing="ij")
    if kind == "sunset":
        disc = (((x - 0.5) ** 2 + (y - 0.6) ** 2) < 0.04).float()
        image = torch.stack([0.6 + 0.4 * y, 0.3 * y + 0.5 * disc, 0.2 * (1 - y)], dim=-1)
    else:
        stripes = (torch.sin(x * 25.0) > 0).float()
        image = torch.stack([0.1 * x, 0.4 + 0.4 * x * stripes, 0.2 + 0.1 * stripes], dim=-1)
    return image.clamp(0, 1).unsqueeze(0)


def load_kjnodes_model_patches(custom_nodes_dir: str):
    """KJNodes' model-patch nodes (its model_optimization_nodes.py: Patch Sage Attention KJ, GGUF Loader KJ,
    WanVideo TeaCache, the compile nodes), from a copy of the pack in custom_nodes, imported as a module: the pack's
    own __init__ also imports its image nodes, which need opencv and others that the model patches do not."""
    import importlib.util
    import shutil
    target = os.path.join(custom_nodes_dir, "ComfyUI-KJNodes")
    if not os.path.isdir(target):
        shutil.copytree(PEERS / "ComfyUI-KJNodes", target, ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"))
    name = "carnator_test_kjnodes_model_optimization"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(target, "nodes", "model_optimization_nodes.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
