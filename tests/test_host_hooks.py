"""Carnator's ComfyUI hooks against the call shapes of newer hosts (stand-ins written from ComfyUI 0.38's signatures):
wrappers pass on whatever arguments the host adds, and the attention override chains to the override installed when
it is called, once."""
from __future__ import annotations

import types

import torch

from carnator_engine.hosts import comfyui


class _Run:
    """What the wrappers report to: the run in progress."""

    def __init__(self):
        self.schedule = torch.linspace(1, 0, 5)
        self.seen = []

    def before_evaluation(self, x, timestep):
        self.seen.append(("before", x, timestep))

    def step_cache(self, model_options, guider, evaluated):
        self.seen.append(("step_cache", model_options, evaluated))

    def after_evaluation(self, out):
        self.seen.append(("after", out))

    def in_history(self):        # a miss's continuation answering its probe's evaluations: not this run
        return False

    def record(self, x, out):
        self.seen.append(("record", x, out))


class _Executor:
    """A WrapperExecutor stand-in: records the arguments it is called with."""

    def __init__(self, out="out"):
        self.class_obj = object()
        self.calls = []
        self.out = out

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.out


def test_predict_noise_wrapper_passes_new_arguments_through(monkeypatch):
    run = _Run()
    monkeypatch.setattr(comfyui._ACTIVE, "run", run)
    executor = _Executor()
    x, timestep, options = torch.zeros(1), torch.ones(1), {"transformer_options": {}}
    # positionally, with an argument a newer host adds after seed, and a new keyword
    out = comfyui._predict_noise_wrapper(executor, x, timestep, options, 7, "later", new_flag=True)
    assert out == "out" and executor.calls == [((x, timestep, options, 7, "later"), {"new_flag": True})]
    assert run.seen[0] == ("before", x, timestep) and run.seen[1][1] is options
    # by name
    run.seen.clear()
    comfyui._predict_noise_wrapper(executor, x=x, timestep=timestep, model_options=options, seed=3)
    assert executor.calls[-1] == ((), {"x": x, "timestep": timestep, "model_options": options, "seed": 3})
    assert run.seen[0] == ("before", x, timestep) and run.seen[1][1] is options


def test_sampler_sample_wrapper_passes_new_arguments_through(monkeypatch):
    run = _Run()
    monkeypatch.setattr(comfyui._ACTIVE, "run", run)
    executor = _Executor()
    guider, sigmas = object(), torch.linspace(1, 0.5, 3, dtype=torch.float64)
    extra = {"model_options": {}}
    comfyui._whole_schedule(executor, guider, sigmas, extra, "callback", "noise", latent_shapes=[(1, 2)])
    assert executor.calls == [((guider, sigmas, extra, "callback", "noise"), {"latent_shapes": [(1, 2)]})]
    whole = extra["model_options"]["transformer_options"]["sample_sigmas"]
    assert torch.equal(whole, run.schedule.double()) and whole.dtype == torch.float64
    extra = {"model_options": {}}
    comfyui._whole_schedule(executor, guider=guider, sigmas=sigmas, extra_args=extra, force_full_load=True)
    assert executor.calls[-1][1]["force_full_load"] is True
    assert "sample_sigmas" in extra["model_options"]["transformer_options"]


def _sparse_like(log, previous_is):
    """An override shaped after core's Model Sparse Attention: declined calls run `previous`, the override it found
    when installed (or the host's function); self-attention it computes itself, as its kernel does."""
    def make(previous):
        def override(func, q, k, v, heads, mask=None, **kwargs):
            log.append("sparse")
            if q.shape != k.shape:         # cross-attention: declined
                kw = dict(mask=mask, **kwargs)
                return func(q, k, v, heads, **kw) if previous is None else previous(func, q, k, v, heads, **kw)
            return func(q, k, v, heads, mask=mask, **kwargs)
        previous_is.append(previous)
        return override
    return make


class _Observer:
    def __init__(self, log):
        self.log = log
        self.region = None

    def self_attention(self, block, q, k, v, dense, video_tokens, host_sdpa):
        self.log.append(("carnator", block, host_sdpa))
        return dense(q, k, v)


def _attention(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
    """The host's attention function (merged heads in and out)."""
    b, length, inner = q.shape
    split = [t.reshape(b, t.shape[1], heads, inner // heads).transpose(1, 2) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*split)
    return out.transpose(1, 2).reshape(b, length, inner)


def _wrap_attn(options, q, k, v, heads):
    """What the host's wrap_attn does: the override in transformer_options, if any, gets the function first."""
    override = options.get("optimized_attention_override")
    if override is None:
        return _attention(q, k, v, heads, transformer_options=options)
    return override(_attention, q, k, v, heads, transformer_options=options)


def test_attention_override_is_on_top_of_the_one_installed_at_call_time(monkeypatch):
    """Core's sparse attention re-installs itself on top at every step, chaining to what it finds: Carnator's override,
    looked up per block call, still sees every self-attention call and runs the sparse one below it exactly once."""
    log, previous_is = [], []
    make = _sparse_like(log, previous_is)
    run = types.SimpleNamespace(observer=_Observer(log), tokens=6)
    monkeypatch.setattr(comfyui._ACTIVE, "run", run)
    model_options = {"optimized_attention_override": make(None)}
    q = torch.randn(1, 6, 8)
    text = torch.randn(1, 3, 8)
    for step in range(3):
        # the sparse node's per-step re-install, on the options the step runs with
        current = model_options["optimized_attention_override"]
        model_options["optimized_attention_override"] = make(current)
        block_options = dict(model_options, block_index=0)
        comfyui._attention_on_top(block_options, joint_text=False)
        log.clear()
        out = _wrap_attn(block_options, q, q, q, 2)
        assert log == [("carnator", 0, False), "sparse"]
        assert torch.allclose(out, _attention(q, q, q, 2), atol=1e-6)
        log.clear()
        _wrap_attn(block_options, q, text, text, 2)     # cross-attention: straight down the chain
        assert log == ["sparse"] * (step + 2)           # the sparse node's own chain, unchanged by Carnator
    assert comfyui._ATTENTION[False] not in previous_is    # Carnator's never ends up below another override
    assert "optimized_attention_override" in model_options and comfyui.ATTENTION_BELOW not in model_options


def test_attention_override_without_another_override_runs_the_host_function(monkeypatch):
    log = []
    monkeypatch.setattr(comfyui._ACTIVE, "run", types.SimpleNamespace(observer=_Observer(log), tokens=6))
    options = {"block_index": 1}
    comfyui._attention_on_top(options, joint_text=False)
    q = torch.randn(1, 6, 8)
    again = dict(options)
    comfyui._attention_on_top(again, joint_text=False)     # already on top: nothing chains to itself
    assert again[comfyui.ATTENTION_BELOW] is None
    assert torch.allclose(_wrap_attn(again, q, q, q, 2), _attention(q, q, q, 2), atol=1e-6)
    assert log == [("carnator", 1, False)]


def test_grouped_keys_and_other_scales_go_down_the_chain(monkeypatch):
    """Newer hosts pass enable_gqa (keys with fewer heads) and scale: attention the observer would compute otherwise
    is left to the chain."""
    log = []
    monkeypatch.setattr(comfyui._ACTIVE, "run", types.SimpleNamespace(observer=_Observer(log), tokens=6))
    options = {"block_index": 0}
    comfyui._attention_on_top(options, joint_text=False)
    override = options["optimized_attention_override"]
    q, kv = torch.randn(1, 6, 8), torch.randn(1, 6, 4)
    calls = []

    def host(*args, **kwargs):
        calls.append(kwargs)
        return args[0]
    override(host, q, kv, kv, 2, transformer_options=options, enable_gqa=True)
    override(host, q, q, q, 2, transformer_options=options, scale=1.0)
    assert log == [] and [c.get("enable_gqa") for c in calls] == [True, None] and calls[1]["scale"] == 1.0
