"""`free_port`: the ports a local fleet's children bind, chosen before any of them does."""

from __future__ import annotations

import socket

import pytest

from plugin_tools.demo.fleet import PORT_SLICE_ENV, free_port

pytestmark = pytest.mark.component


def test_a_process_never_hands_out_the_same_port_twice() -> None:
    """A fleet asks for its ports before its children bind them: a port handed out once must
    not come again (600 draws from about 12,000 ports would repeat one almost surely)."""
    ports = [free_port() for _ in range(600)]
    assert len(set(ports)) == len(ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))  # and it is free to bind


def test_each_slice_of_the_range_is_a_workers_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parallel test workers draw each from its own part of the range (here one of three): no
    port one of them hands out can be another's."""
    drawn = []
    for part in range(3):
        monkeypatch.setenv(PORT_SLICE_ENV, f"{part}/3")
        drawn.append(sorted(free_port() for _ in range(200)))
    assert drawn[0][-1] < drawn[1][0] and drawn[1][-1] < drawn[2][0]


@pytest.mark.parametrize("bad", ["2", "a/b", "2/2", "-1/2"])
def test_a_bad_slice_names_the_variable(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_SLICE_ENV, bad)
    with pytest.raises(ValueError, match=PORT_SLICE_ENV):
        free_port()
