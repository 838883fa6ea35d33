"""benchmarks/prior_caches.py: the decision rules of the cross-request caches the creator trace compares Carnator
with (CacheSeek's, ReDi's, ComfyUI's execution cache), on a toy runner whose every step is known."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from carnator_engine.observer import GenerationObserver
from test_quality_smoke import _script

caches = _script("prior_caches")
N = 20


class ToyRunner:
    """x <- x / 2 + the prompt's offset at every step, one model call each."""

    def __init__(self, offset: float = 0.0):
        self.offset = offset

    def run(self, x, sigmas, start, end, observer):
        for step in range(start, end):
            observer.begin_step(step, x)
            observer.forward()
            x = x / 2 + self.offset
            observer.step_end(step, x, x)
        return x


class ToyEncoder:
    """Normalized 2-d embeddings: a prompt's angle from the first one sets its cosine with it."""

    def __init__(self, cosines: dict):
        self.cosines = cosines

    def encode(self, prompts, normalize_embeddings=True):
        return torch.tensor([[c, math.sqrt(max(0.0, 1 - c * c))] for c in (self.cosines[p] for p in prompts)])


def _request(prompt, seed=0, session=0):
    return SimpleNamespace(prompt=prompt, seed=seed, tags={"session": session})


SIGMAS = torch.linspace(1, 0, N + 1)


def _plain(noise, offset=0.0, start=0, end=N):
    """The toy runner's latent entering step `end`, from `noise` entering `start`."""
    observer = GenerationObserver()
    return ToyRunner(offset).run(noise, SIGMAS, start, end, observer)


def test_cacheseek_skips_the_first_tenth_of_the_steps_on_its_saved_steps():
    # saved steps 5..25 and at most 5 skipped, of 50: scaled to the schedule, K is the largest saved step in bound
    assert caches.cacheseek_skip_step(50) == 5
    assert caches.cacheseek_skip_step(20) == 2          # the trace: 2 of 20, 10 %
    assert caches.cacheseek_skip_step(40) == 4
    assert caches.cacheseek_skip_step(100) == 10
    assert caches.cacheseek_skip_step(4) == 0           # too short: no saved step within the bound, never a hit
    short = caches.cacheseek_cache(ToyEncoder({"a": 1.0}), 0.8, 4)
    served = [short.generate(ToyRunner(), torch.ones(1, 4), SIGMAS[::5], _request("a")) for _ in range(2)]
    assert [(s.reused, s.calls) for s in served] == [(False, 4), (False, 4)]


def test_cacheseek_reuses_the_nearest_prompt_at_or_above_its_threshold_and_refuses_under_it():
    encoder = ToyEncoder({"donor": 1.0, "close": 0.85, "edge": 0.80, "far": 0.79})
    cache = caches.cacheseek_cache(encoder, caches.CACHESEEK_THRESHOLD, N)
    donor_noise = torch.full((1, 4), 8.0)
    first = cache.generate(ToyRunner(1.0), donor_noise, SIGMAS, _request("donor"))
    assert (first.reused, first.calls, first.resume_step) == (False, N, 0)
    donor_at_k = _plain(donor_noise, 1.0, 0, 2).half().float()      # the donor's latent entering step 2
    for prompt in ("close", "edge"):
        hit = cache.generate(ToyRunner(3.0), torch.zeros(1, 4), SIGMAS, _request(prompt))
        assert (hit.reused, hit.calls, hit.resume_step) == (True, N - 2, 2)
        torch.testing.assert_close(hit.latent, _plain(donor_at_k, 3.0, 2, N))
    miss = cache.generate(ToyRunner(3.0), torch.zeros(1, 4), SIGMAS, _request("far"))
    assert (miss.reused, miss.calls) == (False, N)
    torch.testing.assert_close(miss.latent, _plain(torch.zeros(1, 4), 3.0))
    assert len(cache.entries) == 2                       # misses become entries, hits do not


def test_redi_resumes_from_the_nearest_trajectory_only_within_its_distance_threshold():
    assert caches.redi_resume_step(20, 3) == 13          # 3 + (20 - 13) = 10 calls: half, ReDi's 2x
    cache = caches.ReDiCache(key_step=3, resume_step=13, threshold=0.5)
    donor_noise = torch.full((1, 4), 8.0)
    first = cache.generate(ToyRunner(), donor_noise, SIGMAS, _request("a"))
    assert (first.reused, first.calls, first.resume_step) == (False, N, 0)
    torch.testing.assert_close(first.latent, _plain(donor_noise))
    # the same noise with another prompt: its key after 3 steps lies at 0.15 of the query (within 0.5)
    near = cache.generate(ToyRunner(0.1), donor_noise, SIGMAS, _request("b"))
    assert (near.reused, near.calls, near.resume_step) == (True, 3 + N - 13, 13)
    query, key = _plain(donor_noise, 0.1, 0, 3), _plain(donor_noise, 0, 0, 3)
    assert float((query - key).norm() / query.norm()) < 0.5
    weight = float((key * query).sum() / (key * key).sum())            # least squares of the key on the query
    value = _plain(donor_noise, 0, 0, 13).half().float()
    torch.testing.assert_close(near.latent, _plain(weight * value, 0.1, 13, N))
    # other noise: its key is far from every stored key, so it continues its own trajectory
    far = cache.generate(ToyRunner(0.1), -donor_noise, SIGMAS, _request("b", seed=1))
    assert (far.reused, far.calls) == (False, N)
    torch.testing.assert_close(far.latent, _plain(-donor_noise, 0.1))
    assert len(cache.values) == 2
    with pytest.raises(ValueError):
        caches.ReDiCache(key_step=5, resume_step=5, threshold=0.5)


def test_comfyui_cache_answers_only_the_previous_graph_again_within_one_session():
    cache = caches.ComfyUICache()
    noise = torch.ones(1, 4)
    served = [cache.generate(ToyRunner(), noise, SIGMAS, request) for request in (
        _request("a", 1), _request("a", 1),              # queued again unchanged: nothing to run
        _request("a", 2),                                # another seed: another graph
        _request("b", 2), _request("a", 2),              # back to an earlier graph, not the previous one
        _request("a", 2, session=1))]                    # the same graph after a server restart
    assert [(s.reused, s.exact_repeat, s.calls) for s in served] == \
        [(False, False, N), (True, True, 0), (False, False, N), (False, False, N), (False, False, N), (False, False, N)]
    assert served[1].resume_step == N and served[1].latent is served[0].latent


def test_the_settings_are_checked_before_any_model_call():
    args = SimpleNamespace(steps=20, probe_steps=3, text_resume_step=10, redi_resume_step=3, redi_threshold=0.5)
    said = []
    caches.check_arguments(args, ["redi"], said.append)
    assert said and "--redi-resume-step (3)" in said[0]
    said.clear()
    caches.check_arguments(SimpleNamespace(**{**vars(args), "redi_threshold": -1, "redi_resume_step": None}),
                           ["redi"], said.append)
    assert said == ["--redi-threshold (-1) must be >= 0"]
