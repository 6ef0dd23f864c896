"""A program a test needs and pip does not install: skipped with its install line, failed in CI."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import require_tool

pytestmark = pytest.mark.unit


def test_a_missing_tool_skips_naming_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="tmux not found on PATH: apt-get install tmux"):
        require_tool("tmux")


def test_in_ci_a_missing_tool_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="redis-server not found"):
        require_tool("redis-server")


def test_a_present_tool_is_its_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    program = tmp_path / "kustomize"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert require_tool("kustomize") == str(program)
