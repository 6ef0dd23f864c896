"""`hetero-gateway simulate` on a tiny configuration writes well-formed JSON, Markdown and PNGs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from plugin.cli import main

pytestmark = pytest.mark.unit

PNG = b"\x89PNG\r\n\x1a\n"


def test_simulate_writes_json_markdown_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    code = main(
        [
            "simulate",
            "--fleet", "a100,l20,v100",
            "--workload", "chat",
            "--slo-ttft", "1.0",
            "--slo-tpot", "0.06",
            "--strategies", "least-request,load-balance",
            "--seed", "1",
            "--loads", "0.5,0.85",
            "--requests", "200",
            "--warmup", "20",
            "--no-progress",
            "--json", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["g_star"] > 0
    replicas = {"a100-0", "l20-0", "v100-0"}
    assert set(doc["slo_capacity"]) == replicas
    assert set(doc["strategies"]) == {"least-request", "load-balance"}
    for s in doc["strategies"].values():
        assert s["max_rate"] > 0
        assert math.isclose(s["max_rate_over_g_star"], s["max_rate"] / doc["g_star"])
        assert set(s["tpot_p50_ratio"]) == {"0.5", "0.85"}
        assert all(v >= 1 for v in s["tpot_p50_ratio"].values())
        for load in ("0.5", "0.85"):
            assert set(s["utilization"][load]) == replicas
            assert all(0 <= u <= 1.2 for u in s["utilization"][load].values())
            assert 0 <= s["attainment"][load] <= 1
    md = out.with_suffix(".md").read_text()
    assert "| least-request | 0.85 |" in md and "| load-balance |" in md
    for suffix in ("-attainment.png", "-utilization.png"):
        assert (tmp_path / f"sim{suffix}").read_bytes()[:8] == PNG
    assert "G* =" in capsys.readouterr().out


def test_simulate_runs_slo_routing_and_writes_its_doc_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc_md = tmp_path / "benchmarks.md"
    doc_md.write_text("# Benchmarks\n\nHand-written prose stays.\n")
    out = tmp_path / "slo.json"
    code = main(
        [
            "simulate",
            "--fleet", "a100,l20",
            "--workload", "long",
            "--slo-tpat", "0.02",
            "--target", "0.9",
            "--strategies", "slo,least-request",
            "--loads", "0.5",
            "--requests", "100",
            "--warmup", "10",
            "--no-progress",
            "--json", str(out),
            "--doc", str(doc_md),
        ]
    )  # fmt: skip
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["slo"] == {"tpat_s": 0.02}  # only the target given: no default TTFT or TPOT
    assert set(doc["profiles"]) == {"a100", "l20"}
    assert doc["sweep"]["inputs"][-1] >= 16384 and doc["max_tokens"] == 128
    for s in doc["strategies"].values():
        assert 0 <= s["rejected"]["0.5"] <= s["requests"]["0.5"]
    assert doc["strategies"]["least-request"]["rejected"]["0.5"] == 0
    text = doc_md.read_text()
    assert text.startswith("# Benchmarks\n\nHand-written prose stays.\n")
    section = text.split("<!-- simulate-slo:begin -->", 1)[1]
    assert section.rstrip().endswith("<!-- simulate-slo:end -->")
    assert "TPAT <= 20 ms" in section and "| slo | 0.5 |" in section
    assert "hetero-gateway simulate" in section
    assert "| slo | 0.5 |" in capsys.readouterr().out  # the SLO table is printed too


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fleet", "a100,tpu"], "unknown GPU type"),
        (["--set", "a100.max_num_seqs=lots"], "not a number"),
        (["--set", "colour=red"], "FIELD"),
        (["--workload", "sharegpt"], "unknown workload"),
        (["--strategies", "magic"], "unknown strategy"),
        (["--loads", "0.5,-1"], "positive"),
        (["--arrivals", "trace"], "exactly one trace"),
        (["--slo-tpat", "-0.02"], "positive"),
        (["--doc", "x.md", "--strategies", "least-request"], "SLO strategies"),
    ],
    ids=[
        "fleet",
        "set-value",
        "set-field",
        "workload",
        "strategy",
        "loads",
        "trace-arrivals",
        "slo",
        "doc-without-slo-routing",
    ],
)
def test_bad_arguments_stop_with_a_configuration_error(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["simulate", "--no-progress", "--requests", "50", "--warmup", "5", *args])
    assert code == 2
    assert message in capsys.readouterr().err
