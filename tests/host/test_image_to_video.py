"""Image-to-video through the real host: Wan 2.1 I2V (WanImageToVideo with a CLIP vision output), Wan 2.2 I2V A14B
(two experts, WanImageToVideo) and Wan 2.2 TI2V 5B (Wan22ImageToVideoLatent: the image in the latent, kept by its
noise mask), with the Carnator Sampler and the staged nodes.

Tiny random Wan models of each kind (36 input channels for the I2V ones) and the fixture's pixel-pooling VAE, which
gives the image nodes a latent that depends on the image. Two start images, one prompt: a hit only ever resumes a
generation of the same start image, and an exact repeat needs the same image.
"""
from __future__ import annotations

import pytest
import torch

import hostsetup
from conftest import CallCounter
from test_comfyui_host import CFG, SEED, node, nudged, open_cache, sample

STEPS, PROBE, SWITCH = 10, 2, 5
IMAGES = ("sunset", "forest")


def load(comfy, name, shift=None):
    model = node(comfy, "UNETLoader").load_unet(name, "default")[0]
    return node(comfy, "ModelSamplingSD3").patch(model, shift)[0] if shift else model


def run_v3(comfy, name, *args, **kwargs):
    return hostsetup.run_node(comfy.NODE_CLASS_MAPPINGS[name], *args, **kwargs).result


def clip_vision_output(image: str):
    """What CLIPVisionEncode gives Wan 2.1 I2V (a CLIP-H encoding of the image), made up per image."""
    import comfy.clip_vision
    generator = torch.Generator().manual_seed(IMAGES.index(image) + 7)
    output = comfy.clip_vision.Output()
    output["penultimate_hidden_states"] = torch.randn(1, 257, 1280, generator=generator)
    output["image_embeds"] = torch.randn(1, 1024, generator=generator)
    return output


def wan_image_to_video(comfy, conds, image: str, clip_vision: bool):
    """(positive, negative, latent) from WanImageToVideo with `image` as the start image: 128x128, 17 frames."""
    positive, negative = conds
    vae = hostsetup.fixture_module().PixelPoolVAE(16)
    extra = {"clip_vision_output": clip_vision_output(image)} if clip_vision else {}
    return run_v3(comfy, "WanImageToVideo", positive, negative, vae, 128, 128, 17, 1,
                  start_image=hostsetup.start_image(image), **extra)


def ksampler(comfy, model, positive, negative, latent, steps=STEPS):
    return node(comfy, "KSampler").sample(model, SEED, steps, CFG, "euler", "simple", positive, negative, latent)[0]


def close(a, b, tolerance=1e-5):
    return (a - b).abs().max().item() <= tolerance * max(1.0, b.abs().max().item())


@pytest.fixture(scope="module")
def wan21_i2v(comfy, host_dirs):
    return load(comfy, hostsetup.build_tiny_wan(host_dirs["models"], seed=14, name=hostsetup.TINY_WAN21_I2V,
                                                image_to_video="wan21"))


def test_tiny_i2v_models_load_as_the_host_detects_them(comfy, plugin, wan21_i2v, host_dirs):
    from carnator_engine.hosts.comfyui import backbone_for
    high = load(comfy, hostsetup.build_tiny_wan(host_dirs["models"], seed=15, name=hostsetup.TINY_WAN22_I2V_HIGH,
                                                image_to_video="wan22"))
    assert type(wan21_i2v.model).__name__ == "WAN21" and wan21_i2v.model.image_to_video
    assert wan21_i2v.model.diffusion_model.img_emb is not None                   # Wan 2.1 I2V: CLIP vision input
    assert high.model.diffusion_model.patch_embedding.weight.shape[1] == 36      # 16 latent + 16 image + 4 mask
    assert backbone_for(wan21_i2v).model_class == backbone_for(high).model_class == "WAN21"


def reuses_only_its_own_start_image(comfy, model, requests: dict, cache_dir, kept_first_frame=False) -> None:
    """requests: image -> (positive, negative, latent), one prompt. Each image's miss equals KSampler; the second
    image is a miss that names the start image; each exact repeat returns its own image's result with no model call;
    a prompt edit hits only its own image's generation. kept_first_frame: the latent's noise mask keeps the image in
    frame 0 (Wan 2.2 TI2V 5B, HunyuanVideo I2V v2), on a miss and on a hit."""
    counted = CallCounter(model)
    cache = open_cache(comfy, cache_dir)

    def first_frame_kept(out, latent):
        return not kept_first_frame or torch.allclose(out["samples"][:, :, 0], latent["samples"][:, :, 0], atol=1e-4)
    stored, references = {}, {}
    for image in IMAGES:
        positive, negative, latent = requests[image]
        reference = references[image] = ksampler(comfy, counted.model, positive, negative, latent)["samples"]
        full = counted.take()     # STEPS when cond and uncond batch, twice that when they cannot (v2's guiding frame)
        out, miss = sample(comfy, counted.model, cache, positive, negative, latent)
        assert not miss["reuse"] and counted.take() == full and miss["stored_as"]
        assert close(out["samples"], reference), (out["samples"] - reference).abs().max()
        assert first_frame_kept(out, latent)
        stored[image] = miss["stored_as"]
        if image == "forest":     # same prompt, same seed, other image: its own bucket, never the sunset's
            assert "differs in start image" in " ".join(miss["reasons"]), miss["reasons"]
    assert (references["sunset"] - references["forest"]).abs().max() > 1e-2     # the image does change the video
    for image in IMAGES:          # an exact repeat needs the same image: each gets its own stored result
        positive, negative, latent = requests[image]
        _, repeat = sample(comfy, counted.model, cache, positive, negative, latent)
        assert repeat["exact_repeat"] and repeat["entry_id"] == stored[image] and counted.take() == 0
    for image in IMAGES:          # a prompt edit hits, and only ever the generation of its own start image
        positive, negative, latent = requests[image]
        out, hit = sample(comfy, counted.model, cache, nudged(positive), negative, latent)
        assert hit["reuse"] and hit["entry_id"] == stored[image], hit["reasons"]
        assert counted.take() < full and first_frame_kept(out, latent)


def test_wan21_i2v_reuses_only_generations_of_the_same_start_image(comfy, plugin, wan21_i2v, conds, tmp_path):
    requests = {image: wan_image_to_video(comfy, conds, image, clip_vision=True) for image in IMAGES}
    reuses_only_its_own_start_image(comfy, wan21_i2v, requests, tmp_path / "cache")


def test_the_start_image_and_its_clip_vision_encoding_are_part_of_the_bucket(comfy, plugin, wan21_i2v, conds):
    from carnator_engine.hosts.comfyui import ComfyRunner

    def runner(positive, negative, **kwargs):
        return ComfyRunner(wan21_i2v, positive, negative, CFG, "euler", "simple", steps=STEPS, **kwargs)
    positive, negative, _ = wan_image_to_video(comfy, conds, "sunset", clip_vision=True)
    base = runner(positive, negative)
    other_clip = [[t, {**o, "clip_vision_output": clip_vision_output("forest")}] for t, o in positive]
    text_only = runner(*conds)
    assert text_only.image_fingerprint == ""                          # text-to-video buckets stay as they were
    assert base.image_fingerprint and base.model_fingerprint == text_only.model_fingerprint
    clip_changed = runner(other_clip, negative)
    assert clip_changed.image_fingerprint != base.image_fingerprint
    assert clip_changed.request_fingerprint != base.request_fingerprint
    assert runner(nudged(positive), negative).image_fingerprint == base.image_fingerprint   # the prompt is not


def test_wan22_i2v_two_experts_miss_equals_the_template_and_hits_its_own_image(comfy, plugin, conds, tmp_path,
                                                                               host_dirs):
    from test_two_experts import template
    names = ((hostsetup.TINY_WAN22_I2V_HIGH, 15), (hostsetup.TINY_WAN22_I2V_LOW, 16))
    high, low = (load(comfy, hostsetup.build_tiny_wan(host_dirs["models"], seed=seed, name=name,
                                                      image_to_video="wan22"), shift=8.0) for name, seed in names)
    counted_high, counted_low = CallCounter(high), CallCounter(low)
    cache = open_cache(comfy, tmp_path / "cache")
    stored = {}
    for image in IMAGES:
        positive, negative, latent = wan_image_to_video(comfy, conds, image, clip_vision=False)
        reference = template(comfy, high, low, positive, negative, latent)["samples"]
        out, miss = sample(comfy, counted_high.model, cache, positive, negative, latent,
                           low_noise_model=counted_low.model, switch_step=SWITCH)
        assert not miss["reuse"] and (counted_high.take(), counted_low.take()) == (SWITCH, STEPS - SWITCH)
        assert close(out["samples"], reference), (out["samples"] - reference).abs().max()
        stored[image] = miss["stored_as"]
    for image in IMAGES:
        positive, negative, latent = wan_image_to_video(comfy, conds, image, clip_vision=False)
        _, hit = sample(comfy, counted_high.model, cache, nudged(positive), negative, latent,
                        low_noise_model=counted_low.model, switch_step=SWITCH)
        assert hit["reuse"] and hit["entry_id"] == stored[image], hit["reasons"]
        k = hit["resume_step"]
        assert counted_low.take() == STEPS - max(k, SWITCH)


@pytest.fixture(scope="module")
def wan22_5b(comfy, host_dirs):
    return load(comfy, hostsetup.build_tiny_wan(host_dirs["models"], seed=13, name=hostsetup.TINY_WAN22_5B,
                                                channels=48))


def ti2v_latent(comfy, image: str) -> dict:
    """Wan22ImageToVideoLatent with `image`: 256x256 (16x16 latent cells), 17 frames; the image in frame 0."""
    vae = hostsetup.fixture_module().PixelPoolVAE(48)
    return run_v3(comfy, "Wan22ImageToVideoLatent", vae, 256, 256, 17, 1, start_image=hostsetup.start_image(image))[0]


def test_ti2v_5b_keeps_the_start_image_and_reuses_only_its_generations(comfy, plugin, wan22_5b, conds, tmp_path):
    positive, negative = conds
    requests = {image: (positive, negative, ti2v_latent(comfy, image)) for image in IMAGES}
    mask = requests["sunset"][2]["noise_mask"]
    assert mask[:, :, 0].max() == 0 and mask[:, :, 1:].min() == 1
    reuses_only_its_own_start_image(comfy, wan22_5b, requests, tmp_path / "cache", kept_first_frame=True)
    out, _ = sample(comfy, wan22_5b, open_cache(comfy, tmp_path / "other"), *requests["sunset"])
    assert torch.equal(out["noise_mask"], mask)                           # passed on, as KSampler's output does


@pytest.fixture(scope="module")
def hunyuan_i2v(comfy, host_dirs):
    name = hostsetup.build_tiny_hunyuan(host_dirs["models"], in_channels=33,
                                        name="carnator_test_tiny_HunyuanVideoI2V.safetensors")
    model = load(comfy, name)
    assert type(model.model).__name__ == "HunyuanVideoI2V"
    return model


def hunyuan_image_to_video(comfy, image: str, guidance_type: str):
    """(positive, latent) from HunyuanImageToVideo with `image`: 128x128, 17 frames."""
    vae = hostsetup.fixture_module().PixelPoolVAE(16)
    return node(comfy, "HunyuanImageToVideo").encode(hostsetup.hunyuan_conditioning(1), vae, 128, 128, 17, 1,
                                                     guidance_type, start_image=hostsetup.start_image(image))


@pytest.mark.parametrize("guidance_type", ["v1 (concat)", "v2 (replace)"])
def test_hunyuan_video_i2v_reuses_only_generations_of_the_same_start_image(comfy, plugin, hunyuan_i2v, tmp_path,
                                                                           guidance_type):
    negative = hostsetup.hunyuan_conditioning(2)
    requests = {}
    for image in IMAGES:
        positive, latent = hunyuan_image_to_video(comfy, image, guidance_type)
        requests[image] = (positive, negative, latent)
    reuses_only_its_own_start_image(comfy, hunyuan_i2v, requests, tmp_path / "cache",
                                    kept_first_frame=guidance_type.startswith("v2"))


def test_ti2v_runner_resumes_a_masked_trajectory_at_any_step(comfy, plugin, wan22_5b, conds):
    """From step k on, the runner continues KSampler's masked trajectory exactly (the noise carries x_k, the kept
    latent stays the sampler's latent_image)."""
    from comfy.sample import prepare_noise
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.observer import GenerationObserver
    positive, negative = conds
    latent = ti2v_latent(comfy, "sunset")
    runner = ComfyRunner(wan22_5b, positive, negative, CFG, "euler", "simple", steps=STEPS, seed=SEED,
                         latent_image=latent["samples"], noise_mask=latent["noise_mask"])
    noise = prepare_noise(latent["samples"], SEED)
    reference = ksampler(comfy, wan22_5b, positive, negative, latent)["samples"]
    for k in (1, 6, 9):
        entering = runner.run(noise, runner.sigmas, 0, k, GenerationObserver())
        rest = runner.run(entering, runner.sigmas, k, STEPS, GenerationObserver())
        assert close(runner.to_latent_format(rest), reference, 1e-4)


def test_staged_nodes_take_an_image_to_video_request(comfy, plugin, wan21_i2v, conds, tmp_path):
    cache = open_cache(comfy, tmp_path / "cache")
    sunset = wan_image_to_video(comfy, conds, "sunset", clip_vision=True)
    forest = wan_image_to_video(comfy, conds, "forest", clip_vision=True)
    _, miss = sample(comfy, wan21_i2v, cache, *sunset)

    def stages(positive, negative, latent):
        probe = run_v3(comfy, "CarnatorEarlyProbe", wan21_i2v, nudged(positive), negative, latent, SEED, STEPS, CFG,
                       "euler", "simple", PROBE, 64, cache=cache)[0]
        matches = run_v3(comfy, "CarnatorSignatureCacheLookup", cache, probe, 3)[0]
        decision = run_v3(comfy, "CarnatorCompatibilityGate", probe, matches, "balanced")[0]
        latent_out, summary = run_v3(comfy, "CarnatorTrajectoryResume", cache, probe, decision, True)
        return matches, decision.decision, latent_out

    matches, decision, _ = stages(*forest)
    assert matches.candidates == [] and not decision.reuse
    assert "differs in start image" in " ".join(decision.reasons), decision.reasons
    matches, decision, out = stages(*sunset)
    assert decision.reuse and decision.entry_id == miss["stored_as"], decision.reasons
    assert out["samples"].shape == sunset[2]["samples"].shape


def test_a_noise_mask_on_other_models_is_still_refused(comfy, plugin, wan21_i2v, conds, latent, tmp_path):
    masked = {**latent, "noise_mask": torch.ones(1, 1, *latent["samples"].shape[2:])}
    with pytest.raises(ValueError, match=r"input 'latent_image': carries a noise mask .* only for Wan 2.2 TI2V 5B"):
        sample(comfy, wan21_i2v, open_cache(comfy, tmp_path / "cache"), *conds, masked)
