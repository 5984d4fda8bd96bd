"""Every relative link and every repository path named in the docs pages and the READMEs exists.

Checked: Markdown links and images (``[text](target)``, ``![alt](target)``), with their ``#anchor`` against the
target page's headings (GitHub's and MyST's slugs); the paths of MyST ``figure``, ``image`` and ``include``
directives; and code spans that name a path in the repository (``benchmarks/results/shm/``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [*ROOT.joinpath("docs").glob("*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "slurm" / "README.md"]
)
TOP_LEVEL = ("benchmarks/", "conf/", "docs/", "mpistrategy/", "recipes/", "slurm/", "tests/", ".ci/")

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
DIRECTIVE = re.compile(r"^```\{(?:figure|image|include)\}\s+(\S+)", re.MULTILINE)
CODE_SPAN = re.compile(r"`([^`\s]+)`")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading, which MyST's heading anchors follow."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def _links(page: Path) -> list[tuple[str, Path]]:
    """(what the page says, the path it names) for every relative link, directive path and repository path."""
    text = page.read_text()
    found = [(target, page.parent) for target in LINK.findall(text) + DIRECTIVE.findall(text)]
    prose = FENCE.sub("", text)
    found += [
        (span, ROOT)
        for span in CODE_SPAN.findall(prose)
        if span.startswith(TOP_LEVEL) and not re.search(r"[<>*{}$|]", span) and "/" in span.rstrip("/")
    ]
    return [(target, base) for target, base in found if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_exist(page: Path) -> None:
    missing = []
    for target, base in _links(page):
        path, _, anchor = target.partition("#")
        resolved = (base / path).resolve() if path else page
        if not resolved.exists():
            missing.append(f"{target} (no {resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            missing.append(f"{target} (no heading #{anchor} in {resolved.name})")
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_pages_are_found() -> None:
    assert len(PAGES) >= 20, PAGES
    assert all(page.exists() for page in PAGES)
