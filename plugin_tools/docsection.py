"""Benchmarks that share one document each rewrite only their own marked section of it."""

from __future__ import annotations

from pathlib import Path


def write_section(doc: Path, name: str, text: str) -> Path:
    """Put `text` between `<!-- name:begin -->` and `<!-- name:end -->` in `doc`.

    The rest of the document (other benchmarks' sections, hand-written prose) is kept; a section
    that is not there yet is appended.
    """
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    current = doc.read_text(encoding="utf-8") if doc.exists() else ""
    block = f"{begin}\n{text.strip()}\n{end}"
    if begin in current and end in current.split(begin, 1)[1]:
        before, rest = current.split(begin, 1)
        after = rest.split(end, 1)[1]
        doc.write_text(before + block + after, encoding="utf-8")
    else:
        head = current.rstrip("\n") + "\n\n" if current.strip() else ""
        doc.write_text(head + block + "\n", encoding="utf-8")
    return doc
