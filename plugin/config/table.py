"""The configuration table (Markdown), generated from the declarations into
`docs/configuration.md` (`python -m plugin.config --write-readme docs/configuration.md`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from plugin.config.variables import (
    ENV_VARS,
)

README_TABLE_BEGIN = "<!-- config-table:begin -->"
README_TABLE_END = "<!-- config-table:end -->"

# --- the README's table --------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_table() -> str:
    """The README's configuration table (Markdown), one row per declaration."""
    rows = ["| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
    for var in ENV_VARS:
        default = var.default_text
        shown = default if default.startswith("(") and default.endswith(")") else f"`{default}`"
        rows.append(f"| `{var.name}` | {_cell(var.type_text)} | {shown} | {_cell(var.meaning)} |")
    return "\n".join(rows) + "\n"


def with_config_table(readme: str) -> str:
    """`readme` with the text between the config-table markers replaced by `config_table()`."""
    begin, end = readme.find(README_TABLE_BEGIN), readme.find(README_TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no {README_TABLE_BEGIN} ... {README_TABLE_END} markers")
    head = readme[: begin + len(README_TABLE_BEGIN)]
    return f"{head}\n{config_table()}{readme[end:]}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m plugin.config",
        description="Print the README's configuration table, or rewrite or check it in a file.",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write-readme", metavar="PATH", help="rewrite the table in PATH")
    group.add_argument("--check-readme", metavar="PATH", help="exit 1 if PATH's table differs")
    args = parser.parse_args(argv)
    path_arg = args.write_readme or args.check_readme
    if path_arg is None:
        sys.stdout.write(config_table())
        return 0
    path = Path(path_arg)
    text = path.read_text(encoding="utf-8")
    new = with_config_table(text)
    if args.check_readme:
        if new != text:
            print(f"{path}: configuration table is stale; run {parser.prog} --write-readme {path}")
            return 1
        return 0
    if new != text:
        path.write_text(new, encoding="utf-8")
    return 0
