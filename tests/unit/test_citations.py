"""What the source cites, a reader of the repository can open: every `docs/*.md` and other
document of this repository named in `plugin/` or `plugin_tools/` exists, and nothing cites the
design notes that live outside it (`DESIGN.md`)."""

from __future__ import annotations

import re

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.unit

SOURCES = sorted(p for folder in ("plugin", "plugin_tools") for p in (REPO / folder).rglob("*.py"))
CITED = re.compile(r"(?<![\w/.-])((?:docs|proto|deploy|envoy|benchmarks)/[\w./-]+\.md)\b")


def _cited() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in SOURCES:
        for doc in CITED.findall(path.read_text(encoding="utf-8")):
            found.setdefault(doc, []).append(str(path.relative_to(REPO)))
    return found


def test_every_document_the_source_cites_is_in_the_repository() -> None:
    cited = _cited()
    assert "docs/architecture.md" in cited  # the pattern finds what it must
    missing = {doc: where for doc, where in cited.items() if not (REPO / doc).is_file()}
    assert missing == {}


def test_no_source_cites_the_design_notes_outside_the_repository() -> None:
    citing = [str(p.relative_to(REPO)) for p in SOURCES if "DESIGN.md" in p.read_text("utf-8")]
    assert citing == []
