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

from ..signature import EarlySignature, SignatureDistance, shortlist_scores, signature_distance
from ..schedule import schedule_fingerprint
from .store import CarnatorStore, EntryRecord, StoreError
from .vectors import one_torch_thread

SHORTLIST = 32   # entries whose exact distance is computed per lookup (see `benchmarks/store.py scale`)


@dataclass
class Candidate:
    record: EntryRecord
    signature: EarlySignature
    distance: SignatureDistance


def bucket_key(model_fingerprint: str, latent_shape, sigmas, sampler: str, image: str = "") -> str:
    """`image`: the request's start image fingerprint, "" for text-to-video (whose buckets it leaves as they were)."""
    text = "|".join([model_fingerprint, "x".join(str(int(d)) for d in latent_shape),
                     schedule_fingerprint(sigmas), sampler] + ([f"image={image}"] if image else []))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


# A bucket's parts, as a newcomer would name them (bucket_difference).
BUCKET_PARTS = {"model": "model/patches (weights, LoRAs or their strengths)", "shape": "latent shape (size or length)",
                "steps": "steps", "schedule": "scheduler (sigma schedule)", "sampler": "sampler",
                "cfg": "cfg/guidance", "image": "start image (image-to-video conditioning)"}
_NAMED_ONLY = ("model", "schedule", "image")     # digests: named, their values mean nothing to a reader


def bucket_parts(model_fingerprint: str, latent_shape, sigmas, sampler: str, image: str = "") -> dict:
    """The inputs of bucket_key, readable. Kept with each entry, so that a request finding no entry of its own bucket
    can be told which part differs from the nearest entry's. `sampler` is the runner's text "name/cfg=...[/...]"."""
    name, _, guidance = sampler.partition("/")
    parts = {"model": model_fingerprint, "shape": "x".join(str(int(d)) for d in latent_shape),
             "steps": len(sigmas) - 1, "schedule": schedule_fingerprint(sigmas), "sampler": name, "cfg": guidance}
    return {**parts, "image": image} if image else parts


def bucket_difference(store: CarnatorStore, parts: dict) -> str:
    """Why a request found no entry of its bucket: what the nearest other bucket differs in (fewest parts; equal ones:
    the bucket whose oldest entry is oldest), or that the cache is empty. Entries stored before their parts were
    kept are left out. From the store's memory: one example entry per bucket, no entry is read."""
    examples = store.bucket_examples()
    best = None
    for entry_id, theirs in examples:
        differ = [name for name in BUCKET_PARTS if theirs.get(name) != parts.get(name)]
        if "steps" in differ and "schedule" in differ:
            differ.remove("schedule")      # another step count is another schedule: say the cause only
        if differ and (best is None or len(differ) < len(best[1])):
            best = (entry_id, differ, theirs)
    if best is None:
        stats = store.stats()
        usable = stats["entries"] - stats["corrupt"]
        if not usable:
            return EMPTY_CACHE
        return f"none of the cache's {usable} entries records its bucket's parts"
    entry_id, differ, theirs = best
    shown = [BUCKET_PARTS[name] if name in _NAMED_ONLY
             else f"{BUCKET_PARTS[name]} ({parts.get(name) or 'none'} here, {theirs.get(name) or 'none'} there)"
             for name in differ]
    return f"the nearest cached generation, entry {entry_id}, differs in {', '.join(shown)}"


# The start of the reason given when a request's bucket holds entries, none of which could be compared with it: it
# replaces "no earlier generation of this model ... is in the cache", which is then not true.
HELD_BUCKET = "the cache holds generations of this model, shape and schedule"
EMPTY_CACHE = "the cache holds no generation yet"


def incomparable_bucket(store: CarnatorStore, bucket: str, signature: EarlySignature, probe_steps: int,
                        block_size: int) -> str:
    """Why a bucket that holds entries gave no candidate: they were probed for another number of steps (an Early
    Signature holds one state per probe step, so probes of different lengths cannot be compared), their signatures
    differ in shape from this request's (an attention summary recorded at another `block_size`, the probe's tokens
    per attention block), or they could not be read (corrupt or gone; the store reported which). Reads the records
    and signatures of the bucket's nearest entries."""
    try:
        nearest_ids = store.shortlist(bucket, signature, SHORTLIST)
    except ValueError as error:   # a non-finite signature (the lookup has reported it)
        return (f"{HELD_BUCKET}, but this request's signature cannot be "
                f"compared with them ({error})")
    records = {}
    for entry_id in nearest_ids:
        try:
            records[entry_id] = store.record(entry_id)
        except StoreError:
            continue
    others = sorted({record.probe_steps for record in records.values()} - {probe_steps})
    if others:
        steps = " or ".join(str(p) for p in others)
        return (f"{HELD_BUCKET} probed for {steps} steps, this request "
                f"for {probe_steps}: probes of different lengths cannot be compared (set probe steps to {others[0]} "
                "to reuse them)")
    for entry_id, theirs in store.signatures_of(list(records)).items():
        difference = signature.difference(theirs)
        if difference:
            return (f"{HELD_BUCKET}, but the Early Signature of entry {entry_id} differs from this request's in "
                    f"{difference}{_block_size_fix(records[entry_id], signature, theirs, block_size)}")
    return (f"{HELD_BUCKET}, but none could be read for comparison "
            "(the warnings say why)")


def _block_size_fix(record: EntryRecord, mine: EarlySignature, theirs: EarlySignature, block_size: int) -> str:
    """The fix for an attention summary of another size: the probe's block_size (its attention blocks make the
    summary, up to a fixed grid) is not the entry's; "" for any other difference."""
    if mine.attention.shape[-1] == theirs.attention.shape[-1]:
        return ""
    recorded = record.extra.get("block_size") if isinstance(record.extra, dict) else None
    if recorded is None:    # stored before entries kept it
        return f": it was probed at another block_size than this request's {block_size}; probe at its block_size"
    return (f": it was probed at block_size {recorded}, this request at {block_size}; set block_size to {recorded} "
            "to reuse it")


def _finite(score: float) -> float:
    return score if math.isfinite(score) else math.inf


def rank_score(distance: SignatureDistance) -> float:
    """Order candidates by how much of the clip they could share, then by model-level agreement; a NaN
    distance (a broken signature) ranks last."""
    return _finite(distance.denoised + distance.hidden + 0.5 * distance.attention)


def _comparable(store: CarnatorStore, entry_ids: list, query: EarlySignature) -> dict:
    """{id: signature} of those entries whose signature can be compared with the query's, read in one go (the
    store leaves out entries gone meanwhile and corrupt ones, which it reports)."""
    return {e: s for e, s in store.signatures_of(entry_ids).items() if s.compatible_with(query)}


def _candidate(store: CarnatorStore, entry_id: str, cached: EarlySignature,
               query: EarlySignature) -> Optional[Candidate]:
    try:
        record = store.record(entry_id)
    except StoreError:
        return None
    return Candidate(record, cached, signature_distance(query, cached)) if record.corrupt is None else None


def nearest(store: CarnatorStore, bucket: str, signature: EarlySignature, limit: int = 3) -> list:
    if limit < 1:
        raise ValueError(f"lookup limit must be >= 1, got {limit}")
    with one_torch_thread():   # small products: on a busy machine a pool of threads waits for its slowest
        return _nearest(store, bucket, signature, limit)


def _nearest(store: CarnatorStore, bucket: str, signature: EarlySignature, limit: int) -> list:
    try:
        shortlist = store.shortlist(bucket, signature, SHORTLIST)
    except ValueError as error:   # a non-finite signature: nothing can be compared with it
        store.report_problem(f"no lookup: {error}")
        return []
    cached = _comparable(store, shortlist, signature)
    lineages = {e: store.lineage_of(e) for e in cached}
    scores = dict(zip(cached, shortlist_scores(signature, list(cached.values()))))
    ranked = sorted(cached, key=lambda e: (_finite(scores[e]), lineages[e][1]))
    best = {}
    for entry_id in ranked:
        best.setdefault(lineages[entry_id][0], entry_id)
    chosen = []
    for root, entry_id in list(best.items())[:limit]:
        chosen.append(entry_id)
        if root != entry_id:
            chosen.append(root)
    cached.update(_comparable(store, [e for e in chosen if e not in cached], signature))  # roots off the shortlist
    candidates = [_candidate(store, e, cached[e], signature) for e in chosen if e in cached]
    return sorted((c for c in candidates if c is not None), key=lambda c: (rank_score(c.distance), c.record.created))
