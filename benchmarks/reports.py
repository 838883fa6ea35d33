"""A benchmark report on disk: a readable JSON summary, its raw per-request rows gzipped beside it.

`write(path, report)` puts the report's "rows" (one entry per generated request, most of a report's size) into
`<path without .json>.rows.json.gz` and the rest (machine, arguments, summary tables) into `path`, so that the
committed summaries read at a glance and nothing measured is dropped. `read(path)` puts them back together.
"""
from __future__ import annotations

import gzip
import json
import os

ROWS_SUFFIX = ".rows.json.gz"


def rows_path(path: str) -> str:
    return (path[:-len(".json")] if path.endswith(".json") else path) + ROWS_SUFFIX


def write(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    summary = {key: value for key, value in report.items() if key != "rows"}
    if "rows" in report:
        summary["rows_file"] = os.path.basename(rows_path(path))
        # mtime=0: the same rows give the same bytes, so a re-run that changed nothing changes no file
        with open(rows_path(path), "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as handle:
            handle.write(json.dumps(report["rows"], default=str).encode())
    with open(path, "w") as handle:
        json.dump(summary, handle, indent=1, default=str)


def read(path: str, rows: bool = True) -> dict:
    """The report at `path`, with its rows when it has any (rows=False reads the summary only)."""
    with open(path) as handle:
        report = json.load(handle)
    if rows and "rows_file" in report:
        with gzip.open(os.path.join(os.path.dirname(path), report["rows_file"]), "rt") as handle:
            report["rows"] = json.load(handle)
    return report
