"""Compact signature vectors: what the in-memory index compares to find the few entries worth an exact distance.

A vector is 256 float32 numbers (1 KiB): 192 from a fixed random projection of the coarse denoised estimate,
scaled so its Euclidean distance approximates the RMS difference the gate measures (Johnson-Lindenstrauss), and
64 from a projection of the pooled block states, each block's vector normalised first so that their squared
distance tracks 1 - cosine. The projections come from numpy's legacy RandomState, whose stream is frozen across
numpy versions: every process and every version computes the same vector for the same signature, which matters
because vectors are stored with the entry's metadata and shared by every worker of a store.
The exact distance (signature.signature_distance) still decides the order of the shortlist.
"""
from __future__ import annotations

import functools

import numpy as np

from .signature import EarlySignature

DENOISED_DIM = 192
HIDDEN_DIM = 64
VECTOR_DIM = DENOISED_DIM + HIDDEN_DIM
PROJECTION_SEED = 0xCA4
HIDDEN_WEIGHT = 2.0  # a cosine gap of 0.01 weighs like an RMS gap of 0.2: the two views both count


@functools.lru_cache(maxsize=16)
def _projection(inputs: int, outputs: int, salt: int) -> np.ndarray:
    rng = np.random.RandomState(PROJECTION_SEED + salt)
    return (rng.standard_normal((inputs, outputs)) / np.sqrt(outputs)).astype(np.float32)


def compact_vector(signature: EarlySignature) -> np.ndarray:
    denoised = signature.denoised.float().reshape(-1).numpy()
    denoised = denoised / np.sqrt(max(1, denoised.size))
    hidden = signature.hidden.float()
    hidden = hidden / hidden.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    hidden = hidden.reshape(-1).numpy() * (HIDDEN_WEIGHT / np.sqrt(max(1, hidden.shape[:-1].numel())))
    vector = np.concatenate([denoised @ _projection(denoised.size, DENOISED_DIM, 0),
                             hidden @ _projection(hidden.size, HIDDEN_DIM, 1)]).astype(np.float32)
    if not np.isfinite(vector).all():
        raise ValueError("the Early Signature holds non-finite values (NaN or inf): the probe's model output is "
                         "broken, so it cannot be stored or compared")
    return vector


class BucketMatrix:
    """One bucket's vectors as rows of a matrix (grown by doubling, removals swap the last row in)."""

    def __init__(self):
        self.rows = np.zeros((16, VECTOR_DIM), dtype=np.float32)
        self.norms = np.zeros(16, dtype=np.float32)
        self.ids: list = []
        self.position: dict = {}

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, entry_id: str, vector: np.ndarray) -> None:
        if entry_id in self.position:
            self.remove(entry_id)
        n = len(self.ids)
        if n == len(self.rows):
            self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
            self.norms = np.concatenate([self.norms, np.zeros_like(self.norms)])
        self.rows[n] = vector
        self.norms[n] = float(vector @ vector)
        self.ids.append(entry_id)
        self.position[entry_id] = n

    def remove(self, entry_id: str) -> None:
        n = self.position.pop(entry_id, None)
        if n is None:
            return
        last = len(self.ids) - 1
        if n != last:
            moved = self.ids[last]
            self.rows[n], self.norms[n], self.ids[n] = self.rows[last], self.norms[last], moved
            self.position[moved] = n
        self.ids.pop()

    def nearest(self, vector: np.ndarray, count: int) -> list:
        """Ids of the `count` rows nearest to `vector` (squared Euclidean distance), nearest first."""
        n = len(self.ids)
        if n == 0:
            return []
        distances = self.norms[:n] - 2.0 * (self.rows[:n] @ vector)
        if count < n:
            chosen = np.argpartition(distances, count)[:count]
        else:
            chosen = np.arange(n)
        chosen = chosen[np.argsort(distances[chosen], kind="stable")]
        return [self.ids[i] for i in chosen]

    def nbytes(self) -> int:
        return self.rows.nbytes + self.norms.nbytes
