"""Signature Cache Lookup: nearest earlier generations within a compatible bucket.

A bucket is everything that must match exactly for a trajectory to be reusable at all: the model
(weights and patches), the latent shape, the sigma schedule and the sampler. Within a bucket, the store's
in-memory index shortlists the entries whose compact vectors are nearest (no scan of the store), and the exact
signature distance ranks that shortlist; corrupt entries are reported by the store and skipped.

Candidates are grouped by lineage (the full generation an entry descends from through hits): each of the
`limit` nearest lineages gives its nearest entry, and its full generation too when that is another entry. A
hit's entry keeps only the checkpoints after its own resume step, so without the grouping a few hits of one
generation crowded their source out of the candidates and the request missed for want of an early checkpoint.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional

from .signature import EarlySignature, SignatureDistance, signature_distance
from .schedule import schedule_fingerprint
from .store import CarnatorStore, EntryRecord, StoreError

SHORTLIST = 32   # entries whose exact distance is computed per lookup (see benchmarks/store_scale.py)


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
    """Order candidates by how much of the clip they could share, then by model-level agreement; a NaN
    distance (a broken signature) ranks last."""
    score = distance.denoised + distance.hidden + 0.5 * distance.attention
    return score if math.isfinite(score) else math.inf


def _candidate(store: CarnatorStore, entry_id: str, signature: EarlySignature) -> Optional[Candidate]:
    try:
        record = store.record(entry_id)
        cached = store.signature(record)
    except StoreError:  # gone meanwhile, or corrupt (reported by the store)
        return None
    if not cached.compatible_with(signature):
        return None
    return Candidate(record, cached, signature_distance(signature, cached))


def nearest(store: CarnatorStore, bucket: str, signature: EarlySignature, limit: int = 3) -> list:
    if limit < 1:
        raise ValueError(f"lookup limit must be >= 1, got {limit}")
    try:
        shortlist = store.shortlist(bucket, signature, SHORTLIST)
    except ValueError as error:   # a non-finite signature: nothing can be compared with it
        store.report_problem(f"no lookup: {error}")
        return []
    exact = {c.record.entry_id: c for c in (_candidate(store, e, signature) for e in shortlist) if c is not None}
    ranked = sorted(exact.values(), key=lambda c: rank_score(c.distance))
    best = {}
    for candidate in ranked:
        best.setdefault(candidate.record.root, candidate)
    chosen = []
    for root, candidate in list(best.items())[:limit]:
        chosen.append(candidate)
        if candidate.record.entry_id != root:
            source = exact.get(root) or _candidate(store, root, signature)
            if source is not None and source.record.corrupt is None:
                chosen.append(source)
    return sorted(chosen, key=lambda c: rank_score(c.distance))
