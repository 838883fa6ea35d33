"""The README stays a newcomer's page and RESULTS a findable one: sizes, line lengths, and links that resolve.

Every link of every page (README, docs/, benchmarks/RESULTS.md) must reach an existing file, and an anchor a
heading of its page; every repository file a page, a test, the packaging or the code names must exist. No page
or path is let off: a page the README promises is written before the link lands.
"""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", os.path.join("benchmarks", "RESULTS.md"),
         *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
# Files that name repository files in their text: the pages, the packaging, the code and the tests.
NAMING_FILES = [*PAGES, "pyproject.toml", ".ci/run",
                *sorted(os.path.relpath(p, ROOT) for folder in ("carnator_engine", "nodes", "benchmarks", "tests")
                        for p in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True))]
# A source or documentation file named by its path from the repository root (outputs such as JSON are not).
NAMED_PATH = re.compile(r"(?<![\w./-])((?:carnator_engine|nodes|benchmarks|tests|docs|workflows|web)/[\w./-]*\w\.(?:py|md|sh|mjs|js))\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _read(path):
    with open(os.path.join(ROOT, path)) as handle:
        return handle.read()


def _anchors(page: str) -> set:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens, -1 on repeats."""
    seen, anchors = {}, set()
    in_code = False
    for line in _read(page).splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        anchors.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return anchors


def _prose(page: str) -> str:
    """A page without its code: fenced blocks and `inline code` hold no links."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", _read(page), flags=re.MULTILINE | re.DOTALL))


def _broken_links(page: str) -> list:
    broken = []
    for link in LINK.findall(_prose(page)):
        if re.match(r"[a-z]+:", link):
            continue                                         # http(s), mailto: not this repository's
        path, _, anchor = link.partition("#")
        target = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(os.path.join(ROOT, target)):
            broken.append(link)
        elif anchor and target.endswith(".md") and anchor not in _anchors(target):
            broken.append(link)
    return broken


def test_readme_is_short_with_sane_lines_and_shows_the_demo_picture():
    text = _read("README.md")
    assert len(text) <= 8000
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "](docs/images/hit-vs-fresh.png)" in text


@pytest.mark.parametrize("page", PAGES)
def test_every_link_of_a_page_resolves(page):
    assert _broken_links(page) == []


def test_the_link_check_catches_a_missing_page_and_a_missing_anchor(tmp_path, monkeypatch):
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "a.md").write_text("# Top part\n\n## Two, words (`x.py`)\n")
    (tmp_path / "README.md").write_text("[a](pages/a.md) [b](pages/b.md) [c](pages/a.md#two-words-xpy) "
                                        "[d](pages/a.md#nowhere) [e](#top) [f](https://example.org/x.md) `g[0](h)`\n"
                                        "```\n[i](pages/none.md)\n```\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", str(tmp_path))
    assert _broken_links("README.md") == ["pages/b.md", "pages/a.md#nowhere", "#top"]


def test_every_repository_file_the_code_tests_and_pages_name_exists():
    missing = sorted({f"{named_in}: {path}" for named_in in NAMING_FILES
                      for path in NAMED_PATH.findall(_read(named_in))
                      if not os.path.exists(os.path.join(ROOT, path))})
    assert missing == []


def test_no_work_notes_at_the_root():
    """The root holds the product's files; notes to the team are not shipped."""
    assert [name for name in os.listdir(ROOT) if re.match(r"(NOTE|TODO|NOTES)\b", name, re.IGNORECASE)] == []


def test_results_is_short_enough_to_find_a_number_in():
    assert len(_read(os.path.join("benchmarks", "RESULTS.md"))) <= 20000


RESULTS = os.path.join(ROOT, "benchmarks", "results")
# A report's companions count as cited with it: its gzipped rows, its run's log, a plot's table.
COMPANIONS = re.compile(r"(\.rows\.json\.gz|_log\.txt|\.log|\.md)$")


def _expand(pattern: str) -> list:
    """`a{b,c}d` -> [abd, acd] (the brace lists RESULTS.md writes), recursively."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [expanded for choice in match.group(1).split(",")
            for expanded in _expand(pattern[:match.start()] + choice + pattern[match.end():])]


def _cited_patterns() -> list:
    """Every results path RESULTS.md and docs/ name, as globs relative to benchmarks/ (`<x>` reads as `*`)."""
    patterns = []
    for page in PAGES:
        for named in re.findall(r"(results/[\w/.*<>{},-]+\w)", _read(page)):
            patterns += [re.sub(r"<[^>]*>", "*", p) for p in _expand(named)]
    return patterns


def _uncited_results(results: str, patterns: list, source_text: str) -> list:
    import fnmatch
    files = sorted(os.path.relpath(os.path.join(folder, name), os.path.dirname(results))
                   for folder, _, names in os.walk(results) for name in names)

    words = set(re.findall(r"[\w-]+", source_text))

    def cited(path: str) -> bool:
        return os.path.basename(path).split(".")[0] in words or any(fnmatch.fnmatch(path, p) for p in patterns)
    uncited = []
    for path in files:
        report = COMPANIONS.sub(".json", path)
        beside = [report, COMPANIONS.sub(".png", path), re.sub(r"_log\.txt$", ".json", path)]
        if not (cited(path) or any(b != path and b in files and cited(b) for b in beside)):
            uncited.append(path)
    return uncited


def test_results_holds_only_files_that_results_md_or_the_code_cite():
    """benchmarks/results/ keeps the newest run of each benchmark: every file there is named by RESULTS.md or
    docs/ (a path, a glob or its name), or by the code that reads or writes it, or sits beside one that is."""
    source_text = "\n".join(_read(f) for f in NAMING_FILES) + _read("tests/browser/e2e.mjs")
    assert _uncited_results(RESULTS, _cited_patterns(), source_text) == []


def test_results_hold_the_newest_run_of_each_benchmark_in_at_most_80_files():
    """Superseded runs leave the tree (git keeps them); a run of several reports is one pack (benchmarks/reports.py)."""
    assert sum(len(names) for _, _, names in os.walk(RESULTS)) <= 80


def test_an_uncited_result_is_found(tmp_path):
    results = tmp_path / "results"
    (results / "q").mkdir(parents=True)
    for name in ("a_1.json", "a_1.rows.json.gz", "a_1_log.txt", "b.json", "old_run.json", "p.png", "p.md"):
        (results / "q" / name).write_text("{}")
    patterns = [p for named in ("results/q/a_{1,2}.json", "results/q/p.png") for p in _expand(named)]
    assert _uncited_results(str(results), patterns, "reads b.json") == ["results/q/old_run.json"]
