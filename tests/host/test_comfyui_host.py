"""Carnator inside the real ComfyUI host: the runner's hooks, the reuse pipeline through the node classes,
a restart, LoRA-style patches, composition with other patches, and input errors.

A tiny random Wan 2.1 T2V model (ComfyUI's own WanModel, loaded by the UNETLoader node) on the CPU.
Model calls are counted by a DIFFUSION_MODEL wrapper: real forwards, not the engine's own count.
The engine's default gate thresholds are used throughout (no overrides needed on this model).
"""
from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import hostsetup
from conftest import CallCounter
from test_store_marker import folder_state, foreign_wal_database

STEPS, PROBE, CFG, SEED = 10, 2, 5.0, 42
HERE = Path(__file__).resolve().parent


def node(comfy, name):
    """The host's node `name`: a V3 node (Carnator's) to call with its inputs, as ComfyUI's executor runs it, or an
    instance of a V1 core node."""
    cls = comfy.NODE_CLASS_MAPPINGS[name]
    return functools.partial(hostsetup.run_node, cls) if hasattr(cls, "define_schema") else cls()


def open_cache(comfy, directory, size_gb=1.0):
    return node(comfy, "CarnatorCache")(str(directory), size_gb)[0]


def sampler_output(comfy, model, cache, positive, negative, latent, seed=SEED, steps=STEPS, probe_steps=PROBE,
                   risk="balanced", sparse_attention=True, cfg=CFG, sampler_name="euler", unique_id="7", prompt=None,
                   attention_density=1.0, region_only=False, **experts):
    """The Carnator Sampler node's whole output: (latent, decision JSON) and the text it shows on itself."""
    out = node(comfy, "CarnatorSampler")(model, cache, positive, negative, latent, seed, steps, cfg, sampler_name,
                                         "simple", probe_steps, risk, sparse_attention, attention_density,
                                         region_only=region_only, unique_id=unique_id, prompt=prompt, **experts)
    cache.writer.settle()   # the tests read the store directly; the next request and the routes wait by themselves
    return out


def sample(comfy, *args, **kwargs):
    """(latent, decision) of a Carnator Sampler run whose shown verdict agrees with its decision."""
    out = sampler_output(comfy, *args, **kwargs)
    latent_out, summary_json = out.result
    summary = json.loads(summary_json)
    verdict = "REPEAT" if summary["exact_repeat"] else "HIT" if summary["reuse"] else "MISS"
    assert hostsetup.shown_text(out).startswith("Carnator " + verdict)
    return latent_out, summary


def nudged(conditioning, scale=1.001):
    """The same conditioning a hair off (a creator's one-word edit, at its smallest): a new request, so a reuse
    goes through the probe and the gate rather than replaying an exact repeat."""
    return [[tensor * scale, dict(options)] for tensor, options in conditioning]


def store_state(store):
    store.writer.settle()   # what it holds once the generations queued for it are written
    return sorted((r.entry_id, r.hits, r.sig_sha256, r.blob_sha256) for r in store.records(include_corrupt=True))


# ---- the runner against the host's own sampling ------------------------------------------------

class RecordingObserver:
    """Wraps a GenerationObserver and counts what the hooks report."""

    def __init__(self):
        from carnator_engine.observer import GenerationObserver
        self.inner = GenerationObserver()
        self.steps, self.blocks, self.attention, self.ends = [], set(), 0, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def begin_step(self, step, x):
        self.steps.append(step)
        self.inner.begin_step(step, x)

    def block_output(self, index, hidden):
        self.blocks.add((self.inner.step, index, tuple(hidden.shape)))

    def self_attention(self, index, q, k, v, dense, video_tokens=None, host_sdpa=False):
        assert video_tokens is None                          # Wan attends over the video tokens alone
        self.attention += 1
        assert q.dim() == 4 and q.shape[2] == 320          # [B, heads, L, D], L = 5*8*8 video tokens
        return dense(q, k, v)

    def step_end(self, step, x_next, denoised):
        self.ends.append(step)
        self.inner.step_end(step, x_next, denoised)


def test_runner_reproduces_host_sampling_and_reports_every_step(comfy, plugin, tiny_model, conds, latent):
    import comfy.sample
    from carnator_engine.hosts.comfyui import ComfyRunner
    positive, negative = conds
    samples = latent["samples"]
    noise = comfy.sample.prepare_noise(samples, SEED)
    reference = comfy.sample.sample(tiny_model, noise, STEPS, CFG, "euler", "simple", positive, negative, samples,
                                    disable_pbar=True, seed=SEED)
    runner = ComfyRunner(tiny_model, positive, negative, CFG, "euler", "simple", steps=STEPS, seed=SEED)
    observer = RecordingObserver()
    full = runner.run(noise * float(runner.sigmas[0]), runner.sigmas, 0, STEPS, observer)
    assert torch.allclose(runner.to_latent_format(full), reference, atol=1e-4)
    assert observer.steps == list(range(STEPS)) and observer.ends == list(range(STEPS))
    assert {(s, i) for s, i, _ in observer.blocks} == {(s, i) for s in range(STEPS) for i in range(2)}
    assert {shape for _, _, shape in observer.blocks} == {(2, 320, 256)}   # cond + uncond batched
    assert observer.attention == STEPS * 2                                  # self-attention only, per block

    first = runner.run(noise, runner.sigmas, 0, PROBE, RecordingObserver())
    rest = runner.run(first, runner.sigmas, PROBE, STEPS, RecordingObserver())
    assert torch.allclose(runner.to_latent_format(rest), reference, atol=1e-3)
    assert "block_index" not in tiny_model.model_options["transformer_options"]
    assert "optimized_attention_override" not in tiny_model.model_options["transformer_options"]


@pytest.mark.parametrize("sampler_name", ["heun", "dpmpp_2m", "euler_ancestral", "uni_pc"])
def test_other_samplers_report_the_samplers_own_states(comfy, plugin, tiny_model, conds, latent, sampler_name):
    """Predictor samplers (heun evaluates at the next sigma), multistep ones, ancestral noise, and uni_pc (its
    schedule drops the penultimate sigma, as KSampler's does): steps, checkpoints and output match the host."""
    import comfy.sample
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.observer import CheckpointRecorder
    positive, negative = conds
    samples, steps = latent["samples"], 6
    noise = comfy.sample.prepare_noise(samples, SEED)
    seen = {}
    reference = comfy.sample.sample(tiny_model, noise, steps, CFG, sampler_name, "simple", positive, negative, samples,
                                    callback=lambda i, x0, x, total: seen.setdefault(i, x.clone()),
                                    disable_pbar=True, seed=SEED)
    runner = ComfyRunner(tiny_model, positive, negative, CFG, sampler_name, "simple", steps=steps, seed=SEED)
    schedule = runner.sigmas.clone()
    observer = RecordingObserver()
    observer.inner.checkpoints = CheckpointRecorder(frozenset(range(steps)))
    full = runner.run(noise * float(runner.sigmas[0]), runner.sigmas, 0, steps, observer)
    assert torch.equal(runner.sigmas, schedule)           # uni_pc writes into the sigmas it is handed
    assert torch.allclose(runner.to_latent_format(full), reference, atol=1e-4)
    assert observer.steps == list(range(steps)) and observer.ends == list(range(steps))
    for step, x in seen.items():
        assert torch.allclose(observer.inner.checkpoints.latents[step].float(), x, atol=1e-2), step


# One sampler of each kind the node offers (every one of KSampler.SAMPLERS was checked so, in about ten minutes
# on two CPU cores): the history is replayed (single-step, multistep, ancestral noise, two evaluations a step), or
# evaluated again from where the sampler asks for another x (an SDE sampler's Brownian noise spans the schedule),
# or from its start (a CFG++ sampler reads the unguided estimate during the evaluation).
MISS_SAMPLERS = {"euler": 0, "dpmpp_2m": 0, "euler_ancestral": 0, "heun": 0, "uni_pc": 0, "dpmpp_2m_sde": 1,
                 "euler_cfg_pp": 2}


def test_a_miss_is_the_host_samplers_result_with_every_kind_of_sampler(comfy, plugin, counted, conds, latent):
    """A miss runs its probe, then the rest: one sampler pass over both (the rest answers the probe's evaluations
    from its record), as KSampler's, so a multistep sampler keeps its history and an ancestral one its noise; the
    model calls beyond KSampler's are those of the probe's evaluations the sampler asked for at another x."""
    import comfy.sample
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.observer import GenerationObserver
    positive, negative = conds
    samples, steps, probe_steps = latent["samples"], 4, 2
    noise = comfy.sample.prepare_noise(samples, SEED)
    errors, extra = {}, {}
    for sampler_name in MISS_SAMPLERS:
        reference = comfy.sample.sample(counted.model, noise, steps, CFG, sampler_name, "simple", positive, negative,
                                        samples, disable_pbar=True, seed=SEED)
        plain_calls = counted.take()
        runner = ComfyRunner(counted.model, positive, negative, CFG, sampler_name, "simple", steps=steps, seed=SEED)
        probed = runner.run(noise * float(runner.sigmas[0]), runner.sigmas, 0, probe_steps, GenerationObserver())
        probe_calls, observer = counted.take(), GenerationObserver()
        rest = runner.run(probed, runner.sigmas, probe_steps, steps, observer)
        errors[sampler_name] = (runner.to_latent_format(rest) - reference).abs().max().item()
        extra[sampler_name] = probe_calls + counted.calls - plain_calls
        assert observer.forwards == counted.take() and observer.steps_run == steps - probe_steps, sampler_name
    assert max(errors.values()) < 1e-5, errors
    assert extra == MISS_SAMPLERS


# ---- the reuse pipeline through the nodes ------------------------------------------------------

def test_sampler_node_miss_then_hit_with_fewer_model_calls(comfy, plugin, counted, conds, latent, tmp_path):
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    graph = {"7": {"class_type": "CarnatorSampler", "inputs": {"positive": ["3", 0], "model": ["9", 0]}},
             "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox in the snow", "clip": ["2", 0]}},
             "9": {"class_type": "LoraLoaderModelOnly", "inputs": {"lora_name": "style.safetensors", "model": ["1", 0]}},
             "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan.safetensors", "weight_dtype": "default"}}}
    first, miss = sample(comfy, counted.model, cache, positive, negative, latent, prompt=graph)
    miss_calls = counted.take()
    assert not miss["reuse"] and miss["stored_as"] and miss["model_calls"] == STEPS
    assert [r.entry_id for r in cache.records()] == [miss["stored_as"]]
    assert cache.record(miss["stored_as"]).prompt == "a red fox in the snow"      # the cache browser's labels
    assert cache.record(miss["stored_as"]).extra["model"] == "wan.safetensors + style.safetensors"
    assert cache.thumbnail(miss["stored_as"]).startswith(b"\x89PNG")              # from Wan's latent->RGB
    assert first["samples"].shape == latent["samples"].shape

    second, hit = sample(comfy, counted.model, cache, nudged(positive), negative, latent)
    hit_calls = counted.take()
    assert hit["reuse"] and hit["entry_id"] == miss["stored_as"]
    assert hit["resume_step"] > PROBE
    assert hit_calls < miss_calls
    assert hit_calls == PROBE + STEPS - hit["resume_step"] == hit["model_calls"]
    assert cache.record(miss["stored_as"]).hits == 1
    relative = (second["samples"] - first["samples"]).norm() / first["samples"].norm()
    assert relative < 0.05, f"a hit on the nearly identical request drifted by {relative:.3f}"
    print(f"\nmiss: {miss_calls} forward calls; hit: {hit_calls} (resume at step {hit['resume_step']} of {STEPS}); "
          f"relative difference of the hit's latent {relative:.2e}")


def test_a_store_fault_on_a_hit_is_a_full_generation_with_a_warning_on_the_node(comfy, plugin, counted, conds,
                                                                                 latent, tmp_path):
    """Issue 16: the entry the gate chose has a damaged trajectory blob; the node still returns the request's
    latent, generated in full, and shows why on itself (the web UI's node text), not only in the log."""
    from store_damage import set_raw
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    _, miss = sample(comfy, counted.model, cache, positive, negative, latent)
    set_raw(cache, miss["stored_as"], "blob", b"torn by a disk")
    counted.take()
    out = sampler_output(comfy, counted.model, cache, nudged(positive), negative, latent)
    summary = json.loads(out.result[1])
    assert not summary["reuse"] and summary["model_calls"] == counted.take() == STEPS
    assert out.result[0]["samples"].shape == latent["samples"].shape
    shown = hostsetup.shown_text(out)
    assert shown.startswith("Carnator MISS") and f"warning: cache entry {miss['stored_as']} is corrupt" in shown
    assert "generated in full" in shown


def test_cache_node_on_a_password_redis_shows_the_password_nowhere(comfy, plugin, counted, conds, latent, tmp_path):
    """Issue 16: the Carnator Cache node takes a redis:// URL; its password reaches neither the node's outputs and
    text nor its errors, and a wrong one is an error on cache_dir that says what to do."""
    from redis_server import RedisServer, require_redis_server
    require_redis_server()
    secret = "node-Secret-pw"
    server = RedisServer(str(tmp_path / "redis"), password=secret).start()
    try:
        url = f"redis://:{secret}@127.0.0.1:{server.port}/0"
        cache = open_cache(comfy, url)
        assert cache.location == server.url
        positive, negative = conds
        shown = []
        for request in (positive, nudged(positive)):
            out = sampler_output(comfy, counted.model, cache, request, negative, latent)
            shown += [out.result[1], hostsetup.shown_text(out)]
        assert json.loads(shown[2])["reuse"] and all(secret not in text for text in shown)
        with pytest.raises(Exception) as caught:
            open_cache(comfy, f"redis://:wrong-{secret}@127.0.0.1:{server.port}/1")
        message = str(caught.value)
        assert "cache_dir" in message and "password was refused" in message and secret not in message
    finally:
        server.stop()


def test_with_redis_down_the_node_says_what_happened_once_on_its_own_request(comfy, plugin, counted, conds, latent,
                                                                             tmp_path):
    """Redis stops after the first request. The next ones are generated in full and their node text says so
    honestly: the cache could not be read (not "no earlier generation is in the cache"), nothing "stored as",
    each warning once, and the write that failed is reported on the request it belongs to, not on the next."""
    from redis_server import RedisServer, require_redis_server
    require_redis_server()
    server = RedisServer(str(tmp_path / "redis")).start()
    positive, negative = conds
    try:
        cache = open_cache(comfy, server.url)
        sample(comfy, counted.model, cache, positive, negative, latent)
    finally:
        server.stop()
    for scale in (1.001, 1.002):
        out = sampler_output(comfy, counted.model, cache, nudged(positive, scale), negative, latent)
        summary, text = json.loads(out.result[1]), hostsetup.shown_text(out)
        assert out.result[0]["samples"].shape == latent["samples"].shape and summary["steps_run"] == STEPS
        assert text.startswith("Carnator MISS (balanced): the cache could not be read"), text
        assert "no earlier generation" not in summary["why"] and "stored as" not in text.splitlines()[0], text
        assert summary["stored_as"] is None and not summary["store_pending"]
        warnings = summary["warnings"]
        assert len(warnings) == len(set(warnings)) == 2, warnings     # the failed read, then this request's write
        assert warnings[1].startswith("the generation to be stored as ") and "was not stored" in warnings[1]
        assert all(f"warning: {w}" in text for w in warnings)
    assert cache.drain_problems() == []                            # nothing left over for the next request


def test_a_write_that_fails_after_the_result_is_out_is_told_on_its_own_node_not_the_next_request(
        comfy, plugin, counted, conds, latent, tmp_path, monkeypatch):
    """The write runs after the node returned (write_back): the node says "being stored as", and when the write then
    fails (a full disk) the web widget of that node gets the failure and the next request shows no stale warning."""
    import errno
    import threading
    import time
    from carnator_engine.store import CarnatorStore
    sent = []
    server = types.SimpleNamespace(send_sync=lambda event, data: sent.append((event, data)))
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(
        instance=server)))
    released = threading.Event()

    def full_disk(self, **entry):
        released.wait(30)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(CarnatorStore, "put", full_disk)
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    out = node(comfy, "CarnatorSampler")(counted.model, cache, positive, negative, latent, SEED, STEPS, CFG, "euler",
                                         "simple", PROBE, "balanced", True, 1.0, unique_id="7", prompt=None)
    summary = json.loads(out.result[1])
    assert summary["store_pending"] and f"being stored as {summary['stored_as']}" in hostsetup.shown_text(out)
    released.set()
    cache.writer.settle()
    deadline = time.monotonic() + 10    # the notice's thread: sent, then taken back from the next request's warnings
    while (len(sent) < 2 or any("was not stored" in p for p in cache.problems)) and time.monotonic() < deadline:
        time.sleep(0.05)
    (_, shown), (event, update) = sent
    assert event == "carnator.decision" and update["node"] == "7" and shown["store_pending"]
    assert update["stored_as"] is None and not update["store_pending"] and update["write_done"]
    assert [w for w in update["warnings"] if "was not stored" in w and "No space left on device" in w], update
    monkeypatch.undo()
    _, following = sample(comfy, counted.model, cache, nudged(positive), negative, latent)
    assert not [w for w in following["warnings"] if "was not stored" in w], following["warnings"]


def test_cache_node_blob_dir_makes_a_farm_whose_hits_cross_workers(comfy, plugin, counted, conds, latent, tmp_path):
    """The Carnator Cache node's blob_dir: trajectories in that folder, Redis holding the index; a second worker
    (another store object on the same Redis and folder) hits what the first stored; blob_dir without a redis://
    cache_dir is an error on blob_dir."""
    from carnator_engine.store import CarnatorStore
    from redis_server import RedisServer, require_redis_server
    require_redis_server()
    server = RedisServer(str(tmp_path / "redis")).start()
    blobs = str(tmp_path / "blobs")
    try:
        cache = node(comfy, "CarnatorCache")(server.url, 1.0, blobs)[0]
        assert cache.location == f"{server.url} + {os.path.realpath(blobs)}"
        positive, negative = conds
        sampler_output(comfy, counted.model, cache, positive, negative, latent)
        cache.writer.settle()
        assert [n for n in os.listdir(blobs) if n.endswith(".blob")]
        other = CarnatorStore(server.url, 1 << 30, blob_dir=blobs)   # a second worker
        out = sampler_output(comfy, counted.model, other, nudged(positive), negative, latent)
        assert json.loads(out.result[1])["reuse"]
        other.close()
        with pytest.raises(Exception, match="blob_dir.*redis://"):
            node(comfy, "CarnatorCache")(str(tmp_path / "disk"), 1.0, blobs)
        from redis_server import free_port   # a farm whose Redis is down: the node gives a store all the same,
        down = node(comfy, "CarnatorCache")(f"redis://127.0.0.1:{free_port()}/0", 1.0, str(tmp_path / "b2"))[0]
        out = sampler_output(comfy, counted.model, down, positive, negative, latent)   # which generates in full
        assert not json.loads(out.result[1])["reuse"] and "cannot be reached" in hostsetup.shown_text(out)
        assert not os.path.exists(tmp_path / "b2")
    finally:
        server.stop()


def test_sampler_node_replays_an_exact_repeat_with_no_model_call(comfy, plugin, counted, conds, latent, tmp_path):
    from carnator_engine.hosts.comfyui import conditioning_fingerprint
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    first, miss = sample(comfy, counted.model, cache, positive, negative, latent)
    counted.take()
    again, repeat = sample(comfy, counted.model, cache, positive, negative, latent)
    assert counted.take() == 0 and repeat["model_calls"] == 0
    assert repeat["exact_repeat"] and repeat["entry_id"] == miss["stored_as"] and repeat["stored_as"] is None
    assert torch.equal(again["samples"], first["samples"])
    assert [(r.entry_id, r.hits, r.steps_saved) for r in cache.records()] == [(miss["stored_as"], 1, STEPS)]
    # what a repeat must match besides the noise: both conditionings whole, their options, the sampler's seed
    base = conditioning_fingerprint(positive, negative, SEED)
    ranged = [[positive[0][0], {"start_percent": 0.5, "end_percent": 1.0}]]   # ConditioningSetTimestepRange
    one_value = [[positive[0][0].clone(), {}]]
    one_value[0][0][0, -1, -1] += 1.0                                           # where a sampled digest looks not
    assert len({base, conditioning_fingerprint(ranged, negative, SEED), conditioning_fingerprint(one_value, negative,
                SEED), conditioning_fingerprint(positive, positive, SEED),
                conditioning_fingerprint(positive, negative, SEED + 1)}) == 5
    _, other_seed = sample(comfy, counted.model, cache, positive, negative, latent, seed=SEED + 1)
    assert not other_seed["exact_repeat"] and counted.take() == other_seed["model_calls"] > 0


def test_restart_of_the_process_still_hits(comfy, plugin, counted, conds, latent, tmp_path, host_dirs, model_name):
    positive, negative = conds
    cache_dir = tmp_path / "cache"
    _, miss = sample(comfy, counted.model, open_cache(comfy, cache_dir), positive, negative, latent)
    assert not miss["reuse"]
    torch.save({"positive": nudged(positive)[0][0], "negative": negative[0][0], "samples": latent["samples"]},
               tmp_path / "request.pt")
    env = dict(os.environ, COMFYUI_PATH=hostsetup.comfyui_path())
    completed = subprocess.run(
        [sys.executable, str(HERE / "restart_request.py"), host_dirs["models"], str(cache_dir),
         str(tmp_path / "request.pt"), str(tmp_path / "custom_nodes"), json.dumps(
             {"seed": SEED, "steps": STEPS, "cfg": CFG, "probe_steps": PROBE})],
        capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["summary"]["reuse"] and report["summary"]["entry_id"] == miss["stored_as"]
    assert report["summary"]["resume_step"] > PROBE
    assert report["calls"] == PROBE + STEPS - report["summary"]["resume_step"] < STEPS


def test_attention_density_budget_reaches_the_stored_connectivity(comfy, plugin, counted, conds, latent, tmp_path):
    positive, negative = conds
    densities = {}
    for budget in (1.0, 0.25):
        cache = open_cache(comfy, tmp_path / f"cache{budget}")
        _, miss = sample(comfy, counted.model, cache, positive, negative, latent, attention_density=budget)
        tables = cache.trajectory(cache.record(miss["stored_as"])).connectivity
        rows = [t for name, t in tables.items() if name != "block_size"]
        assert rows
        densities[budget] = max(float(t.float().mean()) for t in rows)
        blocks = rows[0].shape[1]
        assert all(int(t.sum(-1).max()) <= math.ceil(budget * blocks) + 1 for t in rows)  # + the diagonal
    assert densities[0.25] < densities[1.0]


def test_very_different_conditioning_is_rejected(comfy, plugin, counted, conds, latent, tmp_path):
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    _, miss = sample(comfy, counted.model, cache, positive, negative, latent)
    counted.take()
    other = hostsetup.conditioning(99, scale=3.0)   # random weights answer a stronger difference
    _, summary = sample(comfy, counted.model, cache, other, negative, latent)
    assert not summary["reuse"] and counted.take() == STEPS
    assert summary["reasons"][0] == f"nearest entry {miss['stored_as']} rejected"
    assert any(" over limit " in reason for reason in summary["reasons"])
    print("\nrejected:", summary["numbers"])


def test_a_request_probed_longer_than_the_cached_ones_names_the_probe_length(comfy, plugin, tiny_model, conds,
                                                                             latent, tmp_path):
    """Entries probed 2 steps, an edit probed 3: the miss says the probe lengths differ (and which to set), not
    that no earlier generation of this model, shape and schedule is in the cache."""
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    sample(comfy, tiny_model, cache, positive, negative, latent, probe_steps=PROBE)
    _, summary = sample(comfy, tiny_model, cache, nudged(positive), negative, latent, probe_steps=PROBE + 1)
    assert not summary["reuse"]
    assert summary["reasons"] == [
        f"the cache holds generations of this model, shape and schedule probed for {PROBE} steps, this request for "
        f"{PROBE + 1}: probes of different lengths cannot be compared (set probe steps to {PROBE} to reuse them)"]


def test_model_patch_changes_the_bucket(comfy, plugin, tiny_model, counted, conds, latent, tmp_path):
    from carnator_engine.hosts.comfyui import ComfyRunner
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    _, miss = sample(comfy, counted.model, cache, positive, negative, latent)

    key = "diffusion_model.blocks.0.self_attn.q.weight"
    weight = tiny_model.model.state_dict()[key]
    delta = torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)) * 0.01
    patched = counted.model.clone()
    assert patched.add_patches({key: ("diff", (delta,))}, 1.0) == [key]
    fresh = "no earlier generation of this model, shape and schedule is in the cache"
    nearest = f"the nearest cached generation, entry {miss['stored_as']}, differs in "
    _, summary = sample(comfy, patched, cache, positive, negative, latent)
    assert not summary["reuse"]
    assert summary["reasons"] == [fresh + " (this model: weight patches on 1 weights (LoRA-style))",
                                  nearest + "model/patches (weights, LoRAs or their strengths)"]

    half = counted.model.clone()
    half.add_patches({key: ("diff", (delta,))}, 0.5)
    fingerprints = {ComfyRunner(m, positive, negative, CFG, "euler", "simple", steps=STEPS).model_fingerprint
                    for m in (counted.model, patched, half)}
    assert len(fingerprints) == 3                          # the strength is part of the key too

    _, again = sample(comfy, counted.model, cache, positive, negative, latent)   # the patched weights were in
    assert again["reuse"] and again["entry_id"] == miss["stored_as"]           # place: the base still matches

    # each part of the bucket on its own: the miss says which one differs from the nearest entry
    smaller = hostsetup.empty_video_latent(comfy, width=96, height=96, length=9)
    differs = {
        "steps (8 here, 10 there)": dict(steps=STEPS - 2),
        "latent shape (size or length) (1x16x3x12x12 here, 1x16x5x16x16 there)": dict(latent=smaller),
        "cfg/guidance (cfg=4 here, cfg=5 there)": dict(cfg=4.0),
        "sampler (heun here, euler there)": dict(sampler_name="heun"),
    }
    for part, change in differs.items():
        request = dict(dict(positive=positive, negative=negative, latent=latent), **change)
        _, summary = sample(comfy, counted.model, cache, **request)
        assert summary["reasons"][0] == fresh
        assert summary["reasons"][1].startswith("the nearest cached generation, entry ")
        assert summary["reasons"][1].endswith(" differs in " + part), summary["reasons"]


def test_split_stage_nodes_probe_lookup_gate_resume(comfy, plugin, counted, conds, latent, tmp_path, monkeypatch):
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    events = []
    fake_server = types.ModuleType("server")
    fake_server.PromptServer = types.SimpleNamespace(
        instance=types.SimpleNamespace(send_sync=lambda event, data, sid=None: events.append((event, data))))
    monkeypatch.setitem(sys.modules, "server", fake_server)

    def run_stages(risk="balanced", request_positive=positive, probe_cache=None, **thresholds):
        probe = node(comfy, "CarnatorEarlyProbe")(counted.model, request_positive, negative, latent, SEED, STEPS,
                                                  CFG, "euler", "simple", PROBE, 64, unique_id="3", prompt=None,
                                                  cache=probe_cache)[0]
        matches = node(comfy, "CarnatorSignatureCacheLookup")(cache, probe, 3).result[0]
        gate = node(comfy, "CarnatorCompatibilityGate")(probe, matches, risk, unique_id="4", **thresholds)
        decision, decision_json = gate.result
        resumed = node(comfy, "CarnatorTrajectoryResume")(cache, probe, decision, True, unique_id="5")
        return probe, matches, json.loads(decision_json), resumed.result

    _, _, first_decision, (latent_out, summary_json) = run_stages(probe_cache=cache)   # nothing to repeat yet
    first_entry = json.loads(summary_json)["stored_as"]
    assert not first_decision["reuse"] and first_entry
    assert latent_out["samples"].shape == latent["samples"].shape
    counted.take()
    probe, matches, decision, (_, summary_json) = run_stages("balanced", nudged(positive), max_hidden=0.5,
                                                             min_saved_steps=2)
    assert decision["reuse"] and not decision["exact_repeat"] and decision["resume_step"] > PROBE, decision["reasons"]
    assert counted.take() == PROBE + STEPS - decision["resume_step"]
    assert json.loads(summary_json)["entry_id"] == decision["entry_id"]
    gate_events = [data for event, data in events if event == "carnator.decision" and data["node"] == "4"]
    assert [e["reuse"] for e in gate_events] == [False, True]
    assert {"resume_step", "risk", "expected_speedup", "reasons"} <= set(gate_events[-1])

    _, _, repeat, (repeated, summary_json) = run_stages()      # the first request again, exactly
    assert repeat["exact_repeat"] and repeat["entry_id"] == json.loads(summary_json)["entry_id"]
    assert counted.take() == PROBE == json.loads(summary_json)["model_calls"]
    assert torch.equal(repeated["samples"], latent_out["samples"])
    # with the cache connected to the Early Probe, the repeat is found before any probe step runs
    _, matches, repeat, (repeated, summary_json) = run_stages(probe_cache=cache)
    assert repeat["exact_repeat"] and matches.candidates == [] and repeat["entry_id"] == first_entry
    assert counted.take() == 0 == json.loads(summary_json)["model_calls"]
    assert torch.equal(repeated["samples"], latent_out["samples"])
    assert cache.record(first_entry).hits == 3                 # the hit, the repeat after probing, this one
    with pytest.raises(ValueError, match=r"Signature Cache Lookup: input 'cache': .*connect the same Carnator Cache"):
        probe = node(comfy, "CarnatorEarlyProbe")(counted.model, positive, negative, latent, SEED, STEPS, CFG,
                                                        "euler", "simple", PROBE, 64, cache=cache)[0]
        node(comfy, "CarnatorSignatureCacheLookup")(open_cache(comfy, tmp_path / "other"), probe, 3)

    other_probe = node(comfy, "CarnatorEarlyProbe")(counted.model, positive, negative, latent, SEED + 1, STEPS,
                                                          CFG, "euler", "simple", PROBE, 64)[0]
    with pytest.raises(ValueError, match="input 'matches': comes from another probe"):
        node(comfy, "CarnatorCompatibilityGate")(other_probe, matches, "balanced")


STAGED_SETTINGS = {"gate risk": ({"risk": "safe"}, {}), "gate limit": ({"max_resume_fraction": 0.2}, {}),
                   "dense resume": ({}, {"sparse_attention": False}),
                   "attention density": ({}, {"attention_density": 0.5}),
                   "region-only": ({}, {"region_only": True})}


def test_a_staged_request_is_served_a_samplers_hit_only_with_the_same_settings(comfy, plugin, counted, conds, latent,
                                                                                tmp_path):
    """A Sampler hit, then the same request through the staged nodes (the Early Probe with the cache connected):
    with any other Gate or Resume setting, it goes through the gate, never the hit's stored result; with the
    Sampler's settings, the Resume replays it after the probe."""
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    sample(comfy, counted.model, cache, positive, negative, latent)
    hit_latent, hit = sample(comfy, counted.model, cache, nudged(positive), negative, latent)
    assert hit["reuse"] and not hit["exact_repeat"] and hit["stored_as"]
    counted.take()

    def staged(gate_settings, resume_settings):
        probe = node(comfy, "CarnatorEarlyProbe")(counted.model, nudged(positive), negative, latent, SEED, STEPS, CFG,
                                                  "euler", "simple", PROBE, 0, cache=cache)[0]
        matches = node(comfy, "CarnatorSignatureCacheLookup")(cache, probe, 3).result[0]
        decision = node(comfy, "CarnatorCompatibilityGate")(probe, matches, gate_settings.pop("risk", "balanced"),
                                                            **gate_settings).result[0]
        resume_settings = {"sparse_attention": True, **resume_settings}
        out = node(comfy, "CarnatorTrajectoryResume")(cache, probe, decision, **resume_settings)
        cache.writer.settle()
        summary = json.loads(out.result[1])
        assert hostsetup.shown_text(out).startswith("Carnator " + ("REPEAT" if summary["exact_repeat"] else
                                                                   "HIT" if summary["reuse"] else "MISS"))
        return out.result[0], summary, counted.take()

    for name, (gate_settings, resume_settings) in STAGED_SETTINGS.items():
        _, summary, calls = staged(dict(gate_settings), resume_settings)
        assert not summary["exact_repeat"] and calls == summary["model_calls"] > PROBE, name
        if summary["stored_as"]:      # the store as before: the next setting meets the Sampler's hit alone
            cache.delete(summary["stored_as"])
    same_latent, same, calls = staged({}, {})
    assert same["exact_repeat"] and same["entry_id"] == hit["stored_as"] and calls == PROBE == same["model_calls"]
    assert torch.equal(same_latent["samples"], hit_latent["samples"])


def test_gate_node_without_shrinking_resumes_at_the_furthest_step(comfy, plugin, counted, conds, latent, tmp_path):
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    sample(comfy, counted.model, cache, positive, negative, latent)
    probe = node(comfy, "CarnatorEarlyProbe")(counted.model, positive, negative, latent, SEED + 1, STEPS, CFG,
                                                    "euler", "simple", PROBE, 64)[0]
    matches = node(comfy, "CarnatorSignatureCacheLookup")(cache, probe, 3).result[0]
    gate = node(comfy, "CarnatorCompatibilityGate")
    loose = dict(max_attention=1.0, max_context=10.0, max_target_fraction=1.0)
    measured = gate(probe, matches, "aggressive", max_hidden=2.0, **loose).result[0].decision
    near_the_limit = {**loose, "max_hidden": measured.numbers["hidden"] * 1.25}   # risk 0.8
    shrunk = gate(probe, matches, "aggressive", **near_the_limit).result[0].decision
    furthest = gate(probe, matches, "aggressive", shrink_with_risk=False, **near_the_limit).result[0].decision
    assert not shrunk.reuse, shrunk.reasons      # shrunk to step 2 + int(4 * 0.2): nothing left to save
    assert furthest.reuse and furthest.resume_step == int(0.65 * STEPS)   # aggressive's furthest resume


def test_hit_with_a_target_region_re_estimates_it_through_the_host_sampler(comfy, plugin, counted, conds, latent,
                                                                           tmp_path):
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    sample(comfy, counted.model, cache, positive, negative, latent)
    loose = dict(max_hidden=2.0, max_attention=1.0, max_context=10.0, cell_threshold=0.05, max_target_fraction=1.0)

    def stages(**switch):
        probe = node(comfy, "CarnatorEarlyProbe")(counted.model, positive, negative, latent, SEED + 1, STEPS,
                                                        CFG, "euler", "simple", PROBE, 64)[0]
        matches = node(comfy, "CarnatorSignatureCacheLookup")(cache, probe, 3).result[0]
        decision = node(comfy, "CarnatorCompatibilityGate")(probe, matches, "aggressive",
                                                                   **switch, **loose).result[0]
        counted.take()
        out = node(comfy, "CarnatorTrajectoryResume")(cache, probe, decision, True).result
        return decision.decision, counted.take(), json.loads(out[1]), out[0]

    decision, calls, summary, latent_out = stages()                 # the node's default refines
    k, m = decision.resume_step, decision.refine_step
    assert decision.reuse and decision.target_cells.any() and PROBE < m < k
    assert calls == 1 + STEPS - k                               # the refine call, then the rest
    assert summary["refine_step"] == m and summary["model_calls"] == PROBE + 1 + STEPS - k
    assert torch.isfinite(latent_out["samples"]).all()
    plain, plain_calls, _, _ = stages(refine_target=False)
    assert plain.refine_step is None and plain_calls == STEPS - plain.resume_step


def test_composes_with_existing_attention_override_and_block_patch(comfy, plugin, tiny_model, conds, latent,
                                                                    tmp_path):
    positive, negative = conds
    seen = {"attention": 0, "block": 0}

    def other_override(func, *args, **kwargs):     # what a SageAttention-style node installs
        seen["attention"] += 1
        return func(*args, **kwargs)

    def other_block(args, extra):                  # another node's block replacement
        seen["block"] += 1
        return extra["original_block"](args)

    model = tiny_model.clone()
    model.model_options["transformer_options"]["optimized_attention_override"] = other_override
    model.set_model_patch_replace(other_block, "dit", "double_block", 0)
    plain, _ = sample(comfy, tiny_model, open_cache(comfy, tmp_path / "a"), positive, negative, latent)
    layered, summary = sample(comfy, model, open_cache(comfy, tmp_path / "b"), positive, negative, latent)
    assert seen["block"] == STEPS and seen["attention"] == STEPS * 4       # self + cross, 2 blocks
    assert torch.allclose(plain["samples"], layered["samples"], atol=1e-5)
    assert model.model_options["transformer_options"]["optimized_attention_override"] is other_override


def test_ltx_video_model_miss_then_hit(comfy, plugin, conds, tmp_path, host_dirs):
    import comfy.ldm.modules.attention as attention
    name = hostsetup.build_tiny_ltxv(host_dirs["models"])
    model = comfy.NODE_CLASS_MAPPINGS["UNETLoader"]().load_unet(name, "default")[0]
    assert type(model.model).__name__ == "LTXV"

    def masked_sdpa(func, *args, **kwargs):     # the CPU default (sub-quadratic) rejects LTXV's text mask
        return attention.attention_pytorch(*args, **kwargs)
    model.model_options["transformer_options"]["optimized_attention_override"] = masked_sdpa
    counter = CallCounter(model)
    mask = {"attention_mask": torch.ones(1, 1, 128)}
    positive = [[hostsetup.conditioning(1)[0][0][:, :128], dict(mask)]]
    negative = [[hostsetup.conditioning(2)[0][0][:, :128], dict(mask)]]
    latent = {"samples": torch.zeros(1, 128, 3, 8, 8)}
    cache = open_cache(comfy, tmp_path / "cache")
    _, miss = sample(comfy, counter.model, cache, positive, negative, latent, cfg=3.0)
    assert not miss["reuse"] and counter.take() == STEPS
    _, hit = sample(comfy, counter.model, cache, nudged(positive), negative, latent, cfg=3.0)
    assert hit["reuse"] and hit["resume_step"] > PROBE and counter.take() == hit["model_calls"] < STEPS


# ---- bad inputs --------------------------------------------------------------------------------

def test_bad_inputs_raise_clear_errors_and_leave_the_store_intact(comfy, plugin, counted, conds, latent, tmp_path):
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    sample(comfy, counted.model, cache, positive, negative, latent)
    before = store_state(cache)
    samples = latent["samples"]

    def bad_sample(message, model=None, latent_image=None, **kwargs):
        with pytest.raises(ValueError, match=message):
            sample(comfy, model or counted.model, cache, positive, negative, latent_image or latent, **kwargs)

    bad_sample(r"input 'latent_image': has shape \[1, 4, 16, 16\], an image latent",
               latent_image={"samples": torch.zeros(1, 4, 16, 16)})
    bad_sample(r"input 'latent_image': has 48 channels but WAN21 \(wan2.1\) works with 16",
               latent_image={"samples": torch.ones(1, 48, 5, 16, 16)})
    bad_sample(r"input 'latent_image': carries a noise mask",
               latent_image={"samples": samples, "noise_mask": torch.ones(1, 1, 16, 16)})
    bad_sample(r"input 'probe_steps': probe_steps=10 must be between 1 and steps-1 \(9\)", probe_steps=10)
    bad_sample(r"input 'sampler_name': unknown sampler_name 'euler_typo'", sampler_name="euler_typo")
    bad_sample(r"input 'cfg': cfg=nan is not a finite number", cfg=float("nan"))
    bad_sample(r"input 'risk': unknown risk level 'reckless'", risk="reckless")
    for density in (0.0, 1.5):
        bad_sample(rf"input 'attention_density': attention_density={density} must be in \(0, 1\]",
                   attention_density=density)
    bad_sample(r"input 'attention_density': attention_density=nan is not a finite number",
               attention_density=float("nan"))

    vace = types.SimpleNamespace(model=type("WAN21_Vace", (), {"diffusion_model": None})())
    bad_sample(r"input 'model': Carnator: unsupported model WAN21_Vace .*VACE adds control blocks", model=vace)

    probe = node(comfy, "CarnatorEarlyProbe")(counted.model, positive, negative, latent, SEED, STEPS, CFG,
                                                    "euler", "simple", PROBE, 0)[0]
    assert probe.config.block_size == 64  # 0 = automatic: the CPU's block size here
    matches = node(comfy, "CarnatorSignatureCacheLookup")(cache, probe, 3).result[0]
    with pytest.raises(ValueError, match=r"gate setting max_attention=5.0 is outside \(0, 1\]"):
        node(comfy, "CarnatorCompatibilityGate")(probe, matches, "balanced", max_attention=5.0)
    with pytest.raises(ValueError, match=r"input 'max_hidden': max_hidden=-1.0 must be >= 0"):
        node(comfy, "CarnatorCompatibilityGate")(probe, matches, "balanced", max_hidden=-1.0)

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=r"Carnator Cache: input 'cache_dir': .*not writable.*choose another"):
        open_cache(comfy, blocker / "cache")
    with pytest.raises(ValueError, match=r"input 'size_limit_gb': size_limit_gb=0.0001 is below the minimum"):
        open_cache(comfy, tmp_path / "cache", size_gb=0.0001)
    blob_named = tmp_path / "my_blobs_file"               # a folder name holding "blob" is still cache_dir's fault
    blob_named.write_text("not a folder")
    with pytest.raises(ValueError, match=r"^Carnator Cache: input 'cache_dir': .*my_blobs_file.* is a file"):
        open_cache(comfy, blob_named)
    for char in ("\x00", "\n", "\t", "\x85"):
        with pytest.raises(ValueError, match=r"^Carnator Cache: input 'cache_dir': cache_dir holds the control "):
            open_cache(comfy, str(tmp_path / f"ca{char}che"))
        with pytest.raises(ValueError, match=r"^Carnator Cache: input 'blob_dir': blob_dir holds the control "):
            node(comfy, "CarnatorCache")("redis://localhost:6379/0", 1.0, str(tmp_path / f"blobs{char}"))
    foreign = foreign_wal_database(tmp_path / "their_app")   # another program's folder: refused, nothing touched
    untouched = folder_state(foreign)
    with pytest.raises(ValueError, match=r"input 'cache_dir': .*not a Carnator store.*nothing in it was touched"):
        open_cache(comfy, foreign)
    assert folder_state(foreign) == untouched
    assert store_state(cache) == before


def test_relative_cache_dir_is_inside_the_user_directory(comfy, plugin, tmp_path, monkeypatch):
    import folder_paths
    user = tmp_path / "user"
    monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(user))
    (tmp_path / "server_cwd").mkdir()
    monkeypatch.chdir(tmp_path / "server_cwd")               # wherever ComfyUI happened to be started from
    assert open_cache(comfy, "my_cache").location == str(user / "my_cache")
    assert open_cache(comfy, "  ").location == str(user / "carnator_cache")
    assert open_cache(comfy, str(tmp_path / "absolute")).location == str(tmp_path / "absolute")
    assert os.listdir(tmp_path / "server_cwd") == []


def test_unsupported_model_error_names_the_class():
    from carnator_engine.hosts.comfyui import UnsupportedModelError, backbone_for
    flux = types.SimpleNamespace(model=type("Flux", (), {"diffusion_model": object()})())
    with pytest.raises(UnsupportedModelError, match=r"unsupported model Flux \(diffusion model object\)\. "
                                                    r"Carnator supports Wan 2.1"):
        backbone_for(flux)


# ---- the plugin as ComfyUI loads it ------------------------------------------------------------

# Input names in order, as the V1 nodes had them: a saved workflow's widgets_values are positional (inputs added
# since, the Wan 2.2 experts' and the probe's cache, come last and are optional: older saves leave them at default).
EXPERTS = ["low_noise_model", "switch_step", "boundary_sigma"]
NODE_INPUTS = {
    "CarnatorCache": ["cache_dir", "size_limit_gb", "blob_dir"],
    "CarnatorEarlyProbe": ["model", "positive", "negative", "latent_image", "seed", "steps", "cfg", "sampler_name",
                           "scheduler", "probe_steps", "block_size", "cache", *EXPERTS],
    "CarnatorSignatureCacheLookup": ["cache", "probe", "limit"],
    "CarnatorCompatibilityGate": ["probe", "matches", "risk", "max_hidden", "max_attention", "max_context",
                                  "cell_threshold", "max_target_fraction", "max_resume_fraction", "min_saved_steps",
                                  "refine_target", "shrink_with_risk", "max_context_share",
                                  "few_step_resume_fraction"],
    "CarnatorTrajectoryResume": ["cache", "probe", "decision", "sparse_attention", "attention_density",
                                 "region_only"],
    "CarnatorSampler": ["model", "cache", "positive", "negative", "latent_image", "seed", "steps", "cfg",
                        "sampler_name", "scheduler", "probe_steps", "risk", "sparse_attention", "attention_density",
                        *EXPERTS, "region_only"],
}
DISPLAY_NAMES = {"CarnatorCache": "Carnator Cache", "CarnatorEarlyProbe": "Carnator Early Probe",
                 "CarnatorSignatureCacheLookup": "Carnator Signature Cache Lookup",
                 "CarnatorCompatibilityGate": "Carnator Compatibility Gate",
                 "CarnatorTrajectoryResume": "Carnator Trajectory Resume", "CarnatorSampler": "Carnator Sampler"}
NODE_OUTPUTS = {
    "CarnatorCache": [("CARNATOR_CACHE", "cache")], "CarnatorEarlyProbe": [("CARNATOR_PROBE", "probe")],
    "CarnatorSignatureCacheLookup": [("CARNATOR_MATCHES", "matches")],
    "CarnatorCompatibilityGate": [("CARNATOR_DECISION", "decision"), ("STRING", "decision_json")],
    "CarnatorTrajectoryResume": [("LATENT", "latent"), ("STRING", "summary_json")],
    "CarnatorSampler": [("LATENT", "latent"), ("STRING", "summary_json")],
}


def test_plugin_loads_through_comfyui_custom_node_loader(comfy, plugin):
    from comfy_api.latest import io
    module, install = plugin
    assert not hasattr(module, "NODE_CLASS_MAPPINGS")        # one node API: the versioned one (comfy_entrypoint)
    listed = asyncio.run(module.comfy_entrypoint().get_node_list())
    assert [cls.GET_SCHEMA().node_id for cls in listed] == list(NODE_INPUTS)
    for cls in listed:
        name = cls.GET_SCHEMA().node_id
        assert comfy.NODE_CLASS_MAPPINGS[name] is cls and issubclass(cls, io.ComfyNode)
        assert cls.CATEGORY == "Carnator" and cls.DESCRIPTION
        assert comfy.NODE_DISPLAY_NAME_MAPPINGS[name] == DISPLAY_NAMES[name]
        assert cls.RELATIVE_PYTHON_MODULE == f"custom_nodes.{hostsetup.PLUGIN_DIR_NAME}"
        info = cls.GET_NODE_INFO_V1()                         # what GET /object_info serves the web app
        assert info["input_order"]["required"] + info["input_order"].get("optional", []) == NODE_INPUTS[name]
        assert list(zip(info["output"], info["output_name"])) == NODE_OUTPUTS[name]
        untipped = [n for section in ("required", "optional") for n, (_, options) in info["input"].get(section, {}).items()
                    if not options.get("tooltip")]
        assert untipped == [], f"{name}: inputs without a tooltip"
        assert all(info["output_tooltips"]), f"{name}: outputs without a tooltip"
    from carnator_engine.store import DEFAULT_SIZE_LIMIT
    size = comfy.NODE_CLASS_MAPPINGS["CarnatorCache"].INPUT_TYPES()["required"]["size_limit_gb"][1]["default"]
    assert size * (1 << 30) == DEFAULT_SIZE_LIMIT                 # one default size limit: node, CLI, engine
    from carnator_engine.pipeline import CarnatorConfig
    for name in ("CarnatorSampler", "CarnatorTrajectoryResume"):   # one region-only default: nodes and engine
        region_only = comfy.NODE_CLASS_MAPPINGS[name].INPUT_TYPES()["optional"]["region_only"][1]["default"]
        assert region_only is CarnatorConfig().region_only is False
    options = comfy.NODE_CLASS_MAPPINGS["CarnatorSampler"].INPUT_TYPES()["required"]["sampler_name"][1]["options"]
    assert options == comfy.NODE_CLASS_MAPPINGS["KSampler"].INPUT_TYPES()["required"]["sampler_name"][0]
    assert module.WEB_DIRECTORY == "./web"
    assert os.path.realpath(comfy.EXTENSION_WEB_DIRS[hostsetup.PLUGIN_DIR_NAME]) == str(hostsetup.REPO / "web")
    import carnator_engine
    assert Path(carnator_engine.__file__).resolve().parent == hostsetup.REPO / "carnator_engine"
    from comfy_config import config_parser          # what ComfyUI and the registry CLI read
    project = config_parser.extract_node_configuration(install)
    assert project.project.name == "comfyui-carnator" and project.tool_comfy.publisher_id == "carnator"
    assert project.tool_comfy.display_name == "Carnator"
