"""HunyuanVideo through the real host: joint attention over the video tokens then the text tokens.

A tiny HunyuanVideo (ComfyUI's own class: one double-stream and one single-stream block, loaded by UNETLoader)
with conditioning shaped as its text encoders give it (llama hidden states plus the CLIP-L pooled vector).
"""
from __future__ import annotations

import pytest
import torch

import hostsetup
from conftest import CallCounter
from test_comfyui_host import CFG, PROBE, SEED, STEPS, node, nudged, open_cache, sample

TOKENS = 5 * 8 * 8            # the video tokens of the test latent


@pytest.fixture(scope="module")
def hunyuan(comfy, host_dirs):
    name = hostsetup.build_tiny_hunyuan(host_dirs["models"])
    model = node(comfy, "UNETLoader").load_unet(name, "default")[0]
    assert type(model.model).__name__ == "HunyuanVideo"
    return model


def ksampler(comfy, model, positive, negative, latent, steps=STEPS):
    return node(comfy, "KSampler").sample(model, SEED, steps, CFG, "euler", "simple", positive, negative, latent)[0]


class JointObserver:
    """Counts what the hooks report: block states cut to the video tokens, attention over video + text."""

    def __init__(self):
        from carnator_engine.observer import GenerationObserver
        self.inner = GenerationObserver()
        self.blocks, self.attention = set(), []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def block_output(self, index, hidden):
        self.blocks.add((index, tuple(hidden.shape)))

    def self_attention(self, index, q, k, v, dense, video_tokens=None, host_sdpa=False):
        self.attention.append((index, q.shape[2], k.shape[2], video_tokens))
        return dense(q, k, v)


@pytest.mark.parametrize("padded", [0, 8])
def test_runner_reproduces_ksampler_with_joint_attention(comfy, plugin, hunyuan, latent, padded):
    """Unpadded text, and text whose last 8 tokens are masked out (the padded keys are dropped, exactly)."""
    from comfy.sample import prepare_noise
    from carnator_engine.hosts.comfyui import ComfyRunner
    positive, negative = hostsetup.hunyuan_conditioning(1, padded=padded), hostsetup.hunyuan_conditioning(2)
    reference = ksampler(comfy, hunyuan, positive, negative, latent)["samples"]
    runner = ComfyRunner(hunyuan, positive, negative, CFG, "euler", "simple", steps=STEPS, seed=SEED)
    observer = JointObserver()
    noise = prepare_noise(latent["samples"], SEED)
    out = runner.to_latent_format(runner.run(noise, runner.sigmas, 0, STEPS, observer))
    assert (out - reference).abs().max() < 1e-5 * max(1.0, float(reference.abs().max()))
    assert {index for index, _ in observer.blocks} == {0, 1}                 # double-stream, single-stream
    assert {shape[1:] for _, shape in observer.blocks} == {(TOKENS, 256)}    # the video stream only
    text = hostsetup.HUNYUAN_TEXT[0]
    assert {(q, video) for _, q, _, video in observer.attention} == {(TOKENS + text, TOKENS)}
    assert {k for _, _, k, _ in observer.attention} == {TOKENS + text, TOKENS + text - padded}


def test_joint_sparse_attention_keeps_text_rows_and_columns_dense():
    from carnator_engine.observer import GenerationObserver
    from carnator_engine.attention.sparse import BlockSparseAttention, expand_token_mask, with_dense_tail
    generator = torch.Generator().manual_seed(0)
    video, text, block = 96, 40, 32
    q, k, v = (torch.randn(1, 2, video + text, 16, generator=generator) for _ in range(3))
    table = torch.eye(3, dtype=torch.bool)                  # each video block sees only itself
    observer = GenerationObserver(sparse=BlockSparseAttention({0: table}, block_size=block, seq_len=video))
    out = observer.self_attention(0, q, k, v, video_tokens=video)
    allowed = torch.ones(video + text, video + text, dtype=torch.bool)
    allowed[:video, :video] = expand_token_mask(table, block, video, video)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    assert torch.allclose(out, reference, atol=1e-5)
    # a video length that is not a multiple of the block size: the block shared with text is dense
    joint = with_dense_tail(torch.zeros(4, 4, dtype=torch.bool), block, 100, 140, 140)
    assert joint.shape == (5, 5) and not joint[:3, :3].any() and joint[3:].all() and joint[:, 3:].all()


def test_sampler_miss_then_hit_with_fewer_calls(comfy, plugin, hunyuan, latent, tmp_path):
    counter = CallCounter(hunyuan)
    positive, negative = hostsetup.hunyuan_conditioning(1), hostsetup.hunyuan_conditioning(2)
    cache = open_cache(comfy, tmp_path / "cache")
    first, miss = sample(comfy, counter.model, cache, positive, negative, latent)
    assert not miss["reuse"] and counter.take() == STEPS
    reference = ksampler(comfy, hunyuan, positive, negative, latent)["samples"]
    assert (first["samples"] - reference).abs().max() < 1e-5 * max(1.0, float(reference.abs().max()))
    tables = cache.trajectory(cache.record(miss["stored_as"])).connectivity
    assert {name for name in tables if name != "block_size"} == {"0", "1"}   # both blocks' video-video tables

    second, hit = sample(comfy, counter.model, cache, nudged(positive), negative, latent)
    assert hit["reuse"] and hit["resume_step"] > PROBE, hit["reasons"]
    assert counter.take() == hit["model_calls"] == PROBE + STEPS - hit["resume_step"] < STEPS
    assert (second["samples"] - first["samples"]).norm() / first["samples"].norm() < 0.05

    other = hostsetup.hunyuan_conditioning(99, scale=3.0)
    _, refused = sample(comfy, counter.model, cache, other, negative, latent)
    assert not refused["reuse"] and counter.take() == STEPS


def test_skyreels_image_to_video_miss_equals_ksampler(comfy, plugin, host_dirs, latent, tmp_path):
    """SkyReels I2V (32 input channels: the latent and the image latent, ComfyUI's concat_keys) samples as KSampler
    does; the start image's cache behaviour is tested with HunyuanVideo I2V in test_image_to_video.py."""
    name = hostsetup.build_tiny_hunyuan(host_dirs["models"], in_channels=32,
                                        name="carnator_test_tiny_HunyuanVideoSkyreelsI2V.safetensors")
    model = node(comfy, "UNETLoader").load_unet(name, "default")[0]
    assert type(model.model).__name__ == "HunyuanVideoSkyreelsI2V"
    image = torch.rand(1, 16, 16, 16, generator=torch.Generator().manual_seed(3))[:, :, None].expand(1, 16, 5, 16, 16)
    positive = [[t, {**o, "concat_latent_image": image}] for t, o in hostsetup.hunyuan_conditioning(1)]
    negative = hostsetup.hunyuan_conditioning(2)
    reference = ksampler(comfy, model, positive, negative, latent)["samples"]
    out, miss = sample(comfy, model, open_cache(comfy, tmp_path / "cache"), positive, negative, latent)
    assert not miss["reuse"] and (out["samples"] - reference).abs().max() < 1e-5 * max(1.0, float(reference.abs().max()))
