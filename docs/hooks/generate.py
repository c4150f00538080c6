"""mkdocs hook: fills in the generated parts of the docs at build time (nothing generated is committed).

A page asks for a generated part with a marker line, replaced when the site is built:

    <!-- generated: configuration -->   every setting, from specdec.config's dataclasses
    <!-- generated: grpc -->            every service, message and enum, from protos/**/*.proto
    <!-- include: deploy/README.md -->  a markdown file from outside docs/ (its title line dropped)

The generators are specdec_cli.docgen's (`python -m specdec_cli.docgen configuration|grpc` prints them).
A marker that no page holds, or an unknown one, fails the build.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

REPO = Path(__file__).resolve().parents[2]
# This checkout's code, not whatever `specdec` the environment installed (an editable install
# of another checkout, say).
sys.path.insert(0, str(REPO))

from specdec_cli import docgen  # noqa: E402

MARKER = re.compile(r"^<!-- (generated|include): ([\w./-]+) -->$", re.M)
EXPECTED = {("generated", name) for name in docgen.PAGES} | {("include", "deploy/README.md")}
_seen: set[tuple[str, str]] = set()


def _fill(match: re.Match[str]) -> str:
    kind, name = match.group(1), match.group(2)
    if (kind, name) not in EXPECTED:
        raise PluginError(f"unknown docs marker {match.group(0)!r}; known: {sorted(EXPECTED)}")
    _seen.add((kind, name))
    if kind == "generated":
        return docgen.PAGES[name]()
    text = (REPO / name).read_text()
    return re.sub(r"\A# .*\n", "", text)


def on_pre_build(config: Any) -> None:
    _seen.clear()


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return MARKER.sub(_fill, markdown)


def on_post_build(config: Any) -> None:
    if missing := EXPECTED - _seen:
        raise PluginError(f"no page holds the docs markers {sorted(missing)}")
