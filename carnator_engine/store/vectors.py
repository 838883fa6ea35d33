"""Compact signature vectors: what the in-memory index compares to find the few entries worth an exact distance.

A vector is 256 numbers, stored and held in memory as float16 (512 bytes): 192 from a fixed random projection of
the coarse denoised estimate, scaled so its Euclidean distance approximates the RMS difference the gate measures
(Johnson-Lindenstrauss), and 64 from a projection of the pooled block states, each block's vector normalised first
so that their squared distance tracks 1 - cosine. The projections come from numpy's legacy RandomState, whose
stream is frozen across numpy versions: every process and every version computes the same vector for the same
signature, which matters because vectors are stored with the entry's metadata and shared by every worker of a
store. The exact distance (signature.signature_distance) still decides the order of the shortlist.
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Optional

import numpy as np
import torch

from ..signature import EarlySignature
from ..threads import cpu_threads

DENOISED_DIM = 192
HIDDEN_DIM = 64
VECTOR_DIM = DENOISED_DIM + HIDDEN_DIM
PROJECTION_SEED = 0xCA4
HIDDEN_WEIGHT = 2.0  # a cosine gap of 0.01 weighs like an RMS gap of 0.2: the two views both count


@functools.lru_cache(maxsize=16)
def _projection(inputs: int, outputs: int, salt: int) -> torch.Tensor:
    rng = np.random.RandomState(PROJECTION_SEED + salt)
    return torch.from_numpy((rng.standard_normal((inputs, outputs)) / np.sqrt(outputs)).astype(np.float32))


_drawing: dict = {}     # denoised size -> the thread drawing its projection (warm_denoised_projection)
_drawing_lock = threading.Lock()


def warm_denoised_projection(size: int) -> None:
    """Starts drawing the denoised projection for signatures of `size` numbers in a background thread. Drawing it
    is the costly part of a process's first lookup for a latent shape (192 x 65536 normals for LTX-Video's
    128-channel latent: 0.36 s of an H200 run's first lookup); the probe starts it so that its GPU steps hide it.
    The values are the same as if drawn on demand; a wrong guess of the size only wastes the draw."""
    with _drawing_lock:
        if size <= 0 or size in _drawing:
            return
        thread = threading.Thread(target=_projection, args=(size, DENOISED_DIM, 0), daemon=True,
                                  name="carnator-projection")
        _drawing[size] = thread
        thread.start()


def _denoised_projection(size: int) -> torch.Tensor:
    thread = _drawing.get(size)
    if thread is not None:
        thread.join()   # one draw per size: wait for the warm-up's instead of drawing it a second time
    return _projection(size, DENOISED_DIM, 0)


_threads_lock = threading.RLock()


@contextlib.contextmanager
def one_torch_thread():
    """torch's intra-op pool at one thread while a lookup's small products run. Split over the pool's threads on
    a machine whose cores are busy (the sampler, other workers), each product waits for the slowest thread: a
    10k-entry lookup measured 31 ms with two threads on a busy 2-core machine against 4 ms with one. The pool
    is process-wide, so lookups take it one at a time and set it back after."""
    with _threads_lock, cpu_threads(1):
        yield


def compact_vectors(signatures: list) -> torch.Tensor:
    """[len(signatures), VECTOR_DIM]; the signatures must share their shapes (one bucket's do)."""
    with one_torch_thread():
        return _compact_vectors(signatures)


def _compact_vectors(signatures: list) -> torch.Tensor:
    denoised = torch.stack([s.denoised.float().reshape(-1) for s in signatures])
    hidden = torch.stack([s.hidden.float() for s in signatures])
    hidden = hidden / hidden.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    blocks = max(1, hidden.shape[1:-1].numel())
    hidden = hidden.flatten(1)
    vectors = torch.cat([(denoised @ _denoised_projection(denoised.shape[1])) / math.sqrt(denoised.shape[1]),
                         (hidden @ _projection(hidden.shape[1], HIDDEN_DIM, 1)) * (HIDDEN_WEIGHT / math.sqrt(blocks))],
                        dim=1)
    if not bool(torch.isfinite(vectors).all()):
        raise ValueError("the Early Signature holds non-finite values (NaN or inf): the probe's model output is "
                         "broken, so it cannot be stored or compared")
    return vectors


def compact_vector(signature: EarlySignature) -> torch.Tensor:
    return compact_vectors([signature])[0]


def _squared_norms(rows: np.ndarray) -> np.ndarray:
    """Of float16 rows, in float32; one computation for a row added and for rows loaded in bulk, so both give
    the same bits."""
    wide = rows.astype(np.float32)
    return np.einsum("ij,ij->i", wide, wide)


class BucketMatrix:
    """One bucket's vectors as rows of a matrix. Rows are float16, as vectors are stored (half the memory of
    float32, nothing lost); removals swap the last row in; the matrix grows by a quarter, not by doubling (a
    doubled 100k matrix held 31k empty rows). A lookup converts CHUNK rows at a time to float32 and multiplies
    them: a chunk stays in the CPU's cache, so this reads half the bytes of a float32 matrix and runs faster."""

    CHUNK = 4096    # rows converted at a time: 4 MB of float32, cache-sized (8192 measured slower at 100k)
    GROWTH = 1.25

    def __init__(self, ids: Optional[list] = None, rows: Optional[np.ndarray] = None):
        """Empty, or holding `ids` with their float16 `rows` (what a snapshot or a rebuild loads)."""
        self.ids = list(ids or [])
        count = len(self.ids)
        self.rows = np.zeros((max(16, count), VECTOR_DIM), dtype=np.float16)
        self.norms = np.zeros(len(self.rows), dtype=np.float32)
        for start in range(0, count, self.CHUNK):   # float32 a chunk at a time, not a second matrix
            stop = min(count, start + self.CHUNK)
            self.rows[start:stop] = rows[start:stop]
            self.norms[start:stop] = _squared_norms(self.rows[start:stop])
        self.position = {entry_id: row for row, entry_id in enumerate(self.ids)}

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, entry_id: str, vector: np.ndarray) -> None:
        if entry_id in self.position:
            self.remove(entry_id)
        n = len(self.ids)
        if n == len(self.rows):
            grown = int(n * self.GROWTH) + 16
            self.rows = np.concatenate([self.rows, np.zeros((grown - n, VECTOR_DIM), dtype=np.float16)])
            self.norms = np.concatenate([self.norms, np.zeros(grown - n, dtype=np.float32)])
        self.rows[n] = vector
        self.norms[n] = _squared_norms(self.rows[n:n + 1])[0]
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

    def filled_rows(self) -> np.ndarray:
        """The rows of `ids`, in their order (a view)."""
        return self.rows[:len(self.ids)]

    def nearest(self, vector: torch.Tensor, count: int) -> list:
        """Ids of the `count` rows nearest to `vector` (squared Euclidean distance), nearest first."""
        n = len(self.ids)
        if n == 0:
            return []
        with one_torch_thread():
            return self._nearest(vector, count, n)

    def _nearest(self, vector: torch.Tensor, count: int, n: int) -> list:
        rows, query = torch.from_numpy(self.rows[:n]), vector.float()
        distances = torch.from_numpy(self.norms[:n].copy())
        for start in range(0, n, self.CHUNK):
            stop = min(n, start + self.CHUNK)
            distances[start:stop] -= 2.0 * torch.mv(rows[start:stop].float(), query)
        chosen = torch.topk(distances, min(count, n), largest=False, sorted=True).indices
        return [self.ids[i] for i in chosen.tolist()]

    def nbytes(self) -> int:
        return self.rows.nbytes + self.norms.nbytes
