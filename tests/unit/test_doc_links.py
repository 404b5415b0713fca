"""The README and docs/ hold together: every relative link and image points at a file that exists
(and, with an `#anchor` into a markdown page, at a heading of that page, slugged as GitHub does),
the docs index links every page, and the README stays a front door (at most 260 lines, with the
test command `.ci/run` runs)."""

import os
import re
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
INDEX = DOCS / "README.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) and ![alt](target), with an optional "title"; text may hold one level of [..].
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
EXTERNAL = ("http://", "https://", "mailto:")


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(page: Path) -> list[str]:
    """Every link and image target of a page, external ones included."""
    return LINK.findall(prose(page.read_text()))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation but `-` and `_`
    dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken(page: Path, target: str) -> str | None:
    """Why a link of `page` is broken, or None when it resolves; web and mail links are not
    followed."""
    if target.startswith(EXTERNAL):
        return None
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    if not resolved.exists():
        return f"{target}: {os.path.relpath(resolved, REPO)} does not exist"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{target}: {resolved.name} has no heading with the anchor #{anchor}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    problems = [why for target in links(page) if (why := broken(page, target))]
    assert not problems, "\n".join(problems)


def test_the_docs_index_links_every_page():
    linked = {(INDEX.parent / t.partition("#")[0]).resolve() for t in links(INDEX)}
    pages = {p.resolve() for p in DOCS.glob("*.md") if p != INDEX}
    missing = sorted(p.name for p in pages - linked)
    assert not missing, f"docs/README.md does not link: {missing}"
    assert "docs/README.md" in links(README), "the README does not link the docs index"


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines; move details into docs/"
    # .ci/run runs the line two below the marker, verbatim.
    at = lines.index("<!-- test-command -->")
    assert lines[at + 1] == "```bash" and "pytest" in lines[at + 2], lines[at : at + 3]


def test_the_checker_sees_a_broken_link_and_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A `Title`: here\n\n[ok](#a-title-here) [gone](missing.md) [bad](#nowhere)\n"
        "`[code](not-a-link.md)`\n\n```\n[fenced](not-a-link.md)\n```\n"
        "![img](page.md) [web](https://x.org/y.md)\n"
    )
    targets = links(page)
    assert targets == ["#a-title-here", "missing.md", "#nowhere", "page.md", "https://x.org/y.md"]
    assert [t for t in targets if broken(page, t)] == ["missing.md", "#nowhere"]
