"""ComfyUI's step caches (EasyCache, LazyCache) inside Carnator's split runs.

Carnator runs one request as several sampler runs (probe 0..p, then p..N on a miss, or k..N on a hit).
EasyCache keeps its state per run: its OUTER_SAMPLE wrapper clones a fresh holder for every run and resets it
at the end, keyed by the run's cond uuids (new every run). Its start/end are sigmas (percent_to_sigma of the
model's own sampling), so a run that starts at step k already sees the right part of the schedule; only the
state is per run. `StepCacheCarry` makes the split invisible to it:
- a run that continues where an earlier run of the same request ended (a miss after its probe) gets that run's
  state back (uuids mapped by cond position), so a miss with EasyCache equals one unbroken KSampler + EasyCache;
- a run that records the Early Signature (the probe) computes every step: the holder's threshold is 0 for that
  run, so it never skips, while its bookkeeping (input and output change rates) runs on as it would. The
  signature then never depends on whether a step was skipped. The cost: when the step cache would have skipped
  inside the first p steps (its default start_percent 0.15 keeps the first ~7 of 50 Wan steps), the miss computes
  those steps and differs from KSampler + EasyCache by what that skip would have changed;
- a hit's resume (k..N) and its refine step start fresh, as EasyCache does for any run that starts at k.
Known holders only (model_key decides which): any other step cache makes the request a plain generation.
"""
from __future__ import annotations

from typing import Optional

from .model_key import STEP_CACHE_KEY, STEP_CACHE_SETTINGS

# the holder's settings and the sigmas it derives from them: the fresh holder's own values always stand
_NOT_STATE = frozenset(STEP_CACHE_SETTINGS) | {"name", "verbose", "offload_cache_diff", "start_t", "end_t"}


def live_holder(model_options: dict):
    return (model_options.get("transformer_options") or {}).get(STEP_CACHE_KEY)


def _uuid_layout(guider) -> dict:
    """uuid -> (cond kind, position): the same request's conds in two runs match position by position."""
    layout = {}
    for kind, conds in (getattr(guider, "conds", None) or {}).items():
        for position, cond in enumerate(conds):
            if "uuid" in cond:
                layout[cond["uuid"]] = (kind, position)
    return layout


def _copy(value):
    return dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value


class StepCacheCarry:
    """The step cache's state at the end of each run of one request, for a run that continues it."""

    def __init__(self):
        self.saved: dict = {}        # (expert, end step) -> (state, uuid layout)

    def begin_run(self, holder, guider, start: tuple, records_signature: bool) -> int:
        """At a run's first evaluation (start: (expert, step)); returns the holder's skip count after the
        hand-over. Two experts (Wan 2.2 A14B) keep apart, as two KSamplerAdvanced with EasyCache each do."""
        saved = self.saved.get(start)
        if saved is not None:
            self._restore(holder, guider, *saved)
        if records_signature:
            holder.reuse_threshold = 0.0     # this run's holder only (a fresh clone): never skip, keep counting
        return int(getattr(holder, "total_steps_skipped", 0) or 0)

    def _restore(self, holder, guider, state: dict, layout: dict) -> None:
        now = {place: uuid for uuid, place in _uuid_layout(guider).items()}
        mapping = {old: now.get(place) for old, place in layout.items()}
        if any(new is None for new in mapping.values()):
            return      # the conds differ from the earlier run's: start fresh, as EasyCache itself would
        state = {name: _copy(value) for name, value in state.items()}
        if state.get("first_cond_uuid") is not None:
            state["first_cond_uuid"] = mapping.get(state["first_cond_uuid"])
        if isinstance(state.get("uuid_cache_diffs"), dict):
            state["uuid_cache_diffs"] = {mapping.get(u, u): d for u, d in state["uuid_cache_diffs"].items()}
        vars(holder).update(state)

    @staticmethod
    def snapshot(holder, guider) -> tuple:
        """The holder's state now (its tensors are replaced, never written in place, so references suffice)."""
        state = {name: _copy(value) for name, value in vars(holder).items() if name not in _NOT_STATE}
        return state, _uuid_layout(guider)

    def end_run(self, end: tuple, snapshot: Optional[tuple]) -> None:
        if snapshot is not None:
            self.saved[end] = snapshot


__all__ = ["StepCacheCarry", "live_holder"]
