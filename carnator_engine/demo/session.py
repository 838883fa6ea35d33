"""The demo's iteration session: its requests, a live progress line, and each decision in plain words."""
from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

from .. import few_step_gate
from ..euler import TinyDiTRunner
from ..store.index import EMPTY_CACHE

_FIRST = {"color": "red", "shape": "circle", "direction": "right", "background": "black", "size": "small",
          "speed": "slow"}
# (label, attributes, seed): a creator's first request, then the edits people make next. The edits that change the
# small object's motion or outline are hits with a wide margin (the changed region is about 0.3 of the clip against
# the balanced limit of 0.5, the rest of the early picture differs at 0.1-0.3 of the 0.5 limit); the background
# changes every pixel, a miss whatever the risk level.
DEMO_SESSION = [
    ("first request", _FIRST, 1),
    ("same prompt, same seed", _FIRST, 1),
    ("speed edit", {**_FIRST, "speed": "fast"}, 1),
    ("shape edit", {**_FIRST, "shape": "square"}, 1),
    ("direction swap", {**_FIRST, "direction": "left"}, 1),
    ("background change", {**_FIRST, "background": "white"}, 1),
]


class ProgressRunner(TinyDiTRunner):
    """The demo model's runner, telling `on_call` about each model call as it starts."""

    def __init__(self, model, prompt: str, guidance_scale: float, on_call: Callable[[], None]):
        super().__init__(model, prompt, guidance_scale=guidance_scale)
        self.on_call = on_call

    def velocity(self, x, sigma, observer):
        self.on_call()
        return super().velocity(x, sigma, observer)


class Progress:
    """One line, rewritten in place while a request runs, on a terminal only (a pipe or a log gets the rows)."""

    def __init__(self, stream, live: bool):
        self.stream, self.live = stream, live
        self.text, self.calls, self.shown = "", 0, 0

    def start(self, text: str) -> None:
        self.text, self.calls = text, 0
        self._show(f"{text} ...")

    def call(self) -> None:
        self.calls += 1
        self._show(f"{self.text}: model call {self.calls}")

    def clear(self) -> None:
        self._show("")

    def _show(self, line: str) -> None:
        if not self.live:
            return
        self.stream.write("\r" + line.ljust(self.shown) + ("\r" if not line else ""))
        self.stream.flush()
        self.shown = len(line)


# A run had the CPU to itself when its wall time is within this factor of its CPU time (the demo runs torch on one
# thread): beyond it, other programs held the CPU for part of the run and its wall time says more about them.
STEADY_WALL_OVER_CPU = 1.10
# Repeated runs of one request agree when their slowest CPU time is within this factor of their fastest.
STEADY_SPREAD = 1.10


@dataclass
class Timed:
    """One run's wall-clock and CPU seconds (the process's CPU time: robust to other programs' load)."""
    wall: float
    cpu: float

    @property
    def steady(self) -> bool:
        return self.wall <= STEADY_WALL_OVER_CPU * self.cpu


def timed(work: Callable[[], object]) -> tuple:
    """(work's result, Timed)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = work()
    return result, Timed(round(time.perf_counter() - wall, 3), round(time.process_time() - cpu, 3))


def row_speedup(plain: Timed, carnator: Timed) -> str:
    """The row's speedup (plain over Carnator wall time), or 'busy' when either run shared the CPU with other
    programs: then the ratio of two single runs is noise, however many calls the request saved."""
    return speedup(plain.wall, carnator.wall) if plain.steady and carnator.steady else "busy"


def steady_ratio(plain: list, carnator: list) -> Optional[float]:
    """Median plain CPU time over median Carnator CPU time across repeated alternating runs, or None when either
    side's runs disagree by more than STEADY_SPREAD (a ratio then would be noise)."""
    def agree(runs):
        cpus = [run.cpu for run in runs]
        return len(cpus) >= 3 and max(cpus) <= STEADY_SPREAD * min(cpus)
    if not (agree(plain) and agree(carnator)):
        return None
    return statistics.median(run.cpu for run in plain) / statistics.median(run.cpu for run in carnator)


def hit_timing_words(plain: list, hit: list, ratio: Optional[float], calls: int, steps: int, wanted: int,
                     load: str) -> tuple:
    """(the sentence on the hit's speed, the picture's two captions): the median times and their ratio when the
    timings agree (steady_ratio), else the model calls alone and why no ratio is stated."""
    if ratio is not None:
        plain_cpu, hit_cpu = (statistics.median(run.cpu for run in runs) for runs in (plain, hit))
        plain_wall, hit_wall = (statistics.median(run.wall for run in runs) for runs in (plain, hit))
        speed = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"    # medians: two digits
        wall = (f"wall time {hit_wall:.2f} s against {plain_wall:.2f} s" if all(run.steady for run in plain + hit)
                else f"the wall times, {hit_wall:.2f} s against {plain_wall:.2f} s, include waiting for other "
                     f"programs: {load}")
        said = (f"{hit_cpu:.2f} s against {plain_cpu:.2f} s for the plain sampler ({speed}; median CPU time of "
                f"{len(hit)} alternating runs each; {wall}), {calls} model calls of {steps}")
        return said, (f"plain sampler: {steps} model calls, {plain_cpu:.2f} s CPU time",
                      f"Carnator hit: {calls} model calls, {hit_cpu:.2f} s CPU time ({speed})")
    if len(hit) < wanted:
        why = "the hit could not be timed again in a scratch cache"
    else:
        why = (f"the {len(hit)} timed runs of each varied by more than {round(100 * (STEADY_SPREAD - 1))}% "
               f"({load}), so a ratio would be noise")
    return (f"{calls} model calls of {steps}; no speed ratio stated: {why}",
            (f"plain sampler: {steps} model calls", f"Carnator hit: {calls} model calls"))


def decision_name(decision) -> str:
    return "repeat" if decision.exact_repeat else "HIT" if decision.reuse else "miss"


def speedup(reference_seconds: float, seconds: float) -> str:
    """'2.3x': the reference's time over this one's (below 1x: slower); no measurable time reads '>999x'."""
    if seconds <= 0 or reference_seconds / seconds > 999:
        return ">999x"
    return f"{reference_seconds / seconds:.1f}x"


def speed_in_words(reference_seconds: float, seconds: float) -> str:
    """'1.3x faster', '1.2x slower' or 'as fast' than the reference: never 'faster' for what took longer."""
    if seconds > 0 and abs(reference_seconds / seconds - 1) < 0.05:
        return "as fast"
    if seconds <= 0 or reference_seconds >= seconds:
        return f"{speedup(reference_seconds, seconds)} faster"
    return f"{speedup(seconds, reference_seconds)} slower"


def psnr(clip, reference) -> Optional[float]:
    """PSNR in dB of a clip in [-1, 1] against a reference; None for identical clips."""
    mse = float(((clip - reference) / 2).pow(2).mean())
    return round(10 * math.log10(1 / mse), 2) if mse > 0 else None


def miss_in_plain_words(decision, policy, cache_trouble: str = "") -> str:
    """Why the gate generated this request in full, in a user's words, from the decision's numbers; with nothing
    compared, `cache_trouble` (the store could not be used: a fault, failed writes, evictions) or the engine's reason
    (entries probed for another number of steps, another model, shape or schedule)."""
    numbers = decision.numbers
    if few_step_gate.refused(decision):
        return few_step_gate.PLAIN_WORDS
    if not numbers:
        if cache_trouble:
            return cache_trouble
        if decision.reasons[-1:] == [EMPTY_CACHE] or not decision.reasons:
            return "nothing comparable in the cache yet (no earlier generation of this model, size and schedule)"
        return "nothing comparable in the cache: " + "; ".join(decision.reasons)
    found = []
    if not numbers["hidden"] <= policy.max_hidden:
        found.append("the model already reads this prompt differently from the nearest cached one")
    if not numbers["attention"] <= policy.max_attention:
        found.append("the model attends to the clip differently")
    if not (numbers["context"] <= policy.max_context and numbers["context_share"] <= policy.max_context_share):
        found.append("the early picture differs even outside the part that changes")
    if not numbers["target_fraction"] <= policy.max_target_fraction:
        found.append(f"the change covers {numbers['target_fraction']:.0%} of the clip, more than the "
                     f"{policy.max_target_fraction:.0%} this risk level lets it regenerate on top of a cached clip")
    if not found:
        found.append("the part that changes needs so many steps of its own that reuse would save too little")
    return "; ".join(found)


def slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def best_hit(rows: list) -> Optional[dict]:
    """The hit (not an exact repeat) that ran the fewest model calls, the first of equals; None without one."""
    hits = [row for row in rows if row["reuse"] and not row["exact_repeat"]]
    return min(hits, key=lambda row: row["model_calls"]) if hits else None


def no_hit_in_plain_words(rows: list, risk: str) -> str:
    """Why there is no hit to show beside its plain generation: every request repeated (a kept cache replayed:
    each returned its stored result, a success), or none was close enough at this risk level."""
    repeats = sum(row["exact_repeat"] for row in rows)
    if repeats == len(rows):
        return (f"all {repeats} requests were exact repeats of generations already in the cache: each returned its "
                "stored result with no model call; nothing was resumed, so there is no hit-versus-fresh picture "
                "(a new --cache replays the session from a cold cache)")
    said = f"{repeats} exact repeat{'s' if repeats != 1 else ''} returned from the cache; " if repeats else ""
    return (f"{said}no request was resumed from a cached trajectory at risk {risk} (each miss above says why): no "
            "hit-versus-fresh picture")
