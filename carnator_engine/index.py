"""Signature Cache Lookup: nearest earlier generations within a compatible bucket.

A bucket is everything that must match exactly for a trajectory to be reusable at all: the model
(weights and patches), the latent shape, the sigma schedule and the sampler. Within a bucket,
entries are ranked by signature distance; corrupt entries are reported by the store and skipped.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .signature import EarlySignature, SignatureDistance, signature_distance
from .schedule import schedule_fingerprint
from .store import CarnatorStore, CorruptEntryError, EntryRecord


@dataclass
class Candidate:
    record: EntryRecord
    signature: EarlySignature
    distance: SignatureDistance


def bucket_key(model_fingerprint: str, latent_shape, sigmas, sampler: str) -> str:
    text = "|".join([model_fingerprint, "x".join(str(int(d)) for d in latent_shape),
                     schedule_fingerprint(sigmas), sampler])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def rank_score(distance: SignatureDistance) -> float:
    """Order candidates by how much of the clip they could share, then by model-level agreement."""
    return distance.denoised + distance.hidden + 0.5 * distance.attention


def nearest(store: CarnatorStore, bucket: str, signature: EarlySignature, limit: int = 3) -> list:
    if limit < 1:
        raise ValueError(f"lookup limit must be >= 1, got {limit}")
    candidates = []
    for record in store.records(bucket):
        try:
            cached = store.signature(record)
        except CorruptEntryError:
            continue
        if not cached.compatible_with(signature):
            continue
        candidates.append(Candidate(record, cached, signature_distance(signature, cached)))
    candidates.sort(key=lambda c: rank_score(c.distance))
    return candidates[:limit]
