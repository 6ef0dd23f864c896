"""Prefix caching in the fleet simulator: the shared-prefix workload, and the study that compares
prefix-cache alone, auto-blended with load-balance, and load-balance on a mixed fleet."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from plugin.core.prefix import PrefixIndex
from plugin_tools.sim.prefix import VARIANTS, PrefixRow, format_markdown, main, prefix_study
from plugin_tools.sim.workload import Arrivals, SharedPrefix

pytestmark = pytest.mark.unit


def test_shared_prefix_requests_share_their_group_text_and_nothing_else() -> None:
    workload = SharedPrefix(groups=8, shared_tokens=300, zipf=1.0)
    requests = workload.requests(Arrivals(), 5.0, 4000, random.Random(3))
    assert all(r.prefix_group in range(8) and r.shared_tokens == 300 for r in requests)
    assert all(r.prompt_tokens == 300 + len(r.prompt_parts[1]) // 4 for r in requests)
    by_group: dict[int, set[str]] = {}
    for r in requests:
        by_group.setdefault(r.prefix_group, set()).add(r.prompt_parts[0])
        assert len(r.prompt_parts[0]) == 300 * 4
    assert all(len(texts) == 1 for texts in by_group.values())
    heads = [next(iter(texts)) for texts in by_group.values()]
    assert len({h[:16] for h in heads}) == len(heads)  # groups differ from the first block on
    # Zipf 1: the first group is drawn about twice as often as the second
    counts = Counter(r.prefix_group for r in requests)
    assert 1.6 < counts[0] / counts[1] < 2.5
    # the same seed gives the same requests; the gateway's index sees the shared blocks
    assert workload.requests(Arrivals(), 5.0, 10, random.Random(3)) == requests[:10]
    index = PrefixIndex(128, 10_000)
    a, b = [r for r in requests if r.prefix_group == requests[0].prefix_group][:2]
    index.record("m", "pod", a.prompt_parts)
    assert index.match("m", b.prompt_parts) == {"pod": 300 * 4 // 128}
    with pytest.raises(ValueError):
        SharedPrefix(groups=0)


def test_prefix_routing_keeps_documents_cached_and_the_blend_keeps_latency_too() -> None:
    study = prefix_study(
        "a100,l20,v100",
        (1.2,),
        workload=SharedPrefix(groups=128, shared_tokens=1500, zipf=0.6),
        measured_requests=600,
        warmup_s=40.0,
        seed=2,
    )
    rows: dict[str, PrefixRow] = {row.variant: row for row in study.rows}
    assert list(rows) == [name for name, _ in VARIANTS]
    alone = rows["prefix-cache alone"]
    blend = rows["prefix-cache:5,load-balance:4 (auto-blend)"]
    spread = rows["load-balance"]
    # load-balance alone sends every document everywhere: the slow replicas' caches churn
    assert alone.hit_rate > spread.hit_rate + 0.1
    assert blend.hit_rate > spread.hit_rate + 0.1
    # prefix-cache alone pins documents to slow replicas too; the blend leans on the fast one
    assert blend.shares[0] > alone.shares[0] + 0.05
    assert blend.ttft_p99 < alone.ttft_p99
    assert blend.ttft_p99 < spread.ttft_p99
    # the index's view of hits follows what the engines found
    assert abs(alone.gateway_hit_rate - alone.hit_rate) < 0.1
    assert spread.gateway_hit_rate != spread.gateway_hit_rate  # NaN: no index
    table = format_markdown(study)
    assert "| load (x G*) | req/s | routing | hit rate | index hit rate |" in table
    assert table.count("\n| 1.2 | ") == len(VARIANTS)


def test_the_module_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--fleet", "a100,l20", "--loads", "0.5", "--requests", "40", "--warmup", "5"]
    assert main([*argv, "--groups", "4", "--shared-tokens", "200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Fleet a100,l20 (a100-0 / l20-0); 4 shared prefixes of 200 tokens")
    assert sum(line.startswith("| 0.5 | ") for line in out.splitlines()) == len(VARIANTS)
    with pytest.raises(SystemExit):
        main(["--groups", "0"])
