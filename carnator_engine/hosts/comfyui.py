"""ComfyUI runner: ComfyUI's own samplers, models and patches under the engine's Runner contract.

`ComfyRunner.run(x, sigmas, start, end, observer)` runs steps [start, end) with comfy.sample.sample_custom
on a clone of the MODEL, patched for that run only (key "carnator"; nothing global is touched and no
model forward is copied):
- WrappersMP.PREDICT_NOISE: one call per model evaluation, with the model-space x and its sigma. The first
  evaluation at a schedule sigma starts that step (observer.begin_step).
- the sampler callback (step, x0, x): the step's denoised estimate (observer.step_end, sent once the latent
  leaving the step is known) and the sampler's own x entering the step, kept as the checkpoint (samplers
  that evaluate a predictor at the next sigma, e.g. heun, would otherwise start a step with the predictor).
- WrappersMP.SAMPLER_SAMPLE: transformer_options["sample_sigmas"] is the request's whole schedule.
- patches_replace["dit"][("double_block", i)]: runs the block (or the replacement another node installed
  there) with block_index set on a copy of transformer_options, then observer.block_output(i, hidden); the
  first block counts the forward (observer.forward).
- transformer_options["optimized_attention_override"]: put on top at each block call, on the block's own copy of
  transformer_options, over whatever override is installed then (SageAttention nodes, core's sparse attention,
  which re-installs itself on top at every step); self-attention over the video tokens goes through
  observer.self_attention with that override as its `dense` function.
Every wrapper takes the host's arguments as they come (*args, **kwargs) and passes them on untouched, reading the
few it needs by position or by name: newer hosts add arguments (contract.py checks what is relied on).

Latent spaces: the engine works in model space (ComfyUI's process_latent_in). Flow models start sampling
from sigma * noise + (1 - sigma) * latent, so a run entering at sigma = 1 passes x as the noise, and any
other entry passes zero noise and the latent x / (1 - sigma) in the latent format; the sampler's output is
mapped back the same way. ComfyUI is imported inside functions only.

The hooks are the same objects in every run, so a compiled model (torch.compile) compiles around them once (see "the
hooks" below, and compiled.py for the options refused and the recompile watch).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..backbones import HUNYUAN_VIDEO, LTX_VIDEO, WAN21, WAN22_5B, BackboneLayout
from ..kept_kv import TorchMemory
from . import contract
from .compiled import CompileWatch, compile_settings, eager_frame, region_only_unfit, whole_model_refusal
from .conditioning import conditioning_fingerprint, start_image_fingerprint
from .model_key import host_version, model_key
from .refused import refusal
from .step_caches import StepCacheCarry, live_holder

log = logging.getLogger("carnator.comfyui")

HOOK_KEY = "carnator"

StepCallback = Callable[[int, torch.Tensor, torch.Tensor, int], None]


class UnsupportedModelError(ValueError):
    pass


class ExpertMismatchError(ValueError):
    """A low-noise expert that cannot continue the high-noise expert's trajectory."""
    input_name = "low_noise_model"


@dataclass(frozen=True)
class HostBackbone:
    model_class: str      # ComfyUI's model_base class, e.g. "WAN21"
    layout: BackboneLayout
    block_keys: tuple     # the patches_replace["dit"] key of each transformer block, in order
    joint_text: bool      # self-attention runs over the video tokens followed by the text tokens (HunyuanVideo)

    @property
    def num_blocks(self) -> int:
        return len(self.block_keys)


@dataclass(frozen=True)
class _Spec:
    diffusion_class: str
    blocks: tuple         # (attribute of the diffusion model holding blocks, their patches_replace["dit"] kind)
    layouts: dict         # latent channels -> layout
    joint_text: bool = False


# model_base class -> how its diffusion model runs. Each runs its transformer blocks through
# patches_replace["dit"][(kind, i)] and its self-attention through optimized_attention, tokens frame-major;
# Wan and LTX-Video attend over the video tokens alone, HunyuanVideo over the video tokens then the text tokens
# (double-stream blocks concatenate the two streams, single-stream blocks carry them concatenated).
_SUPPORTED = {
    "WAN21": _Spec("WanModel", (("blocks", "double_block"),), {16: WAN21}),          # Wan 2.1 T2V/I2V, Wan 2.2 A14B T2V/I2V
    "WAN22": _Spec("WanModel", (("blocks", "double_block"),), {48: WAN22_5B}),       # Wan 2.2 TI2V 5B (T2V, I2V)
    "LTXV": _Spec("LTXVModel", (("transformer_blocks", "double_block"),), {128: LTX_VIDEO}),
    "HunyuanVideo": _Spec("HunyuanVideo", (("double_blocks", "double_block"), ("single_blocks", "single_block")),
                          {16: HUNYUAN_VIDEO}, joint_text=True),
}
# HunyuanVideo image-to-video (HunyuanImageToVideo's "v1 (concat)" image latent, or "v2 (replace)": the image kept in
# the first latent frame by a noise mask) and SkyReels I2V: the same transformer with more input channels
_SUPPORTED["HunyuanVideoI2V"] = _SUPPORTED["HunyuanVideoSkyreelsI2V"] = _SUPPORTED["HunyuanVideo"]
MODEL_CLASSES = tuple(_SUPPORTED)   # the host's model classes Carnator adapts (contract.check_at_load)
SUPPORTED_TEXT = ("Wan 2.1 / Wan 2.2 T2V and I2V (ComfyUI classes WAN21, WAN22), LTX-Video (LTXV) and HunyuanVideo "
                  "T2V and I2V (HunyuanVideo, HunyuanVideoI2V, HunyuanVideoSkyreelsI2V)")

_WHY_NOT = {
    "WAN21_Vace": "VACE adds control blocks whose states are not part of the signature",
    "WAN21_Camera": "camera control changes the trajectory outside the conditioning Carnator compares",
    "WAN21_HuMo": "audio/reference conditioning is not compared by the signature",
    "WAN22_S2V": "speech-to-video uses its own forward pass",
    "WAN22_Animate": "animate uses its own forward pass",
}


def _patch_size(diffusion) -> Optional[tuple]:
    size = getattr(diffusion, "patch_size", None)
    if size is None:
        size = getattr(getattr(diffusion, "patchifier", None), "patch_size", None)
    return tuple(int(s) for s in size) if size is not None else None


def backbone_for(model) -> HostBackbone:
    """The backbone behind a ComfyUI MODEL (ModelPatcher), or UnsupportedModelError naming its class."""
    whole = whole_model_refusal(model)
    if whole:
        raise UnsupportedModelError(f"Carnator: {whole}")
    base = getattr(model, "model", None)
    name = type(base).__name__
    diffusion = getattr(base, "diffusion_model", None)
    entry = _SUPPORTED.get(name)
    if entry is None or type(diffusion).__name__ != entry.diffusion_class:
        why = _WHY_NOT.get(name)
        raise UnsupportedModelError(
            f"Carnator: unsupported model {name} (diffusion model {type(diffusion).__name__})"
            + (f": {why}" if why else "") + f". Carnator supports {SUPPORTED_TEXT}; use a regular KSampler "
            "for this model")
    layouts = entry.layouts
    channels = int(base.latent_format.latent_channels)
    layout = layouts.get(channels)
    if layout is None:
        raise UnsupportedModelError(
            f"Carnator: unsupported model {name} with {channels} latent channels (expected "
            f"{' or '.join(str(c) for c in layouts)})")
    patch = _patch_size(diffusion)
    if patch is not None and patch != tuple(layout.patch_size):
        layout = dataclasses.replace(layout, patch_size=patch)
    import comfy.model_sampling
    sampling = model.get_model_object("model_sampling")
    if not isinstance(sampling, comfy.model_sampling.CONST):
        raise UnsupportedModelError(
            f"Carnator: model {name} samples with {type(sampling).__name__}, not a flow-matching (CONST) "
            "schedule: Carnator resumes along flow trajectories only")
    keys = tuple((kind, i) for attribute, kind in entry.blocks for i in range(len(getattr(diffusion, attribute))))
    return HostBackbone(name, layout, keys, entry.joint_text)


# ---- fingerprint ----------------------------------------------------------------------------------

def _parameter_shapes(model) -> dict:
    return {name: tuple(t.shape) for name, t in model.model.diffusion_model.state_dict().items()}


def _parameter_count(model) -> int:
    return sum(t.numel() for t in model.model.diffusion_model.parameters())


# ---- one run ----------------------------------------------------------------------------------

@dataclass
class _Continuation:
    """A run from step 0 (a probe), kept so that the run continuing from its end (the rest of a miss) samples both in
    one sampler pass, as KSampler does: the sampler starts again from the same inputs over both runs' steps, and the
    evaluations it asks for at the same x as in the first run are answered from this record, with no model call.
    A multistep sampler (dpmpp_2m) so keeps its history across the split and an ancestral one draws its noise in
    KSampler's order. A sampler whose first steps depend on the later ones (an SDE sampler's Brownian noise spans the
    whole schedule, uni_pc lowers its order near the end) asks for another x: from there the first run's steps are
    evaluated again, so the result is KSampler's all the same, at the cost of those model calls."""
    source: object              # the expert that ran it
    schedule: torch.Tensor      # the whole schedule
    end: int                    # the step its latent enters
    noise: torch.Tensor         # the sampler's inputs
    latent: torch.Tensor
    inputs: list = dataclasses.field(default_factory=list)     # the x of each evaluation (CPU)
    outputs: list = dataclasses.field(default_factory=list)    # its denoised output (CPU)
    result: Optional[torch.Tensor] = None                      # the latent run() returned

    def continued_by(self, source, schedule: torch.Tensor, start: int, x: torch.Tensor) -> bool:
        """Whether a run from `start` at `x` continues this one (the same expert, schedule and latent)."""
        return (source is self.source and start == self.end and torch.equal(schedule, self.schedule)
                and (x is self.result or (x.shape == self.result.shape and torch.equal(x.cpu(), self.result))))


class _Run:
    """State of one run() call: which step the sampler is in and the observer it reports to. With `history` (the
    run it continues) the sampler runs from step 0, and the evaluations of the steps before `start` come from it."""

    def __init__(self, observer, layout: BackboneLayout, sigmas: torch.Tensor, start: int, end: int,
                 total_steps: int, step_callback: Optional[StepCallback], carry: StepCacheCarry, lane: str,
                 history: Optional[_Continuation] = None, recording: Optional[_Continuation] = None):
        self.history = history
        self.recording = recording           # this run's record, when a later run may continue it
        self.first = 0 if history is not None else start   # the step the sampler starts at
        self.evaluations = 0                 # of the history's, asked for so far
        self.diverged = False                # the sampler asked for an x the history did not evaluate
        self.post_cfg_functions = 0          # the model's own (its patches'), which the history's evaluations ran
        self.observer = observer
        self.layout = layout
        self.schedule = sigmas
        self.sigmas = [float(s) for s in sigmas[start:end + 1]]
        self.start = start
        self.count = end - start
        self.total_steps = total_steps
        self.step_callback = step_callback
        self.local: Optional[int] = None     # step of the sub-run in progress
        self.ended: set = set()
        self.denoised: dict = {}             # local step -> x0 from the sampler callback
        self.first_denoised: dict = {}       # local step -> x0 of its first evaluation (fallback)
        self.tokens: Optional[int] = None
        self.carry = carry                   # the request's step cache state across its runs
        self.lane = lane                     # which expert runs it: state never passes from one to the other
        self.step_cache_start: Optional[int] = None   # the step cache's skip count at this run's start
        self.step_cache_state: Optional[tuple] = None  # its state after the latest evaluation

    # PREDICT_NOISE wrapper (the outermost: it sees every evaluation the sampler asks for, skipped or not)
    def in_history(self) -> bool:
        return self.history is not None and self.evaluations < len(self.history.outputs)

    def from_history(self, executor, args, kwargs) -> torch.Tensor:
        """The history's output for this evaluation while the sampler asks for the same x; once it does not, the
        model's, reported to no observer (the history's run reported these steps) but counted as forwards. A CFG++
        sampler reads the unguided estimate through a post-CFG function of its own, which only an evaluation
        calls: its history is evaluated again."""
        x, index = _argument(args, kwargs, 0, "x"), self.evaluations
        self.evaluations += 1
        model_options = _argument(args, kwargs, 2, "model_options", {})
        own_functions = len(model_options.get("sampler_post_cfg_function", ())) == self.post_cfg_functions
        if own_functions and not self.diverged and torch.equal(x.detach().cpu(), self.history.inputs[index]):
            return self.history.outputs[index].to(x.device)
        self.diverged = True
        from ..observer import GenerationObserver
        observer, self.observer = self.observer, GenerationObserver()
        self.tokens = math.prod(self.layout.token_grid(x.shape))
        try:
            return executor(*args, **kwargs)
        finally:
            if hasattr(observer, "forwards"):
                observer.forwards += self.observer.forwards
            self.observer = observer

    def record(self, x: torch.Tensor, denoised: torch.Tensor) -> None:
        if self.recording is not None:
            self.recording.inputs.append(x.detach().cpu())
            self.recording.outputs.append(denoised.detach().cpu())

    def step_cache(self, model_options: dict, guider, evaluated: bool) -> None:
        holder = live_holder(model_options)
        if holder is None:
            return
        if not evaluated and self.step_cache_start is None:
            records = getattr(self.observer, "signature", None) is not None
            self.step_cache_start = self.carry.begin_run(holder, guider, (self.lane, self.start), records)
        elif evaluated:
            self.step_cache_state = self.carry.snapshot(holder, guider)
            skipped = int(getattr(holder, "total_steps_skipped", 0) or 0) - (self.step_cache_start or 0)
            self.observer.step_cache_skipped = skipped

    def before_evaluation(self, x: torch.Tensor, timestep: torch.Tensor) -> None:
        sigma = float(timestep.reshape(-1)[0])
        self.tokens = math.prod(self.layout.token_grid(x.shape))
        first = 0 if self.local is None else self.local + 1
        match = next((j for j in range(first, self.count)
                      if math.isclose(self.sigmas[j], sigma, rel_tol=1e-4, abs_tol=1e-6)), None)
        if match is None and self.local is None:
            match = 0
        if match is not None:
            self._end_step(x)
            self.local = match
            self.observer.begin_step(self.start + match, x)

    def after_evaluation(self, denoised: torch.Tensor) -> None:
        if self.local is not None and self.local not in self.first_denoised:
            self.first_denoised[self.local] = denoised

    # sampler callback: (step within this sub-run, denoised, x entering the step, steps of the sub-run)
    def callback(self, i: int, x0: torch.Tensor, x: torch.Tensor, _total: int) -> None:
        step = self.first + int(i)
        if step < self.start:      # a step of the history: reported by its own run
            return
        self.denoised[step - self.start] = x0
        if getattr(self.observer, "checkpoints", None) is not None:
            self.observer.checkpoints.record(step, x)
        if self.step_callback is not None:
            self.step_callback(step, x0, x, self.total_steps)

    def _end_step(self, x_next: torch.Tensor) -> None:
        local = self.local
        if local is None or local in self.ended:
            return
        denoised = self.denoised.pop(local, None)
        fallback = self.first_denoised.pop(local, None)
        denoised = denoised if denoised is not None else fallback
        self.ended.add(local)
        if denoised is not None:
            self.observer.step_end(self.start + local, x_next, denoised)

    def finish(self, x_end: torch.Tensor, end: int) -> None:
        self.carry.end_run((self.lane, end), self.step_cache_state)
        self._end_step(x_end)
        self.denoised.clear()
        self.first_denoised.clear()


# ---- the hooks ----------------------------------------------------------------------------------
# Every hook is one object per (block, chained function), the same in every run and request, and reads the run in
# progress from _ACTIVE. Under torch.compile (ComfyUI's TorchCompileModel, KJNodes' compile nodes) dynamo guards on
# the hooks it meets, so hooks that stay the same objects and keep their state outside traced code are compiled
# around once, not once per run. What records or changes a run's tensors (the observer, a region's tokens, the
# attention override with whatever it chains to) is torch.compiler.disable'd: it runs eagerly, a graph break
# between compiled graphs at a place where the tensors are whole anyway (between blocks, around the attention
# kernel), while the blocks themselves stay compiled.

class _ActiveRun(threading.local):
    run: Optional[_Run] = None      # the run() in progress on this thread (ComfyUI samples on one thread)


_ACTIVE = _ActiveRun()


@contextlib.contextmanager
def _running(run: _Run):
    previous, _ACTIVE.run = _ACTIVE.run, run
    try:
        yield
    finally:
        _ACTIVE.run = previous


def _argument(args: tuple, kwargs: dict, index: int, name: str, default=None):
    """A wrapped function's argument, given by position or by name (a host may pass either)."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _predict_noise_wrapper(executor, *args, **kwargs):
    """PREDICT_NOISE, outermost (outside any compiled model): every evaluation the sampler asks for. The guider's
    predict_noise(x, timestep, model_options, seed, ...): whatever else the host passes goes on untouched."""
    run = _ACTIVE.run
    if run.in_history():
        return run.from_history(executor, args, kwargs)
    x, model_options = _argument(args, kwargs, 0, "x"), _argument(args, kwargs, 2, "model_options", {})
    run.before_evaluation(x, _argument(args, kwargs, 1, "timestep"))
    run.step_cache(model_options, executor.class_obj, evaluated=False)
    out = executor(*args, **kwargs)
    run.step_cache(model_options, executor.class_obj, evaluated=True)
    run.after_evaluation(out)
    run.record(x, out)
    return out


def _whole_schedule(executor, *args, **kwargs):
    """SAMPLER_SAMPLE, around sampler.sample(guider, sigmas, extra_args, ...): transformer_options["sample_sigmas"]
    is the request's whole schedule, as in one KSampler run, not this run's part of it. Nodes that place a step within
    the schedule (hook keyframes, context windows) then see each step where KSampler shows it, and a compiled model
    sees a schedule of one length in every run: dynamo guards on the shape of that tensor, and parts of different
    lengths would recompile it."""
    sigmas = _argument(args, kwargs, 1, "sigmas")
    options = _argument(args, kwargs, 2, "extra_args")["model_options"].setdefault("transformer_options", {})
    options["sample_sigmas"] = _ACTIVE.run.schedule.to(sigmas.device, sigmas.dtype)
    return executor(*args, **kwargs)


_UNCUT = ("img", "txt", "transformer_options")   # block arguments a region-only step never cuts to its tokens


class _BlockPatch:
    """patches_replace["dit"] for one block, around `inner` (another node's replacement there, or None): the block
    with the observer's hooks before and after it. A region-only resume's step (observer.region active) cuts the
    tokens to its target at the first block and puts them back at the last. Dynamo never compiles __call__ itself
    (a compiled frame of it would be guarded on the patch, one per block), only the block it calls."""

    def __init__(self, index: int, inner, last: bool, joint_text: bool):
        self.index, self.inner, self.last, self.joint_text = index, inner, last, joint_text

    @eager_frame
    def __call__(self, args, extra):
        args, tokens = _enter_block(self, args)
        out = self.inner(args, extra) if self.inner is not None else extra["original_block"](args)
        return _leave_block(self, out, tokens)


@torch.compiler.disable
def _enter_block(patch: _BlockPatch, args: dict) -> tuple:
    """(the block's arguments, its video tokens): block_index set on a copy of transformer_options (nothing leaks into
    other blocks or runs); in a region-only step the tokens cut to the target (image tokens at the first block, every
    argument with a token axis at each)."""
    run, index = _ACTIVE.run, patch.index
    if index == 0:      # one call per forward the diffusion model really runs (a cond/uncond batch as ComfyUI runs
        run.observer.forward()    # it), after any step cache has decided to skip or not
    options = dict(args.get("transformer_options") or {})
    options["block_index"] = index
    _attention_on_top(options, patch.joint_text)
    args = dict(args, transformer_options=options)
    region = getattr(run.observer, "region", None)
    img = args["img"]
    tokens = run.tokens if index == 0 or region is None else region.video_tokens()
    if img.shape[1] < tokens or ("txt" in args and img.shape[1] != tokens):
        raise UnsupportedModelError(
            f"Carnator: block {index} carries {img.shape[1]} image tokens for a latent of {tokens}: a "
            "reference latent or image conditioning adds tokens the signature does not compare; use a "
            "regular KSampler for it")
    if region is not None:
        if index == 0:
            args["img"] = region.gather(img, args["txt"].shape[1] if patch.joint_text and "txt" in args else None)
        cut = {key: value if key in _UNCUT else region.gather_like(value) for key, value in args.items()}
        for key in cut:
            _dynamic_tokens(img if key == "img" else args[key], cut[key])
        args, tokens = cut, region.video_tokens()
    return args, tokens


def _dynamic_tokens(whole, cut) -> None:
    """Marks the token axis of a block argument a region step cut as dynamic for torch.compile: the first region-only
    step compiles the blocks once for any token count, even where the compile node asked for static shapes
    (KJNodes' dynamic=False); otherwise every target size would be compiled anew. Uncompiled, a no-op."""
    if isinstance(cut, (tuple, list)):
        for w, c in zip(whole, cut):
            _dynamic_tokens(w, c)
    elif torch.is_tensor(cut) and torch.is_tensor(whole) and cut.dim() == whole.dim() and cut.shape != whole.shape:
        for dim, (a, b) in enumerate(zip(whole.shape, cut.shape)):
            if a != b:
                torch._dynamo.maybe_mark_dynamic(cut, dim)


@torch.compiler.disable
def _leave_block(patch: _BlockPatch, out: dict, tokens: int) -> dict:
    run = _ACTIVE.run
    run.observer.block_output(patch.index, out["img"][:, :tokens])   # single-stream blocks carry the text after
    region = getattr(run.observer, "region", None)
    if region is not None and patch.last:
        out = dict(out, img=region.scatter(out["img"]))
    return out


def _stable(factory, *key):
    """factory(*key), the same object for the same key (an unhashable key: a new one)."""
    try:
        return factory(*key)
    except TypeError:
        return factory.__wrapped__(*key)


_block_patch = functools.lru_cache(maxsize=1024)(_BlockPatch)


def _kept_keys(mask: torch.Tensor, length: int, video_tokens: int) -> Optional[torch.Tensor]:
    """The keys a joint-attention padding mask leaves visible ([length] bool), or None for any other mask. An
    additive mask of 0 (visible) and a huge negative number (padded text) weighs the padded keys exactly 0, so
    dropping them gives the same attention; video keys must all be visible."""
    if mask.numel() != length or mask.dtype == torch.bool:
        return None
    flat = mask.reshape(-1)
    keep = flat == 0
    if not bool(keep[:video_tokens].all()) or not bool((flat[~keep] < -1e4).all()):
        return None
    return keep


ATTENTION_OVERRIDE = "optimized_attention_override"   # the host's key (comfy.ldm.modules.attention.wrap_attn)
ATTENTION_BELOW = "carnator_attention_below"          # the override Carnator's chains to, on the block's options


def _attention_on_top(options: dict, joint_text: bool) -> None:
    """Puts Carnator's attention override on top of the one installed now, in a block's own copy of its
    transformer_options: looked up at every block call, not once when the model was patched, since other nodes change
    it while sampling runs (core's sparse attention re-installs itself on top at every step, chaining to what it
    finds). Carnator's then sees every self-attention call, and chains to that override exactly once."""
    current = options.get(ATTENTION_OVERRIDE)
    if current not in _ATTENTION.values():
        options[ATTENTION_BELOW] = current
        options[ATTENTION_OVERRIDE] = _ATTENTION[joint_text]


def _next_in_chain(func, *args, **kwargs):
    """The attention below Carnator's: the override it was put on top of (transformer_options[ATTENTION_BELOW]), or
    the host's own function."""
    below = (kwargs.get("transformer_options") or {}).get(ATTENTION_BELOW)
    if below is not None:
        return below(func, *args, **kwargs)
    return func(*args, **kwargs)


def _standard_attention(q, k, v, kwargs: dict, heads: int, split: bool) -> bool:
    """Whether the call is plain multi-head attention the observer computes the same way: no grouped keys (newer hosts'
    enable_gqa gives k and v fewer heads) and the usual 1/sqrt(head_dim) scale."""
    if q.shape != k.shape or q.shape != v.shape:
        return False
    scale = kwargs.get("scale")
    head_dim = q.shape[-1] if split else q.shape[-1] // heads
    return scale is None or math.isclose(float(scale), head_dim ** -0.5, rel_tol=1e-6)


def _attention_override(joint_text: bool):
    """Carnator's attention override (_attention_on_top installs it): self-attention over the video tokens goes through
    the observer, with the override below it as its dense function; any other call goes straight down the chain. Not
    traced (it and the chain run eagerly around the attention kernel): the observer reads and keeps tensors."""
    @torch.compiler.disable
    def override(func, *args, **kwargs):
        run = _ACTIVE.run
        options = kwargs.get("transformer_options") or {}
        block = options.get("block_index")
        heads = args[3] if len(args) > 3 else kwargs.get("heads")
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        if block is None or heads is None or len(args) < 3 or (mask is not None and not joint_text):
            return _next_in_chain(func, *args, **kwargs)
        q, k, v = args[:3]
        split = bool(kwargs.get("skip_reshape", False))     # q, k, v already [B, heads, L, D]
        merged_out = not kwargs.get("skip_output_reshape", False)
        token_dim = 2 if split else 1
        length_q, length_k = q.shape[token_dim], k.shape[token_dim]
        region = getattr(run.observer, "region", None)
        tokens = run.tokens if region is None else region.video_tokens()
        video_ok = length_q == tokens or (joint_text and length_q > tokens)
        if not video_ok or q.dim() != (4 if split else 3) or not _standard_attention(q, k, v, kwargs, int(heads), split):
            return _next_in_chain(func, *args, **kwargs)  # cross-attention, tokens beyond the video grid, other kinds
        rest = list(args[3:])
        if mask is not None:
            keep = _kept_keys(mask, length_k, tokens)
            if keep is None:
                return _next_in_chain(func, *args, **kwargs)   # not a text padding mask: left to the host
            keep = keep.to(k.device)
            k, v = k.index_select(token_dim, keep.nonzero().flatten()), v.index_select(token_dim, keep.nonzero().flatten())
            if len(rest) > 1:
                rest[1] = None
            kwargs = {**kwargs, "mask": None} if "mask" in kwargs else kwargs
        heads = int(heads)
        batch = q.shape[0]
        head_dim = q.shape[-1] if split else q.shape[-1] // heads

        def to_heads(t):
            return t if split else t.reshape(batch, t.shape[1], heads, head_dim).transpose(1, 2)

        def from_heads(t):
            return t if split else t.transpose(1, 2).reshape(batch, t.shape[2], heads * head_dim)

        def dense(q4, k4, v4):
            out = _next_in_chain(func, from_heads(q4), from_heads(k4), from_heads(v4), *rest, **kwargs)
            if merged_out:
                return out.reshape(batch, out.shape[1], heads, head_dim).transpose(1, 2)
            return out

        video = tokens if length_q > tokens else None
        # ComfyUI's own SDPA, no other node's override: another exact kernel may stand in (a region step's fa4)
        host_sdpa = options.get(ATTENTION_BELOW) is None and getattr(func, "__name__", None) == "attention_pytorch"
        out = run.observer.self_attention(int(block), to_heads(q), to_heads(k), to_heads(v), dense=dense,
                                          video_tokens=video, host_sdpa=host_sdpa)
        if merged_out:
            return out.transpose(1, 2).reshape(batch, out.shape[2], heads * head_dim)
        return out

    return override


# one object per kind, the same in every run: a compiled model is guarded on the override it meets
_ATTENTION = {joint_text: _attention_override(joint_text) for joint_text in (False, True)}


# ---- the runner -------------------------------------------------------------------------------

def _host_free_memory(device) -> int:
    """The GPU memory ComfyUI can still give (its free memory, torch's cache included)."""
    import comfy.model_management
    return int(comfy.model_management.get_free_memory(device))


class ComfyRunner:
    """Runner for a ComfyUI MODEL: `layout`, `model_fingerprint`, `sampler`, `request_fingerprint`, `run`,
    `preview`."""

    def __init__(self, model, positive, negative, cfg: float, sampler_name: str, scheduler: Optional[str] = None,
                 sigmas: Optional[torch.Tensor] = None, steps: Optional[int] = None, seed: int = 0,
                 step_callback: Optional[StepCallback] = None, disable_pbar: bool = True,
                 low_noise_model=None, switch_step: int = 0, boundary_sigma: float = 0.0,
                 latent_image: Optional[torch.Tensor] = None, noise_mask: Optional[torch.Tensor] = None):
        """`low_noise_model`: Wan 2.2 A14B's second expert, run from the switch on (see expert_switch_step).
        `latent_image` with `noise_mask`: a LATENT whose masked-out part is kept (Wan 2.2 TI2V 5B's start image,
        from Wan22ImageToVideoLatent); every run samples with both, as KSampler does."""
        why = contract.refusal()
        if why:         # a host without the hooks Carnator needs: no run would reuse, or record, anything
            raise UnsupportedModelError(why)
        import comfy.samplers
        self.backbone = backbone_for(model)
        self.layout = self.backbone.layout
        for input_name, source in (("model", model), ("low_noise_model", low_noise_model)):
            why = source is not None and refusal(source)
            if why:
                error = UnsupportedModelError(f"Carnator: {why}")
                error.input_name = input_name
                raise error
        if sampler_name not in comfy.samplers.KSampler.SAMPLERS:
            raise ValueError(f"unknown sampler_name {sampler_name!r}: choose one of "
                             f"{', '.join(comfy.samplers.KSampler.SAMPLERS)}")
        cfg = float(cfg)
        if not math.isfinite(cfg) or cfg <= 0:
            raise ValueError(f"cfg={cfg} must be a finite number > 0 (1 = no guidance)")
        if sigmas is None:
            if scheduler is None or steps is None:
                raise ValueError("ComfyRunner needs either sigmas or a scheduler and a step count")
            sigmas = self.schedule(model, sampler_name, scheduler, steps)
        sigmas = torch.as_tensor(sigmas, dtype=torch.float32).flatten().cpu()
        if sigmas.numel() < 2:
            raise ValueError(f"a schedule needs at least 2 sigmas, got {sigmas.numel()}")
        self.model = model
        self.positive = positive
        self.negative = negative
        self.cfg = cfg
        self.sampler_name = sampler_name
        self.scheduler = scheduler
        self.sigmas = sigmas
        self.seed = int(seed)
        self.step_callback = step_callback
        self.disable_pbar = disable_pbar
        self.sampler = f"{sampler_name}/cfg={cfg:g}"
        self.counts_forwards = True                  # at the first block (_enter_block)
        self.request_fingerprint = conditioning_fingerprint(positive, negative, self.seed)
        if noise_mask is not None and latent_image is None:
            raise ValueError("a noise_mask needs the latent_image it keeps")
        # the request's latent stays the sampler's latent_image in every run when the model reads it: a noise mask
        # keeps part of it, and a model with concat_keys (HunyuanVideo I2V) concatenates it to a conditioning that
        # carries no image of its own (ComfyUI's BaseModel.concat_cond)
        reads_latent = noise_mask is not None or bool(getattr(model.model, "concat_keys", ()))
        self.kept_latent = latent_image.detach().to("cpu", torch.float32) if reads_latent and latent_image is not None \
            else None
        self.noise_mask = None if noise_mask is None else noise_mask.detach().to("cpu", torch.float32)
        # part of the bucket: a hit only ever resumes a generation of the same start image ("" for text-to-video)
        self.image_fingerprint = start_image_fingerprint(positive, negative, self.kept_latent, self.noise_mask)
        self.carry = StepCacheCarry()                # the step cache's state from one run of the request to the next
        self._continuation: Optional[_Continuation] = None   # its probe, for the run that continues it
        # what a region-only resume may keep on the GPU (kept_kv): nothing under dynamic VRAM
        self.memory = TorchMemory(_host_free_memory, paged=contract.dynamic_vram(model))
        # what torch compiles in this request's runs, when a model is compiled (shared by with_step_callback's clones)
        settings = [compile_settings(m) for m in (model, low_noise_model) if m is not None]
        self.compile_watch = CompileWatch() if any(s is not None for s in settings) else None
        # why a hit resumes whole-clip rather than region-only on this model ("" when it may): resume.plan_region
        self.region_only_unfit = next(filter(None, map(region_only_unfit, settings)), None)
        self.low_noise_model, self.switch_step = None, None
        if low_noise_model is not None:
            self._add_low_noise_expert(low_noise_model, sampler_name, scheduler, steps, switch_step, boundary_sigma)
        # the model key: the bucket and the repeat key; its text names the options in "why a new bucket"; an
        # option it cannot read makes the request a plain generation (uncacheable names it)
        self.model_fingerprint, self.model_text, self.uncacheable = self._key()
        step_cache = model_key(model, self.backbone).step_cache
        self.step_cache = step_cache.text() if step_cache else None

    def _add_low_noise_expert(self, low, sampler_name, scheduler, steps, switch_step, boundary_sigma) -> None:
        """Checks that `low` continues this model's trajectories (same architecture and size, same schedule) and
        resolves the switch; the bucket then holds both experts' fingerprints and the switch step."""
        try:
            low_backbone = backbone_for(low)
        except UnsupportedModelError as error:
            raise ExpertMismatchError(str(error)) from None
        if low_backbone != self.backbone or _parameter_shapes(low) != _parameter_shapes(self.model):
            raise ExpertMismatchError(
                f"the low-noise expert ({low_backbone.model_class}, {low_backbone.layout.name}, "
                f"{low_backbone.num_blocks} blocks, {_parameter_count(low) / 1e6:.1f} M parameters) is not the same "
                f"architecture and size as the high-noise model ({self.backbone.model_class}, "
                f"{self.backbone.layout.name}, {self.backbone.num_blocks} blocks, "
                f"{_parameter_count(self.model) / 1e6:.1f} M parameters): connect the other expert of the same pair")
        if scheduler is not None and steps is not None:
            low_sigmas = self.schedule(low, sampler_name, scheduler, steps)
            if not torch.allclose(low_sigmas.float().cpu(), self.sigmas, atol=1e-6):
                raise ExpertMismatchError(
                    "the low-noise expert samples another sigma schedule than the high-noise model (a different "
                    "shift, e.g. ModelSamplingSD3): give both experts the same model sampling")
        from ..schedule import expert_switch_step
        self.switch_step = expert_switch_step(self.sigmas, switch_step, boundary_sigma)
        self.low_noise_model = low
        self.low_backbone = low_backbone

    def _key(self) -> tuple:
        """(digest, text, why uncacheable) of everything on the model(s) that changes the outputs (model_key);
        with two experts, both and the switch step."""
        key = model_key(self.model, self.backbone)
        digest, text, uncacheable = key.digest, key.text(), key.uncacheable()
        if self.low_noise_model is not None:
            low = model_key(self.low_noise_model, self.low_backbone)
            digest = hashlib.sha256(f"{digest}|low_noise={low.digest}|switch={self.switch_step}".encode()
                                    ).hexdigest()[:24]
            text = "; ".join(filter(None, [text, low.text() and f"low-noise expert: {low.text()}"]))
            uncacheable = uncacheable or low.uncacheable()
        return digest, text, uncacheable

    def expert_for(self, step: int):
        """The model that runs `step`."""
        if self.low_noise_model is not None and step >= self.switch_step:
            return self.low_noise_model
        return self.model

    @staticmethod
    def schedule(model, sampler_name: str, scheduler: str, steps: int) -> torch.Tensor:
        """The sigmas ComfyUI's KSampler would use for this sampler, scheduler and step count."""
        import comfy.samplers
        if scheduler not in comfy.samplers.KSampler.SCHEDULERS:
            raise ValueError(f"unknown scheduler {scheduler!r}: choose one of "
                             f"{', '.join(comfy.samplers.KSampler.SCHEDULERS)}")
        steps = int(steps)
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        discard = sampler_name in comfy.samplers.KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS
        sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), scheduler,
                                                 steps + (1 if discard else 0))
        if discard:
            sigmas = torch.cat([sigmas[:-2], sigmas[-1:]])
        return sigmas

    # ---- latent spaces ----

    def to_latent_format(self, x: torch.Tensor) -> torch.Tensor:
        """Model space -> the LATENT a VAE decodes."""
        return self.model.model.process_latent_out(x.to(torch.float32))

    def from_latent_format(self, latent: torch.Tensor) -> torch.Tensor:
        return self.model.model.process_latent_in(latent.to(torch.float32))

    # ---- Runner contract ----

    def changed_since_fingerprint(self) -> str:
        """Why the MODEL no longer matches the key this runner took of it ("" when it does): a node edited it in
        place between the probe and the resume, or one of its options changes while it runs."""
        digest, text, _ = self._key()
        if digest == self.model_fingerprint:
            return ""
        return ("the MODEL changed between the probe and the resume (now: "
                f"{text or 'no options'}; at the probe: {self.model_text or 'no options'}): this request is "
                "finished from its own probe without the cache, and not stored. A node whose settings change while "
                "it runs cannot be compared: bypass it to use the cache; its author can make it comparable "
                "(docs/composing.md)")

    def fresh_step_cache(self) -> None:
        """The next run starts its step cache (EasyCache, LazyCache) afresh instead of continuing the last run's
        state: after a region-only run, that state holds changes measured on the target tokens alone."""
        self.carry = StepCacheCarry()

    def with_step_callback(self, step_callback: Optional[StepCallback]) -> "ComfyRunner":
        clone = object.__new__(ComfyRunner)
        clone.__dict__.update(self.__dict__)
        clone.step_callback = step_callback
        return clone

    def _patched_clone(self, source):
        """A clone of `source` with Carnator's hooks: the same functions for every run (see _ACTIVE)."""
        from comfy.patcher_extension import WrappersMP, add_wrapper_with_key
        model = source.clone()
        replaced = model.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
        for index, (kind, number) in enumerate(self.backbone.block_keys):
            last = index == self.backbone.num_blocks - 1
            patch = _stable(_block_patch, index, replaced.get((kind, number)), last, self.backbone.joint_text)
            model.set_model_patch_replace(patch, "dit", kind, number)
        # first among the patcher's wrappers (which run outside model_options' own): outermost
        model.wrappers[WrappersMP.PREDICT_NOISE] = {HOOK_KEY: [_predict_noise_wrapper],
                                                    **model.wrappers.get(WrappersMP.PREDICT_NOISE, {})}
        add_wrapper_with_key(WrappersMP.SAMPLER_SAMPLE, HOOK_KEY, _whole_schedule, model.model_options,
                             is_model_options=True)
        return model

    def run(self, x: torch.Tensor, sigmas: torch.Tensor, start: int, end: int, observer) -> torch.Tensor:
        """Steps [start, end) from the model-space latent entering `start`; returns the one entering `end`. With two
        experts the steps split at the switch, as ComfyUI's two KSamplerAdvanced do (the first returns its latent
        with the leftover noise, the second continues it without adding noise)."""
        steps = len(sigmas) - 1
        if not 0 <= start <= end <= steps:
            raise ValueError(f"steps [{start}, {end}) are outside the schedule's {steps} steps")
        if start == end:
            return x
        switch = self.switch_step
        if switch is not None and start < switch < end:
            x = self._run(self.model, x, sigmas, start, switch, observer)
            start = switch
        return self._run(self.expert_for(start), x, sigmas, start, end, observer)

    def _watched(self, source, run: _Run, x: torch.Tensor):
        """Counts what torch compiles during one run of a compiled model (CompileWatch), keyed by what a compiled
        model's graphs depend on: the expert and its options, the latent shape, the schedule, guidance (cfg 1 runs
        one batch), the steps run and whether the tokens are cut to a region."""
        if self.compile_watch is None:
            return contextlib.nullcontext()
        fingerprint = self.model_fingerprint if source is self.model else f"low:{self.model_fingerprint}"
        key = (fingerprint, tuple(x.shape), len(run.schedule), self.cfg == 1.0, run.start, run.start + run.count,
               getattr(run.observer, "region", None) is not None)
        return self.compile_watch.run(key)

    def compile_warnings(self) -> list:
        """A recompile storm in this request's runs, or torch's recompile limit hit (CompileWatch)."""
        return self.compile_watch.warnings() if self.compile_watch is not None else []

    def _run(self, source, x: torch.Tensor, sigmas: torch.Tensor, start: int, end: int, observer) -> torch.Tensor:
        import comfy.model_management
        import comfy.sample
        import comfy.samplers
        steps = len(sigmas) - 1
        schedule = torch.as_tensor(sigmas, dtype=torch.float32).flatten().cpu()
        model = self._patched_clone(source)
        history = self._continuation
        if history is not None and not history.continued_by(source, schedule, start, x):
            history = None
        # a run from step 0 that stops short (a probe) is recorded for the run that may continue it; not with a
        # step cache inside, whose own state carries from run to run (StepCacheCarry)
        recording = None
        x = x.detach().to("cpu", torch.float32)
        if history is not None:
            noise, latent = history.noise, history.latent
        else:
            sigma0 = float(schedule[start])
            if sigma0 <= 0.0:
                raise ValueError("cannot run steps from sigma 0: the trajectory has already ended")
            noise, latent = self._sampler_start(x, sigma0)
            if start == 0 and end < steps and live_holder(model.model_options) is None:
                recording = _Continuation(source, schedule, end, noise, latent)
        run = _Run(observer, self.layout, schedule, start, end, steps, self.step_callback, self.carry,
                   "low" if source is not self.model else "high", history, recording)
        run.post_cfg_functions = len(model.model_options.get("sampler_post_cfg_function", ()))
        # a copy: some host samplers write into the sigmas they are given (uni_pc sets the last one to 0.001)
        sub = schedule[run.first:end + 1].clone()
        sampler = comfy.samplers.sampler_object(self.sampler_name)
        try:
            with torch.no_grad(), _running(run), self._watched(source, run, x):
                out = comfy.sample.sample_custom(model, noise, self.cfg, sampler, sub, self.positive, self.negative,
                                                 latent, noise_mask=self.noise_mask, callback=run.callback,
                                                 disable_pbar=self.disable_pbar, seed=self.seed)
        except Exception as error:   # say where: another node's wrapper or patch raises inside the sampler
            if isinstance(error, (comfy.model_management.InterruptProcessingException, torch.OutOfMemoryError)):
                raise                # ComfyUI handles a cancel and an OOM itself
            raise RuntimeError(f"Carnator: sampling steps [{start}, {end}) failed inside ComfyUI's sampler "
                               f"({type(error).__name__}: {error}); the model carries: "
                               f"{self.model_text or 'no patches or wrappers'}. Nothing was stored") from error
        x_end = self.from_latent_format(out.to("cpu")) * (1.0 - float(schedule[end]))
        run.finish(x_end, end)
        if recording is not None:
            recording.result = x_end
            self._continuation = recording
        return x_end

    def _sampler_start(self, x: torch.Tensor, sigma0: float) -> tuple:
        """(noise, latent_image) for which the host sampler starts at x: it starts from sigma0 * noise +
        (1 - sigma0) * latent (latent in the model space). With a kept latent the latent must be the request's own
        (the model reads it: a noise mask keeps part of it, concat_keys concatenate it), so the noise carries x."""
        if self.kept_latent is not None:
            kept = self.from_latent_format(self.kept_latent) if bool(self.kept_latent.any()) else self.kept_latent
            return (x - (1.0 - sigma0) * kept) / sigma0, self.kept_latent
        if sigma0 >= 1.0 or math.isclose(sigma0, 1.0, rel_tol=1e-6):
            return x / sigma0, torch.zeros_like(x)
        return torch.zeros_like(x), self.to_latent_format(x / (1.0 - sigma0)).cpu()

    def preview(self, latent: torch.Tensor) -> torch.Tensor:
        """Middle frame of a model-space latent as RGB [3, H, W] in [-1, 1] (the host's latent->RGB factors)."""
        frame = latent[0, :, latent.shape[2] // 2].detach().to("cpu", torch.float32)
        latent_format = self.model.model.latent_format
        factors = getattr(latent_format, "latent_rgb_factors", None)
        if factors is not None:
            weights = torch.tensor(factors, dtype=torch.float32)
            if weights.shape == (frame.shape[0], 3):
                rgb = torch.einsum("chw,cr->rhw", frame, weights)
                bias = getattr(latent_format, "latent_rgb_factors_bias", None)
                if bias is not None:
                    rgb = rgb + torch.tensor(bias, dtype=torch.float32)[:, None, None]
                return rgb.clamp(-1, 1)
        rgb = frame[:3] if frame.shape[0] >= 3 else frame[:1].expand(3, -1, -1)
        return (rgb / rgb.abs().amax().clamp_min(1e-6)).clamp(-1, 1)


__all__ = ["ComfyRunner", "UnsupportedModelError", "HostBackbone", "backbone_for", "conditioning_fingerprint",
           "host_version", "HOOK_KEY", "SUPPORTED_TEXT", "MODEL_CLASSES"]
