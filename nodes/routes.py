"""HTTP routes of the cache browser, served by ComfyUI's PromptServer under /carnator/ (and /api/carnator/).

  GET    /carnator/entries[?cache=DIR]                       entries of a store, newest first
  GET    /carnator/entries/{entry_id}/thumbnail[?cache=DIR]  the entry's PNG thumbnail
  DELETE /carnator/entries/{entry_id}[?cache=DIR]            delete one entry
  POST   /carnator/clear[?cache=DIR]   body {"confirm": true} delete every entry of the store
  GET    /carnator/stats[?cache=DIR]                         totals, plus the stores the browser may pick

A request never names a filesystem path Carnator has not opened itself: `cache` must be one of
the stores this ComfyUI opened (in this run, or remembered from an earlier one: nodes/stores.py) or the
default store, and a folder is opened only when it carries the store marker; anything else is a 400
(which never echoes a URL's password). Entry ids are the store's 16 lowercase hex digits. Errors are JSON: {"error": message, "status"}.

The logic (validation, store choice, serialisation) is plain functions, testable without aiohttp;
the handlers only translate between HTTP and those functions, and run store work off the event loop.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
from typing import Optional

from carnator_engine.store.backends import holds_store, is_redis_url
from carnator_engine.store.backends.redis_store import shown_url
from carnator_engine.plain import json_safe
from carnator_engine.store import DEFAULT_SIZE_LIMIT, CarnatorStore, StoreError
from carnator_engine.typed_paths import control_character

from .stores import default_cache_dir, known_stores, open_store, remembered_stores

log = logging.getLogger("carnator.routes")

PREFIX = "/carnator"
ENTRY_ID = re.compile(r"[0-9a-f]{16}")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_PATH_LENGTH = 4096
MAX_BODY_BYTES = 1 << 20   # aiohttp's own default limit, answered as 413 instead of a 500


class RequestError(Exception):
    """A request the routes refuse; `status` is the HTTP status, `message` says what to do instead."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# ---- validation and store choice ----------------------------------------------------------------

def check_entry_id(entry_id: str) -> str:
    if not isinstance(entry_id, str) or not ENTRY_ID.fullmatch(entry_id):
        shown = entry_id[:40] if isinstance(entry_id, str) else type(entry_id).__name__
        raise RequestError(400, f"invalid entry id {shown!r}: an entry id is 16 lowercase hex digits")
    return entry_id


def _normalise(location: str) -> str:
    """A directory spelled one way; a Redis store's shown URL (never holding a password) as it is."""
    return location if is_redis_url(location) else os.path.normpath(os.path.abspath(location))


def _shown(cache: str) -> str:
    """A `cache` parameter as an answer may echo it: a Redis URL without its password."""
    return shown_url(cache) if is_redis_url(cache) else cache


def store_directories() -> list:
    """The directories a request may name: every store opened by this process or remembered from earlier runs
    (stores.remembered_stores), and the default one."""
    default = _normalise(default_cache_dir())
    listed = {_normalise(d) for d in known_stores()} | {_normalise(d) for d in remembered_stores()}
    listed = {d for d in listed if holds_store(d)}   # a folder deleted (or moved) since is no store to pick
    listed.add(default)
    return [{"directory": d, "default": d == default} for d in sorted(listed, key=lambda d: (d != default, d))]


def resolve_store(cache: Optional[str]) -> Optional[CarnatorStore]:
    """The store a request names (the default one when `cache` is empty).

    Returns None for the default store when nothing has created it yet (a browser's GET must not
    create directories). Raises RequestError(400) for anything but a known store directory: the
    name is compared, never opened.
    """
    default = _normalise(default_cache_dir())
    if cache is None or cache.strip() == "":
        directory = default
    else:
        typed = len(cache) <= MAX_PATH_LENGTH and not control_character(cache)
        if not (typed and (os.path.isabs(cache) or is_redis_url(cache))):
            raise RequestError(400, "the cache parameter must be the absolute directory or the Redis URL of a "
                                    "known Carnator store (GET /carnator/stats lists them)")
        directory = _normalise(cache)
    opened = {_normalise(d): store for d, store in known_stores().items()}
    if directory in opened:
        return opened[directory]
    remembered = {_normalise(d): limit for d, limit in remembered_stores().items()}
    if directory != default and directory not in remembered:
        raise RequestError(400, f"{_shown(cache)!r} is not a Carnator store of this ComfyUI: pick one of the "
                                "stores listed by GET /carnator/stats")
    if not holds_store(directory):   # a folder only once it carries the store marker: nothing else is opened
        if directory == default:
            return None
        raise RequestError(400, f"{_shown(cache)!r} is no longer a Carnator store (moved or deleted?): pick one of "
                                "the stores listed by GET /carnator/stats")
    try:
        return open_store(directory, remembered.get(directory, DEFAULT_SIZE_LIMIT))
    except StoreError as error:
        raise RequestError(500, str(error)) from error


def clear_confirmed(body) -> bool:
    return isinstance(body, dict) and body.get("confirm") is True


# ---- serialisation ------------------------------------------------------------------------------

def record_json(record) -> dict:
    """One EntryRecord as the cache browser shows it."""
    extra = record.extra if isinstance(record.extra, dict) else {}
    decision = extra.get("decision") if isinstance(extra.get("decision"), dict) else {}
    return json_safe({
        "id": record.entry_id,
        "prompt": record.prompt,
        "model": extra.get("model") or "",     # the model's file name, or a short fingerprint of it
        "bucket": record.bucket,
        "seed": record.seed,
        "steps": record.steps,
        "probe_steps": record.probe_steps,
        "checkpoints": len(record.checkpoint_steps),
        "latent_shape": list(record.latent_shape),
        "hits": record.hits - record.repeats,     # reuses through the gate; exact repeats apart (store.stats)
        "exact_repeats": record.repeats,
        "steps_saved": record.steps_saved,
        "size_bytes": record.size_bytes,
        "created": record.created,
        "last_used": record.last_used,
        "reused_from": record.reused_from,
        "corrupt": record.corrupt,
        "decision": {key: decision[key] for key in ("reuse", "risk", "resume_step", "model_calls", "steps",
                                                    "steps_run", "step_cache", "step_cache_skipped",
                                                    "expected_speedup", "entry_id") if key in decision},
    })


def empty_stats(directory: str, size_limit_bytes: int = 0) -> dict:
    return {"entries": 0, "corrupt": 0, "bytes": 0, "size_limit_bytes": size_limit_bytes, "hits": 0,
            "exact_repeats": 0, "steps_saved": 0, "directory": directory}


def list_entries(store: Optional[CarnatorStore]) -> dict:
    records = store.records(include_corrupt=True) if store is not None else []
    entries = [record_json(r) for r in sorted(records, key=lambda r: r.created, reverse=True)]
    directory = store.location if store is not None else _normalise(default_cache_dir())
    return {"directory": directory, "entries": entries}


def store_stats(store: Optional[CarnatorStore]) -> dict:
    stats = store.stats() if store is not None else empty_stats(_normalise(default_cache_dir()))
    return json_safe({**stats, "stores": store_directories()})


def entry_thumbnail(store: Optional[CarnatorStore], entry_id: str) -> bytes:
    check_entry_id(entry_id)
    if store is None:
        raise RequestError(404, f"no cache entry {entry_id}: the cache is empty")
    try:
        store.record(entry_id)
    except StoreError:
        raise RequestError(404, f"no cache entry {entry_id} (deleted or evicted?)") from None
    data = store.thumbnail(entry_id)
    if not data.startswith(PNG_SIGNATURE):
        raise RequestError(404, f"cache entry {entry_id} has no thumbnail")
    return data


def delete_entry(store: Optional[CarnatorStore], entry_id: str) -> dict:
    check_entry_id(entry_id)
    if store is None or not store.delete(entry_id):
        raise RequestError(404, f"no cache entry {entry_id} (already deleted or evicted?)")
    log.info("carnator: cache entry %s deleted from the web UI", entry_id)
    return {"deleted": entry_id}


def clear_store(store: Optional[CarnatorStore], body) -> dict:
    if not clear_confirmed(body):
        raise RequestError(400, 'clearing the cache deletes every entry: send the JSON body {"confirm": true}')
    count = store.clear() if store is not None else 0
    log.info("carnator: cache %s cleared from the web UI (%d entries)",
             store.location if store is not None else "(default, empty)", count)
    return {"deleted": count}


# ---- aiohttp handlers ---------------------------------------------------------------------------

def _web():
    from aiohttp import web  # ComfyUI's server dependency; imported late so the logic above needs none
    return web


def _error(status: int, message: str):
    return _web().json_response({"error": message, "status": status}, status=status)


async def _call(request, job, *args):
    """job(store named by ?cache=, *args) in a worker thread: store work never blocks the server."""
    cache = request.query.get("cache")

    def work():
        store = resolve_store(cache)
        if store is not None:   # the browser lists (and clears) what this process is still writing too
            store.writer.settle()
        return job(store, *args)
    return await asyncio.to_thread(work)


def _handler(work):
    async def handle(request):
        try:
            return await work(request)
        except RequestError as error:
            return _error(error.status, error.message)
        except Exception as error:  # noqa: BLE001 - the browser gets a message, the log gets the trace
            log.exception("carnator: %s %s failed", request.method, request.path)
            return _error(500, f"Carnator could not answer {request.method} {request.path}: {error}")
    handle.__name__ = f"carnator{work.__name__}"
    return handle


async def _entries(request):
    return _web().json_response(await _call(request, list_entries))


async def _thumbnail(request):
    data = await _call(request, entry_thumbnail, request.match_info["entry_id"])
    return _web().Response(body=data, content_type="image/png", headers={"Cache-Control": "private, max-age=3600"})


async def _delete(request):
    return _web().json_response(await _call(request, delete_entry, request.match_info["entry_id"]))


def parse_body(data: bytes):
    """The JSON of a request body; RequestError(400) for anything else, deep nesting included."""
    try:
        return json.loads(data) if data else None
    except (ValueError, RecursionError):
        raise RequestError(400, 'the request body is not (plain) JSON: send {"confirm": true}') from None


async def _read_body(request) -> bytes:
    """At most MAX_BODY_BYTES of the body, read piece by piece: a chunked body declares no length, and the
    application's own limit (ComfyUI raises aiohttp's to its upload size) would let it be read whole."""
    too_large = RequestError(413, f"the request body is over {MAX_BODY_BYTES} bytes: send {{\"confirm\": true}}")
    if (request.content_length or 0) > MAX_BODY_BYTES:
        raise too_large
    if not request.can_read_body:
        return b""
    data = bytearray()
    async for piece in request.content.iter_chunked(64 << 10):
        data += piece
        if len(data) > MAX_BODY_BYTES:
            raise too_large
    return bytes(data)


async def _clear(request):
    body = parse_body(await _read_body(request))
    return _web().json_response(await _call(request, clear_store, body))


async def _stats(request):
    return _web().json_response(await _call(request, store_stats))


ROUTES = (
    ("GET", PREFIX + "/entries", _entries),
    ("GET", PREFIX + "/entries/{entry_id}/thumbnail", _thumbnail),
    ("DELETE", PREFIX + "/entries/{entry_id}", _delete),
    ("POST", PREFIX + "/clear", _clear),
    ("GET", PREFIX + "/stats", _stats),
)


def add_routes(routes) -> bool:
    """Adds the Carnator routes to an aiohttp RouteTableDef (PromptServer.instance.routes) once.

    Returns False when they are already there (the module imported under a second name).
    """
    present = {(getattr(r, "method", ""), getattr(r, "path", "")) for r in routes}
    if ("GET", PREFIX + "/stats") in present:
        return False
    for method, path, work in ROUTES:
        routes.route(method, path)(_handler(work))
    return True


def register_with_host() -> bool:
    """Registers on ComfyUI's running PromptServer, if this process is ComfyUI (never imports it)."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None:
        return False
    return add_routes(instance.routes)


register_with_host()
