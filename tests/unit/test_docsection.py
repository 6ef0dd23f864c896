"""Benchmarks sharing a document: each rewrites its own section and keeps everything else."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugin_tools.docsection import write_section

pytestmark = pytest.mark.unit


def test_section_is_appended_then_replaced_in_place(tmp_path: Path) -> None:
    doc = tmp_path / "cost.md"
    doc.write_text("# Cost\n\nIntro.\n", encoding="utf-8")
    write_section(doc, "a", "first A")
    write_section(doc, "b", "only B")
    write_section(doc, "a", "second A\n")
    text = doc.read_text(encoding="utf-8")
    assert text == (
        "# Cost\n\nIntro.\n\n"
        "<!-- a:begin -->\nsecond A\n<!-- a:end -->\n\n"
        "<!-- b:begin -->\nonly B\n<!-- b:end -->\n"
    )


def test_missing_document_is_created(tmp_path: Path) -> None:
    doc = tmp_path / "new.md"
    write_section(doc, "x", "body")
    assert doc.read_text(encoding="utf-8") == "<!-- x:begin -->\nbody\n<!-- x:end -->\n"


def test_a_begin_marker_without_its_end_appends_instead_of_eating_the_rest(tmp_path: Path) -> None:
    doc = tmp_path / "cost.md"
    doc.write_text("<!-- a:begin -->\nkept prose\n", encoding="utf-8")
    write_section(doc, "a", "new")
    assert "kept prose" in doc.read_text(encoding="utf-8")
    assert doc.read_text(encoding="utf-8").endswith("<!-- a:begin -->\nnew\n<!-- a:end -->\n")
