"""The dashboard and alert rules that ship (deploy/components/monitoring) against what the plugin
and the optimizer export: every metric a query names is one they export (the names are read from
the queries themselves and from the real collectors, no list kept here), and Prometheus's own
`promtool` accepts the rules and every dashboard query, and a real Prometheus scraping two plugin
replicas evaluates them all. `.ci/run` installs Debian's `prometheus` package (promtool and the
server) where it is missing."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from plugin.adapters.extproc import ErrorCounts
from plugin.adapters.http import GatewayCollector, LatencyView
from plugin.adapters.optimizer.state import OptimizerMetrics
from plugin.adapters.scraper import MetricsScraper
from plugin.config import DEFAULT_DEPLOYMENT_LABEL
from plugin.core.capacity import CapacityEstimator
from plugin.core.drift import BeyondGrid, ProfileDrift
from plugin.core.latency import DECISION_BUCKETS_S, ClientLatency, Histogram, SloOutcomes
from plugin.core.pool import PodPool
from plugin.core.router import PredictionStats, WaitStats
from tests.helpers import (
    REPO,
    StartGateway,
    free_port,
    make_pod,
    poll,
    require_tool,
    write_pods_file,
)

pytestmark = pytest.mark.component

MONITORING = REPO / "deploy" / "components" / "monitoring"
DASHBOARD = MONITORING / "hetero-gateway-dashboard.json"
RULES = MONITORING / "hetero-gateway-rules.yaml"
# A metric name in a query: ours all start so (the dashboard reads no engine's metrics).
NAME = re.compile(r"\b(hetero_(?:gateway|optimizer)_[a-z0-9_]+)\b")
# Grafana's variables, as a query is sent once Grafana has filled them in.
GRAFANA_VARS = {"$__rate_interval": "5m", "$model": ".*"}


class _Shared:
    up = True
    sync_errors_total = 0
    other_gateways = 1

    def status(self) -> dict[str, Any]:
        return {}


class _Tracing:
    flush_errors_total = 0
    windows_dropped_total = 0

    def status(self) -> dict[str, Any]:
        return {}


def _sample_names(families: list[Metric]) -> set[str]:
    """The sample names these families expose, whether or not they hold samples now."""
    names: set[str] = set()
    for family in families:
        if isinstance(family, HistogramMetricFamily) or family.type == "histogram":
            names |= {f"{family.name}_{s}" for s in ("bucket", "sum", "count")}
        elif isinstance(family, CounterMetricFamily) or family.type == "counter":
            names.add(f"{family.name}_total")
        else:
            names.add(family.name)
        names |= {s.name for s in family.samples}
    return names


def exported() -> set[str]:
    """Every sample name the plugin's /metrics (with each optional part on: shared state,
    tracing, the queue, prefix cache, profiles) and the optimizer's can carry."""
    pool = PodPool(CapacityEstimator())
    pool.set_pods([make_pod("a100-0", deployment="a100")])
    collector = GatewayCollector(
        pool,
        ErrorCounts(),
        MetricsScraper(pool, interval_s=1.0, timeout_s=1.0),
        _Shared(),
        lambda: {"m": 0},
        WaitStats(),
        PredictionStats(),
        _Tracing(),
        lambda: {"m": 0},
        lambda: {"m": (1, 1, 1)},
        BeyondGrid(),
        ProfileDrift(),
        LatencyView(ClientLatency(), Histogram(DECISION_BUCKETS_S), SloOutcomes()),
    )
    names = _sample_names(list(collector.collect()))
    names |= _sample_names(list(OptimizerMetrics().registry.collect()))
    return names


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in doc["templating"]["list"] if v["type"] == "query"]
    return queries


def rule_queries() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in doc["groups"] for rule in group["rules"]]


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_every_metric_a_query_names_is_exported(source: str) -> None:
    queries = dashboard_queries() if source == "dashboard" else rule_queries()
    assert len(queries) >= 8
    ours = exported()
    for query in queries:
        named = set(NAME.findall(query))
        assert named, f"a query that reads none of our metrics: {query}"
        missing = named - ours
        assert not missing, f"{sorted(missing)} in {query!r} are not exported"


def test_the_name_check_would_catch_a_renamed_metric() -> None:
    """The check reads the collectors, not a list: a name they do not export is caught."""
    ours = exported()
    assert "hetero_gateway_time_to_first_token_seconds_bucket" in ours
    assert "hetero_gateway_slo_requests_total" in ours
    assert "hetero_optimizer_unserved_rate" in ours
    assert "hetero_gateway_time_to_first_token_bucket" not in ours


def _promtool() -> str:
    return require_tool("promtool")


def test_promtool_accepts_the_alert_rules() -> None:
    done = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    alerts = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert f"SUCCESS: {len(alerts)} rules found" in done.stdout
    # Every alert is explained where operators read (docs/operations.md).
    operations = (REPO / "docs" / "operations.md").read_text()
    for alert in alerts:
        assert alert in operations, f"{alert} is not in docs/operations.md"


def test_promtool_accepts_every_dashboard_query(tmp_path: Path) -> None:
    """Each query, with Grafana's variables filled in, as a recording rule promtool parses."""
    rules = []
    for i, query in enumerate(dashboard_queries()):
        if query.startswith("label_values("):  # Grafana's own function, not PromQL
            continue
        for var, value in GRAFANA_VARS.items():
            query = query.replace(var, value)
        assert "$" not in query, query
        rules.append({"record": f"dashboard:query_{i}", "expr": query})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        [_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


@pytest.mark.parametrize("per_pod", [True, False])
async def test_the_per_pod_switch_reaches_a_running_gateways_metrics(
    per_pod: bool, tmp_path: Path, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    pod = make_pod("a100-0", deployment="a100")
    gateway = await start_gateway(
        write_pods_file(tmp_path / "pods.yaml", [pod]),
        {"HETERO_GATEWAY_POD_LATENCY": str(per_pod).lower()},
    )
    gateway.router.latency.observe(pod.key, pod.model, "a100", 0.0, 0.1, 0.5, 0.6, 5)
    async with http.get(f"http://127.0.0.1:{gateway.http_port}/metrics") as resp:
        text = await resp.text()
    ttft = next(
        f
        for f in text_string_to_metric_families(text)
        if f.name == "hetero_gateway_time_to_first_token_seconds"
    )
    assert {s.labels["pod"] for s in ttft.samples} == {pod.key if per_pod else ""}


async def test_a_real_prometheus_evaluates_every_query_over_two_gateways(
    tmp_path: Path,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    """Debian's Prometheus scrapes two plugin replicas over one pod list and evaluates every
    dashboard query and every alert rule: what promtool's syntax check cannot see, such as a
    join that matches many-to-many once two gateways export the same pods."""
    binary = require_tool("prometheus")
    pods = write_pods_file(
        tmp_path / "pods.yaml",
        [  # the GPU type as discovery reads it: the deployment label
            make_pod("a100-0", labels={DEFAULT_DEPLOYMENT_LABEL: "a100"}),
            make_pod("l20-0", address="10.0.0.2", labels={DEFAULT_DEPLOYMENT_LABEL: "l20"}),
        ],
    )
    gateways = [await start_gateway(pods, {}) for _ in range(2)]
    for g in gateways:  # each has felt some latency and judged an SLO
        for pod in g.pool.pods():
            g.router.latency.observe(
                pod.key, pod.model, pod.deployment or "", 0.0, 0.1, 0.5, 0.6, 5
            )
            g.router.slo_outcomes.count(pod.model, pod.deployment or "", "met")
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "hetero-gateway",
                "static_configs": [{"targets": [f"127.0.0.1:{g.http_port}" for g in gateways]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = await asyncio.create_subprocess_exec(
        binary,
        f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{port}/api/v1"

    async def get(path: str, **params: str) -> Any:
        async with http.get(f"{api}/{path}", params=params) as resp:
            return await resp.json()

    async def scraped() -> int:
        try:
            doc = await get("query", query='count(up{job="hetero-gateway"} == 1)')
        except aiohttp.ClientError:
            return 0
        result = doc.get("data", {}).get("result", [])
        return int(float(result[0]["value"][1])) if result else 0

    try:
        await poll(scraped, lambda n: n == 2, "Prometheus scraping both gateways", limit_s=30)
        await asyncio.sleep(3)  # a few scrapes in: rates have two samples
        for query in dashboard_queries():
            if query.startswith("label_values("):
                continue
            for var, value in GRAFANA_VARS.items():
                query = query.replace(var, value)
            doc = await get("query", query=query)
            assert doc["status"] == "success", (query, doc)
        routed = await get(
            "query",
            query="sum by (gpu) (rate(hetero_gateway_routed_requests_total[5m]) * on (instance,"
            " pod, model) group_left (gpu) hetero_gateway_pod_info)",
        )
        assert {r["metric"]["gpu"] for r in routed["data"]["result"]} == {"a100", "l20"}
        rules = await get("rules")
        evaluated = [r for g in rules["data"]["groups"] for r in g["rules"]]
        assert len(evaluated) == len(rule_queries())
        assert all(r["health"] in ("ok", "unknown") for r in evaluated), evaluated
    finally:
        proc.terminate()
        await proc.wait()
