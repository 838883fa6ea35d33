"""The persistent store of earlier generations (diskcache on disk, survives restarts).

Each entry is four diskcache keys written in one transaction, metadata last:
  ("sig", id)   safetensors bytes of the Early Signature (read by every lookup, small)
  ("blob", id)  safetensors bytes of trajectory checkpoints + attention connectivity + the final latent
                (read on a hit)
  ("thumb", id) PNG thumbnail for the cache browser
  ("meta", id)  a small dict: bucket, request key, prompt, seed, steps, hits, sizes and the SHA-256 of sig
                and blob
An entry whose metadata is missing is invisible; one whose bytes do not match their checksum,
or do not parse, is reported and marked corrupt, and never reaches a generation.

The size limit is ours, not diskcache's: after each write we evict the entries with the least
computational benefit (steps saved by their past hits, as in NIRVANA's LCBFU; never-hit entries
first, oldest use first) until the store fits.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Optional

import diskcache
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .signature import EarlySignature

log = logging.getLogger("carnator.store")

MIN_SIZE_LIMIT = 1 << 20
# The one default size limit of a cache: the Carnator Cache node, the CLI and the engine use it alike.
DEFAULT_SIZE_LIMIT = 8 << 30
CACHE_FILE = "cache.db"   # diskcache's database in a cache folder: a folder without it holds no cache


class StoreError(RuntimeError):
    pass


class CorruptEntryError(StoreError):
    pass


def _check_size_limit(size_limit_bytes: int) -> None:
    if size_limit_bytes < MIN_SIZE_LIMIT:
        raise ValueError(f"cache size limit {size_limit_bytes} bytes is below the minimum of "
                         f"{MIN_SIZE_LIMIT} bytes (1 MiB): raise the size limit")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class EntryRecord:
    entry_id: str
    bucket: str
    prompt: str
    seed: int
    steps: int
    probe_steps: int
    checkpoint_steps: list
    latent_shape: list
    created: float
    last_used: float
    sig_sha256: str
    blob_sha256: str
    size_bytes: int
    hits: int = 0
    steps_saved: int = 0
    reused_from: Optional[str] = None
    corrupt: Optional[str] = None
    extra: dict = field(default_factory=dict)
    request_key: str = ""  # every input of the request (pipeline.request_identity); "" in entries older than it

    def replays(self, request_key: str) -> bool:
        """Whether this entry's stored result is exactly that request's own: a full generation (no hit) of it."""
        return bool(request_key) and self.request_key == request_key and self.reused_from is None

    @property
    def benefit(self) -> float:
        return float(self.steps_saved)


@dataclass
class TrajectoryPayload:
    """What a hit needs from an entry: the latents entering chosen steps, and attention connectivity; what an
    exact repeat needs: the generation's final latent, kept at full precision."""

    checkpoints: dict          # step -> latent tensor (fp16, CPU)
    connectivity: dict         # name -> tensor (ConnectivityRecorder.tensors())
    final: Optional[torch.Tensor] = None


class CarnatorStore:
    def __init__(self, directory: str, size_limit_bytes: int = DEFAULT_SIZE_LIMIT):
        _check_size_limit(size_limit_bytes)
        directory = os.path.abspath(os.path.expanduser(directory))
        try:
            os.makedirs(directory, exist_ok=True)
            probe = os.path.join(directory, f".write-test-{uuid.uuid4().hex}")
            with open(probe, "wb") as handle:
                handle.write(b"ok")
            os.remove(probe)
            self._cache = diskcache.Cache(directory, size_limit=1 << 62, eviction_policy="none")
        except OSError as error:
            raise StoreError(f"Carnator cache directory {directory!r} is not writable ({error.strerror or error}): "
                             "choose another cache path") from error
        self.directory = directory
        self.size_limit_bytes = int(size_limit_bytes)
        self.problems: list = []

    def set_size_limit(self, size_limit_bytes: int) -> list:
        """Applies a new limit at once; returns the ids it evicted."""
        _check_size_limit(size_limit_bytes)
        self.size_limit_bytes = int(size_limit_bytes)
        return self.enforce_size_limit()

    def close(self) -> None:
        self._cache.close()

    # ---- writing -------------------------------------------------------------------------------

    def put(self, *, bucket: str, prompt: str, seed: int, steps: int, probe_steps: int,
            signature: EarlySignature, payload: TrajectoryPayload, latent_shape, thumbnail: bytes = b"",
            reused_from: Optional[str] = None, extra: Optional[dict] = None, request_key: str = "") -> str:
        tensors = {f"checkpoint.{step}": latent.contiguous() for step, latent in payload.checkpoints.items()}
        tensors.update({f"connectivity.{name}": value.contiguous() for name, value in payload.connectivity.items()})
        if payload.final is not None:
            tensors["final"] = payload.final.detach().to("cpu").contiguous()
        blob = save_safetensors(tensors) if tensors else save_safetensors({"empty": torch.zeros(0)})
        sig = save_safetensors(signature.to_tensors())
        size = len(blob) + len(sig) + len(thumbnail)
        if size > self.size_limit_bytes:
            raise StoreError(f"this generation needs {size / 2**20:.1f} MiB but the cache size limit is "
                             f"{self.size_limit_bytes / 2**20:.1f} MiB: raise the size limit to keep it")
        now = time.time()
        record = EntryRecord(
            entry_id=uuid.uuid4().hex[:16], bucket=bucket, prompt=prompt, seed=int(seed), steps=int(steps),
            probe_steps=int(probe_steps), checkpoint_steps=sorted(int(s) for s in payload.checkpoints),
            latent_shape=[int(d) for d in latent_shape], created=now, last_used=now,
            sig_sha256=_sha256(sig), blob_sha256=_sha256(blob), size_bytes=size,
            reused_from=reused_from, extra=dict(extra or {}), request_key=request_key)
        entry = record.entry_id
        with self._cache.transact():
            self._cache.set(("sig", entry), sig)
            self._cache.set(("blob", entry), blob)
            self._cache.set(("thumb", entry), thumbnail)
            self._cache.set(("meta", entry), asdict(record))
        self.enforce_size_limit(keep=entry)
        return entry

    def record_hit(self, entry_id: str, steps_saved: int) -> None:
        with self._cache.transact():
            meta = self._cache.get(("meta", entry_id))
            if meta is None:
                return
            meta["hits"] += 1
            meta["steps_saved"] += int(steps_saved)
            meta["last_used"] = time.time()
            self._cache.set(("meta", entry_id), meta)

    def delete(self, entry_id: str) -> bool:
        with self._cache.transact():
            existed = self._cache.delete(("meta", entry_id))
            for kind in ("sig", "blob", "thumb"):
                self._cache.delete((kind, entry_id))
        return bool(existed)

    def clear(self) -> int:
        count = len(self.records(include_corrupt=True))
        self._cache.clear()
        return count

    def enforce_size_limit(self, keep: Optional[str] = None) -> list:
        """Evict least-benefit entries until the entries fit the limit; returns evicted ids."""
        records = self.records(include_corrupt=True)
        total = sum(r.size_bytes for r in records)
        evicted = []
        # Corrupt entries go first, then the least benefit, then the least recently used.
        order = sorted((r for r in records if r.entry_id != keep),
                       key=lambda r: (r.corrupt is None, r.benefit, r.last_used))
        for record in order:
            if total <= self.size_limit_bytes:
                break
            self.delete(record.entry_id)
            total -= record.size_bytes
            evicted.append(record.entry_id)
        if evicted:
            log.info("carnator: evicted %d entries to stay under %d bytes", len(evicted), self.size_limit_bytes)
        return evicted

    # ---- reading -------------------------------------------------------------------------------

    def records(self, bucket: Optional[str] = None, include_corrupt: bool = False) -> list:
        found = []
        for key in list(self._cache.iterkeys()):
            if not (isinstance(key, tuple) and key[0] == "meta"):
                continue
            meta = self._cache.get(key)
            if meta is None:
                continue
            try:
                record = EntryRecord(**meta)
            except TypeError:
                self._report(key[1], "metadata does not parse")
                continue
            if (bucket is None or record.bucket == bucket) and (include_corrupt or record.corrupt is None):
                found.append(record)
        return sorted(found, key=lambda r: r.created)

    def exact_repeat(self, bucket: str, request_key: str) -> Optional[EntryRecord]:
        """The newest full generation (no hit) of exactly this request, same bucket and request key, else None."""
        same = [r for r in self.records(bucket) if r.replays(request_key)]
        return same[-1] if same else None

    def record(self, entry_id: str) -> EntryRecord:
        meta = self._cache.get(("meta", entry_id))
        if meta is None:
            raise StoreError(f"no cache entry {entry_id!r} (deleted or evicted?): run the probe and lookup again")
        return EntryRecord(**meta)

    def signature(self, record: EntryRecord) -> EarlySignature:
        data = self._checked_bytes(record, "sig", record.sig_sha256)
        try:
            return EarlySignature.from_tensors(load_safetensors(data))
        except Exception as error:  # any parse failure of stored bytes means corruption
            raise self._mark_corrupt(record.entry_id, f"signature does not parse ({error})")

    def trajectory(self, record: EntryRecord) -> TrajectoryPayload:
        data = self._checked_bytes(record, "blob", record.blob_sha256)
        try:
            tensors = load_safetensors(data)
        except Exception as error:
            raise self._mark_corrupt(record.entry_id, f"trajectory does not parse ({error})")
        checkpoints = {int(k.split(".", 1)[1]): v for k, v in tensors.items() if k.startswith("checkpoint.")}
        connectivity = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("connectivity.")}
        final = tensors.get("final")
        expected = tuple(record.latent_shape)
        latents = {f"checkpoint {step}": latent for step, latent in checkpoints.items()}
        if final is not None:
            latents["the final latent"] = final
        for name, latent in latents.items():
            if tuple(latent.shape) != expected:
                raise self._mark_corrupt(record.entry_id, f"{name} has shape {tuple(latent.shape)}, "
                                                          f"expected {expected}")
        return TrajectoryPayload(checkpoints=checkpoints, connectivity=connectivity, final=final)

    def thumbnail(self, entry_id: str) -> bytes:
        return self._cache.get(("thumb", entry_id)) or b""

    def stats(self) -> dict:
        records = self.records(include_corrupt=True)
        return {"entries": len(records), "corrupt": sum(r.corrupt is not None for r in records),
                "bytes": sum(r.size_bytes for r in records), "size_limit_bytes": self.size_limit_bytes,
                "hits": sum(r.hits for r in records), "steps_saved": sum(r.steps_saved for r in records),
                "directory": self.directory}

    def drain_problems(self) -> list:
        """Corruption reports since the last call, for the node's output and the run's summary."""
        problems, self.problems = self.problems, []
        return problems

    # ---- corruption ----------------------------------------------------------------------------

    def _checked_bytes(self, record: EntryRecord, kind: str, sha: str) -> bytes:
        if record.corrupt:
            raise CorruptEntryError(f"cache entry {record.entry_id} is corrupt ({record.corrupt}); it was skipped")
        data = self._cache.get((kind, record.entry_id))
        if data is None:
            raise self._mark_corrupt(record.entry_id, f"its {kind} data is missing (torn write?)")
        if _sha256(data) != sha:
            raise self._mark_corrupt(record.entry_id, f"its {kind} data does not match its checksum")
        return data

    def _mark_corrupt(self, entry_id: str, why: str) -> CorruptEntryError:
        with self._cache.transact():
            meta = self._cache.get(("meta", entry_id))
            if meta is not None:
                meta["corrupt"] = why
                self._cache.set(("meta", entry_id), meta)
        return self._report(entry_id, why)

    def _report(self, entry_id: str, why: str) -> CorruptEntryError:
        message = f"cache entry {entry_id} is corrupt: {why}; it was skipped (delete it or clear the cache)"
        self.problems.append(message)
        log.warning("carnator: %s", message)
        return CorruptEntryError(message)
