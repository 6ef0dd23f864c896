"""The table of engine dialects: the document rendered from it is current, and its rows are
well formed (the scraper, discovery and the Kubernetes source read only this table)."""

from __future__ import annotations

from collections import Counter

import pytest

from plugin.adapters import engines
from plugin.adapters.engines import ENGINES, EngineDialect
from tests.helpers import REPO

pytestmark = pytest.mark.unit


def test_docs_engines_md_is_rendered_from_the_table() -> None:
    text = (REPO / "docs" / "engines.md").read_text(encoding="utf-8")
    assert text == engines.render_markdown(), (
        "docs/engines.md drifted: run `python -m plugin.adapters.engines --write docs/engines.md`"
    )


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.name)
def test_each_engine_says_what_routing_needs(engine: EngineDialect) -> None:
    assert engine.running and engine.waiting and engine.kv_usage and engine.generation_tokens
    assert engine.metrics_path.startswith("/")
    assert all(flag.startswith("--") for flag in engine.batch_cap_flags)
    for total, count in (*engine.queue_time, *engine.token_latency):
        assert total.endswith("_sum") and count == total.removesuffix("_sum") + "_count"


def test_no_two_engines_claim_a_sample_name() -> None:
    names = Counter(
        name
        for field in ("running", "waiting", "kv_usage", "cpu_kv_usage", "generation_tokens")
        for name in engines.metric_names(field)
    )
    assert [name for name, n in names.items() if n > 1] == []
    assert len({e.name for e in ENGINES}) == len(ENGINES)


def test_lookups_follow_the_table() -> None:
    assert engines.default_metrics_path("trtllm") == "/prometheus/metrics"
    assert engines.default_metrics_path("TRTLLM") == "/metrics"  # another spelling: not guessed
    assert engines.batch_cap_flags() == ("--max-num-seqs", "--max-running-requests")
    assert engines.stepwise_counters() == frozenset({"vllm:generation_tokens_total"})
    assert engines.metric_names("running")[0] == "vllm:num_requests_running"  # vLLM first
