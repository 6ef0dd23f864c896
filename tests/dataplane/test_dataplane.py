"""Data plane: a real Envoy, the plugin and mock engines as separate processes on loopback.

Everything goes through Envoy's listener exactly as a client's request would. One stack (the
`fleet` fixture of tests/conftest.py) serves the whole module; tests that need counts compare
deltas.
"""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from plugin.adapters.envoy_config import EnvoyOptions, render_bootstrap
from plugin.config.variables import ENVOY_DEFAULT_MAX_HEADERS
from plugin_tools.demo.fleet import LocalFleet
from plugin_tools.demo.loadgen import LengthDist, Workload, run_open_loop
from tests.helpers import (
    bootstrap_hcm,
    chat_body,
    debug_pods,
    free_port,
    metric_sum,
    poll,
    wait_idle,
)

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio(loop_scope="module")]

MODEL = "llama-3-8b"


async def pods_state(session: aiohttp.ClientSession, fleet: LocalFleet) -> dict[str, Any]:
    return await debug_pods(session, fleet.plugin_url)


async def pods_listing(session: aiohttp.ClientSession, fleet: LocalFleet, key: str) -> None:
    """Until the plugin lists `key`: the edited pods file has been read again."""
    await poll(
        lambda: pods_state(session, fleet),
        lambda state: key in state["pods"],
        f"{key} from the edited pods file",
        limit_s=10,
        interval_s=0.2,
    )


def chat(max_tokens: int = 8, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return chat_body(MODEL, max_tokens, stream=stream, **extra)


async def test_non_streaming_request_is_steered_and_annotated(fleet: LocalFleet) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{fleet.envoy_url}/v1/chat/completions",
            json=chat(5),
            headers={"routing-strategy": "least-request"},
        ) as resp:
            assert resp.status == 200
            doc = await resp.json()
            pod = resp.headers["target-pod"]
            # The engine that really served it is the one the plugin named.
            assert resp.headers["x-mock-engine"] == pod
            assert resp.headers["routing-strategy"] == "least-request"
            assert resp.headers["request-id"]
            engine = next(e for e in fleet.engines if e.name == pod)
            assert resp.headers["target-pod-ip"] == f"127.0.0.1:{engine.port}"
        assert doc["usage"]["completion_tokens"] == 5
        await wait_idle(session, fleet)
        state = await pods_state(session, fleet)
        assert state["pods"][f"default/{pod}"]["output_tokens_total"] >= 5


@pytest.mark.slow(
    reason="open-loop load at 70% of the fleet long enough for the shares to settle on capacity"
)
async def test_load_balance_follows_capacity_and_counts_every_token(fleet: LocalFleet) -> None:
    saturated = {e.name: e.saturated_tokens_per_s for e in fleet.engines}
    capacity_share = {k: v / sum(saturated.values()) for k, v in saturated.items()}
    out = LengthDist(median=24, sigma=0.5, low=4, high=96)
    rate = 0.7 * sum(saturated.values()) / out.mean()
    async with aiohttp.ClientSession() as session:
        await wait_idle(session, fleet)
        before_plugin = await pods_state(session, fleet)
        before_engine = {
            e.name: await metric_sum(session, e.url, "vllm:generation_tokens_total")
            for e in fleet.engines
        }
        workload = Workload(
            rate_per_s=rate,
            duration_s=25.0,
            prompt_words=LengthDist(median=16, sigma=0.5, low=2, high=64),
            output_tokens=out,
            seed=7,
        )
        results = await run_open_loop(
            fleet.envoy_url, MODEL, workload, strategy="load-balance", request_timeout_s=60
        )
        await wait_idle(session, fleet)
        after_engine = {
            e.name: await metric_sum(session, e.url, "vllm:generation_tokens_total")
            for e in fleet.engines
        }
        generated_total = sum(after_engine.values()) - sum(before_engine.values())
        # The counting filter's stream is not the one that holds in-flight counts: its last
        # message may land a moment after the request ends. Wait (bounded) for it to settle.
        deadline = time.monotonic() + 10
        while True:
            after_plugin = await pods_state(session, fleet)
            counted_total = sum(
                after_plugin["pods"][k]["output_tokens_total"]
                - before_plugin["pods"][k]["output_tokens_total"]
                for k in before_plugin["pods"]
            )
            if counted_total >= generated_total or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)

    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    # Shares in the second half, once capacity has been learned.
    late = [r for r in results if r.started_at >= 12.5]
    share = {name: sum(r.replica == name for r in late) / len(late) for name in saturated}
    assert share["a100-0"] > share["l20-0"] and share["a100-0"] > share["v100-0"], share
    for name in saturated:
        assert abs(share[name] - capacity_share[name]) < 0.15, (share, capacity_share)
    # The plugin counted exactly the tokens each engine generated.
    for name in saturated:
        key = f"default/{name}"
        counted = (
            after_plugin["pods"][key]["output_tokens_total"]
            - before_plugin["pods"][key]["output_tokens_total"]
        )
        generated = after_engine[name] - before_engine[name]
        assert counted == generated, (name, counted, generated)
        assert counted == sum(r.output_tokens for r in results if r.replica == name)
        assert after_plugin["pods"][key]["capacity_tokens_per_s"] > 0


async def test_a_blended_strategy_routes_and_echoes_what_the_client_sent(
    fleet: LocalFleet,
) -> None:
    """Through a gateway with auto-blend on (AIBrix's default; the test fleet turns it off to
    compare pure strategies): a weighted list and a bare name that auto-blend extends both
    route, and each response names the strategy string the client sent."""
    gateway = await fleet.start_extra_gateway(
        "gw-blend", {"AIBRIX_ROUTING_AUTO_BLEND_LOAD_BALANCE_WEIGHT": "1"}
    )
    async with aiohttp.ClientSession() as session:
        for strategy in ("least-request:2,load-balance:1", "least-request", "random:1,slo:0"):
            for stream in (False, True):
                async with session.post(
                    f"{gateway.envoy_url}/v1/chat/completions",
                    json=chat(3, stream=stream),
                    headers={"routing-strategy": strategy},
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["routing-strategy"] == strategy
                    assert resp.headers["x-mock-engine"] == resp.headers["target-pod"]
                    await resp.read()
        state = await debug_pods(session, gateway.plugin_url)
        assert sum(p["routed_total"] for p in state["pods"].values()) == 6


async def test_a_gateway_with_a_bearer_token_lets_in_only_requests_that_carry_it(
    fleet: LocalFleet,
) -> None:
    """AIBRIX_AUTH_BEARER_TOKEN set: without the token, or with another, a 401 in OpenAI's
    shape before anything is routed (the model list included); with it, served."""
    gateway = await fleet.start_extra_gateway("gw-auth", {"AIBRIX_AUTH_BEARER_TOKEN": "dp-token-7"})
    url = f"{gateway.envoy_url}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        for auth in (None, "Bearer wrong", "Basic dp-token-7", "Bearer dp-token-7x"):
            headers = {} if auth is None else {"authorization": auth}
            async with session.post(url, json=chat(3), headers=headers) as resp:
                assert resp.status == 401
                assert resp.headers["x-error-auth"] == "true"
                error = (await resp.json())["error"]
                assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
                assert "dp-token" not in error["message"]
        async with session.get(f"{gateway.envoy_url}/v1/models") as resp:
            assert resp.status == 401
        ok = {"authorization": "bearer dp-token-7"}
        async with session.post(url, json=chat(3), headers=ok) as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["completion_tokens"] == 3
        async with session.get(f"{gateway.envoy_url}/v1/models", headers=ok) as resp:
            assert resp.status == 200
        state = await debug_pods(session, gateway.plugin_url)
        assert sum(p["routed_total"] for p in state["pods"].values()) == 1


async def test_prefix_cache_keeps_a_shared_prompt_on_the_replica_that_holds_it(
    fleet: LocalFleet,
) -> None:
    """`routing-strategy: prefix-cache` through a gateway with AIBrix's defaults (auto-blended
    to prefix-cache:5,load-balance:4, gate on): three long system prompts, each asked five
    questions in turn; every prompt's requests land on one engine (the one its first request
    went to), and the plugin counts the hits."""
    gateway = await fleet.start_extra_gateway(
        "gw-prefix",
        {
            "AIBRIX_ROUTING_AUTO_BLEND_LOAD_BALANCE_WEIGHT": "1",
            "HETERO_GATEWAY_IMBALANCE_GATE": "capacity",
        },
    )
    systems = [f"You are assistant number {i}. " * 30 for i in range(3)]  # ~900 chars each
    served: dict[int, set[str]] = {i: set() for i in range(3)}
    async with aiohttp.ClientSession() as session:
        for question in range(5):
            for i, system in enumerate(systems):
                body = chat(2) | {
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"question {question}?"},
                    ]
                }
                async with session.post(
                    f"{gateway.envoy_url}/v1/chat/completions",
                    json=body,
                    headers={"routing-strategy": "prefix-cache"},
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["routing-strategy"] == "prefix-cache"
                    served[i].add(resp.headers["x-mock-engine"])
                    await resp.read()
        assert all(len(engines) == 1 for engines in served.values()), served
        metrics = await (await session.get(f"{gateway.plugin_url}/metrics")).text()
    hits = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("hetero_gateway_prefix_cache_matched_blocks_total{")
    ]
    assert sum(hits) > 0


async def test_a_config_profile_from_the_pods_file_chooses_the_strategy(
    fleet: LocalFleet,
) -> None:
    """AIBrix's model config (`model.aibrix.ai/config`, here the pods file's `config`): with no
    header the default profile's strategy routes; `config-profile: auto` picks the profile whose
    range fits (max_tokens >= 64) and the response names it in `x-aibrix-config-profile`; a
    `routing-strategy` header still wins. The original pods file is put back at the end."""
    original = fleet.pods_file.read_text()
    doc = yaml.safe_load(original)
    doc["models"][MODEL]["config"] = {
        "defaultProfile": "default",
        "profiles": {
            "default": {"routingStrategy": "round-robin"},
            "long": {"routingStrategy": "random", "routingConfig": {"maxTokensGte": 64}},
        },
    }
    url = f"{fleet.envoy_url}/v1/chat/completions"

    async def send(
        session: aiohttp.ClientSession, max_tokens: int, headers: dict[str, str]
    ) -> tuple[str, str | None]:
        async with session.post(url, json=chat(max_tokens), headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
            return resp.headers["routing-strategy"], resp.headers.get("x-aibrix-config-profile")

    async def profiles_listed(session: aiohttp.ClientSession, listed: bool) -> None:
        await poll(
            lambda: pods_state(session, fleet),
            lambda state: all(
                (p["config_profiles"] is not None) is listed
                for p in state["pods"].values()
                if p["model"] == MODEL
            ),
            "the pods file's config profiles",
            limit_s=10,
            interval_s=0.2,
        )

    async with aiohttp.ClientSession() as session:
        fleet.pods_file.write_text(yaml.safe_dump(doc))
        try:
            await profiles_listed(session, True)
            assert await send(session, 4, {}) == ("round-robin", None)
            assert await send(session, 100, {"config-profile": "auto"}) == ("random", "long")
            assert await send(session, 4, {"config-profile": "auto"}) == (
                "round-robin",
                "default",
            )
            assert await send(session, 4, {"config-profile": "long"}) == ("random", "long")
            spoofed = {"config-profile": "long", "routing-strategy": "least-request"}
            assert await send(session, 4, spoofed) == ("least-request", "long")
            # A client's own copy of the echo header is removed, not passed back.
            assert await send(session, 4, {"x-aibrix-config-profile": "forged"}) == (
                "round-robin",
                None,
            )
        finally:
            fleet.pods_file.write_text(original)
        await profiles_listed(session, False)


async def test_models_list_through_envoy(fleet: LocalFleet) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{fleet.envoy_url}/v1/models") as resp,
    ):
        assert resp.status == 200
        doc = await resp.json()
    assert MODEL in [m["id"] for m in doc["data"]]


def _envoy_alone(listen: int, admin: int) -> dict[str, Any]:
    """The product's listener at Envoy's own default header limit, with no filter but the
    router and a route that answers 200 itself: what Envoy alone accepts of a request."""
    boot = render_bootstrap(
        EnvoyOptions(
            listen_host="127.0.0.1",
            listen_port=listen,
            admin_port=admin,
            max_request_headers=ENVOY_DEFAULT_MAX_HEADERS,
        )
    )
    hcm = bootstrap_hcm(boot)
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"].endswith("router")]
    hcm["route_config"]["virtual_hosts"][0]["routes"] = [
        {"match": {"prefix": "/"}, "direct_response": {"status": 200}}
    ]
    return boot


async def _statuses(url: str, extras: range) -> dict[int, int]:
    """POST a chat request with each count of extra headers: its status (0: Envoy's codec
    refused it and closed the connection)."""
    seen: dict[int, int] = {}
    for extra in extras:
        headers = {f"x-extra-{i}": "v" for i in range(extra)}
        async with aiohttp.ClientSession() as session:  # a refusal closes the connection
            try:
                async with session.post(
                    f"{url}/v1/chat/completions", json=chat(2), headers=headers
                ) as resp:
                    body = await resp.read()
                    seen[extra] = resp.status
            except aiohttp.ClientError:
                seen[extra] = 0
                continue
        if resp.status == 431 and body:
            error = orjson.loads(body)["error"]
            assert error["type"] == "invalid_request_error"
            assert "headers" in error["message"]
    return seen


async def test_every_request_envoy_alone_accepts_is_routed_despite_the_gateway_s_headers(
    fleet: LocalFleet, envoy_binary: str, tmp_path: Path
) -> None:
    """ext_proc refuses a mutation that takes a request over the listener's header count with an
    empty 503. The rendered listener leaves room above Envoy's default for the headers routing
    adds: every request Envoy alone (its default limit, no filter) answers is routed, and one
    over gets the plugin's 431 in OpenAI shape or Envoy's own refusal, never an empty 503."""
    listen, admin = free_port(), free_port()
    config = tmp_path / "envoy-alone.yaml"
    config.write_text(yaml.safe_dump(_envoy_alone(listen, admin)))
    alone = await asyncio.create_subprocess_exec(
        envoy_binary,
        *("-c", str(config), "--disable-hot-restart", "--concurrency", "1"),
        *("--log-level", "warn"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{listen}"
        await poll(lambda: _statuses(url, range(1)), lambda s: s[0] == 200, "Envoy alone up")
        envoy_alone = await _statuses(url, range(80, 101))
    finally:
        alone.terminate()
        await alone.wait()
    most = max(n for n, status in envoy_alone.items() if status == 200)
    assert envoy_alone[most + 1] != 200  # its limit lies inside the range tried
    through = await _statuses(fleet.envoy_url, range(most - 4, most + 24))
    assert all(through[n] == 200 for n in range(most - 4, most + 1)), through
    assert 431 in through.values()  # the plugin's own refusal was reached
    assert 503 not in through.values()
    first_refused = min(n for n, status in through.items() if status != 200)
    assert all(status != 200 for n, status in through.items() if n >= first_refused)


async def test_a_body_over_the_limit_gets_envoy_s_413_in_openai_shape(fleet: LocalFleet) -> None:
    """Envoy refuses a body over its buffer limit itself (the plugin never sees it): the reply
    is still OpenAI JSON, while the plugin's own errors pass through as it wrote them."""
    too_big = b'{"model": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{fleet.envoy_url}/v1/chat/completions",
            data=io.BytesIO(too_big),  # aiohttp warns on large raw bytes
            headers={"content-type": "application/json"},
        ) as resp:
            assert resp.status == 413
            error = (await resp.json())["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
        async with session.post(
            f"{fleet.envoy_url}/v1/chat/completions", json={"model": "nope", "messages": []}
        ) as resp:
            assert resp.status == 400  # the plugin's reply, untouched by the mapper
            assert (await resp.json()) == {
                "error": {
                    "message": "model nope does not exist",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            }


async def test_only_the_openai_paths_reach_an_engine(fleet: LocalFleet) -> None:
    """An engine's other endpoints are not reachable through the gateway, and an LLM path asked
    with the wrong method is 405: both OpenAI-shaped JSON, neither touching an engine."""
    async with aiohttp.ClientSession() as session:
        for path in ("/metrics", "/v1/load_lora_adapter", "/"):
            async with session.get(f"{fleet.envoy_url}{path}") as resp:
                assert resp.status == 404, path
                assert resp.headers["content-type"] == "application/json"
                assert "x-mock-engine" not in resp.headers
                doc = await resp.json()
                assert doc["error"]["code"] == "not_found"
        async with session.get(f"{fleet.envoy_url}/v1/chat/completions") as resp:
            assert resp.status == 405 and resp.headers["allow"] == "POST"
            assert "x-mock-engine" not in resp.headers
            assert (await resp.json())["error"]["code"] == "method_not_allowed"
        async with session.get(f"{fleet.envoy_url}/v1/models") as resp:
            assert resp.status == 200  # answered by the plugin from discovery
        for method in ("POST", "DELETE"):
            async with session.request(method, f"{fleet.envoy_url}/v1/models") as resp:
                assert resp.status == 405 and resp.headers["allow"] == "GET", method
                assert (await resp.json())["error"]["code"] == "method_not_allowed"


async def test_client_cannot_steer_an_unrouted_path(fleet: LocalFleet) -> None:
    engine = fleet.engines[0]
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{fleet.envoy_url}/v1/embeddings",
            json={"model": MODEL, "input": "x"},
            headers={"target-pod": f"127.0.0.1:{engine.port}"},
        ) as resp,
    ):
        # Not an OpenAI path the gateway serves: Envoy's own 404, and the client's target-pod
        # steered nothing (the engine would have answered with its x-mock-engine header).
        assert resp.status == 404
        assert "x-mock-engine" not in resp.headers


async def test_a_dead_engine_leaves_rotation_at_its_first_failed_scrape(fleet: LocalFleet) -> None:
    """A pod whose engine is gone answers 503 fast, so it would always score best. Its scrape is
    refused, which takes it out of rotation at once: at most the requests routed before that
    scrape fail (fewer than the 3 failures the 5xx rule needs), then none."""
    original = fleet.pods_file.read_text()
    doc = yaml.safe_load(original)
    doc["models"][MODEL]["pods"].append(
        {"name": "dead-0", "address": "127.0.0.1", "port": free_port()}
    )
    fleet.pods_file.write_text(yaml.safe_dump(doc))
    try:
        async with aiohttp.ClientSession() as session:

            async def send() -> tuple[int, str | None]:
                async with session.post(
                    f"{fleet.envoy_url}/v1/chat/completions",
                    json=chat(2),
                    headers={"routing-strategy": "load-balance"},
                ) as resp:
                    await resp.read()
                    return resp.status, resp.headers.get("target-pod")

            await pods_listing(session, fleet, "default/dead-0")
            before = [await send() for _ in range(8)]  # some may reach it before its scrape
            state = await poll(
                lambda: pods_state(session, fleet),
                lambda state: bool(state["pods"]["default/dead-0"]["unreachable"]),
                "the dead pod to leave rotation",
                interval_s=0.05,
            )
            after = [await send() for _ in range(30)]
    finally:
        fleet.pods_file.write_text(original)
    assert all(pod == "dead-0" for status, pod in before if status != 200)
    assert all(status == 200 for status, _ in after), after
    assert all(pod != "dead-0" for _, pod in after)
    assert state["pods"]["default/dead-0"]["inflight"] == 0


BAD_JSON = b"{not json"


@pytest.mark.parametrize(
    ("body", "headers", "status", "header", "code"),
    [
        pytest.param(
            BAD_JSON, {}, 400, ("x-error-request-body-processing", "true"), None, id="bad-json"
        ),
        pytest.param(
            orjson.dumps({"messages": []}),
            {},
            400,
            ("x-error-no-model-backends", "true"),
            "model_not_found",
            id="no-model",
        ),
        pytest.param(
            orjson.dumps({**chat(), "model": "nope"}),
            {},
            400,
            ("x-error-no-model-backends", "nope"),
            "model_not_found",
            id="unknown-model",
        ),
        pytest.param(
            orjson.dumps(chat()),
            {"routing-strategy": "fastest"},
            400,
            ("x-error-routing", "true"),
            None,
            id="unknown-strategy",
        ),
        pytest.param(
            orjson.dumps(chat()),
            {"routing-strategy": "least-request:2,load-balance:x"},
            400,
            ("x-error-routing", "true"),
            None,
            id="malformed-blend",
        ),
    ],
)
async def test_errors_through_envoy(
    fleet: LocalFleet,
    body: bytes,
    headers: dict[str, str],
    status: int,
    header: tuple[str, str],
    code: str | None,
) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{fleet.envoy_url}/v1/chat/completions",
            data=body,
            headers={"content-type": "application/json", **headers},
        ) as resp,
    ):
        assert resp.status == status
        assert resp.headers.get(header[0]) == header[1]
        doc = orjson.loads(await resp.read())
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["type"] == "invalid_request_error"
    assert doc["error"]["code"] == code


async def test_no_ready_pod_is_503_and_pods_file_is_reread(fleet: LocalFleet) -> None:
    doc = yaml.safe_load(fleet.pods_file.read_text())
    doc["models"]["offline-model"] = {
        "pods": [
            {
                "name": "down-0",
                "address": "127.0.0.1",
                "port": free_port(),
                "ready": False,
            }
        ]
    }
    fleet.pods_file.write_text(yaml.safe_dump(doc))
    async with aiohttp.ClientSession() as session:
        await pods_listing(session, fleet, "default/down-0")
        async with session.post(
            f"{fleet.envoy_url}/v1/chat/completions", json={**chat(), "model": "offline-model"}
        ) as resp:
            assert resp.status == 503
            assert resp.headers.get("x-error-no-model-backends") == "true"
            err = (await resp.json())["error"]
    assert err["type"] == "overloaded_error"
    assert "offline-model" in err["message"]


async def test_in_flight_counts_hold_mid_stream_and_return_to_zero_on_disconnect(
    fleet: LocalFleet,
) -> None:
    """The routing filter's stream holds the in-flight count for the whole response (with the
    counting filter in observability mode too), and a client drop releases it."""
    async with aiohttp.ClientSession() as session:
        await wait_idle(session, fleet)
        clients = [aiohttp.ClientSession() for _ in range(12)]
        try:
            responses = []
            for client in clients:
                resp = await client.post(
                    f"{fleet.envoy_url}/v1/chat/completions",
                    json=chat(max_tokens=2000, stream=True),
                )
                assert resp.status == 200
                await resp.content.readline()  # the stream is under way
                responses.append(resp)
            state = await pods_state(session, fleet)
            by_pod: dict[str, int] = {}
            for resp in responses:
                name = resp.headers["target-pod"]
                by_pod[name] = by_pod.get(name, 0) + 1
            assert {
                k.split("/")[1]: v["inflight"] for k, v in state["pods"].items() if v["inflight"]
            } == by_pod
            for resp in responses:
                resp.close()  # drop the connection mid-stream
        finally:
            for client in clients:
                await client.close()
        # The plugin's in-flight counts and the engines' running sequences return to zero.
        await wait_idle(session, fleet, limit_s=30)
        state = await pods_state(session, fleet)
    assert all(p["inflight"] == 0 for p in state["pods"].values())


async def test_plugin_down_fail_closed_answers_503(fleet: LocalFleet) -> None:
    """Last in the module: it stops the plugin. Fail-closed means a 503, not an empty 500."""
    await fleet.stop_process(fleet.plugin)
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(f"{fleet.envoy_url}/v1/chat/completions", json=chat(2)) as resp,
    ):
        assert resp.status == 503
        assert "x-mock-engine" not in resp.headers
        # Envoy's own reply, in OpenAI's error shape (its local-reply mapper), not empty.
        assert resp.headers["content-type"] == "application/json"
        error = (await resp.json())["error"]
        assert (error["type"], error["code"]) == ("overloaded_error", "service_unavailable")
        assert "ext_proc" in error["message"]  # says which failure it was
