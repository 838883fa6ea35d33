"""What keeps the store's work per request independent of its size: float16 rows searched a chunk at a time, one
backend call for a lookup's shortlist, a miss's explanation from memory, and an open that reads no entry to find
orphan blobs."""
import functools
import os

import numpy as np
import torch

from carnator_engine.store.index import bucket_difference, bucket_parts, nearest
from carnator_engine.store import CarnatorStore
from carnator_engine.store.owned_files import header
from carnator_engine.store.vectors import VECTOR_DIM, BucketMatrix
from test_store import _age_blobs, _put, _signature, location  # noqa: F401 - location is a fixture


def test_a_bucket_matrix_holds_float16_rows_grown_by_a_quarter_and_ranks_them_exactly(monkeypatch):
    monkeypatch.setattr(BucketMatrix, "CHUNK", 512)            # several chunks, one of them partial
    rng = np.random.RandomState(0)
    vectors = rng.standard_normal((3000, VECTOR_DIM)).astype(np.float16)
    matrix = BucketMatrix()
    for i, vector in enumerate(vectors):
        matrix.add(f"e{i}", vector)
    for i in range(0, 3000, 7):
        matrix.remove(f"e{i}")
    kept = [i for i in range(3000) if i % 7]
    assert matrix.rows.dtype == np.float16 and len(matrix.rows) <= 1.25 * 3000 + 16
    query = rng.standard_normal(VECTOR_DIM).astype(np.float32)
    exact = ((vectors[kept].astype(np.float32) - query) ** 2).sum(1)
    assert matrix.nearest(torch.from_numpy(query), 10) == [f"e{kept[i]}" for i in np.argsort(exact)[:10]]
    loaded = BucketMatrix(matrix.ids, matrix.filled_rows())     # as a snapshot or a rebuild makes it
    assert loaded.nearest(torch.from_numpy(query), 10) == matrix.nearest(torch.from_numpy(query), 10)


def test_a_lookup_reads_its_shortlist_signatures_in_one_backend_call(location, monkeypatch):
    writer = CarnatorStore(location, 64 << 20)
    ids = [_put(writer, seed) for seed in range(5)]
    store = CarnatorStore(location, 64 << 20)                  # no signature in memory yet
    calls, real = [], store._backend.parts

    def one_at_a_time(entry_id, kind):
        raise AssertionError(f"read {kind} of {entry_id} on its own")

    def parts(entry_ids, kind):
        calls.append(len(entry_ids))
        return real(entry_ids, kind)
    monkeypatch.setattr(store._backend, "part", one_at_a_time)
    monkeypatch.setattr(store._backend, "parts", parts)
    assert nearest(store, "b", _signature(2), limit=3)[0].record.entry_id == ids[2]
    assert [n for n in calls if n] == [5]
    writer.close(), store.close()


SIGMAS = torch.linspace(1, 0, 11)


def _put_in(store, bucket, parts, seed):
    latent = torch.zeros(1, 1, 1, 1, 10).half()
    from carnator_engine.store import TrajectoryPayload
    return store.put(bucket=bucket, prompt="p", seed=seed, steps=10, probe_steps=2, signature=_signature(seed),
                     payload=TrajectoryPayload({4: latent}, {}), latent_shape=latent.shape,
                     extra={"bucket": parts} if parts else None)


def test_a_miss_for_want_of_a_bucket_is_explained_from_memory(store, monkeypatch):
    assert bucket_difference(store, {}) == "the cache holds no generation yet"
    _put_in(store, "old", None, 0)
    assert bucket_difference(store, {}) == "none of the cache's 1 entries records its bucket's parts"
    request = bucket_parts("m", [1, 16, 4, 8, 8], SIGMAS, "euler/cfg=5")
    near = bucket_parts("m", [1, 16, 4, 8, 8], SIGMAS, "euler/cfg=3")
    far = bucket_parts("other", [1, 16, 2, 8, 8], SIGMAS, "heun/cfg=3")
    first, second = _put_in(store, "near", near, 1), _put_in(store, "near", near, 2)
    _put_in(store, "far", far, 3)

    def scan(*args, **kwargs):
        raise AssertionError("read every entry to explain a miss")
    monkeypatch.setattr(store, "records", scan)
    monkeypatch.setattr(type(store._backend), "metas", scan)
    said = f"the nearest cached generation, entry {first}, differs in cfg/guidance (cfg=5 here, cfg=3 there)"
    assert bucket_difference(store, request) == said
    store.delete(first)
    assert bucket_difference(store, request) == said.replace(first, second)
    assert store.holds_bucket("near") and not store.holds_bucket("new")


def test_an_open_reads_no_entry_to_find_orphan_blobs(tmp_path, monkeypatch):
    from carnator_engine.store.backends.disk import DiskBackend
    directory = str(tmp_path / "c")
    store = CarnatorStore(directory, 64 << 20)
    kept = [_put(store, seed) for seed in range(3)]
    store._backend._cache.set("k:0123456789abcdef", "5" * 32)   # a write's nonce, recorded before it crashed
    store.close()
    with open(os.path.join(directory, "blobs", "0123456789abcdef.blob"), "wb") as orphan:
        orphan.write(header("5" * 32) + b"left by a crash")
    _age_blobs(directory)
    read, real = [], DiskBackend.meta

    def meta(self, entry_id):
        read.append(entry_id)
        return real(self, entry_id)
    monkeypatch.setattr(DiskBackend, "meta", meta)
    reopened = CarnatorStore(directory, 64 << 20)
    # One scan of the keys, under the lock no write can hold meanwhile: not even the orphan's metadata is read.
    assert reopened.orphans_reclaimed == 1 and read == []
    assert sorted(r.entry_id for r in reopened.records()) == sorted(kept)


def test_the_probe_draws_the_lookups_projection_in_the_background_and_the_lookup_waits_for_that_draw(
        tiny_model, monkeypatch):
    """A process's first lookup for a latent shape drew its projection itself (0.36 s of an LTX-Video miss on the
    H200); the probe now starts that draw, sized from the latent, and the lookup reuses it (one draw, the same projection)."""
    from carnator_engine.store import vectors
    from carnator_engine.euler import TinyDiTRunner
    from carnator_engine.pipeline import CarnatorConfig, probe
    from carnator_engine.schedule import flow_sigmas

    drawn = []
    original = vectors._projection.__wrapped__

    def counting(inputs, outputs, salt):
        drawn.append((inputs, salt))
        return original(inputs, outputs, salt)
    monkeypatch.setattr(vectors, "_projection", functools.lru_cache(maxsize=16)(counting))
    monkeypatch.setattr(vectors, "_drawing", {})
    probed = probe(TinyDiTRunner(tiny_model, "a red car"), torch.randn(1, 3, 8, 32, 32), flow_sigmas(12),
                   CarnatorConfig(probe_steps=2, block_size=64))
    size = probed.signature.denoised.numel()
    assert size in vectors._drawing, "the probe did not start the draw for its own signature's size"
    vector = vectors.compact_vector(probed.signature)
    assert [call for call in drawn if call[1] == 0] == [(size, 0)]
    expected = (probed.signature.denoised.float().reshape(-1) @ original(size, vectors.DENOISED_DIM, 0)) / size ** 0.5
    # The store takes this product on one torch thread, the test on the default pool: a sum split over other threads
    # rounds differently, so the comparison allows float32 rounding (the projection drawn is the same either way).
    torch.testing.assert_close(vector[:vectors.DENOISED_DIM], expected, rtol=1e-5, atol=1e-6)


def test_a_lookup_runs_its_products_on_one_torch_thread_and_gives_the_pool_back(store, monkeypatch):
    # On a busy machine the products split over torch's pool wait for its slowest thread (31 ms against 4 ms at
    # 10k entries on a busy 2-core machine: benchmarks/RESULTS.md); the speed itself is the benchmark's to show.
    for seed in range(3):
        _put(store, seed)
    from carnator_engine.store import index as index_module
    seen, real_mv, real_topk, real_scores = [], torch.mv, torch.topk, index_module.shortlist_scores
    monkeypatch.setattr(torch, "mv", lambda *a: (seen.append(torch.get_num_threads()), real_mv(*a))[1])
    monkeypatch.setattr(torch, "topk", lambda *a, **k: (seen.append(torch.get_num_threads()), real_topk(*a, **k))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert len(store.shortlist("b", _signature(1), 2)) == 2
        assert torch.get_num_threads() == 2
        pool = []
        monkeypatch.setattr(index_module, "shortlist_scores", lambda *a: (pool.append(torch.get_num_threads()),
                                                                          real_scores(*a))[1])
        assert nearest(store, "b", _signature(1), 1)                 # the whole lookup, exact distances included
        assert pool == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
