"""A benchmark report on disk: a readable JSON summary, its raw per-request rows gzipped beside it.

`write(path, report)` puts the report's "rows" (one entry per generated request, most of a report's size) into
`<path without .json>.rows.json.gz` and the rest (machine, arguments, summary tables) into `path`, so that the
committed summaries read at a glance and nothing measured is dropped. `read(path)` puts them back together.

A run made of several reports (a pooled run's request sets, a sweep's settings) is committed as one pack:
`python benchmarks/reports.py pack OUT.json IN.json ...` keeps each report under its file name in "packed" and
their rows in one `.rows.json.gz`; `read_all(path)` gives {name: report} for a pack or a single report alike.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

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


def name(path: str) -> str:
    """A report's name: its file name without .json."""
    base = os.path.basename(path)
    return base[:-len(".json")] if base.endswith(".json") else base


def pack(out: str, paths: list) -> None:
    """One report at `out` holding the reports at `paths` under their names, their rows in one rows file."""
    members, rows = {}, {}
    for path in paths:
        report = read(path)
        if name(path) in members:
            raise ValueError(f"{path}: a report named {name(path)} is packed already; rename one")
        if report.pop("rows_file", None):                 # rows kept beside it move to the pack's rows file
            rows[name(path)] = report.pop("rows")
        members[name(path)] = report
    write(out, {"packed": members, **({"rows": rows} if rows else {})})


def read_all(path: str, rows: bool = True) -> dict:
    """{name: report} of a pack (`pack`), or {its name: the report} of a single report; rows as in `read`."""
    report = read(path, rows)
    if "packed" not in report:
        return {name(path): report}
    packed_rows = report.get("rows", {})
    return {member: {**summary, **({"rows": packed_rows[member]} if member in packed_rows else {})}
            for member, summary in report["packed"].items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Pack several benchmark reports into one file.")
    parser.add_argument("command", choices=["pack"])
    parser.add_argument("out", help="the pack to write (.json; its rows go beside it)")
    parser.add_argument("reports", nargs="+", help="the reports (.json) to pack, each kept under its file name")
    args = parser.parse_args(argv)
    missing = [path for path in args.reports if not os.path.isfile(path)]
    if missing:
        parser.error(f"no report at {', '.join(missing)}: name existing .json files")
    pack(args.out, args.reports)
    print(f"{args.out}: {len(args.reports)} reports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
