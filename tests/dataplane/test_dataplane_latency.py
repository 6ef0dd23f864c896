"""Latency as clients feel it, through real Envoy: the plugin's per-pod TTFT, TPOT, E2E and
output-token histograms against the mock engine's own (`vllm:time_to_first_token_seconds`,
`vllm:time_per_output_token_seconds`), which time the same requests inside the engine. One
request at a time, so each engine step is one request's and the two must agree within the
gateway's own few milliseconds: within one bucket of the plugin's histograms. Both count modes:
the counting filter's stream (`observe`) and the routing filter's (`streamed`). Then a pod that
leaves discovery takes its series with it."""

from __future__ import annotations

from bisect import bisect_left

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from plugin.core.latency import E2E_BUCKETS_S, TPOT_BUCKETS_S, TTFT_BUCKETS_S
from plugin_tools.demo.fleet import FleetSpec, LocalFleet
from tests.helpers import poll, wait_idle

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio(loop_scope="module")]

MODEL = "llama-3-8b"
REQUESTS = 6
MAX_TOKENS = 48
NAMES = {
    "ttft": "hetero_gateway_time_to_first_token_seconds",
    "tpot": "hetero_gateway_time_per_output_token_seconds",
    "e2e": "hetero_gateway_e2e_request_latency_seconds",
    "tokens": "hetero_gateway_request_output_tokens",
}


@pytest.fixture(scope="module", params=["observe", "streamed"])
def fleet_spec(request: pytest.FixtureRequest) -> FleetSpec:
    return FleetSpec(
        model=MODEL,
        presets=("v100", "a100"),
        time_scale=1.0,
        tokens_per_chunk=1,
        count_mode=request.param,
    )


async def _families(session: aiohttp.ClientSession, url: str) -> dict[str, dict[str, float]]:
    """{family: {sample name + sorted labels: value}} of `url`/metrics."""
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + repr(sorted(s.labels.items()))
            out.setdefault(family.name, {})[key] = s.value
    return out


def _stat(samples: dict[str, float], suffix: str, **labels: str) -> float:
    """The one sample ending in `suffix` whose labels include `labels` (0 if none)."""
    found = [
        v
        for k, v in samples.items()
        if k.split("[", 1)[0].endswith(suffix)
        and all(repr((name, value)) in k for name, value in labels.items())
    ]
    assert len(found) <= 1, found
    return found[0] if found else 0.0


def _mean(samples: dict[str, float], **labels: str) -> float:
    count = _stat(samples, "_count", **labels)
    assert count > 0, (labels, samples)
    return _stat(samples, "_sum", **labels) / count


def _bucket(bounds: tuple[float, ...], value: float) -> int:
    return bisect_left(bounds, value)


async def test_each_pods_latency_matches_its_engines_own_within_a_bucket(
    fleet: LocalFleet,
) -> None:
    async with aiohttp.ClientSession() as session:
        await wait_idle(session, fleet)
        before = {e.name: await _families(session, e.url) for e in fleet.engines}
        plugin_before = await _families(session, fleet.plugin_url)
        for i in range(REQUESTS * len(fleet.engines)):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"request {i} " + "word " * 40}],
                "max_tokens": MAX_TOKENS,
                "stream": True,
            }
            # One at a time, round-robin: every pod serves some, each alone on its engine.
            headers = {"routing-strategy": "round-robin"}
            url = f"{fleet.envoy_url}/v1/chat/completions"
            async with session.post(url, json=body, headers=headers) as resp:
                assert resp.status == 200
                await resp.read()
            await wait_idle(session, fleet)
        after = {e.name: await _families(session, e.url) for e in fleet.engines}
        plugin = await _families(session, fleet.plugin_url)
    for e in fleet.engines:
        pod = f"{fleet.spec.namespace}/{e.name}"
        mine = {"pod": pod, "model": MODEL, "deployment": e.preset}
        served = _stat(plugin[NAMES["e2e"]], "_count", **mine) - _stat(
            plugin_before.get(NAMES["e2e"], {}), "_count", **mine
        )
        assert served >= 2, (e.name, served)  # round-robin: about REQUESTS each

        def engine_mean(name: str, e_name: str = e.name) -> float:
            total = _stat(after[e_name][name], "_sum") - _stat(before[e_name][name], "_sum")
            count = _stat(after[e_name][name], "_count") - _stat(before[e_name][name], "_count")
            assert count > 0
            return total / count

        # The engine's TTFT is from its own arrival; the client's adds Envoy and the plugin.
        true_ttft = engine_mean("vllm:time_to_first_token_seconds")
        ttft = _mean(plugin[NAMES["ttft"]], **mine)
        assert true_ttft <= ttft + 0.002, (e.name, ttft, true_ttft)
        assert abs(_bucket(TTFT_BUCKETS_S, ttft) - _bucket(TTFT_BUCKETS_S, true_ttft)) <= 1
        # TPOT: the engine's is per gap, the plugin's per request; alone, they are one.
        true_tpot = engine_mean("vllm:time_per_output_token_seconds")
        tpot = _mean(plugin[NAMES["tpot"]], **mine)
        assert tpot == pytest.approx(true_tpot, rel=0.15), (e.name, tpot, true_tpot)
        assert abs(_bucket(TPOT_BUCKETS_S, tpot) - _bucket(TPOT_BUCKETS_S, true_tpot)) <= 1
        # E2E: first token, then MAX_TOKENS - 1 more gaps.
        e2e = _mean(plugin[NAMES["e2e"]], **mine)
        expected = true_ttft + (MAX_TOKENS - 1) * true_tpot
        assert e2e == pytest.approx(expected, rel=0.15), (e.name, e2e, expected)
        assert abs(_bucket(E2E_BUCKETS_S, e2e) - _bucket(E2E_BUCKETS_S, expected)) <= 1
        assert _mean(plugin[NAMES["tokens"]], **mine) == MAX_TOKENS
    # The gateway's own time: one decision per request, each well under a millisecond or so.
    decisions = plugin["hetero_gateway_routing_decision_seconds"]
    before_count = _stat(plugin_before.get("hetero_gateway_routing_decision_seconds", {}), "_count")
    assert _stat(decisions, "_count") - before_count == REQUESTS * len(fleet.engines)
    assert 0 < _mean(decisions) < 0.05
    # The V100 is slower per token than the A100: the histograms tell GPU types apart.
    v100, a100 = (
        _mean(plugin[NAMES["tpot"]], pod=f"{fleet.spec.namespace}/{e.name}") for e in fleet.engines
    )
    assert v100 > a100


async def test_a_pod_that_leaves_takes_its_series_with_it(fleet: LocalFleet) -> None:
    gone = fleet.engines[0]
    pod = f"{fleet.spec.namespace}/{gone.name}"
    original = fleet.pods_file.read_text()
    doc = fleet.pods_document()
    pods = doc["models"][MODEL]["pods"]  # type: ignore[index]
    doc["models"][MODEL]["pods"] = [p for p in pods if p["name"] != gone.name]  # type: ignore[index]

    def labelled(families: dict[str, dict[str, float]]) -> set[str]:
        return {
            name
            for name in NAMES.values()
            for key in families.get(name, {})
            if repr(("pod", pod)) in key
        }

    async with aiohttp.ClientSession() as session:
        await wait_idle(session, fleet)
        assert labelled(await _families(session, fleet.plugin_url)) == set(NAMES.values())
        fleet.pods_file.write_text(yaml.safe_dump(doc))
        try:
            await poll(
                lambda: _families(session, fleet.plugin_url),
                lambda f: not labelled(f),
                "the departed pod's latency series to go",
                limit_s=15,
            )
        finally:
            fleet.pods_file.write_text(original)
        await poll(
            lambda: _families(session, fleet.plugin_url),
            lambda f: any(
                repr(("pod", pod)) in key for key in f.get("hetero_gateway_routed_requests", {})
            ),
            "the pod back in the pool",
            limit_s=15,
        )


async def test_requests_with_an_slo_count_as_met_or_late(fleet: LocalFleet) -> None:
    """A client's own `x-slo-ttft-ms`: a target of a minute is met, one of a millisecond is
    not (the engine alone takes longer to its first token); each counts once, by deployment."""

    def outcomes(families: dict[str, dict[str, float]], outcome: str) -> float:
        samples = families.get("hetero_gateway_slo_requests", {})
        return sum(
            v
            for k, v in samples.items()
            if k.startswith("hetero_gateway_slo_requests_total") and repr(("outcome", outcome)) in k
        )

    async with aiohttp.ClientSession() as session:
        await wait_idle(session, fleet)
        before = await _families(session, fleet.plugin_url)
        for target in ("60000", "1"):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "judge me"}],
                "max_tokens": 8,
                "stream": True,
            }
            headers = {"x-slo-ttft-ms": target}
            url = f"{fleet.envoy_url}/v1/chat/completions"
            async with session.post(url, json=body, headers=headers) as resp:
                assert resp.status == 200
                await resp.read()
        await wait_idle(session, fleet)
        after = await _families(session, fleet.plugin_url)
    assert outcomes(after, "met") - outcomes(before, "met") == 1
    assert outcomes(after, "late") - outcomes(before, "late") == 1
    assert outcomes(after, "rejected") == outcomes(before, "rejected")
