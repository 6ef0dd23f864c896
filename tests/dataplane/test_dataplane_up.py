"""`hetero-gateway up --demo` end to end on a tiny configuration: runs, writes the JSON, exits 0.

The figures themselves are a benchmark (see docs/demo.md); this only checks the command works and
its output is well formed.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.helpers import free_port, run_cli

pytestmark = pytest.mark.dataplane

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


def test_up_demo_writes_the_comparison(tmp_path: Path) -> None:
    out = tmp_path / "not-yet" / "demo.json"  # the folder is made before the run, not after
    proc = run_cli(
        *("up", "--demo", "3", "--warmup", "1", "--time-scale", "0.5", "--load", "0.05"),
        *("--port", str(free_port()), "--json", str(out)),
        timeout_s=240,
    )
    assert "least-request" in proc.stdout and "load-balance" in proc.stdout
    assert "plugin CPU per routed request" in proc.stdout
    # It says how to watch it: the live view and the dashboard that ship.
    assert "hetero-gateway top --url http://127.0.0.1:" in proc.stderr  # its progress lines
    assert "deploy/components/monitoring" in proc.stderr
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
