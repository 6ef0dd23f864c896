"""The lease header the routing stream writes and the counting stream on another replica reads
(`plugin.adapters.extproc.tokens`): what is taken over, and what is refused."""

from __future__ import annotations

import pytest

from plugin.adapters.extproc.tokens import parse_lease_header

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("gw-1;1;1", ("gw-1", 1.0, 1.0)),
        ("ns/gw-2;0.25;0.0625", ("ns/gw-2", 0.25, 0.0625)),
        ("gw;0;0", ("gw", 0.0, 0.0)),
    ],
)
def test_a_lease_header_names_the_gateway_and_the_share(
    value: str, parsed: tuple[str, float, float]
) -> None:
    assert parse_lease_header(value) == parsed


@pytest.mark.parametrize(
    "value",
    [
        "",
        ";1;1",  # a gateway without shared state names none
        "gw;1",
        "gw;1;1;1",
        "gw;one;1",
        "gw;nan;1",
        "gw;1;inf",
        "gw;-1;0",
        "gw;1e7;1",
        "g" * 257 + ";1;1",
    ],
)
def test_a_malformed_lease_header_is_not_taken_over(value: str) -> None:
    assert parse_lease_header(value) is None
