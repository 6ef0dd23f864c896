"""The command line as a user first meets it: `--version`, and help texts that print as written."""

from __future__ import annotations

import argparse
from importlib.metadata import version

import pytest

from plugin.cli import build_parser, command_parsers, main
from tests.helpers import REPO

pytestmark = pytest.mark.unit


def test_version_prints_the_installed_release(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"hetero-gateway {version('hetero-gateway')}"


def test_no_help_text_shows_a_doubled_percent_sign() -> None:
    """argparse fills `%` in an argument's help but prints a description as written: a `%%`
    there reaches the user as `%%` (it did in `profile sweep -h`)."""
    seen = dict(command_parsers(build_parser()))
    assert "hetero-gateway profile sweep" in seen  # the tools' commands are walked too
    doubled = [path for path, parser in seen.items() if "%%" in parser.format_help()]
    assert doubled == []


def test_the_license_the_metadata_names_ships_with_the_source() -> None:
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert 'license = "Apache-2.0"' in (REPO / "pyproject.toml").read_text(encoding="utf-8")


def test_every_option_has_help_and_shows_its_default() -> None:
    """`-h` is where a user learns a flag: each says what it is and, when it has one, its
    default (`envoy-config`'s ports and timeouts, `--seed` and `--strategies` said neither)."""
    bare, hidden = [], []
    for path, parser in command_parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(
                action, argparse._HelpAction | argparse._VersionAction
            ):
                continue
            name = f"{path} {action.option_strings[-1]}"
            if not action.help:
                bare.append(name)
            elif action.default not in (None, False, "", [], argparse.SUPPRESS) and (
                "default" not in formatter._expand_help(action).lower()
            ):
                hidden.append(name)
    assert bare == [] and hidden == []
