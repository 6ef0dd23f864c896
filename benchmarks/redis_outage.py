"""What a Redis outage does to a running load: two gateways sharing state, Redis killed for 10 s.

Starts a `redis-server`, three mock engines, two plugin processes sharing state through that Redis
(each behind its own Envoy), and offers an open-loop streaming load through both Envoys. After
the warm-up it kills Redis (SIGKILL), starts it again (empty) 10 s later, and keeps the load on.
Prints requests, errors and latency before, during and after the outage, how long the gateways
took to notice and to share again, and writes the same to docs/redis-outage.md.

    python benchmarks/redis_outage.py            # about a minute and a half on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from plugin_tools.demo.fleet import ExtraGateway, FleetSpec, LocalFleet, free_port
from plugin_tools.demo.loadgen import Workload, run_open_loop
from plugin_tools.demo.redis_server import RedisServer
from plugin_tools.demo.report import RequestResult
from plugin_tools.demo.up import DEMO_OUTPUT_TOKENS, DEMO_PROMPT_WORDS
from plugin_tools.stats import percentile

MODEL = "llama-3-8b"
OUT = Path(__file__).resolve().parent.parent / "docs" / "redis-outage.md"


@dataclass
class Timeline:
    """Each gateway's `hetero_gateway_shared_state_up`, sampled every 100 ms."""

    samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def first(self, name: str, value: float, after: float) -> float | None:
        for t, v in self.samples.get(name, []):
            if t >= after and v == value:
                return t
        return None


async def _up(session: aiohttp.ClientSession, url: str) -> float | None:
    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=1)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "hetero_gateway_shared_state_up":
                return float(s.value)
    return None


async def _sample(urls: dict[str, str], t0: float, stop: asyncio.Event, out: Timeline) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            for name, url in urls.items():
                value = await _up(session, url)
                if value is not None:
                    out.samples.setdefault(name, []).append((time.monotonic() - t0, value))
            await asyncio.sleep(0.1)


def _phase(results: list[RequestResult], start: float, end: float) -> dict[str, Any]:
    rs = [r for r in results if start <= r.started_at < end]
    ok = [r for r in rs if r.ok]
    lat = [r.latency_s for r in ok if r.latency_s is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    return {
        "requests": len(rs),
        "errors": len(rs) - len(ok),
        "rate": len(rs) / (end - start),
        "p50": percentile(lat, 50),  # nearest-rank, as in every other report here
        "p99": percentile(lat, 99),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50),
        "tpot_p99": percentile(tpot, 99),
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


async def measure(warmup_s: float, outage_s: float, after_s: float, load: float) -> str:
    async with RedisServer() as redis:
        env = {"REDIS_HOST": redis.host, "REDIS_PORT": str(redis.port)}
        spec = FleetSpec(
            model=MODEL, listen_port=free_port(), plugin_env={**env, "POD_NAME": "gw-a"}
        )
        async with LocalFleet(spec) as fleet:
            second: ExtraGateway = await fleet.start_extra_gateway("gw-b", {"POD_NAME": "gw-b"})
            urls = {"gw-a": fleet.plugin_url, "gw-b": second.plugin_url}
            saturated = sum(e.saturated_tokens_per_s for e in fleet.engines)
            out = DEMO_OUTPUT_TOKENS  # the demo's workload shape (short prompts: little prefill)
            duration = warmup_s + outage_s + after_s
            rate = load * saturated / out.mean() / 2  # per gateway

            def workload(seed: int) -> Workload:
                return Workload(
                    rate_per_s=rate,
                    duration_s=duration,
                    prompt_words=DEMO_PROMPT_WORDS,
                    output_tokens=out,
                    seed=seed,
                )

            timeline = Timeline()
            stop = asyncio.Event()
            t0 = time.monotonic()
            sampler = asyncio.ensure_future(_sample(urls, t0, stop, timeline))
            loads = [
                asyncio.ensure_future(run_open_loop(u, MODEL, workload(s), strategy="load-balance"))
                for u, s in ((fleet.envoy_url, 1), (second.envoy_url, 2))
            ]
            await asyncio.sleep(warmup_s - (time.monotonic() - t0))
            killed_at = time.monotonic() - t0
            await redis.kill()
            await asyncio.sleep(outage_s - (time.monotonic() - t0 - killed_at))
            restarted_at = time.monotonic() - t0
            await redis.start()
            results = [r for rs in await asyncio.gather(*loads) for r in rs]
            stop.set()
            await sampler

    phases = {
        "before": _phase(results, 0.0, killed_at),
        "during (Redis down)": _phase(results, killed_at, restarted_at),
        "after": _phase(results, restarted_at, duration),
    }
    lines = [
        "# A 10-second Redis outage under load",
        "",
        "Generated by `python benchmarks/redis_outage.py` (2 cores, loopback): two plugin",
        "processes sharing state through one `redis-server`, each behind its own Envoy, three mock",
        f"engines (a100, l20, v100, time scale {spec.time_scale}); open-loop streaming load at",
        f"{load:.0%} of the fleet's saturated output through both Envoys ({2 * rate:.1f} req/s in",
        f"all, load-balance). Redis is killed (SIGKILL) at {killed_at:.1f} s and started again,",
        f"empty, at {restarted_at:.1f} s. Latency is end to end per request, from its scheduled",
        "start; phases group requests by start time.",
        "",
        "| phase | requests | errors | req/s | latency p50 / p99 ms | TTFT p50 / p99 ms |"
        " TPOT p50 / p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, p in phases.items():
        lines.append(
            f"| {name} | {p['requests']} | {p['errors']} | {p['rate']:.1f} |"
            f" {_ms(p['p50'])} / {_ms(p['p99'])} | {_ms(p['ttft_p50'])} / {_ms(p['ttft_p99'])} |"
            f" {_ms(p['tpot_p50'])} / {_ms(p['tpot_p99'])} |"
        )
    lines += ["", "| gateway | local-only after the kill | shared again after the restart |"]
    lines.append("| --- | --- | --- |")
    for name in urls:
        down = timeline.first(name, 0.0, killed_at)
        back = timeline.first(name, 1.0, restarted_at)
        lines.append(
            f"| {name} | {'-' if down is None else f'{down - killed_at:.1f} s'} |"
            f" {'-' if back is None else f'{back - restarted_at:.1f} s'} |"
        )
    lines += [
        "",
        "The state gauge is sampled every 100 ms. While Redis is down each gateway routes on its",
        "own in-flight counts and credits only the tokens it counted itself; the clients see no",
        "error. Its previous view of the other gateway's in-flight requests is kept for one expiry",
        "(2 s) and then dropped.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds before the kill")
    ap.add_argument("--outage", type=float, default=10.0, help="seconds Redis stays down")
    ap.add_argument("--after", type=float, default=30.0, help="seconds of load after the restart")
    ap.add_argument("--load", type=float, default=0.6, help="fraction of saturated output")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    text = asyncio.run(measure(args.warmup, args.outage, args.after, args.load))
    print(text)
    if not args.no_write:
        OUT.write_text(text, encoding="utf-8")
        print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
