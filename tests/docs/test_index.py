"""docs/README.md, the documentation's index: its three parts, every page in it, and every link
of it and of the guide pointing at a file that exists."""

from __future__ import annotations

import re

from tests.support import DOCS, REPO

INDEX = DOCS / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _links(page) -> list[str]:
    return [target for target in LINK.findall(page.read_text()) if "://" not in target]


def test_the_index_has_a_guide_a_reference_and_the_evidence():
    parts = re.findall(r"^## (.+)$", INDEX.read_text(), re.MULTILINE)
    assert parts == ["Guide", "Reference", "Evidence"]


def test_every_page_of_the_docs_is_in_the_index():
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.glob("*.md")} - {"README.md"}
    pages |= {p.relative_to(DOCS).as_posix() for p in (DOCS / "guide").glob("*.md")}
    indexed = set(_links(INDEX))
    assert pages - indexed == set()


def test_the_links_of_the_index_the_guide_and_the_readme_resolve():
    for page in (INDEX, *sorted((DOCS / "guide").glob("*.md")), REPO / "README.md"):
        missing = [t for t in _links(page) if not (page.parent / t).exists()]
        assert missing == [], page
        assert "../shared/" not in page.read_text(), page
