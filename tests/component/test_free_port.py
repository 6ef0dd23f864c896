"""`free_port`: the ports a local fleet's children bind, chosen before any of them does."""

from __future__ import annotations

import socket

import pytest

from plugin_tools.demo.fleet import free_port

pytestmark = pytest.mark.component


def test_a_process_never_hands_out_the_same_port_twice() -> None:
    """A fleet asks for its ports before its children bind them: a port handed out once must
    not come again (600 draws from about 12,000 ports would repeat one almost surely)."""
    ports = [free_port() for _ in range(600)]
    assert len(set(ports)) == len(ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))  # and it is free to bind
