import pytest
import torch

from carnator_engine.backbones import WAN21
from carnator_engine.localize import latent_mask, target_cells
from carnator_engine.resume import resume_latent
from carnator_engine.schedule import flow_sigmas, jump


def test_jump_stays_on_the_straight_flow_path():
    x0, noise = torch.randn(2, 3), torch.randn(2, 3)
    x_at = lambda sigma: (1 - sigma) * x0 + sigma * noise  # noqa: E731
    torch.testing.assert_close(jump(x_at(0.9), x0, 0.9, 0.4), x_at(0.4))


def test_resume_latent_takes_target_from_own_state_and_the_rest_from_cache():
    probe_latent, denoised, cached = torch.randn(1, 2, 3, 4, 4), torch.randn(1, 2, 3, 4, 4), torch.randn(1, 2, 3, 4, 4)
    target = torch.zeros(3, 4, 4, dtype=torch.bool)
    target[1, :2, :2] = True
    x = resume_latent(probe_latent, denoised, 0.9, 0.5, cached.half(), target)
    own = jump(probe_latent, denoised, 0.9, 0.5)
    torch.testing.assert_close(x[:, :, 1, :2, :2], own[:, :, 1, :2, :2])
    torch.testing.assert_close(x[:, :, 0], cached.half().float()[:, :, 0])
    with pytest.raises(ValueError, match="another latent size"):
        resume_latent(probe_latent, denoised, 0.9, 0.5, torch.randn(1, 2, 3, 4, 5), target)


def test_resume_latent_accepts_a_denoised_estimate_on_another_device_or_dtype():
    # ComfyRunner hands back the latent on the CPU while the sampler's x0 stays on the GPU (seen on an H200)
    probe_latent, cached = torch.randn(1, 2, 3, 4, 4), torch.randn(1, 2, 3, 4, 4).half()
    denoised = torch.randn(1, 2, 3, 4, 4, dtype=torch.float64)
    if torch.cuda.is_available():
        denoised = denoised.cuda()
    target = torch.ones(3, 4, 4, dtype=torch.bool)
    x = resume_latent(probe_latent, denoised, 0.9, 0.5, cached, target)
    assert x.device == probe_latent.device and x.dtype == probe_latent.dtype
    torch.testing.assert_close(x, jump(probe_latent, denoised.cpu().float(), 0.9, 0.5))


def test_target_cells_dilate_and_upsample_to_the_latent():
    cell_map = torch.zeros(4, 4, 4)
    cell_map[2, 2, 2] = 1.0
    cells = target_cells(cell_map, threshold=0.5)
    assert cells.sum() == 27 and cells[1:4, 1:4, 1:4].all()
    mask = latent_mask(cells, (8, 16, 16))
    assert mask.shape == (8, 16, 16) and mask.float().mean() == pytest.approx(27 / 64)
    with pytest.raises(ValueError, match="threshold"):
        target_cells(cell_map, threshold=0)


def test_wan_layout_maps_latent_regions_to_tokens():
    assert WAN21.token_grid((1, 16, 21, 60, 104)) == (21, 30, 52)
    mask = torch.zeros(2, 4, 4, dtype=torch.bool)
    mask[1, 0, 0] = True
    tokens = WAN21.tokens_from_latent_mask(mask)
    assert tokens.shape == (2 * 2 * 2,) and tokens.nonzero().flatten().tolist() == [4]
    with pytest.raises(ValueError, match="latent channels"):
        WAN21.token_grid((1, 4, 21, 60, 104))


def test_flow_sigmas_validate():
    sigmas = flow_sigmas(10)
    assert sigmas[0] == 1 and sigmas[-1] == 0 and (sigmas[1:] < sigmas[:-1]).all()
    with pytest.raises(ValueError):
        flow_sigmas(0)


def test_signature_records_every_view(live_tiny_model):
    from carnator_engine.euler import TinyDiTRunner
    from carnator_engine.observer import GenerationObserver
    from carnator_engine.signature import SignatureRecorder, signature_distance
    recorder = SignatureRecorder(probe_steps=2, block_size=64)
    runner = TinyDiTRunner(live_tiny_model, "a red circle")
    runner.run(torch.randn(1, 3, 8, 32, 32), flow_sigmas(10), 0, 2, GenerationObserver(signature=recorder))
    signature = recorder.signature()
    assert signature.hidden.shape == (2, 2, 64)
    assert signature.denoised.shape == (3, 8, 8, 8)
    assert signature.attention.shape == (2, 8, 8)
    torch.testing.assert_close(signature.attention.sum(-1), torch.ones(2, 8))
    assert signature_distance(signature, signature).denoised == 0
