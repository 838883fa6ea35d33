"""The cross-request caches a creator could use instead of Carnator, each with its own decision rule, for the demo
model's runner (benchmarks/quality.py runs them; benchmarks/trace.py replays the creator trace through them).

Every cache serves one request at a time, `generate(runner, noise, sigmas, request) -> Served`, keeps what it needs
of earlier requests of the same cache (one cache per method and request set, cold at its start) and counts the
model calls it ran: a skipped step is not computed.

- text_similarity (`TextSimilarityCache`, NIRVANA-style): the nearest earlier prompt by the cosine of their sentence
  embeddings; at or above a threshold, its latent at a fixed step is resumed.
- cacheseek (`cacheseek_cache`, CacheSeek's approximate reuse for Wan 2.2, Tele-AI, Apache-2.0): the same lookup
  with CacheSeek's threshold and skip depth (`cacheseek_skip_step`); the trace's sentence encoder stands in for its
  Qwen3-VL embedding and reranker models.
- redi (`ReDiCache`, ReDi, ICML 2023): the nearest earlier trajectory by the distance of the latents after the first
  steps; under a distance threshold, the request resumes from that trajectory's later latent.
- comfyui_cache (`ComfyUICache`, ComfyUI's own execution cache): a request identical to the previous one of the same
  server lifetime costs nothing; everything else is generated in full.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from carnator_engine.observer import CheckpointRecorder, GenerationObserver

METHODS = ("text_similarity", "cacheseek", "redi", "comfyui_cache")

# CacheSeek's defaults (cacheseek/service/config.py, CacheConfig): the donor's latents are saved entering steps
# 5, 10, 15, 20 and 25 of the Wan 2.2 schedule, which the trace reads as 50 steps; a hit skips at most 5 steps,
# landing on the largest saved step within that bound; a hit needs a reranker score >= 0.80.
CACHESEEK_SAVED_STEPS = (5, 10, 15, 20, 25)
CACHESEEK_MAX_SKIP = 5
CACHESEEK_SCHEDULE = 50
CACHESEEK_THRESHOLD = 0.80

# ReDi's distance limit, relative (||query - key|| / ||query||) after the probe steps. ReDi's knowledge base holds
# trajectories of one seed, so its nearest neighbour always shares the request's noise. On the creator trace (80
# requests per seed habit, 20 steps, key after 3) requests of the same seed lay at 0 to 0.16 of each other and
# requests of different seeds at 1.39-1.40 (about sqrt 2: the noise still dominates): 0.5 accepts the neighbours
# ReDi's knowledge base would hold and refuses other noises; any limit from 0.2 to 1.3 decides alike there.
REDI_THRESHOLD = 0.5


class Served(NamedTuple):
    """How a cache served one request: its final latent, whether an earlier request's state was reused, the model
    calls it ran, the step it resumed at (0: none; the schedule's length: nothing computed) and whether it was an
    exact repeat answered without a model call."""

    latent: torch.Tensor
    reused: bool
    calls: int
    resume_step: int
    exact_repeat: bool = False


def _generate_in_full(runner, noise, sigmas, keep: frozenset):
    """The whole schedule from the request's noise: (latent, model calls, the latents entering the `keep` steps)."""
    observer = GenerationObserver(checkpoints=CheckpointRecorder(keep))
    latent = runner.run(noise * float(sigmas[0]), sigmas, 0, len(sigmas) - 1, observer)
    return latent, observer.forwards, observer.checkpoints.latents


def _resume(runner, latent, sigmas, step: int):
    """The schedule from `step` on, from a latent entering it: (final latent, model calls)."""
    observer = GenerationObserver()
    final = runner.run(latent.float(), sigmas, step, len(sigmas) - 1, observer)
    return final, observer.forwards


class TextSimilarityCache:
    """Prompt-embedding cosine picks the entry, the resume step is fixed: the nearest earlier generation's prompt (by
    the cosine of normalized sentence embeddings) scoring at least `threshold` lends its latent entering
    `resume_step`; the request runs the steps from there (a resume step of 0 skips nothing: every request is a miss,
    as CacheSeek treats a skip of 0). A miss generates in full and becomes an entry (a hit does not: its early
    latents are the donor's)."""

    def __init__(self, encoder, threshold: float, resume_step: int):
        if not 0 <= resume_step:
            raise ValueError(f"resume_step must be >= 0, got {resume_step}")
        self.encoder, self.threshold, self.resume_step = encoder, threshold, resume_step
        self.entries = []  # (embedding, latent entering resume_step)

    def nearest(self, embedding: torch.Tensor) -> tuple:
        """(entry, its cosine with `embedding`) of the entry nearest in meaning, (None, -inf) when there is none."""
        scored = [(entry, float(entry[0] @ embedding)) for entry in self.entries]
        return max(scored, key=lambda pair: pair[1], default=(None, -math.inf))

    def generate(self, runner, noise, sigmas, request) -> Served:
        embedding = torch.as_tensor(self.encoder.encode([request.prompt], normalize_embeddings=True))[0]
        best, score = self.nearest(embedding)
        if best is not None and score >= self.threshold and self.resume_step > 0:
            latent, calls = _resume(runner, best[1], sigmas, self.resume_step)
            return Served(latent, True, calls, self.resume_step)
        latent, calls, kept = _generate_in_full(runner, noise, sigmas, frozenset({self.resume_step}))
        self.entries.append((embedding, kept[self.resume_step]))
        return Served(latent, False, calls, 0)


def cacheseek_skip_step(steps: int) -> int:
    """CacheSeek's skip depth K on a schedule of `steps`: its saved steps and its bound (at most 5 of 50 skipped)
    are shares of its schedule, scaled to this one, and K is the largest saved step within the bound (their
    `_determine_skip_step` without the staircase, which is off by default). On the trace's 20 steps: saved steps
    2, 4, 6, 8, 10, bound 2, so K = 2 of 20 (10 %), as 5 of 50. 0 when no saved step fits: then every request is a
    miss, as in CacheSeek."""
    saved = [round(s * steps / CACHESEEK_SCHEDULE) for s in CACHESEEK_SAVED_STEPS]
    bound = round(CACHESEEK_MAX_SKIP * steps / CACHESEEK_SCHEDULE)
    return max((s for s in saved if 0 < s <= bound), default=0)


def cacheseek_cache(encoder, threshold: float, steps: int) -> TextSimilarityCache:
    """CacheSeek's rule: the nearest earlier prompt (top 1, here by sentence-embedding cosine in place of their
    Qwen3-VL retrieval and reranker) at or above `threshold` (theirs: a reranker score of 0.80) lends its latent at
    step K (`cacheseek_skip_step`), and the request skips its first K steps."""
    return TextSimilarityCache(encoder, threshold, cacheseek_skip_step(steps))


def redi_resume_step(steps: int, key_step: int) -> int:
    """ReDi's resume step v on a schedule of `steps` with the key after `key_step` steps: the one that halves a
    hit's model calls (key_step computed, then steps - v), ReDi's reported 2x; 13 of 20 with the key at 3."""
    return min(steps - 1, key_step + math.ceil(steps / 2))


class ReDiCache:
    """ReDi's rule (Zhang et al., ICML 2023, "ReDi: Efficient Learning-Free Diffusion Inference via Trajectory
    Retrieval"): run the first `key_step` steps, find the stored trajectory whose latent after those steps (its key)
    is nearest in L2 distance, and continue from that trajectory's latent entering `resume_step` (its value), scaled
    by the least-squares weight of the key against the query (their released code with one neighbour). ReDi always
    resumes from its precomputed knowledge base (of one seed, in their released code); a growing cache needs a
    limit, so it resumes only when the relative distance ||query - key|| / ||query|| is at most `threshold`. No
    signature, region or other gate. A miss continues its own trajectory and becomes an entry."""

    def __init__(self, key_step: int, resume_step: int, threshold: float):
        if not 0 < key_step < resume_step:
            raise ValueError(f"ReDi needs 0 < key step ({key_step}) < resume step ({resume_step})")
        if not threshold >= 0:
            raise ValueError(f"ReDi's distance threshold must be >= 0, got {threshold}")
        self.key_step, self.resume_step, self.threshold = key_step, resume_step, threshold
        self.keys = None    # [entries, ...]: each entry's latent after key_step steps
        self.values = []    # each entry's latent entering resume_step

    def nearest(self, query: torch.Tensor) -> tuple:
        """(index, relative L2 distance to `query`) of the nearest key, (None, inf) when there is none."""
        if self.keys is None:
            return None, math.inf
        distances = (self.keys - query.float()).flatten(1).norm(dim=1) / query.float().norm().clamp_min(1e-12)
        index = int(distances.argmin())
        return index, float(distances[index])

    def generate(self, runner, noise, sigmas, request) -> Served:
        steps = len(sigmas) - 1
        observer = GenerationObserver(checkpoints=CheckpointRecorder(frozenset({self.resume_step})))
        query = runner.run(noise * float(sigmas[0]), sigmas, 0, self.key_step, observer)
        index, distance = self.nearest(query)
        if index is not None and distance <= self.threshold:
            key = self.keys[index]
            weight = float((key * query.float()).sum() / (key * key).sum().clamp_min(1e-12))
            value = self.values[index].to(query.device).float()
            latent, calls = _resume(runner, weight * value, sigmas, self.resume_step)
            return Served(latent, True, observer.forwards + calls, self.resume_step)
        latent = runner.run(query, sigmas, self.key_step, steps, observer)
        key = query.detach().float()[None]
        self.keys = key if self.keys is None else torch.cat([self.keys, key])
        self.values.append(observer.checkpoints.latents[self.resume_step])
        return Served(latent, False, observer.forwards, 0)


class ComfyUICache:
    """ComfyUI's execution cache (the default, classic): after each run the server keeps the outputs of that run's
    nodes only, keyed by their inputs, so a graph identical to the previous one (here: the same prompt and seed, all
    else being fixed in the trace) is answered from memory without running the sampler, while any change reruns the
    sampler in full. The cache lives as long as the server: it restarts at every session boundary of the trace (a
    session is one sitting; the request's `session` tag), so nothing carries from one session to the next."""

    def __init__(self):
        self.previous: Optional[tuple] = None   # (session, prompt, seed, final latent)

    def generate(self, runner, noise, sigmas, request) -> Served:
        steps = len(sigmas) - 1
        session = (getattr(request, "tags", None) or {}).get("session")
        if self.previous is not None and self.previous[:3] == (session, request.prompt, request.seed):
            return Served(self.previous[3], True, 0, steps, exact_repeat=True)
        latent, calls, _ = _generate_in_full(runner, noise, sigmas, frozenset())
        self.previous = (session, request.prompt, request.seed, latent)
        return Served(latent, False, calls, 0)


def add_arguments(parser) -> None:
    """The settings of these caches, for a benchmark's command line."""
    parser.add_argument("--text-threshold", type=float, default=0.90,
                        help="cosine at or above which text_similarity reuses (prompts of one edit score 0.93-0.99)")
    parser.add_argument("--text-resume-step", type=int, default=10, help="the step text_similarity resumes at")
    parser.add_argument("--cacheseek-threshold", type=float, default=CACHESEEK_THRESHOLD,
                        help="prompt-embedding cosine at or above which cacheseek reuses (CacheSeek's reranker "
                        "threshold, 0.80)")
    parser.add_argument("--redi-threshold", type=float, default=REDI_THRESHOLD,
                        help="relative L2 distance of the latents after the probe steps at or below which redi "
                        "resumes from the nearest trajectory")
    parser.add_argument("--redi-resume-step", type=int, default=None,
                        help="the step redi resumes at (default: the one that halves a hit's model calls, ReDi's 2x)")


def check_arguments(args, methods, error) -> None:
    """Refuses settings of these caches that cannot run, through `error` (argparse's parser.error)."""
    if "text_similarity" in methods and not 1 <= args.text_resume_step < args.steps:
        error(f"--text-resume-step ({args.text_resume_step}) must be between 1 and --steps - 1 ({args.steps - 1})")
    if "redi" in methods:
        resume = redi_step(args)
        if not args.probe_steps < resume < args.steps:
            error(f"--redi-resume-step ({resume}) must be between --probe-steps + 1 ({args.probe_steps + 1}) and "
                  f"--steps - 1 ({args.steps - 1})")
        if not args.redi_threshold >= 0:
            error(f"--redi-threshold ({args.redi_threshold}) must be >= 0")


def redi_step(args) -> int:
    return args.redi_resume_step or redi_resume_step(args.steps, args.probe_steps)


def make(method: str, args, text_encoder):
    """A fresh cache of one of METHODS with the run's settings."""
    if method == "text_similarity":
        return TextSimilarityCache(text_encoder, args.text_threshold, args.text_resume_step)
    if method == "cacheseek":
        return cacheseek_cache(text_encoder, args.cacheseek_threshold, args.steps)
    if method == "redi":
        return ReDiCache(args.probe_steps, redi_step(args), args.redi_threshold)
    if method == "comfyui_cache":
        return ComfyUICache()
    raise ValueError(f"{method!r} is not one of {METHODS}")


def needs_text_encoder(method: str) -> bool:
    return method in ("text_similarity", "cacheseek")
