"""`hetero-gateway up --demo` end to end on a tiny configuration: runs, writes the JSON, exits 0.

The figures themselves are a benchmark (see docs/demo.md); this only checks the command works and
its output is well formed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from plugin.errors import ConfigError
from plugin_tools.demo.fleet import free_port
from plugin_tools.demo.up import UpOptions

# The issue fixes these keys; spelled out here (not imported) so a change in report.py fails here.
REPLICA_KEYS = {
    "requests",
    "request_share",
    "capacity_share",
    "output_tokens_per_s",
    "utilization",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "p50_ms",
    "p99_ms",
}


@pytest.mark.dataplane
def test_up_demo_writes_the_comparison(tmp_path: Path) -> None:
    out = tmp_path / "not-yet" / "demo.json"  # the folder is made before the run, not after
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "plugin",
            "up",
            "--demo",
            "3",
            "--warmup",
            "1",
            "--time-scale",
            "0.5",
            "--load",
            "0.05",
            "--port",
            str(free_port()),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "least-request" in proc.stdout and "load-balance" in proc.stdout
    assert "plugin CPU per routed request" in proc.stdout
    doc = orjson.loads(out.read_bytes())
    assert set(doc["strategies"]) == {"least-request", "load-balance"}
    for summary in doc["strategies"].values():
        fleet = summary["fleet"]
        assert {"tpot_p99_ms", "latency_p99_ms", "errors"} <= set(fleet)
        assert fleet["errors"] == 0
        assert fleet["requests"] > 0
        assert set(summary["replicas"]) == {"a100-0", "l20-0", "v100-0"}
        for replica in summary["replicas"].values():
            assert set(replica) == REPLICA_KEYS
        shares = sum(r["capacity_share"] for r in summary["replicas"].values())
        assert abs(shares - 1) < 1e-9


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
