"""AIBrix's `external-filter` header: Kubernetes label-selector syntax and matching."""

from __future__ import annotations

import pytest

from plugin.core.selector import parse_selector
from plugin.errors import BadRequestHeader

pytestmark = pytest.mark.unit

A100 = {"gpu": "a100", "model.aibrix.ai/name": "m", "vram": "80"}
L20 = {"gpu": "l20", "model.aibrix.ai/name": "m", "vram": "48", "spot": ""}
BARE: dict[str, str] = {}


@pytest.mark.parametrize(
    ("selector", "a100", "l20", "bare"),
    [
        ("", True, True, True),
        ("   ", True, True, True),
        ("gpu=a100", True, False, False),
        ("gpu==l20", False, True, False),
        ("gpu!=a100", False, True, True),  # absent counts as "not a100", as in Kubernetes
        ("gpu in (a100, h100)", True, False, False),
        ("gpu notin (a100,h100)", False, True, True),
        ("gpu", True, True, False),
        ("!gpu", False, False, True),
        ("spot", False, True, False),  # present with an empty value
        ("spot=", False, True, False),
        ("vram>60", True, False, False),
        ("vram<60", False, True, False),
        ("gpu=a100,vram>60", True, False, False),
        ("gpu=a100, vram<60", False, False, False),
        ("model.aibrix.ai/name=m,!spot", True, False, False),
        (" gpu in (l20) , spot ", False, True, False),
    ],
)
def test_selector_matches_like_kubernetes(selector: str, a100: bool, l20: bool, bare: bool) -> None:
    parsed = parse_selector(selector)
    assert [parsed.matches(x) for x in (A100, L20, BARE)] == [a100, l20, bare]


def test_a_non_integer_label_never_matches_a_comparison() -> None:
    assert not parse_selector("vram>1").matches({"vram": "lots"})


@pytest.mark.parametrize(
    "selector",
    [
        "gpu=a100,",  # trailing comma
        ",gpu",
        "gpu=a100 vram=80",  # a missing comma
        "gpu in ()",
        "gpu in (a100",
        "gpu>lots",
        "-gpu=a100",  # a key must start alphanumeric
        "gpu=a" + "x" * 63,  # a value longer than 63
        "gpu=a/b",
        "!",
        "gpu=a100=b",
    ],
)
def test_a_bad_selector_is_a_400_naming_the_header(selector: str) -> None:
    with pytest.raises(BadRequestHeader) as err:
        parse_selector(selector)
    assert err.value.status == 400
    assert err.value.param == "external-filter"
    assert "external-filter" in err.value.message
