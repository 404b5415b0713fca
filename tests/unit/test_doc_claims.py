"""Claims in the README and docs/ name the test that backs them.

A sentence that says something is tested, bit-identical, checked by a test or the suite, or
within a tolerance must carry a pytest node id in backticks (`tests/unit/test_x.py::test_y`) in
the same paragraph, list item or table row; and every node id the pages name must exist: the file,
and the function (or Class::method) defined in it, read with `ast` (the test modules are not
imported; a parametrized id's `[...]` is stripped)."""

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.unit.test_doc_links import FENCE, PAGES

# `tests/...py` or `tests/...py::name`, `tests/...py::Class::name`, `...::name[param]`
NODE_ID = re.compile(r"`(tests/[\w./-]+\.py)(?:::([\w:]+?)(?:\[[^`\]]*\])?)?`")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
CLAIM = re.compile(
    r"bit-identical|bit for bit|\bidentical\b|\btested\b|\ba test\b|\bthe suite\b"
    r"|\bwithin\s+[~±]?\d|\bto\s+\d(?:\.\d+)?e-\d",
    re.I,
)
# Phrases with a claim word that claim no test, each with the reason.
NOT_CLAIMS = {
    r"(?:the|test) suite takes": "the suite's run time (README, performance.md), not a result",
    r"the suite installs": "what the suite installs (check.md): its environment, not a result",
    r"within 25 ?%": (
        "the planner's score: the share of published runs predicted within 25 % (planner.md and "
        "the generated planner_validation.md), a measured statistic, not a tolerance"
    ),
}
NOT_CLAIM = re.compile("|".join(NOT_CLAIMS), re.I)
LIST_ITEM = re.compile(r"^\s{0,3}(?:[-*+]|\d+[.)])\s")


def units(text: str) -> list[tuple[int, str]]:
    """The text's paragraphs, list items, table rows and headings, each with its first line;
    fenced code is left out."""
    lines = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text).split("\n")
    found: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        alone = stripped.startswith(("|", "#", "<!--"))
        if current and (not stripped or alone or LIST_ITEM.match(line)):
            found.append((start, " ".join(current)))
            current = []
        if alone:
            found.append((number, stripped))
        elif stripped:
            start = start if current else number
            current.append(stripped)
    if current:
        found.append((start, " ".join(current)))
    return found


def node_ids(text: str) -> list[tuple[str, str | None]]:
    """Every backticked node id: (file, function or Class::function, or None)."""
    return [(path, name or None) for path, name in NODE_ID.findall(text)]


@cache
def defined(path: str) -> frozenset[str]:
    """The functions of a test file, and its classes' methods as Class::method."""
    tree = ast.parse((REPO / path).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            methods = (
                n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            )
            names.update(f"{node.name}::{m.name}" for m in methods)
    return frozenset(names)


def missing(path: str, name: str | None) -> str | None:
    """Why a node id names nothing, or None when it resolves."""
    if not (REPO / path).is_file():
        return f"{path} does not exist"
    if name and name not in defined(path):
        return f"{path} defines no {name}"
    return None


def unbacked(text: str) -> list[tuple[int, str, str]]:
    """(line, claim word, the unit's text) for each unit with a claim and no node id."""
    found = []
    for line, unit in units(text):
        claims = CLAIM.findall(NOT_CLAIM.sub("", CODE_SPAN.sub("", unit)))
        if claims and not node_ids(unit):
            found.append((line, claims[0], unit))
    return found


def _page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_named_test_exists(page):
    ids = node_ids(page.read_text())
    problems = [f"`{p}{'::' + n if n else ''}`: {why}" for p, n in ids if (why := missing(p, n))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_claim_names_its_test(page):
    problems = [
        f"{_page_id(page)}:{line}: '{claim}' with no `tests/...py::test_name`: {unit[:160]}"
        for line, claim, unit in unbacked(page.read_text())
    ]
    assert not problems, "\n".join(problems)


def test_the_checker_sees_a_wrong_id_and_an_unbacked_claim():
    text = "\n".join(
        [
            "Resumes are bit-identical",  # 1: backed, by an id on the paragraph's next line
            "(`tests/unit/test_doc_claims.py::test_every_named_test_exists[README.md]`).",
            "",
            "Losses agree within 1e-6 relative.",  # 4: a tolerance with no id
            "",
            "- one item,",  # 6: a list item, whose second line claims
            "  tested, no id",
            "- a `within 1e-3` in code is no claim",
            "",
            "| row | within 2% | `tests/unit/test_nowhere.py::test_x` |",  # a row with an id
            "| row | `tests/unit/test_doc_claims.py::test_no_such_function` |",
            "",
            "```",
            "bit-identical in a fence",
            "```",
            "How long the suite takes.",  # allowed: a duration
        ]
    )
    assert [(line, claim) for line, claim, _ in unbacked(text)] == [(4, "within 1"), (6, "tested")]
    assert [missing(p, n) for p, n in node_ids(text)] == [
        None,
        "tests/unit/test_nowhere.py does not exist",
        "tests/unit/test_doc_claims.py defines no test_no_such_function",
    ]
