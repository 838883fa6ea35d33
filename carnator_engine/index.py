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


# A bucket's parts, as a newcomer would name them (bucket_difference).
BUCKET_PARTS = {"model": "model/patches (weights, LoRAs or their strengths)", "shape": "latent shape (size or length)",
                "steps": "steps", "schedule": "scheduler (sigma schedule)", "sampler": "sampler",
                "cfg": "cfg/guidance"}


def bucket_parts(model_fingerprint: str, latent_shape, sigmas, sampler: str) -> dict:
    """The inputs of bucket_key, readable. Kept with each entry, so that a request finding no entry of its own bucket
    can be told which part differs from the nearest entry's. `sampler` is the runner's text "name/cfg=...[/...]"."""
    name, _, guidance = sampler.partition("/")
    return {"model": model_fingerprint, "shape": "x".join(str(int(d)) for d in latent_shape),
            "steps": len(sigmas) - 1, "schedule": schedule_fingerprint(sigmas), "sampler": name, "cfg": guidance}


def bucket_difference(store: CarnatorStore, parts: dict) -> str:
    """Why a request found no entry of its bucket: what the nearest other entry differs in (fewest parts), or that the
    cache is empty. Entries stored before their parts were kept are left out."""
    records = store.records()
    if not records:
        return "the cache holds no generation yet"
    best = None
    for record in records:
        theirs = record.extra.get("bucket") if isinstance(record.extra, dict) else None
        if not isinstance(theirs, dict):
            continue
        differ = [name for name in BUCKET_PARTS if theirs.get(name) != parts.get(name)]
        if "steps" in differ and "schedule" in differ:
            differ.remove("schedule")      # another step count is another schedule: say the cause only
        if differ and (best is None or len(differ) < len(best[1])):
            best = (record, differ, theirs)
    if best is None:
        return f"none of the cache's {len(records)} entries records its bucket's parts"
    record, differ, theirs = best
    shown = [BUCKET_PARTS[name] if name in ("model", "schedule")
             else f"{BUCKET_PARTS[name]} ({parts.get(name) or 'none'} here, {theirs.get(name) or 'none'} there)"
             for name in differ]
    return f"the nearest cached generation, entry {record.entry_id}, differs in {', '.join(shown)}"


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
