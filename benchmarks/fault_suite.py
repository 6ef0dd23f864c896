"""The fault suite: each failure the gateway must survive, run against a real Envoy, the plugin and
mock engines on loopback, scored against the targets of the faults issue; writes
docs/reliability.md.

Scenarios (each on a fresh fleet, default wiring: ORIGINAL_DST, fail-closed, counting filter):

- plugin kill -9 with long generations streaming: how many are cut;
- a hung engine (SIGSTOP for 10 s under an open-loop load): requests routed to it after the
  first second, time until it leaves rotation, time until it is back after SIGCONT;
- a dead engine (killed for 10 s, then restarted): failed requests, time to leave rotation,
  time back after its restart;
- a hung plugin (SIGSTOP for 3 s): the longest a request stalled, and what it got;
- 1,000 requests naming a ~4 MB unknown model: statuses, and the plugin's memory after them
  against before;
- an engine whose metrics page answers 404 (a wrong metrics path) while it serves: its share of
  the traffic against its share with a good page, in the same run, and the failures;
- requests of 90 to 100 header lines (Envoy's default limit is 100): their statuses;
- a `routing-strategy` header the operator locked, with each denied-header action: the status,
  and which strategy routed it;
- 200 streams cancelled mid-way: how long until the plugin counts none in flight, and the
  output tokens it credited against the engines' own counters;
- 3 plugin replicas sharing Redis behind one Envoy cluster, one killed -9 while generations
  stream: how many are cut, how long until every survivor counts none in flight, how often
  each engine is scraped with all three up (counted on the engines) and the longest an engine
  goes unscraped across the kill; and the plugins' CPU per request through those 3 replicas
  against through one of them.

    python benchmarks/fault_suite.py            # about 4 minutes on 2 cores
    python benchmarks/fault_suite.py --only hung-engine --repeat 10
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from plugin_tools.demo.fleet import (
    EngineProc,
    ExtraGateway,
    FleetSpec,
    LocalFleet,
    free_port,
    process_cpu_seconds,
)
from plugin_tools.demo.redis_server import RedisServer

DOC = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"
MODEL = "llama-3-8b"


@dataclass
class Outcome:
    started: float  # seconds since the load began
    status: int  # 0: no response (connection error)
    complete: bool  # a 200 whose stream ended with [DONE]
    pod: str  # the routed pod (target-pod response header), "" when none
    took: float


@dataclass
class Row:
    scenario: str
    sent: int
    failed: int
    cut: int = 0
    eject_s: float | None = None
    restore_s: float | None = None
    measure: str = ""
    target: str = ""
    met: bool = True
    notes: list[str] = field(default_factory=list)


def _chat(max_tokens: int, model: str = MODEL) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], t0: float
) -> Outcome:
    started = time.monotonic()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            text = (await resp.read()).decode("utf-8", "replace")
            complete = resp.status == 200 and text.rstrip().endswith("data: [DONE]")
            pod = resp.headers.get("target-pod", "")
            status = resp.status
    except (aiohttp.ClientError, TimeoutError):
        status, complete, pod = 0, False, ""
    return Outcome(started - t0, status, complete, pod, time.monotonic() - started)


async def _offer(url: str, rate: float, duration_s: float, max_tokens: int) -> list[Outcome]:
    """Open loop: a request every 1/rate s for `duration_s`, whatever the earlier ones do."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.monotonic()
        tasks = []
        n = 0
        while (at := n / rate) < duration_s:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(_one(session, url, _chat(max_tokens), t0)))
            n += 1
        return list(await asyncio.gather(*tasks))


async def _pod_state(fleet: LocalFleet, name: str, key: str) -> Any:
    """`key` of pod `name` in the plugin's /debug/pods (None when it cannot be read)."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session,
            session.get(f"{fleet.plugin_url}/debug/pods") as resp,
        ):
            pods = (await resp.json())["pods"]
    except (aiohttp.ClientError, TimeoutError):
        return None
    return next((p[key] for p in pods.values() if p["name"] == name), None)


async def _unreachable(fleet: LocalFleet, name: str) -> bool | None:
    state = await _pod_state(fleet, name, "unreachable")
    return None if state is None else bool(state)


async def _metric_sum(url: str, name: str) -> float:
    """The sum of every sample named `name` on `url`/metrics."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session,
        session.get(f"{url}/metrics") as resp,
    ):
        text = await resp.text()
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


async def _time_until(check: Callable[[], Awaitable[bool]], limit_s: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if await check():
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    return None


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _fleet(tmp: Path, **spec: Any) -> LocalFleet:
    return LocalFleet(FleetSpec(model=MODEL, listen_port=free_port(), **spec), str(tmp))


# --- scenarios ---------------------------------------------------------------------------------


async def plugin_kill(tmp: Path) -> Row:
    async with _fleet(tmp, presets=("a100", "l20"), time_scale=3.0, tokens_per_chunk=1) as fleet:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            t0 = time.monotonic()
            streams = [
                asyncio.create_task(_one(session, fleet.envoy_url, _chat(200), t0))
                for _ in range(10)
            ]
            await asyncio.sleep(1.5)
            assert fleet.plugin is not None
            fleet.plugin.kill()
            outcomes = await asyncio.gather(*streams)
    cut = sum(not o.complete for o in outcomes)
    return Row(
        "plugin kill -9, 10 generations streaming",
        len(outcomes),
        cut,
        cut=cut,
        measure=f"{cut} of {len(outcomes)} cut",
        target="0 cut",
        met=cut == 0,
    )


async def _engine_outage(
    tmp: Path,
    fault: Callable[[LocalFleet, EngineProc], Awaitable[None]],
    recover: Callable[[LocalFleet, EngineProc], Awaitable[None]],
) -> tuple[float | None, float | None, list[Outcome]]:
    """Three engines under 14 req/s for 18 s; the a100's `fault` 3 s in, its `recover` 10 s
    later. Returns (seconds until it was out of rotation, seconds from recovery until it was
    back, every request's outcome)."""
    async with _fleet(tmp, presets=("a100", "l20", "v100")) as fleet:
        engine = next(e for e in fleet.engines if e.preset == "a100")
        load = asyncio.create_task(_offer(fleet.envoy_url, 14.0, 18.0, 16))
        await asyncio.sleep(3.0)
        await fault(fleet, engine)

        async def out() -> bool:
            return await _unreachable(fleet, engine.name) is True

        async def back() -> bool:
            return await _unreachable(fleet, engine.name) is False

        eject = await _time_until(out, 10.0)
        await asyncio.sleep(max(0.0, 10.0 - (eject or 0.0)))
        await recover(fleet, engine)
        restore = await _time_until(back, 10.0)
        return eject, restore, await load


def _signal(sig: signal.Signals) -> Callable[[LocalFleet, EngineProc], Awaitable[None]]:
    async def send(_: LocalFleet, engine: EngineProc) -> None:
        assert engine.proc is not None
        os.kill(engine.proc.pid, sig)

    return send


async def _kill(_: LocalFleet, engine: EngineProc) -> None:
    assert engine.proc is not None
    engine.proc.kill()


async def _restart(fleet: LocalFleet, engine: EngineProc) -> None:
    await fleet.restart_engine(engine)


async def hung_engine(tmp: Path) -> Row:
    eject, restore, outcomes = await _engine_outage(
        tmp, _signal(signal.SIGSTOP), _signal(signal.SIGCONT)
    )
    hang_from, hang_to = 3.0, 13.0
    late = [o for o in outcomes if hang_from + 1.0 <= o.started < hang_to and o.pod == "a100-0"]
    failed = sum(o.status != 200 for o in outcomes)
    return Row(
        "hung engine (SIGSTOP 10 s, 14 req/s)",
        len(outcomes),
        failed,
        eject_s=eject,
        restore_s=restore,
        measure=f"{len(late)} routed to it after the first second",
        target="at most 2 after the first second",
        met=len(late) <= 2,
    )


async def dead_engine(tmp: Path) -> Row:
    eject, restore, outcomes = await _engine_outage(tmp, _kill, _restart)
    # Generations running on it when it died are lost with it (cut); what the gateway decides
    # is what happens to requests sent after that.
    cut = sum(not o.complete for o in outcomes if o.started < 3.0)
    failed = sum(not o.complete for o in outcomes if o.started >= 3.0)
    met = failed <= 1 and restore is not None and restore <= 2.0
    return Row(
        "dead engine (killed 10 s, restarted)",
        len(outcomes),
        failed,
        cut=cut,
        eject_s=eject,
        restore_s=restore,
        measure=f"{failed} sent after the kill failed; back {restore:.2f} s after its restart"
        if restore is not None
        else f"{failed} sent after the kill failed; not back",
        target="at most 1 failed; back within 2 s",
        met=met,
        notes=[
            f"{cut} generations running on it when it was killed were cut (its work is lost)",
            "a request that fails on a pod triggers a scrape of it at once; no retry: ORIGINAL_DST"
            " retries go to the same dead address",
        ],
    )


async def hung_plugin(tmp: Path) -> Row:
    async with _fleet(tmp, presets=("a100", "l20")) as fleet:
        load = asyncio.create_task(_offer(fleet.envoy_url, 5.0, 8.0, 8))
        await asyncio.sleep(2.0)
        assert fleet.plugin is not None
        os.kill(fleet.plugin.pid, signal.SIGSTOP)
        await asyncio.sleep(3.0)
        os.kill(fleet.plugin.pid, signal.SIGCONT)
        outcomes = await load
    during = [o for o in outcomes if 2.0 <= o.started < 5.0]
    stall = max((o.took for o in during), default=0.0)
    failed = sum(o.status != 200 for o in outcomes)
    return Row(
        "hung plugin (SIGSTOP 3 s, 5 req/s)",
        len(outcomes),
        failed,
        measure=f"longest stall {stall:.2f} s; {sum(o.status != 200 for o in during)} of "
        f"{len(during)} sent during it failed (fail-closed)",
        target="a routing decision stalls about 1 s at most",
        met=stall <= 2.0,
    )


async def huge_model(tmp: Path, count: int) -> Row:
    async with _fleet(tmp, presets=("a100",)) as fleet:
        assert fleet.plugin is not None
        pid = fleet.plugin.pid
        # Baseline: the plugin after ordinary traffic (its caches and buffers exist).
        warm = await _offer(fleet.envoy_url, 50.0, 4.0, 2)
        await asyncio.sleep(1.0)
        before = _rss_mb(pid)
        body = _chat(2, model="m" * 4_000_000)
        statuses: dict[int, int] = {}
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            gate = asyncio.Semaphore(4)

            async def one() -> None:
                async with gate:
                    outcome = await _one(session, fleet.envoy_url, body, 0.0)
                    statuses[outcome.status] = statuses.get(outcome.status, 0) + 1

            await asyncio.gather(*(one() for _ in range(count)))
        # What the burst leaves: the plugin hands free native memory back within a few seconds
        # (plugin.adapters.native_memory), so read it once that has had its chance.
        await asyncio.sleep(SETTLE_S)
        after = _rss_mb(pid)
    growth = after / before - 1
    bad = count - statuses.get(400, 0)
    return Row(
        f"{count} requests naming a 4 MB unknown model",
        count + len(warm),
        bad,
        measure=f"statuses {dict(sorted(statuses.items()))}; plugin RSS {before:.0f} -> "
        f"{after:.0f} MB ({growth:+.0%})",
        target="all 400; memory within 10%",
        met=bad == 0 and growth <= 0.10,
        notes=[
            "before the fixes: 503 with an empty body and 59 -> 400-770 MB; with the fixed mmap"
            " threshold alone +31-49%: glibc kept what gRPC's threads freed in their arenas,"
            " which the plugin's memory trimmer now hands back (malloc_trim when the resident"
            f" size stands 4 MB above its low mark); read {SETTLE_S:.0f} s after the last request"
        ],
    )


def _share(outcomes: list[Outcome], pod: str) -> float:
    return sum(o.pod == pod for o in outcomes) / max(1, len(outcomes))


async def metrics_404(tmp: Path) -> Row:
    """Two engines under load, then the a100's metrics path made wrong (its page answers 404)
    while it keeps serving: it must keep its share of the traffic, with nothing failing."""
    async with _fleet(tmp, presets=("a100", "l20")) as fleet:
        name = next(e.name for e in fleet.engines if e.preset == "a100")
        before = await _offer(fleet.envoy_url, 8.0, 10.0, 16)
        doc: Any = fleet.pods_document()
        for pod in doc["models"][MODEL]["pods"]:
            if pod["name"] == name:
                pod["metricsPath"] = "/no-metrics-here"
        fleet.pods_file.write_text(yaml.safe_dump(doc, sort_keys=False))

        async def flagged() -> bool:
            return bool(await _pod_state(fleet, name, "metrics_unusable"))

        seen = await _time_until(flagged, 10.0)
        after = await _offer(fleet.envoy_url, 8.0, 10.0, 16)
        out = await _unreachable(fleet, name)
    failed = sum(o.status != 200 for o in after)
    share_before, share_after = _share(before, name), _share(after, name)
    met = seen is not None and not out and failed == 0 and share_after >= 0.8 * share_before
    return Row(
        "engine whose metrics page answers 404 (8 req/s)",
        len(before) + len(after),
        failed,
        measure=f"its share {share_before:.0%} with a good page, {share_after:.0%} with a 404; "
        f"{failed} failed; {'flagged' if seen is not None else 'not flagged'}, "
        f"{'out of rotation' if out else 'in rotation'}",
        target="keeps its share (>= 0.8 x), 0 failed",
        met=met,
    )


async def _raw_post(port: int, lines: int) -> int:
    """A chat request with exactly `lines` header lines (Host, Content-Type, Content-Length,
    Connection and extras), over a plain socket; its status (0: closed without one)."""
    body = (
        b'{"model": "'
        + MODEL.encode()
        + b'", "max_tokens": 2, '
        + (b'"messages": [{"role": "user", "content": "hi"}]}')
    )
    head = [
        "POST /v1/chat/completions HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"x-extra-{i}: v" for i in range(lines - 4)),
    ]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10.0)
    except (ConnectionError, TimeoutError):
        return 0
    finally:
        writer.close()
    parts = status_line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


async def many_headers(tmp: Path) -> Row:
    async with _fleet(tmp, presets=("a100",)) as fleet:
        statuses = {n: await _raw_post(fleet.spec.listen_port, n) for n in range(90, 101)}
    bad = sum(status != 200 for status in statuses.values())
    counts: dict[int, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    return Row(
        "requests of 90 to 100 header lines",
        len(statuses),
        bad,
        measure=f"statuses {dict(sorted(counts.items()))}",
        target="all 200 (Envoy alone takes up to 100)",
        met=bad == 0,
    )


async def _post_status(url: str, headers: dict[str, str]) -> tuple[int, str]:
    """A short chat request with `headers`; its status and the strategy that routed it."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=_chat(2), headers=headers) as resp,
    ):
        await resp.read()
        return resp.status, resp.headers.get("routing-strategy", "")


async def locked_header(tmp: Path) -> Row:
    """An operator locks `routing-strategy` to two strategies: a client naming another gets a
    403 (action `reject`), or is routed by the default strategy (action `ignore`); an allowed
    value is routed by it in both."""
    seen: dict[str, tuple[tuple[int, str], tuple[int, str]]] = {}
    for action in ("reject", "ignore"):
        env = {
            "HETERO_GATEWAY_CLIENT_HEADERS": "routing-strategy=least-request|random",
            "HETERO_GATEWAY_DENIED_HEADER_ACTION": action,
        }
        (tmp / action).mkdir()
        async with _fleet(tmp / action, presets=("a100", "l20"), plugin_env=env) as fleet:
            allowed = await _post_status(fleet.envoy_url, {"routing-strategy": "least-request"})
            locked = await _post_status(fleet.envoy_url, {"routing-strategy": "round-robin"})
        seen[action] = (allowed, locked)
    met = (
        all(allowed == (200, "least-request") for allowed, _ in seen.values())
        and seen["reject"][1][0] == 403
        and seen["ignore"][1] == (200, "load-balance")
    )
    measure = "; ".join(
        f"{action}: locked value {locked[0]}"
        + (f" routed by {locked[1]}" if locked[0] == 200 else "")
        + f", allowed value {allowed[0]} routed by {allowed[1]}"
        for action, (allowed, locked) in seen.items()
    )
    return Row(
        "a locked routing-strategy header",
        4,
        0,
        measure=measure,
        target="403 (reject) or the default strategy (ignore); allowed values routed by them",
        met=met,
    )


async def _cancelled(session: aiohttp.ClientSession, url: str, chunks: int) -> None:
    """A long stream read for `chunks` chunks, then dropped by the client."""
    async with session.post(f"{url}/v1/chat/completions", json=_chat(400)) as resp:
        read = 0
        async for _ in resp.content.iter_any():
            read += 1
            if read >= chunks:
                break
        resp.close()  # the connection goes, mid-stream


async def cancelled_streams(tmp: Path, count: int = 200) -> Row:
    """`count` long streams (400 tokens, 8 a chunk), each dropped by its client after a few
    chunks: the plugin must count none in flight within 0.25 s of the last drop, and credit the
    tokens the engines generated for them within 10%."""
    async with _fleet(tmp, presets=("a100", "l20"), time_scale=1.0) as fleet:
        # One whole stream per engine first: the plugin learns how many tokens a chunk carries.
        warm = await _offer(fleet.envoy_url, 4.0, 1.0, 64)
        await asyncio.sleep(1.0)
        urls = [e.url for e in fleet.engines]
        engines_before = sum([await _metric_sum(u, "vllm:generation_tokens_total") for u in urls])
        counted_before = await _metric_sum(fleet.plugin_url, "hetero_gateway_output_tokens_total")
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            gate = asyncio.Semaphore(20)

            async def one(i: int) -> None:
                async with gate:
                    await _cancelled(session, fleet.envoy_url, 3 + i % 5)

            await asyncio.gather(*(one(i) for i in range(count)))
            dropped = time.monotonic()

            async def idle() -> bool:
                return await _metric_sum(fleet.plugin_url, "hetero_gateway_inflight_requests") == 0

            freed = await _time_until(idle, 10.0)
            freed_s = None if freed is None else time.monotonic() - dropped
        await asyncio.sleep(1.0)  # the engines have seen every disconnect
        engines = sum([await _metric_sum(u, "vllm:generation_tokens_total") for u in urls])
        counted = await _metric_sum(fleet.plugin_url, "hetero_gateway_output_tokens_total")
    generated, credited = engines - engines_before, counted - counted_before
    ratio = credited / generated if generated else float("nan")
    met = freed_s is not None and freed_s <= 0.25 and abs(ratio - 1) <= 0.10
    freed_text = "not within 10 s" if freed_s is None else f"{freed_s:.2f} s"
    return Row(
        f"{count} streams cancelled mid-way",
        count + len(warm),
        0,
        cut=count,
        measure=f"in flight at 0 {freed_text} after the last drop; tokens credited "
        f"{credited:.0f} of {generated:.0f} the engines generated ({ratio:.2f})",
        target="in flight at 0 within 0.25 s; tokens within 10%",
        met=met,
    )


SCRAPE_WINDOW_S = 5.0


async def _replica_fleet(
    tmp: Path, redis: RedisServer, count: int, **spec: Any
) -> tuple[LocalFleet, list[ExtraGateway]]:
    """A fleet whose plugin is `count` replicas sharing `redis`, the first being the fleet's
    own (its Envoy reaches that one alone); `start_extra_envoy` puts one Envoy over all."""
    env = {"REDIS_HOST": redis.host, "REDIS_PORT": str(redis.port)}
    fleet = _fleet(tmp, plugin_env={**env, "POD_NAME": "replica-0"}, **spec)
    await fleet.start()
    try:
        replicas = [
            await fleet.start_plugin_replica(f"replica-{i}", {"POD_NAME": f"replica-{i}"})
            for i in range(1, count)
        ]
    except BaseException:
        await fleet.stop()
        raise
    return fleet, replicas


SCRAPES = "mock_engine_metrics_requests_total"


async def _scrapes(session: aiohttp.ClientSession, engines: list[str]) -> list[float]:
    """Each engine's count of the metrics pages it served (this read included)."""
    counts = []
    for url in engines:
        async with session.get(f"{url}/metrics", params=[("name[]", SCRAPES)]) as resp:
            page = await resp.text()
        samples = (s for f in text_string_to_metric_families(page) for s in f.samples)
        counts.append(next(s.value for s in samples if s.name == SCRAPES))
    return counts


async def _scrape_times(
    session: aiohttp.ClientSession, engines: list[str], duration_s: float, poll_s: float = 0.05
) -> list[list[float]]:
    """When each engine was scraped by a gateway, to within `poll_s`: each poll counts itself
    once, so a count that grew by more than one between polls saw a gateway's scrape."""
    times: list[list[float]] = [[] for _ in engines]
    last = await _scrapes(session, engines)
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        await asyncio.sleep(poll_s)
        now, counts = time.monotonic(), await _scrapes(session, engines)
        for i, (a, b) in enumerate(zip(last, counts, strict=True)):
            if b - a > 1:
                times[i].append(now)
        last = counts
    return times


def _longest_gap(times: list[float], since: float) -> float:
    """The longest time between a gateway's scrapes of one engine from `since` on."""
    marks = [since, *(t for t in times if t > since)]
    return max(b - a for a, b in itertools.pairwise(marks)) if len(marks) > 1 else math.inf


async def plugin_replicas(tmp: Path, count: int = 3) -> Row:
    """`count` plugin replicas behind one Envoy cluster (Envoy spreads each request's routing
    and counting streams over them on its own), long generations streaming, one replica killed
    -9: how many are cut, and how long until every surviving replica counts none in flight
    (its own and what the others publish); short requests keep arriving meanwhile."""
    async with RedisServer() as redis:
        fleet, replicas = await _replica_fleet(
            tmp, redis, count, presets=("a100", "l20"), time_scale=3.0, tokens_per_chunk=1
        )
        try:
            url = await fleet.start_replicas_envoy(replicas)
            victim, survivors = (
                replicas[0],
                [fleet.plugin_url, *(r.plugin_url for r in replicas[1:])],
            )
            engines = [e.url for e in fleet.engines]
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                # Scrapes per engine per period with every replica up (period: 1 s).
                before, t_before = await _scrapes(session, engines), time.monotonic()
                await asyncio.sleep(SCRAPE_WINDOW_S)
                after, t_after = await _scrapes(session, engines), time.monotonic()
                per_period = [
                    (b - a - 1) / (t_after - t_before) for a, b in zip(before, after, strict=True)
                ]
                t0 = time.monotonic()
                streams = [
                    asyncio.create_task(_one(session, url, _chat(200), t0)) for _ in range(12)
                ]
                load = asyncio.create_task(_offer(url, 8.0, 4.0, 16))
                watch = asyncio.create_task(_scrape_times(session, engines, 6.0))
                await asyncio.sleep(1.5)
                assert victim.plugin is not None
                victim.plugin.kill()
                killed_at = time.monotonic()
                outcomes = await asyncio.gather(*streams)
                short = await load
                ended = time.monotonic()
                scraped_at = await watch

            async def idle() -> bool:
                for plugin in survivors:
                    local = await _metric_sum(plugin, "hetero_gateway_inflight_requests")
                    remote = await _metric_sum(plugin, "hetero_gateway_remote_inflight_requests")
                    if local or remote:
                        return False
                return True

            freed = await _time_until(idle, 10.0)
            freed_s = None if freed is None else time.monotonic() - ended
            taken_over = 0
            async with aiohttp.ClientSession() as session:
                for plugin in survivors:
                    async with session.get(f"{plugin}/debug/pods") as resp:
                        taken_over += (await resp.json())["shared_state"]["counts_taken_over"]
        finally:
            await fleet.stop()
    cut = sum(not o.complete for o in outcomes)
    failed_short = sum(o.status != 200 for o in short)
    # From the last scrape before the kill: the longest an engine went unscraped across it.
    gap = max(
        _longest_gap(times, max((t for t in times if t <= killed_at), default=killed_at))
        for times in scraped_at
    )
    met = cut == 0 and freed_s is not None and max(per_period) <= 1.2 and gap <= 2.0
    freed_text = "not within 10 s" if freed_s is None else f"{freed_s:.2f} s after the last"
    return Row(
        f"{count} plugin replicas behind one cluster, one killed -9",
        len(outcomes) + len(short),
        cut + failed_short,
        cut=cut,
        measure=f"{cut} of {len(outcomes)} generations cut; in flight at 0 on every survivor "
        f"{freed_text}; {failed_short} of {len(short)} short requests failed; each engine "
        f"scraped {min(per_period):.2f}-{max(per_period):.2f} times a period with all "
        f"{count} up; the longest an engine went unscraped across the kill {gap:.2f} s",
        target="0 cut, counts at 0, each engine scraped once a period, taken over within two",
        met=met,
        notes=[
            "scrapes counted on the engines (`mock_engine_metrics_requests_total`, the reads of"
            " this benchmark left out); the period is 1 s; unscraped time measured by polling"
            " every engine's count every 50 ms from the kill's 1.5 s before to 4.5 s after",
            f"{taken_over} counts taken over by a survivor whose counting stream got a request"
            " routed by another replica (Redis carries the claim back)",
            "short requests whose routing stream was on the killed replica when it died, or"
            " reached it before Envoy ejected it, get a 503: Envoy fails the ext_proc stream"
            " closed; the client may retry",
        ],
    )


async def _cpu_per_request(
    urls: list[str], pids: list[int], idle_per_s: float, count: int, concurrency: int
) -> tuple[float, int]:
    """Plugin CPU seconds per request over `count` short requests (`concurrency` at a time,
    round robin over `urls`), summed over `pids`, less what they spend idle (`idle_per_s`);
    and the failures."""
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(url: str) -> Outcome:
            async with gate:
                return await _one(session, url, _chat(8), 0.0)

        before, t0 = _cpu(pids), time.monotonic()
        outcomes = await asyncio.gather(*(one(urls[i % len(urls)]) for i in range(count)))
        spent, took = _cpu(pids) - before, time.monotonic() - t0
    return (spent - idle_per_s * took) / count, sum(o.status != 200 for o in outcomes)


def _cpu(pids: list[int]) -> float:
    return sum(process_cpu_seconds(pid) or 0.0 for pid in pids)


CPU_CONCURRENCY = int(os.environ.get("FAULT_SUITE_CPU_CONCURRENCY", "8"))


async def replicas_cpu(tmp: Path, count: int = 3, requests: int = 300, rounds: int = 3) -> Row:
    """Plugin CPU per request, the same short requests three ways, alternated `rounds` times:
    one replica alone (an Envoy reaching only the first); the replicas each behind an Envoy of
    its own, requests spread over the Envoys (both streams of a request on one replica); and
    the replicas behind one Envoy cluster (streams spread by Envoy, most requests handed over).
    The replicas' idle CPU (scrapes, Redis syncs) is measured first and left out."""
    async with RedisServer() as redis:
        fleet, replicas = await _replica_fleet(tmp, redis, count, presets=("a100", "l20"))
        try:
            shared = [await fleet.start_replicas_envoy(replicas)]
            own = [fleet.envoy_url]
            for i, replica in enumerate(replicas):
                port = free_port()
                opts = replace(
                    fleet.envoy_options(port, free_port()), extproc_port=replica.grpc_port
                )
                await fleet.start_extra_envoy(f"own-envoy-{i}", opts)
                own.append(f"http://127.0.0.1:{port}")
            procs = [fleet.plugin, *(r.plugin for r in replicas)]
            pids = [p.pid for p in procs if p is not None]
            for url in (*own, *shared):  # warm every path
                await _offer(url, 20.0, 0.5, 8)
            await asyncio.sleep(1.0)
            before = _cpu(pids)
            await asyncio.sleep(5.0)
            idle_per_s = (_cpu(pids) - before) / 5.0
            # (Envoys, requests at a time): "busy" keeps each replica as busy as the one alone.
            ways = {
                "one": (own[:1], CPU_CONCURRENCY),
                "split": (own, CPU_CONCURRENCY),
                "shared": (shared, CPU_CONCURRENCY),
                "busy": (shared, count * CPU_CONCURRENCY),
            }
            spent: dict[str, float] = dict.fromkeys(ways, 0.0)
            failed = 0
            for _ in range(rounds):
                for way, (urls, concurrency) in ways.items():
                    per_request, bad = await _cpu_per_request(
                        urls, pids, idle_per_s, requests, concurrency
                    )
                    spent[way] += per_request / rounds
                    failed += bad
        finally:
            await fleet.stop()
    handover = spent["shared"] / spent["split"]
    thinned = spent["shared"] / spent["one"]
    scaled = spent["busy"] / spent["one"]
    ms = {way: f"{1000 * v:.2f} ms" for way, v in spent.items()}
    return Row(
        f"plugin CPU per request, {count} replicas",
        len(ways) * rounds * requests,
        failed,
        measure=f"one replica alone {ms['one']}; {count} behind one cluster at {count}x the"
        f" load (each as busy) {ms['busy']} ({scaled:.2f}x), at the same load {ms['shared']}"
        f" ({thinned:.2f}x); each behind its own Envoy at the same load {ms['split']}"
        f" (handover {handover:.2f}x)",
        target="within 10% of one replica's with each as busy; handover within 10%",
        met=scaled <= 1.10 and handover <= 1.10 and failed == 0,
        notes=[
            f"{CPU_CONCURRENCY} requests at a time per replica ({count * CPU_CONCURRENCY} for"
            f" {count} equally busy), 8 output tokens each; idle CPU of the {count} replicas"
            f" together (scrapes, Redis syncs): {100 * idle_per_s:.1f}% of a core, left out of"
            " every figure",
            "at the same load each of the replicas is a third as busy and batches fewer"
            " messages per event-loop wake-up than one alone: that costs, the handover itself"
            " does not (same replicas, each request's streams on one replica)",
        ],
    )


# --- report ------------------------------------------------------------------------------------


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(rows: list[Row], seconds: float) -> str:
    lines = [
        "# Reliability",
        "",
        "What the gateway does when its parts fail, measured by `python benchmarks/fault_suite.py`"
        f" (real Envoy, plugin and mock engines on loopback; {seconds:.0f} s on this machine, 2"
        " cores). Each scenario runs on a fresh fleet in the default wiring (ORIGINAL_DST,"
        " fail-closed, counting filter). *Eject* is how long after the fault `/debug/pods` showed"
        " the engine out of rotation, *restore* how long after it recovered it was back. Nothing"
        " here retries: ORIGINAL_DST retries would go to the same address (the override-host"
        " wiring retries a refused connection once on a fallback replica the plugin lists).",
        "",
        "| scenario | sent | failed | cut | eject s | restore s | result | target | met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.scenario} | {r.sent} | {r.failed} | {r.cut} | {_s(r.eject_s)} "
            f"| {_s(r.restore_s)} | {r.measure} | {r.target} | {'yes' if r.met else 'no'} |"
        )
    notes = [f"- {r.scenario}: {n}" for r in rows for n in r.notes]
    lines += [
        "",
        "How each is handled (docs/routing.md, docs/protocol.md; docs/architecture.md: Failures):",
        "",
        "- The routing filter only picks and the plugin ends its stream at the pick; the counting"
        " filter's stream holds the in-flight slot. A plugin crash then leaves Envoy nothing to"
        " fail running responses with.",
        "- An engine that does not answer its metrics scrape (1 s period, 500 ms timeout) leaves"
        " rotation at once and is back with the next scrape it answers.",
        "- Envoy waits 1 s for each plugin reply, then fails closed with an OpenAI-shaped 503/504;"
        " a request the plugin holds in its SLO queue asks Envoy for longer.",
        "- Client text in error messages is cut to 256 characters, so a huge model name gets a"
        " small 400.",
        *notes,
    ]
    return "\n".join(lines) + "\n"


SETTLE_S = 10.0  # after the 4 MB burst, before the plugin's memory is read

SCENARIOS = (
    "plugin-kill",
    "hung-engine",
    "dead-engine",
    "hung-plugin",
    "huge-model",
    "metrics-404",
    "many-headers",
    "locked-header",
    "cancelled-streams",
    "plugin-replicas",
    "replicas-cpu",
)


async def _scenario(name: str, path: Path, huge_count: int) -> Row:
    if name == "huge-model":
        return await huge_model(path, huge_count)
    runs: dict[str, Callable[[Path], Awaitable[Row]]] = {
        "plugin-kill": plugin_kill,
        "hung-engine": hung_engine,
        "dead-engine": dead_engine,
        "hung-plugin": hung_plugin,
        "metrics-404": metrics_404,
        "many-headers": many_headers,
        "locked-header": locked_header,
        "cancelled-streams": cancelled_streams,
        "plugin-replicas": plugin_replicas,
        "replicas-cpu": replicas_cpu,
    }
    return await runs[name](path)


def _repeated(rows: list[Row]) -> Row:
    """Runs of one scenario in one row: met only when every run met its target."""
    first = rows[0]
    return Row(
        f"{first.scenario}, {len(rows)} runs",
        sum(r.sent for r in rows),
        sum(r.failed for r in rows),
        cut=sum(r.cut for r in rows),
        eject_s=max((r.eject_s for r in rows if r.eject_s is not None), default=None),
        restore_s=max((r.restore_s for r in rows if r.restore_s is not None), default=None),
        measure="; ".join(r.measure for r in rows),
        target=f"{first.target}, every run",
        met=all(r.met for r in rows),
        notes=first.notes,
    )


async def run(names: list[str], huge_count: int, repeat: int = 1) -> list[Row]:
    rows = []
    for name in names:
        runs = []
        for _ in range(repeat if name == "hung-engine" else 1):
            with tempfile.TemporaryDirectory(prefix=f"fault-{name}-") as tmp:
                row = await _scenario(name, Path(tmp), huge_count)
            print(f"{row.scenario}: {row.measure} (target: {row.target}; met: {row.met})")
            for note in row.notes:
                print(f"  {note}")
            runs.append(row)
        rows.append(runs[0] if len(runs) == 1 else _repeated(runs))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=SCENARIOS, action="append", help="run just these")
    parser.add_argument("--huge-count", type=int, default=1000)
    parser.add_argument(
        "--repeat", type=int, default=10, help="runs of the hung-engine scenario (default 10)"
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    start = time.monotonic()
    rows = asyncio.run(run(args.only or list(SCENARIOS), args.huge_count, args.repeat))
    text = render(rows, time.monotonic() - start)
    if not args.no_write and not args.only:
        DOC.write_text(text, encoding="utf-8")
        print(f"wrote {DOC.name}", file=sys.stderr)
    return 0 if all(r.met for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
