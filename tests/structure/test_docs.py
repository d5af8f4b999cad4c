"""The docs stay a size a reader gets through: all pages together at most 150 KB, DESIGN.md a ten-minute page,
tables with short cells, and every file and section a page points to present (a moved or renamed one breaks its
pointers here, not for a reader)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
#: DESIGN.md is the map a new contributor reads in ten minutes; the details live in module docstrings
DESIGN_MAX_BYTES = 25_000
#: README, BENCHMARKS.md and docs/ together: a fact lives in one place and the others link to it
PAGES_MAX_BYTES = 150_000
#: a table cell longer than this is a paragraph: write it as one below the table
MAX_CELL_CHARS = 400
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
#: a pointer to a section: `docs/MEMORY.md, "Loading"` (the quoted text starts that page's heading)
SECTION = re.compile(r"\b([A-Z_]+\.md), \"([^\"\n]+)\"")


def test_design_is_a_short_page():
    size = (ROOT / "docs" / "DESIGN.md").stat().st_size
    assert size <= DESIGN_MAX_BYTES, f"docs/DESIGN.md is {size} bytes: link to module docstrings instead"


def test_the_pages_together_stay_small():
    sizes = {page.name: page.stat().st_size for page in PAGES}
    assert sum(sizes.values()) <= PAGES_MAX_BYTES, (
        f"README, BENCHMARKS.md and docs/ hold {sum(sizes.values())} bytes (limit {PAGES_MAX_BYTES}): link to the "
        f"one place a fact lives instead of restating it; largest pages: {sorted(sizes.items(), key=lambda kv: -kv[1])[:3]}")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_table_cells_are_short(page):
    long = [(n, len(cell)) for n, line in enumerate(page.read_text().splitlines(), 1) if line.startswith("|")
            for cell in line.strip().strip("|").split(" | ") if len(cell) > MAX_CELL_CHARS]
    assert not long, f"{page.name}: table cells over {MAX_CELL_CHARS} characters (line, length): {long}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_to_files(page):
    targets = [t for t in LINK.findall(page.read_text()) if "://" not in t]
    missing = [t for t in targets if not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


def _headings(name: str) -> list[str]:
    path = ROOT / name if (ROOT / name).exists() else ROOT / "docs" / name
    return re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M) if path.exists() else []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_section_pointers_name_a_heading(page):
    bad = [(doc, section) for doc, section in SECTION.findall(page.read_text())
           if _headings(doc) and not any(h.startswith(section) for h in _headings(doc))]
    assert not bad, f"{page.name} points to sections that do not exist (page, section): {bad}"
