"""Carnator with a compiled model: ComfyUI's TorchCompileModel and KJNodes' TorchCompileModelWanVideoV2 (its default,
transformer blocks only) in front of the Carnator Sampler, on the tiny Wan on the CPU.

One compilation serves every part of a request and every request: a sequence of requests mixing misses, nudged hits,
an exact repeat, region-only hits, a LoRA strength change and EasyCache on top compiles nothing that a compiled
KSampler does not compile for the same requests (torch's own compile-start callback counts every frame dynamo
compiles, and which of them were recompiles), and gives the results Carnator gives uncompiled (a miss: the compiled
KSampler's), to float tolerance.

The sequence runs with the backend "eager": what dynamo traces, guards and recompiles does not depend on the backend
that runs its graphs, and inductor's C++ compile of every graph would take minutes on two CPU cores. A shorter
sequence confirms it with inductor, the compile nodes' default. Compile options that cannot work (fullgraph, CUDA
graphs) are refused before any model call, and a recompile storm is a warning on the node.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter

import pytest
import torch

import hostsetup
from test_comfyui_host import CFG, SEED, STEPS, node, nudged, open_cache, sample, sampler_output, store_state
from test_model_options import easycache, lora
from test_peer_attention import kjnodes  # noqa: F401  (the fixture)

TOLERANCE = 1e-4    # of the latent's largest value: compiled and eager graphs round differently


@dataclasses.dataclass
class Compiles:
    """The compile ids dynamo started while a block ran ("frame/n": the frame's n-th compile; n > 0 a recompile)."""
    ids: list = dataclasses.field(default_factory=list)

    @property
    def recompiles(self) -> int:
        return sum(1 for i in self.ids if int(i.split("/")[-1].split("_")[0]) > 0)


@contextlib.contextmanager
def counting():
    from torch._dynamo import callback_handler
    compiles = Compiles()

    def started(args):
        compiles.ids.append(str(args.compile_id))
    callback_handler.register_start_callback(started)
    try:
        yield compiles
    finally:
        callback_handler.remove_start_callback(started)


def compiled_by(comfy, kjnodes, how: str, model, backend: str):  # noqa: F811
    if how == "TorchCompileModel":
        if backend == "inductor":       # the node itself (its backend input offers inductor and cudagraphs)
            return hostsetup.run_node(comfy.NODE_CLASS_MAPPINGS["TorchCompileModel"], model, backend).result[0]
        from comfy_api.torch_helpers import set_torch_compile_wrapper   # what the node runs, with another backend
        model = model.clone()
        set_torch_compile_wrapper(model, backend=backend)
        return model
    return kjnodes.TorchCompileModelWanVideoV2().patch(model, backend, False, "default", False, 64, True)[0]


def region_hit(comfy, model, cache, positive, negative, latent, rows):
    """A nudged request resumed region-only, its target forced to the top `rows` latent rows of each frame (random
    weights mark the whole clip): the staged path the Carnator Sampler runs, with the target set between the gate and
    the resume."""
    import comfy.sample
    from carnator_engine import pipeline
    from carnator_engine.hosts.comfyui import ComfyRunner
    runner = ComfyRunner(model, positive, negative, CFG, "euler", "simple", steps=STEPS, seed=SEED)
    config = pipeline.CarnatorConfig(probe_steps=2, block_size=64, region_only=True, region_max_share=1.0)
    noise = comfy.sample.prepare_noise(latent["samples"], SEED)
    probed = pipeline.probe(runner, noise, runner.sigmas, config)
    decision = pipeline.decide(probed, pipeline.lookup(cache, probed, config), config)
    assert decision.reuse, decision.reasons
    target = torch.zeros(tuple(latent["samples"].shape[-3:]), dtype=torch.bool)
    target[:, :rows] = True
    decision = dataclasses.replace(decision, target_cells=target, cell_map=None)   # the forced target alone
    result = pipeline.resume(runner, probed, decision, cache, config)
    cache.writer.settle()
    return {"samples": runner.to_latent_format(result.latent)}, result.summary()


def requests(comfy, model, p1, p2):
    """(name, model, positive, region-only target rows or 0) of the sequence: each a request a creator sends."""
    with_lora = lora(model, 0.5)
    return [("miss", model, p1, 0), ("nudged hit", model, nudged(p1), 0), ("exact repeat", model, p1, 0),
            ("region-only hit", model, nudged(p1, 1.002), 4),
            ("LoRA at 0.5: miss", with_lora, p1, 0), ("LoRA at 0.5: nudged hit", with_lora, nudged(p1), 0),
            ("LoRA at 1.0: miss", lora(model, 1.0), p1, 0),
            ("another prompt: miss", model, p2, 0), ("its region-only hit, another size", model, nudged(p2), 6),
            ("EasyCache: miss", easycache(comfy, model), p1, 0),
            ("EasyCache: nudged hit", easycache(comfy, model), nudged(p1, 1.003), 0)]


def ksampler(comfy, model, positive, negative, latent):
    return node(comfy, "KSampler").sample(model, SEED, STEPS, CFG, "euler", "simple", positive, negative,
                                          latent)[0]["samples"]


def carnator(comfy, model, cache, positive, negative, latent, rows):
    if rows:
        return region_hit(comfy, model, cache, positive, negative, latent, rows)
    return sample(comfy, model, cache, positive, negative, latent)


def close(a, b) -> bool:
    return (a - b).abs().max().item() <= TOLERANCE * max(1.0, b.abs().max().item())


def run_sequence(comfy, kjnodes, how, backend, tiny_model, conds, latent, tmp_path, sequence):  # noqa: F811
    """{name: (latent, summary, Compiles)} of Carnator's requests on a freshly compiled model, and of KSampler's on
    another ({name: (latent, Compiles)}), and of Carnator's uncompiled; dynamo's caches emptied before each."""
    positive, negative = conds
    other = hostsetup.conditioning(3)
    out = {}
    for kind in ("ksampler", "carnator", "carnator uncompiled"):
        torch._dynamo.reset()
        model = tiny_model if kind == "carnator uncompiled" else compiled_by(comfy, kjnodes, how, tiny_model, backend)
        cache = open_cache(comfy, tmp_path / kind)
        out[kind] = {}
        for name, m, p, rows in sequence(comfy, model, positive, other):
            with counting() as compiles:
                if kind == "ksampler":
                    result, summary = {"samples": ksampler(comfy, m, p, negative, latent)}, None
                else:
                    result, summary = carnator(comfy, m, cache, p, negative, latent, rows)
            out[kind][name] = (result["samples"], summary, compiles)
    torch._dynamo.reset()
    return out


def short(comfy, model, p1, p2):
    return [("miss", model, p1, 0), ("nudged hit", model, nudged(p1), 0), ("region-only hit", model, nudged(p1), 4),
            ("another prompt: miss", model, p2, 0), ("its region-only hit, another size", model, nudged(p2), 6)]


def check(out, static_shapes=False):
    """Carnator's results equal its uncompiled results (a miss: the compiled KSampler's), and it compiles what a
    compiled KSampler compiles: no more recompiles in the first request, nothing more in any later one but the
    region-only graphs at the first region-only hit (the blocks then see fewer tokens: each graph of the first request
    recompiled at most once, for any token count, as a later region-only hit of another size shows). With
    `static_shapes` (a compile node's dynamic=False) region-only hits resume whole-clip, saying why, and compile
    nothing. Returns Carnator's summaries by request."""
    plain, compiled, eager = out["ksampler"], out["carnator"], out["carnator uncompiled"]
    names = list(plain)
    for name in names:
        ours, theirs = compiled[name][2], plain[name][2]
        print(f"{name:36s} compiles (recompiles): KSampler {len(theirs.ids):3d} ({theirs.recompiles:3d})"
              f"  Carnator {len(ours.ids):3d} ({ours.recompiles:3d})")
    regions = [n for n in names if "region-only" in n]
    for name in names:
        latent, summary, compiles = compiled[name]
        eager_latent, eager_summary, _ = eager[name]
        assert (summary["reuse"], summary["exact_repeat"]) == (eager_summary["reuse"], eager_summary["exact_repeat"])
        if name in regions:
            assert summary["numbers"]["region_only"] is not static_shapes, summary["reasons"]
            assert eager_summary["numbers"]["region_only"]
            assert not static_shapes or "compiled with static shapes" in summary["reasons"][-1]
        if not (static_shapes and name in regions):     # else whole-clip against region-only uncompiled
            assert close(latent, eager_latent), name
        if not summary["reuse"]:
            assert close(latent, plain[name][0]), name        # a miss is the compiled KSampler's result
        storm = [w for w in summary["warnings"] if "torch.compile" in w]
        assert not storm or plain[name][2].recompiles, (name, storm)     # only where KSampler recompiles too
    first = names[0]
    assert compiled[first][2].recompiles <= plain[first][2].recompiles
    for name in names[1:]:
        if name != regions[0] or static_shapes:
            assert len(compiled[name][2].ids) <= len(plain[name][2].ids), (name, compiled[name][2].ids)
    region_compiles = compiled[regions[0]][2]
    assert region_compiles.recompiles == len(region_compiles.ids) and not compiled[regions[1]][2].ids
    # each graph the first request compiled (a frame compiles one per guard variant: a block's parameters that
    # differ in requires_grad are another) recompiled at most once, for any token count
    graphs, recompiled = (Counter(compile_id.split("/")[0] for compile_id in compiles.ids)
                          for compiles in (compiled[first][2], region_compiles))
    assert all(count <= graphs[frame] for frame, count in recompiled.items()), (region_compiles.ids, graphs)
    return {name: summary for name, (_, summary, _) in compiled.items()}


@pytest.mark.parametrize("how", ["TorchCompileModel", "TorchCompileModelWanVideoV2"])
def test_one_compilation_serves_every_request(comfy, plugin, kjnodes, tiny_model, conds, latent, tmp_path,  # noqa: F811
                                              how):
    out = run_sequence(comfy, kjnodes, how, "eager", tiny_model, conds, latent, tmp_path, requests)
    summaries = check(out, static_shapes=how == "TorchCompileModelWanVideoV2")      # KJNodes' default dynamic=False
    assert [name for name, s in summaries.items() if s["exact_repeat"]] == ["exact repeat"]
    assert all(summaries[name]["reuse"] for name in ("nudged hit", "LoRA at 0.5: nudged hit", "EasyCache: nudged hit"))
    if how == "TorchCompileModel":   # EasyCache inside the compiled model recompiles it at every step (KSampler too:
        # its list of change rates grows), up to torch's limit: the node says so
        assert any("hit its recompile limit" in w for w in summaries["EasyCache: nudged hit"]["warnings"])


def test_inductor_compiles_once_too(comfy, plugin, kjnodes, tiny_model, conds, latent, tmp_path):  # noqa: F811
    # inductor's C++ headers stay in the run's temporary folder (tests/run_temp.py): later compiles of this process
    # need them
    check(run_sequence(comfy, kjnodes, "TorchCompileModel", "inductor", tiny_model, conds, latent, tmp_path, short))


@pytest.fixture(autouse=True)
def _dynamo_settings():
    """KJNodes' compile nodes set dynamo's recompile limit for the whole process (64): back to what it was."""
    config = torch._dynamo.config
    kept = config.recompile_limit, config.force_parameter_static_shapes
    yield
    config.recompile_limit, config.force_parameter_static_shapes = kept


def test_compile_options_carnator_cannot_honour_are_refused_naming_the_input(  # noqa: F811
        comfy, plugin, kjnodes, tiny_model, conds, latent, tmp_path):
    """fullgraph (Carnator's hooks are graph breaks) and CUDA graphs (a replay reuses the memory of tensors Carnator
    keeps) are refused before any model call, as is the deprecated whole-model copy; nothing is stored."""
    from conftest import CallCounter
    positive, negative = conds
    counter = CallCounter(tiny_model)
    patch = kjnodes.TorchCompileModelWanVideoV2().patch
    refused = {
        r"compiled with fullgraph=True .*Set fullgraph to false": patch(counter.model, "inductor", True, "default",
                                                                         False, 64, True)[0],
        r"compiled with mode reduce-overhead, which captures CUDA graphs.*max-autotune-no-cudagraphs":
            patch(counter.model, "inductor", False, "reduce-overhead", False, 64, True)[0],
        r"compiled with mode max-autotune, which captures CUDA graphs": patch(counter.model, "inductor", False,
                                                                              "max-autotune", False, 64, True)[0],
        r"compiled with backend cudagraphs": hostsetup.run_node(comfy.NODE_CLASS_MAPPINGS["TorchCompileModel"],
                                                                counter.model, "cudagraphs").result[0],
        r"replaced by a compiled copy \(KJNodes' deprecated TorchCompileModelWanVideo.*TorchCompileModelWanVideoV2":
            kjnodes.TorchCompileModelWanVideo().patch(counter.model, "inductor", False, "default", False, 64,
                                                      False)[0],
    }
    cache = open_cache(comfy, tmp_path / "cache")
    before = store_state(cache)
    for message, model in refused.items():
        with pytest.raises(ValueError, match=r"input 'model': Carnator: .*" + message):
            sample(comfy, model, cache, positive, negative, latent)
        with pytest.raises(ValueError, match=r"input 'low_noise_model': Carnator: .*" + message):
            sample(comfy, tiny_model, cache, positive, negative, latent, low_noise_model=model, switch_step=5)
    assert counter.take() == 0 and store_state(cache) == before
    torch._dynamo.reset()


def storming(model):
    """A compiled model with an option dynamo recompiles at every forward: a wrapper reading a list that grows (as
    EasyCache's list of change rates does), declared an observer so that it is not part of Carnator's key."""
    from comfy.patcher_extension import WrappersMP
    seen = []

    def grows(executor, *args, **kwargs):
        seen.append(0)
        return executor(*args, **kwargs) * (1.0 + 0.0 * len(seen))
    grows.carnator_fingerprint = ""
    model = model.clone()
    model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "test_grows", grows)
    return model


@pytest.mark.parametrize("limit", [8, 64])
def test_a_recompile_storm_is_a_warning_on_the_node(comfy, plugin, kjnodes, tiny_model, conds, latent,  # noqa: F811
                                                    tmp_path, limit):
    """torch's default limit (8) is hit within the first request (10 forwards): said then, and in the next request
    (those parts now run uncompiled); under KJNodes' limit (64) the next request compiles again: said so."""
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = limit
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    model = compiled_by(comfy, kjnodes, "TorchCompileModel", storming(tiny_model), "eager")
    first = hostsetup.shown_text(sampler_output(comfy, model, cache, positive, negative, latent))
    again = hostsetup.shown_text(sampler_output(comfy, model, cache, nudged(positive), negative, latent))
    if limit == 8:
        assert "torch.compile hit its recompile limit (8) during this request" in first
        assert "torch.compile stopped compiling parts of this model at its recompile limit earlier" in again
    else:
        assert "torch.compile" not in first
        assert "torch.compile compiled parts of the model again" in again
    # the same requests on the model without it: no warning
    torch._dynamo.reset()
    calm = compiled_by(comfy, kjnodes, "TorchCompileModel", tiny_model, "eager")
    calm_cache = open_cache(comfy, tmp_path / "calm")
    for request in (positive, nudged(positive)):
        assert "torch.compile" not in hostsetup.shown_text(sampler_output(comfy, calm, calm_cache, request, negative,
                                                                          latent))
    torch._dynamo.reset()
