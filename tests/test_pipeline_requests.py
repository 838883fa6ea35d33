"""Requests through the engine API that earlier versions got wrong: a hit repeated, a candidate that cannot
continue the request, inputs of the wrong kind."""
import pytest
import torch

from carnator_engine.euler import TinyDiTRunner
from carnator_engine.pipeline import CarnatorConfig, decide, generate, lookup, probe, resume
from carnator_engine.schedule import flow_sigmas
from carnator_engine.signature import EarlySignature
from carnator_engine.store import StoreError, TrajectoryPayload

SIGMAS = flow_sigmas(12)
PROMPT = "a red circle moving left"


def _noise(seed, nudge=0.0):
    return torch.randn(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(seed)) * (1 + nudge)


def _config(**kwargs):
    return CarnatorConfig(probe_steps=2, block_size=64, **kwargs)


def test_a_candidate_whose_latent_shape_differs_is_a_full_generation_with_a_warning(tiny_model, store):
    first = generate(TinyDiTRunner(tiny_model, PROMPT), _noise(1), SIGMAS, store, _config(), PROMPT, 1)
    record = store.record(first.entry_id)
    payload = store.trajectory(record)
    halved = {step: latent[..., ::2, ::2].contiguous() for step, latent in payload.checkpoints.items()}
    odd = store.put(bucket=record.bucket, prompt=PROMPT, seed=1, steps=12, probe_steps=2,
                    signature=store.signature(record), payload=TrajectoryPayload(halved, {}),
                    latent_shape=next(iter(halved.values())).shape)
    store.delete(first.entry_id)
    result = generate(TinyDiTRunner(tiny_model, PROMPT), _noise(1, nudge=1e-4), SIGMAS, store, _config(), PROMPT, 1)
    assert not result.decision.reuse and result.model_calls == 12
    assert any(odd in w and "shape" in w and "generated in full" in w for w in result.warnings)
    assert result.latent.shape == _noise(1).shape


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_noise_that_is_not_floating_point_is_refused_before_anything_runs(tiny_model, store, dtype):
    noise = _noise(1).to(dtype)
    with pytest.raises(ValueError, match=f"noise are a dtype {dtype}, not a floating-point tensor"):
        generate(TinyDiTRunner(tiny_model, PROMPT), noise, SIGMAS, store, _config())
    with pytest.raises(ValueError, match="not a floating-point tensor"):
        probe(TinyDiTRunner(tiny_model, PROMPT), noise, SIGMAS, _config())
    assert store.stats()["entries"] == 0


@pytest.mark.parametrize("parts, expected", [
    ((torch.ones(2, 3, 64), torch.ones(3, 4, 4), torch.ones(3, 4, 4)), "denoised has shape"),
    ((torch.ones(2, 3, 10), torch.ones(3, 4, 4, 4), torch.ones(3, 4, 4)), "64 features"),
    ((torch.ones(2, 3, 64, dtype=torch.int64), torch.ones(3, 4, 4, 4), torch.ones(3, 4, 4)), "hidden is a dtype"),
    (([1.0], torch.ones(3, 4, 4, 4), torch.ones(3, 4, 4)), "hidden is a list"),
    ((torch.ones(2, 3, 64), torch.ones(3, 4, 4, 4), torch.ones(3, 4, 5)), "not square"),
])
def test_a_malformed_signature_is_a_clear_error(parts, expected):
    with pytest.raises(ValueError, match=expected):
        EarlySignature(*parts)


def test_storing_something_that_is_not_a_signature_is_a_store_error(store):
    latent = torch.zeros(1, 1, 1, 1, 8).half()
    with pytest.raises(StoreError, match="not an Early Signature"):
        store.put(bucket="b", prompt="p", seed=0, steps=10, probe_steps=2, signature="not a signature",
                  payload=TrajectoryPayload({4: latent}, {}), latent_shape=latent.shape)
