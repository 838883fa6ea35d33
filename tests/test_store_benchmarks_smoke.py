"""The store benchmarks run end to end at a tiny size (the reported runs: benchmarks/RESULTS.md)."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_store_scale_smoke(tmp_path):
    from redis_server import require_redis_server
    require_redis_server()
    import store
    out = tmp_path / "scale.json"
    assert store.main(["scale", "--sizes", "5,20", "--queries", "3", "--puts", "2", "--blob-repeats", "0",
                             "--memory-entries", "1", "--memory-redis-entries", "0", "--open-with", "fork",
                             "--root", str(tmp_path),
                             "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["backend"], r["entries"]) for r in rows] == [("disk", 5), ("disk", 20), ("redis", 5), ("redis", 20),
                                                           ("farm", 5), ("farm", 20)]
    assert all(r["nearest_found"] == "3/3" for r in rows)
    (memory,) = result["redis_memory"]   # one Wan-1.3B-sized entry: its blob in the folder, not in Redis
    assert memory["layout"] == "farm" and memory["entry_mb"] > 50 and memory["blob_folder_mb_per_entry"] > 50
    assert memory["redis_memory_usage_mb_per_entry"] < 1


def test_workers_smoke(tmp_path):
    from redis_server import require_redis_server
    require_redis_server()
    import store
    out = tmp_path / "workers.json"
    assert store.main(["workers", "--workers", "2", "--users", "1", "--session", "2", "--steps", "6", "--start-method", "fork",
                         "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["shared"]["requests"] == results["farm"]["requests"] == results["per_worker"]["requests"] == 2
    check = results["farm"]["check"]
    assert check["acknowledged"] == 2 and check["acknowledged_lost"] == check["torn_entries"] == 0
    assert check["blob_files"] >= 1 and check["foreign_files"] == 9 and check["foreign_files_touched"] == []


def test_store_scale_reads_rows_against_the_goals():
    import store
    row = {"backend": "disk", "entries": 100_000, "lookup_ms_median": 120.0, "put_ms_median": 12.0, "open_s": 1.5,
           "rebuild_s": 9.0, "open_rss_mb": 150.0, "rebuild_rss_mb": 250.0}
    verdicts = {v["field"]: v["met"] for v in store.against_goals([row, {**row, "entries": 20}])}
    assert verdicts == {"lookup_ms_median": False, "put_ms_median": True, "open_s": True, "rebuild_s": True,
                        "open_rss_mb": True, "rebuild_rss_mb": False}


def test_farm_soak_smoke(tmp_path):
    from redis_server import require_redis_server
    require_redis_server()
    import farm_soak
    out = tmp_path / "soak.json"
    farm_soak.main(["--workers", "2", "--minutes", "0.15", "--rounds", "1", "--fault-s", "0.3", "--limit-mb", "8",
                    "--folder-mb", "16", "--out", str(out)])
    report = json.loads(out.read_text())
    result = report["result"]
    assert [f["fault"] for f in result["faults"]] == [f for f in farm_soak.FAULTS if f != "flushall"] + ["flushall"]
    assert result["acknowledged"] > 0 and result["reads"] > 0
    for goal in ("lost", "torn", "wrong_served", "evicted_live_by_bookkeeping", "foreign_touched",
                 "second_farm_refused", "no_open_failed"):
        assert report["goals"][goal], (goal, result)
