"""README.md stays a short front page whose links land, and the docs site is complete.

The site itself is built with `mkdocs build --strict` by `make docs` (part of `make test`), which
fails on a broken link or anchor between its pages and on a page left out of the nav; README.md
is not one of its pages, so its links are checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from markdown.extensions.toc import slugify

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_LINES = 250
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _headings(page: Path) -> set[str]:
    """The anchors of a page's headings, as mkdocs (Python-Markdown's toc) and GitHub make them."""
    out, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"#{1,6} (.+?)(?: \{#([^}]+)\})?$", line)):
            out.add(m.group(2) or slugify(m.group(1).replace("`", ""), "-"))
    return out


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; the rest belongs in docs/"


def test_readme_quick_start_is_make_demo_and_make_test() -> None:
    text = README.read_text()
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no Quick start shell block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    test_target = re.search(r"^test:.*\n(?:\t.*\n)*", makefile, re.M)  # its line and its recipe
    assert re.search(r"^demo:", makefile, re.M) and test_target and re.search(r"\bdocs\b", test_target.group(0))


def test_readme_links_land() -> None:
    """Every relative link of README.md names a file that exists, and its #anchor a heading there."""
    links = [link for link in LINK.findall(README.read_text()) if not re.match(r"[a-z]+://", link)]
    assert len(links) >= 10
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = REPO / path if path else README
        if not target.is_file():
            broken.append(link)
        elif anchor and target.suffix == ".md" and anchor not in _headings(target):
            broken.append(link)
    assert not broken, f"README.md links that land nowhere: {broken}"


def test_every_docs_page_is_in_the_nav() -> None:
    """mkdocs.yml's nav lists every page under docs/, once (the strict build checks it too, and
    that every page the nav names exists)."""
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]

    def pages(item: object) -> list[str]:
        if isinstance(item, str):
            return [item]
        if isinstance(item, dict):
            return [p for v in item.values() for p in pages(v)]
        if isinstance(item, list):
            return [p for v in item for p in pages(v)]
        return []

    listed = pages(nav)
    on_disk = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md") if "hooks" not in p.parts}
    assert len(listed) == len(set(listed)), "a page is listed twice in the nav"
    assert sorted(on_disk - set(listed)) == [], "pages under docs/ missing from mkdocs.yml's nav"
