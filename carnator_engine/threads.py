"""torch's CPU thread count for one piece of work, put back after it.

Small CPU operations (the demo model's layers, a lookup's distances) do not gain from sharing among threads, and
on a machine busy with other work torch's threads, one per core, wait on each other: the demo took 158 s instead
of 13 s on a loaded 2-core machine. Such work runs on a fixed small count instead.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def cpu_threads(count: int):
    """torch runs its CPU operations on `count` threads inside the block; the caller's count is restored after."""
    previous = torch.get_num_threads()
    if previous == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
