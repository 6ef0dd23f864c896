"""`hetero-gateway up`'s options are checked before any process starts or any load is offered.

The command's run end to end is in tests/dataplane/test_dataplane_up.py.
"""

from __future__ import annotations

import pytest

from plugin.errors import ConfigError
from plugin_tools.demo.up import UpOptions

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (UpOptions(strategies=("least-request", "magic")), "--strategies"),
        (UpOptions(strategies=()), "--strategies"),
        (UpOptions(demo_s=5, json_path="/proc/no/such/demo.json"), "--json"),
    ],
    ids=["unknown-strategy", "no-strategy", "json-folder-cannot-be-made"],
)
def test_bad_options_stop_before_any_load(options: UpOptions, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        options.check()
