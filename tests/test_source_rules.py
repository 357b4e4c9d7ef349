"""Rules of the repository that a reader checks by eye, checked by the suite: the docs and
the code describe what is, not how it came to be, and a catch-all handler says why."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "rallypoint"

# an issue of this project, by its number; another project's ("pytorch#130345") is
# a reference a reader can follow
ISSUE = re.compile(r"\bissues?\s+\d+", re.IGNORECASE)
# a calendar date that is not part of a timestamp (a sample screen shows one)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b(?! \d\d:\d\d)")


def _texts() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("src", "tests", "benchmarks", "examples"):
        files += sorted(p for p in (ROOT / folder).rglob("*.py") if ".egg-info" not in str(p))
    return files


def _hits(pattern: re.Pattern[str], files: list[Path]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


def test_nothing_cites_an_issue_of_this_project() -> None:
    assert _hits(ISSUE, _texts()) == []


def test_dates_appear_only_with_the_benchmark_results() -> None:
    files = [p for p in _texts() if p != ROOT / "docs" / "benchmarks.md"]
    assert _hits(DATE, files) == []


def test_the_rpc_reference_fits_500_lines() -> None:
    assert len((ROOT / "docs" / "rpc.md").read_text().splitlines()) <= 500


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_a_catch_all_handler_says_why(path: Path) -> None:
    """``except BaseException`` catches Ctrl-C and ``sys.exit()``; each one says why it must
    (a comment on its line or the line above)."""
    lines = path.read_text().splitlines()
    silent = [
        f"{path.relative_to(SRC)}:{i + 1}"
        for i, line in enumerate(lines)
        if re.search(r"except BaseException\b", line)
        and "#" not in line
        and not lines[i - 1].strip().startswith("#")
    ]
    assert silent == []
