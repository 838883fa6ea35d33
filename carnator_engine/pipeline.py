"""One request through Carnator: probe -> lookup -> gate -> resume (or continue) -> write-back (queued: store/write_back.py).

The four stages are separate functions so ComfyUI can expose each as a node; `generate` chains
them, after `replay`: a request whose every input matches an earlier full generation gets that
generation's stored result, with no model call. A runner is anything with `layout`,
`model_fingerprint` (everything on the model that changes its outputs), `sampler` (text naming the
sampler and its guidance scale), `request_fingerprint` (a digest of the request's own inputs besides
the noise: its conditioning, a stochastic sampler's seed), `run(x, sigmas, start, end, observer)` that
runs steps [start, end) and returns the latent entering `end`, and `preview(latent)` giving an RGB frame
[3, H, W] in [-1, 1] for the thumbnail. Optional: `uncacheable` (why this model must be generated without
the cache: an option its fingerprint cannot read), `model_text` (the model's options, for people),
`step_cache` (the per-request step cache running inside, by name), `counts_forwards` (the runner reports
each diffusion-model forward to observer.forward(); otherwise a step counts as one call),
`changed_since_fingerprint()` (why the model no longer matches its fingerprint, "" when it does) and
`fresh_step_cache()` (the next run starts its step cache afresh: after a region-only run, resume.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
import types
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import gate as gate_module
from . import resume as resume_stage
from .fingerprint import hash_values
from .store.index import (HELD_BUCKET, Candidate, bucket_difference, bucket_key, bucket_parts,
                          incomparable_bucket, nearest)
from .attention.sparse import tiled_block_size
from .observer import CheckpointRecorder, GenerationObserver
from .preview import thumbnail_png
from .resume import follow_entry
from .signature import EarlySignature, SignatureRecorder
from .store import CarnatorStore, StoreError, TrajectoryPayload, new_entry_id
from .store.vectors import warm_denoised_projection
from .store.write_back import PendingWrite

log = logging.getLogger("carnator")


@dataclass
class CarnatorConfig:
    probe_steps: int = 3
    risk: str = "balanced"
    block_size: int = 64            # tokens per attention block (128 on GPUs, FlexAttention's tile)
    attention_mass: float = 0.9     # share of pooled attention the cached connectivity keeps
    max_density: float = 1.0        # budget: share of key blocks a query block may keep (1 = mass alone decides)
    sparse_attention: bool = True   # ablation switch: resume with dense attention
    localize: bool = True           # ablation switch: copy the whole cached latent, no target region
    # Region-only resume (docs/region-resume.md): a hit's resumed steps run the target tokens and a halo only, every
    # other token is the cached generation's, the kept keys and values within the GPU memory plain sampling needed
    # (kept_kv). Off: at cfg 1 on the tiny Wan its result is further from plain sampling of the edit than a
    # whole-clip hit's by more than the 3 dB it may be (docs/region-resume.md says what was measured).
    region_only: bool = False
    region_max_share: float = 0.5   # beyond this share of the clip's tokens (halo included): whole-clip resume
    # full steps added to a region-only resume's first (and an expert switch's) at stored checkpoints of the cached
    # trajectory: the other tokens' keys and values the target attends to are refreshed from states the cached
    # generation passed through
    region_refresh_steps: int = 2
    # the region-only target adds to the gate's cells the fewest cells holding this share of the early estimates'
    # squared difference (localize.region_cells): a target that carries across models; 0: the gate's cells alone
    region_target_mass: float = 0.7
    # the share of this process's GPU high-water mark (a full step's peak) a region-only resume may add for the
    # kept keys and values (kept_kv.placement); beyond it they are streamed from host memory block by block
    region_memory_margin: float = 0.05
    # a region step's target attends only to the key blocks its query blocks reach in the cached generation's sparse
    # connectivity (with sparse_attention, on an entry that has it): fewer keys kept, moved and attended to; off until
    # its GPU speed and its quality are measured
    region_sparse_keys: bool = False
    # the kept keys and values in 8 bits, a float32 scale per row (kept_kv.quantize_rows): half the host memory,
    # pinning and bytes streamed per region step; on since it measured as 16 bits in quality (pooled sets, creator
    # trace) and lower in GPU and host memory, at about 16 bits' speed (docs/region-resume.md)
    region_kv_8bit: bool = True
    # ... dequantized on the GPU by a Triton kernel (kernels.dequantize: torch's values bit for bit, in one pass;
    # torch's multiply where Triton cannot run); on since it measured faster (H100: a region step at 10 % 72.8 ms
    # against 81.5)
    region_kv_triton: bool = True
    # a region step's target attends over every key on FlashAttention-4 (attention.fa4.dense) where it is installed
    # and the host attends with torch's own SDPA, instead of the host's kernel; on since it measured faster (H100: a
    # region step at 30 % 162 ms against cuDNN's 176-181, the same at 10 %); exact attention, so quality is unchanged
    region_fa4: bool = True
    max_checkpoints: int = 12
    lookup_limit: int = 3
    gate_overrides: dict = field(default_factory=dict)

    def policy(self) -> gate_module.GatePolicy:
        return gate_module.policy_for(self.risk, **self.gate_overrides)

    def reuse_settings(self) -> dict:
        """Every setting of this config, as a hit's result may depend on it, with the gate's overrides resolved into
        the policy they give: the same limits set through a risk preset or through overrides are one setting."""
        settings = dataclasses.asdict(self)
        del settings["gate_overrides"]
        return {**settings, "policy": dataclasses.asdict(self.policy())}

    def validate(self, steps: int) -> None:
        if steps < 2:
            raise ValueError(f"the schedule has {steps} step(s): Carnator needs at least 2 (a probe step and one the "
                             "cache can save); raise steps, or sample a one-step schedule without Carnator")
        if not 1 <= self.probe_steps < steps:
            raise ValueError(f"probe_steps={self.probe_steps} must be between 1 and steps-1 ({steps - 1}): "
                             "the probe runs the first steps of the request")
        tiled_block_size(self.block_size)
        if not 0.0 < self.attention_mass <= 1.0:
            raise ValueError(f"attention_mass={self.attention_mass} must be in (0, 1]")
        if not 0.0 < self.max_density <= 1.0:
            raise ValueError(f"max_density={self.max_density} must be in (0, 1]: the share of key blocks "
                             "each query block of the cached sparse attention may keep")
        if not isinstance(self.region_only, bool):
            raise ValueError(f"region_only must be True or False, got {self.region_only!r}")
        if not 0.0 < self.region_max_share <= 1.0:
            raise ValueError(f"region_max_share={self.region_max_share} must be in (0, 1]: the largest share of the "
                             "clip's tokens a region-only resume computes")
        if not 0.0 <= self.region_target_mass <= 1.0:
            raise ValueError(f"region_target_mass={self.region_target_mass} must be in [0, 1]: the share of the early "
                             "estimates' difference the region-only target holds (0: the gate's target cells alone)")
        if not 0.0 <= self.region_memory_margin <= 100.0:
            raise ValueError(f"region_memory_margin={self.region_memory_margin} must be in [0, 100]: the share of the "
                             "GPU memory a request already used that region-only resume may add")
        if not isinstance(self.region_sparse_keys, bool):
            raise ValueError(f"region_sparse_keys must be True or False, got {self.region_sparse_keys!r}")
        for name in ("region_kv_8bit", "region_kv_triton", "region_fa4"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.region_refresh_steps, bool) or not isinstance(self.region_refresh_steps, int) \
                or not 0 <= self.region_refresh_steps <= 16:
            raise ValueError(f"region_refresh_steps={self.region_refresh_steps!r} must be a whole number from 0 to 16: "
                             "the full steps a region-only resume adds to refresh the other tokens' keys and values")
        if self.max_checkpoints < 1:
            raise ValueError(f"max_checkpoints must be >= 1, got {self.max_checkpoints}")
        self.policy()


@dataclass
class ProbeResult:
    latent: Optional[torch.Tensor]        # entering step probe_steps; None for an exact repeat (nothing ran)
    denoised: Optional[torch.Tensor]      # x0-hat from the last probe step
    signature: Optional[EarlySignature]
    sigmas: torch.Tensor
    probe_steps: int
    bucket: str
    request_key: str
    seconds: float
    repeat: Optional[tuple] = None        # (entry id, final latent) of the full generation this request repeats
    bucket_parts: dict = field(default_factory=dict)    # index.bucket_parts: stored with the entry
    model_calls: int = 0        # diffusion model forwards of the probe
    uncacheable: str = ""       # non-empty: why this request is generated without the cache
    store_fault: str = ""       # non-empty: the store could not be read for this request (its first failed read)
    model_text: str = ""        # the model's options, for the "no earlier generation of this model" reason
    block_size: int = 0         # tokens per attention block of its signature's attention summary (stored with it)

    @property
    def steps(self) -> int:
        return len(self.sigmas) - 1


@dataclass
class GenerationResult:
    latent: torch.Tensor
    decision: gate_module.Decision
    model_calls: int              # diffusion model forwards (per cond/uncond batch as the host runs them)
    storing: Optional[PendingWrite]   # the generation's write into the store, running in the background
    seconds: dict
    warnings: list = field(default_factory=list)
    steps_run: int = 0            # sampler steps evaluated, probe included
    step_cache: Optional[str] = None   # the per-request step cache inside the run (EasyCache ...), by name
    step_cache_skipped: int = 0   # steps it answered without a forward

    @property
    def entry_id(self) -> Optional[str]:
        """The entry this generation is stored as, once it is written (this waits for the write); None when nothing
        was stored: a repeat, a model Carnator cannot key, or a write that failed (the store reported why)."""
        return self.storing.wait() if self.storing is not None else None

    def summary(self) -> dict:
        """The decision and its cost, without waiting for the write: `stored_as` names the entry written or being
        written (`store_pending`), None when nothing is or a write that failed (its warning says why)."""
        storing = self.storing
        failed = storing is not None and storing.done and storing.wait() is None
        return {**self.decision.summary(), "model_calls": self.model_calls, "steps_run": self.steps_run,
                "step_cache": self.step_cache, "step_cache_skipped": self.step_cache_skipped,
                "stored_as": storing.entry_id if storing is not None and not failed else None,
                "store_pending": storing is not None and not storing.done,
                "seconds": {k: round(v, 4) for k, v in self.seconds.items()}, "warnings": self.warnings}


def _calls(runner, observer: GenerationObserver) -> int:
    return observer.forwards if getattr(runner, "counts_forwards", False) else observer.steps_run


REFRESH_CHECKPOINTS = 3     # checkpoints after the furthest resume step: where a region-only resume refreshes


def checkpoint_steps(steps: int, probe_steps: int, max_checkpoints: int) -> list:
    """Steps whose entering latent an entry keeps: every step a hit could resume at, thinned evenly, and a few
    evenly spread after the furthest of them, where a later region-only hit refreshes the keys and values of the
    tokens it does not compute from a state this generation passed through (resume.region_only_steps)."""
    furthest = gate_module.latest_resume_checkpoint(steps)
    candidates = list(range(probe_steps + 1, furthest + 1))
    if len(candidates) > max_checkpoints:
        stride = len(candidates) / max_checkpoints
        candidates = [candidates[min(len(candidates) - 1, int(round((i + 1) * stride)) - 1)]
                      for i in range(max_checkpoints)]
    later = range(furthest + 1, steps - 1)     # the last step's own latent serves no refresh: nothing follows it
    refresh = {later[int((i + 0.5) * len(later) / REFRESH_CHECKPOINTS)] for i in range(REFRESH_CHECKPOINTS)} \
        if len(later) else set()
    return sorted(set(candidates) | refresh)


def _validate_request(runner, noise: torch.Tensor, sigmas: torch.Tensor, config: CarnatorConfig) -> None:
    for name, tensor in (("sigmas", sigmas), ("noise", noise)):
        if not torch.is_tensor(tensor) or not tensor.is_floating_point():
            kind = f"dtype {tensor.dtype}" if torch.is_tensor(tensor) else type(tensor).__name__
            raise ValueError(f"the {name} are a {kind}, not a floating-point tensor: pass float noise (torch.randn) "
                             "and float sigmas; nothing was run or stored")
    config.validate(len(sigmas) - 1)
    runner.layout.token_grid(noise.shape)  # raises a clear error for a latent of the wrong shape
    for name, tensor in (("sigmas", sigmas), ("noise", noise)):
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"the {name} hold non-finite values (NaN or inf): check the scheduler and the latent "
                             "input; nothing was run or stored")


def _read(store: CarnatorStore, what: str, work, default=None, request=None):
    """work() reading the store once the writes this process queued for it are in, or `default` when the store
    fails it: a store fault costs the request its reuse, never its result. The warning reaches the request's result
    (store.drain_problems) and the log. `request` (its ProbeResult, or before the probe anything with a
    `store_fault`) keeps the first failed read: the request's later reads are not tried (a server that is down
    answers each only after its timeout), so it gets one warning and its decision says the store was unreachable."""
    if request is not None and request.store_fault:
        return default
    store.writer.settle()
    try:
        return work()
    except StoreError as error:
        fault = store.report_problem(f"{what} failed ({error}): this request is generated in full")
        if request is not None:
            request.store_fault = fault
        return default


def request_identity(runner, noise: torch.Tensor, sigmas: torch.Tensor) -> tuple:
    """(bucket, request key): the bucket is what must match for any reuse (model, shape, schedule, sampler); the
    key adds every other input that shapes the output: the runner's request fingerprint (conditioning, sampler
    seed) and the noise itself, whole."""
    bucket = bucket_key(runner.model_fingerprint, noise.shape, sigmas, runner.sampler, _start_image(runner))
    digest = hashlib.sha256(f"{bucket}|{runner.request_fingerprint}|".encode())
    hash_values(digest, noise)
    return bucket, digest.hexdigest()[:32]


def _start_image(runner) -> str:
    """The runner's start image fingerprint (image-to-video hosts); "" for text-to-video."""
    return getattr(runner, "image_fingerprint", "") or ""


def hit_replay_key(request_key: str, config: CarnatorConfig) -> str:
    """The key a hit's entry answers repeats under: the request key with every reuse setting
    (CarnatorConfig.reuse_settings), since a hit's result depends on them as well; a request repeated with other
    settings goes through the gate again. Only a stage that knows every setting may compute it: the resume (the
    staged nodes' Early Probe and Gate run before the Resume's settings are known), or `generate` up front."""
    settings = json.dumps(config.reuse_settings(), sort_keys=True, default=str)
    return hashlib.sha256(f"{request_key}|hit|{settings}".encode()).hexdigest()[:32]


def probe(runner, noise: torch.Tensor, sigmas: torch.Tensor, config: CarnatorConfig,
          identity: Optional[tuple] = None, store: Optional[CarnatorStore] = None) -> ProbeResult:
    """The first steps of the request and its Early Signature; `identity` is request_identity's answer when the
    caller already has it (hashing a video's noise is not free). With a store, an exact repeat of a full generation
    is found first and nothing runs: the result carries that generation's final latent (`repeat`). Only a full
    generation's: the later stages' settings, which a hit's result depends on, are not known yet (`resume` answers
    a repeated hit)."""
    _validate_request(runner, noise, sigmas, config)
    started = time.perf_counter()
    uncacheable = getattr(runner, "uncacheable", "") or ""
    fault = ""
    if store is not None and not uncacheable:
        identity = identity or request_identity(runner, noise, sigmas)
        repeat, fault = _repeated(store, identity)
        if repeat is not None:
            return ProbeResult(None, None, None, sigmas, config.probe_steps, *identity,
                               time.perf_counter() - started, repeat=repeat)
    recorder = SignatureRecorder(config.probe_steps, config.block_size)
    warm_denoised_projection(recorder.denoised_size(noise.shape))   # for the lookup, drawn while the probe runs
    observer = GenerationObserver(signature=recorder)
    x = noise * float(sigmas[0])
    latent = runner.run(x, sigmas, 0, config.probe_steps, observer)
    bucket, key = identity or request_identity(runner, noise, sigmas)
    return ProbeResult(latent, observer.last_denoised, recorder.signature(), sigmas, config.probe_steps, bucket,
                       key, time.perf_counter() - started, model_calls=_calls(runner, observer),
                       uncacheable=uncacheable, model_text=getattr(runner, "model_text", "") or "", store_fault=fault,
                       block_size=config.block_size,
                       bucket_parts=bucket_parts(runner.model_fingerprint, noise.shape, sigmas, runner.sampler,
                                                 _start_image(runner)))


def replay(store: CarnatorStore, identity: tuple, steps: int, config: CarnatorConfig,
           device: torch.device) -> Optional[GenerationResult]:
    """The stored result of an earlier generation of exactly this request (request_identity), with no model call;
    None when the store has none (or only a corrupt one, which is reported and skipped).

    A full generation's result is the request's own, whatever the reuse settings; a hit's result is replayed only
    for the same reuse settings (hit_replay_key), and a full generation of the request is preferred to it.
    """
    return _replay(store, identity, steps, config, device)[0]


def _replay(store: CarnatorStore, identity: tuple, steps: int, config: CarnatorConfig, device: torch.device) -> tuple:
    """(replay's answer, the store's fault when it could not be read, else "")."""
    started = time.perf_counter()
    repeat, fault = _repeated(store, identity, config)
    if repeat is None:
        return None, fault
    decision = gate_module.exact_repeat(repeat[0], steps, config.risk)
    return _replayed(repeat[1].to(device), decision, store, {"replay": time.perf_counter() - started}), ""


def _repeated(store: CarnatorStore, identity: tuple, config: Optional[CarnatorConfig] = None) -> tuple:
    """((entry id, final latent) of a readable full generation of exactly this request, else, given the request's
    complete `config`, of a hit of it with the same reuse settings, or None; the store's fault when it could not be
    read, else "")."""
    bucket, request_key = identity
    reads = types.SimpleNamespace(store_fault="")      # the request's failed read, before it has a ProbeResult
    keys = [request_key] + ([hit_replay_key(request_key, config)] if config is not None else [])
    for key in keys:
        repeat = _repeat_of(store, bucket, key, reads)
        if repeat is not None:
            return repeat, ""
    return None, reads.store_fault


def _repeat_of(store: CarnatorStore, bucket: str, key: str, request) -> Optional[tuple]:
    """(entry id, final latent) of the readable entry whose stored result answers `key` (EntryRecord.repeat_key),
    else None; a failed read is kept in `request` (_read)."""
    record = _read(store, "the exact-repeat check", lambda: store.exact_repeat(bucket, key), request=request)
    final = _stored_final(store, record.entry_id) if record is not None else None
    return (record.entry_id, final) if final is not None else None


def _stored_final(store: CarnatorStore, entry_id: str) -> Optional[torch.Tensor]:
    """A full generation's final latent, or None if the entry is gone, lacks one or is torn (the store reports
    a torn one)."""
    try:
        record = store.record(entry_id)
        store.signature(record)  # an entry with any torn part is corrupt as a whole
        return store.trajectory(record).final
    except StoreError:
        return None


def _replayed(final: torch.Tensor, decision: gate_module.Decision, store: CarnatorStore, seconds: dict,
              probed: Optional[ProbeResult] = None) -> GenerationResult:
    """The stored result; found after a probe, the probe's calls are what the request cost."""
    _record_hit(store, decision)
    calls, steps = (probed.model_calls, decision.probe_steps) if probed is not None else (0, 0)
    return GenerationResult(final.to(torch.float32), decision, calls, None, seconds,
                            list(dict.fromkeys(store.drain_problems())), steps)


def _record_hit(store: CarnatorStore, decision: gate_module.Decision) -> None:
    """Counts the hit for eviction's benefit; a store that cannot take the count costs the count only."""
    try:
        store.record_hit(decision.entry_id, steps_saved=decision.steps - decision.model_calls,
                         exact_repeat=decision.exact_repeat)
    except StoreError as error:
        store.report_problem(f"the hit on entry {decision.entry_id} was not counted ({error})")


def lookup(store: CarnatorStore, probed: ProbeResult, config: CarnatorConfig) -> list:
    """Nearest entries of the probe's bucket; none for an exact repeat found before probing (it needs none), and
    none (a full generation, with a warning) when the store cannot be read."""
    if probed.repeat is not None or probed.uncacheable:
        return []
    return _read(store, "the cache lookup",
                 lambda: nearest(store, probed.bucket, probed.signature, config.lookup_limit), [], probed)


def new_bucket_reasons(store: CarnatorStore, probed: ProbeResult) -> list:
    """For a request the lookup found no candidate for: which part of it (model, shape, steps, ...) differs from the
    nearest cached generation's when its bucket holds no entry; why the bucket's entries could not be compared when
    it does (another probe length). Empty when the store cannot be read (the lookup has reported that)."""
    def work():
        if store.holds_bucket(probed.bucket):
            return [incomparable_bucket(store, probed.bucket, probed.signature, probed.probe_steps,
                                        probed.block_size)]
        return [bucket_difference(store, probed.bucket_parts)]
    return _read(store, "explaining the miss", work, [], probed)


def decide(probed: ProbeResult, candidates: list, config: CarnatorConfig,
           bucket_reasons: tuple = ()) -> gate_module.Decision:
    """The gate's decision, unless the request is a full generation's exact repeat (found before probing, or
    a candidate): then that generation's result. A repeated hit is `resume`'s to answer, which knows every reuse
    setting. `bucket_reasons` (new_bucket_reasons) explain a miss for want of any candidate."""
    if probed.uncacheable:
        return gate_module.Decision(False, config.risk, probed.steps, probed.probe_steps, probed.probe_steps,
                                    reasons=[probed.uncacheable])
    if probed.repeat is not None:
        return gate_module.exact_repeat(probed.repeat[0], probed.steps, config.risk)
    for candidate in candidates:
        if candidate.record.replays(probed.request_key):
            return gate_module.exact_repeat(candidate.record.entry_id, probed.steps, config.risk, probed.probe_steps)
    if probed.store_fault and not candidates:    # nothing could be compared: say so, not "no earlier generation"
        return gate_module.Decision(False, config.risk, probed.steps, probed.probe_steps, probed.probe_steps,
                                    reasons=["the cache could not be read (the warning says why): nothing could "
                                             "be compared with this request, which is generated in full"])
    decision = gate_module.decide(candidates, probed.steps, probed.probe_steps, config.policy(), config.risk,
                                  probed.model_text)
    if not candidates and bucket_reasons:    # the bucket's entries, not comparable: its own reason replaces "none"
        held = bucket_reasons[0].startswith(HELD_BUCKET)
        decision = dataclasses.replace(decision, reasons=([] if held else decision.reasons) + list(bucket_reasons))
    return decision


def _continue(runner, probed: ProbeResult, decision: gate_module.Decision, store: CarnatorStore,
              config: CarnatorConfig) -> resume_stage.Finished:
    """Reads the chosen entry and has the resume stage finish the request: a hit whose entry cannot be read becomes
    a full generation; the stage's warnings (an entry that does not fit, region-only not possible) reach the result."""
    payload = None
    if decision.reuse:
        payload = _read(store, f"reading entry {decision.entry_id}",
                        lambda: store.trajectory(store.record(decision.entry_id)))
        if payload is None:   # corrupt, missing, or deleted/evicted since the gate chose it
            decision = resume_stage.full_generation(decision, probed, f"entry {decision.entry_id} could not be read")
    finished = resume_stage.finish(runner, probed, decision, payload, config,
                                   checkpoint_steps(probed.steps, probed.probe_steps, config.max_checkpoints))
    for warning in finished.warnings:
        store.report_problem(warning)
    if finished.decision.reuse:
        _record_hit(store, finished.decision)
    return finished


def resume(runner, probed: ProbeResult, decision: gate_module.Decision, store: CarnatorStore,
           config: CarnatorConfig, prompt: str = "", seed: int = 0, model_name: str = "") -> GenerationResult:
    """Finishes the request (from the cache on a hit, from the probe state on a miss) and stores it; an exact
    repeat returns its entry's result, or is generated in full if that entry can no longer be read. So does a
    repeated hit: an earlier hit of exactly this request with exactly these settings (`config`, complete here: the
    staged nodes' Resume adds its own to the Gate's). `model_name` labels the entry in the cache browser (the
    model's file name; default: a short fingerprint)."""
    started = time.perf_counter()
    warnings = []
    changed = getattr(runner, "changed_since_fingerprint", None)
    why = changed() if changed is not None and probed.repeat is None else ""
    if why:    # the probe's key no longer describes the model: no cached result for it, nothing stored from it
        log.warning("carnator: %s", why)
        probed = dataclasses.replace(probed, uncacheable=why)
        if decision.reuse:
            decision = resume_stage.full_generation(decision, probed, why)
    repeat = probed.repeat
    if not decision.exact_repeat and repeat is None and not probed.uncacheable:
        repeat = _repeat_of(store, probed.bucket, hit_replay_key(probed.request_key, config), probed)
        if repeat is not None:
            decision = gate_module.exact_repeat(repeat[0], probed.steps, config.risk, probed.probe_steps)
    if decision.exact_repeat:
        held = repeat is not None and repeat[0] == decision.entry_id
        final = repeat[1] if held else _stored_final(store, decision.entry_id)
        if final is not None:
            device = probed.latent.device if probed.latent is not None else final.device
            return _replayed(final.to(device), decision, store,
                             {"probe": probed.seconds, "replay": time.perf_counter() - started}, probed)
        warnings.append(f"entry {decision.entry_id} could not be replayed: this request was generated in full")
        decision = resume_stage.full_generation(decision, probed, warnings[-1])
    finished = _continue(runner, probed, decision, store, config)
    decision, latent, observer = finished.decision, finished.latent, finished.observer
    seconds = {"probe": probed.seconds, "resume": time.perf_counter() - started}
    cost = {"model_calls": probed.model_calls + _calls(runner, observer), "steps_run": probed.probe_steps +
            observer.steps_run, "step_cache": getattr(runner, "step_cache", None),
            "step_cache_skipped": observer.step_cache_skipped}
    warnings += store.drain_problems()   # drained before the write is queued: a failure of it is the next request's
    compile_warnings = getattr(runner, "compile_warnings", None)    # a compiled model recompiling on every run
    warnings += compile_warnings() if compile_warnings is not None else []
    written = time.perf_counter()
    storing = None
    if probed.uncacheable:
        warnings.append("not stored: " + ("its model carries a node setting Carnator cannot compare" if not why else
                                          "its model changed since the probe"))
    else:
        entry = dict(bucket=probed.bucket, prompt=prompt, seed=seed, steps=probed.steps, probe_steps=probed.probe_steps,
                     signature=probed.signature, latent_shape=probed.latent.shape,
                     reused_from=decision.entry_id if decision.reuse else None,
                     replay_key=hit_replay_key(probed.request_key, config) if decision.reuse else "",
                     extra={"decision": {**decision.summary(), **cost}, "bucket": probed.bucket_parts,
                            "model": model_name or runner.model_fingerprint[:12], "block_size": probed.block_size},
                     request_key=probed.request_key)
        storing = _queue_write(store, entry, observer.checkpoints, finished.connectivity, latent,
                               runner.preview(latent))
        if probed.store_fault:      # a store this request could not read: the write's outcome is this request's to
            storing.wait()          # tell (stored or not), not a warning on the next one
            warnings += store.drain_problems()
    seconds["write_back"] = time.perf_counter() - written   # what the request waits for: copies and queueing
    return GenerationResult(latent, decision, cost["model_calls"], storing, seconds, list(dict.fromkeys(warnings)),
                            cost["steps_run"], cost["step_cache"], cost["step_cache_skipped"])


def _queue_write(store: CarnatorStore, entry: dict, checkpoints: CheckpointRecorder, connectivity: dict,
                 final: Optional[torch.Tensor], frame: torch.Tensor) -> PendingWrite:
    """Hands the generation to the store's background writer (write_back). Copied now, as the caller may change its
    tensors once it has them: the final latent (kept to replay an exact repeat) and the preview
    frame. Left to the writer: waiting for the checkpoints' device copies, the thumbnail, serialising, the commit."""
    entry_id = new_entry_id()
    final = None if final is None else final.detach().to("cpu", copy=True)
    frame = frame.detach().to("cpu", copy=True)

    def write():
        store.put(**entry, payload=TrajectoryPayload(checkpoints.latents, connectivity, final=final),
                  thumbnail=thumbnail_png(frame), entry_id=entry_id)
    return store.writer.submit(entry_id, write)


def generate(runner, noise: torch.Tensor, sigmas: torch.Tensor, store: CarnatorStore, config: CarnatorConfig,
             prompt: str = "", seed: int = 0, model_name: str = "") -> GenerationResult:
    _validate_request(runner, noise, sigmas, config)
    identity = request_identity(runner, noise, sigmas)
    fault = ""
    if not getattr(runner, "uncacheable", ""):
        replayed, fault = _replay(store, identity, len(sigmas) - 1, config, noise.device)
        if replayed is not None:
            return replayed
    probed = probe(runner, noise, sigmas, config, identity)
    probed.store_fault = fault      # a store that failed the exact-repeat check is not asked again
    started = time.perf_counter()
    candidates = lookup(store, probed, config)
    decision = decide(probed, candidates, config, new_bucket_reasons(store, probed) if not candidates else ())
    gate_seconds = time.perf_counter() - started
    result = resume(runner, probed, decision, store, config, prompt, seed, model_name)
    result.seconds["lookup_and_gate"] = gate_seconds
    return result


__all__ = ["CarnatorConfig", "ProbeResult", "GenerationResult", "Candidate", "probe", "lookup", "decide",
           "resume", "replay", "generate", "follow_entry", "checkpoint_steps", "request_identity", "new_bucket_reasons"]
