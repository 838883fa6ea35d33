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
import math

import numpy as np
import torch

from .signature import EarlySignature

DENOISED_DIM = 192
HIDDEN_DIM = 64
VECTOR_DIM = DENOISED_DIM + HIDDEN_DIM
PROJECTION_SEED = 0xCA4
HIDDEN_WEIGHT = 2.0  # a cosine gap of 0.01 weighs like an RMS gap of 0.2: the two views both count


@functools.lru_cache(maxsize=16)
def _projection(inputs: int, outputs: int, salt: int) -> torch.Tensor:
    rng = np.random.RandomState(PROJECTION_SEED + salt)
    return torch.from_numpy((rng.standard_normal((inputs, outputs)) / np.sqrt(outputs)).astype(np.float32))


def compact_vectors(signatures: list) -> torch.Tensor:
    """[len(signatures), VECTOR_DIM]; the signatures must share their shapes (one bucket's do)."""
    denoised = torch.stack([s.denoised.float().reshape(-1) for s in signatures])
    hidden = torch.stack([s.hidden.float() for s in signatures])
    hidden = hidden / hidden.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    blocks = max(1, hidden.shape[1:-1].numel())
    hidden = hidden.flatten(1)
    vectors = torch.cat([(denoised @ _projection(denoised.shape[1], DENOISED_DIM, 0)) / math.sqrt(denoised.shape[1]),
                         (hidden @ _projection(hidden.shape[1], HIDDEN_DIM, 1)) * (HIDDEN_WEIGHT / math.sqrt(blocks))],
                        dim=1)
    if not bool(torch.isfinite(vectors).all()):
        raise ValueError("the Early Signature holds non-finite values (NaN or inf): the probe's model output is "
                         "broken, so it cannot be stored or compared")
    return vectors


def compact_vector(signature: EarlySignature) -> torch.Tensor:
    return compact_vectors([signature])[0]


class BucketMatrix:
    """One bucket's vectors as rows of a matrix (grown by doubling, removals swap the last row in). Rows live in
    numpy (a row write is a memory copy, not a torch op); a lookup multiplies them as a torch view."""

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
        self.norms[n] = float(np.dot(vector, vector))
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

    def nearest(self, vector: torch.Tensor, count: int) -> list:
        """Ids of the `count` rows nearest to `vector` (squared Euclidean distance), nearest first."""
        n = len(self.ids)
        if n == 0:
            return []
        rows, norms = torch.from_numpy(self.rows[:n]), torch.from_numpy(self.norms[:n])
        distances = norms - 2.0 * torch.mv(rows, vector.float())
        chosen = torch.topk(distances, min(count, n), largest=False, sorted=True).indices
        return [self.ids[i] for i in chosen.tolist()]

    def nbytes(self) -> int:
        return self.rows.nbytes + self.norms.nbytes
