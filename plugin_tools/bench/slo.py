"""SLO routing through a real Envoy: profile a mixed mock fleet, then offer it a mix of short chat
prompts and long prompts under each strategy and score the SLO each one keeps.

The profiles come from the product's own workflow, run against the fleet it then routes: `profile
sweep`'s steady-state search through the gateway, every GPU type at once (AIBrix's
`external-filter` header narrows each sweep to one deployment), for the SLO, then `profile build`
into `HETERO_GATEWAY_PROFILE_DIR`.

The SLO is p99 TTFT: the one a long prompt on a slow card breaks (its prefill alone can exceed
it), and the one waiting at the gateway eats into, so a held request has a real deadline. Chunk
gaps (AIBrix's TPOT) are no use as the profile's SLO for this mix: an engine that prefills a 4k
prompt stalls every decode on it for that long, so p99 chunk gaps of long-prompt cells fail on
every GPU at every rate. TPOT per request is reported beside it.

Scoring, per strategy, over every request the mix offered:
- served: a 200 with a complete stream; rejected: the gateway's 503 saying the SLO cannot be met;
- attainment: the share of offered requests served within the SLO; goodput: requests per second
  served within it;
- for rejected requests, how long after its deadline each answer came: the deadline is arrival +
  min(target - the profile's TTFT on the best GPU type that can serve it, the gateway's max wait).
"""

from __future__ import annotations

import asyncio
import io
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from plugin.core.profile import GpuProfile, parse_profile
from plugin.core.request import DEFAULT_TOKENIZER
from plugin.core.types import SloTarget
from plugin_tools.demo.fleet import FleetSpec, LocalFleet
from plugin_tools.demo.loadgen import LengthDist, Workload, prompt_text, run_open_loop
from plugin_tools.demo.report import RequestResult
from plugin_tools.profile.build import parse_row
from plugin_tools.profile.steady import build_steady_profile
from plugin_tools.profile.store import write_profile
from plugin_tools.profile.sweep import SteadySweepPlan, run_steady_sweep
from plugin_tools.stats import percentile

__all__ = [
    "MixResult",
    "Sent",
    "SloBench",
    "ensure_profiles",
    "light_mix",
    "profile_fleet",
    "run_mix",
    "saved_profiles",
    "score",
    "slo_fleet",
]

DEPLOYMENT_LABEL = "app.kubernetes.io/name"  # AIBRIX_POD_DEPLOYMENT_LABEL's default


@dataclass(frozen=True, slots=True)
class RequestClass:
    """One kind of request in the mix: fixed prompt words and output tokens, Poisson at `rate`."""

    name: str
    prompt_words: int
    output_tokens: int
    rate_per_s: float


@dataclass(frozen=True, slots=True)
class SloBench:
    """The experiment's knobs; the defaults are the documented run (`benchmarks/slo_routing.py`)."""

    model: str = "llama-3-8b"
    presets: tuple[str, ...] = ("a100", "v100")
    time_scale: float = 1.0
    ttft_slo_s: float = 1.0  # the SLO the profiles are built for, at `percentile`
    percentile: int = 99
    max_wait_ms: int = 2000  # HETERO_GATEWAY_SLO_MAX_WAIT_MS
    # The steady sweep's grid: the mix's sizes (prompt tokens as the engine counts 64 and 4,200
    # words are about 64 and 4,096 ticks) and 1,024 between them, from which the profile says
    # what a 4k prompt costs inside the mix (`GpuProfile.mix_tputs`); the rates it may offer.
    inputs: tuple[int, ...] = (64, 1024, 4096)
    outputs: tuple[int, ...] = (32,)
    rate_floor: float = 0.1
    rate_limit: float = 128.0
    mix: tuple[RequestClass, ...] = (
        RequestClass("short", 64, 32, 6.0),
        RequestClass("long", 4200, 32, 1.0),  # > 4k tokens as the engine counts them
    )
    # The same classes at half the rates: a load the fleet serves with room to spare, where the
    # SLO strategies should reject nothing.
    light: float = 0.5
    duration_s: float = 30.0
    seed: int = 0
    strategies: tuple[str, ...] = (
        "slo",
        "slo-pack-load",
        "slo-least-load",
        "least-request",
        "load-balance",
    )
    listen_port: int = 0  # 0: a free one

    def fleet_spec(self, profile_dir: Path, listen_port: int) -> FleetSpec:
        return FleetSpec(
            model=self.model,
            presets=self.presets,
            time_scale=self.time_scale,
            tokens_per_chunk=1,  # one token per SSE event: TPOT gaps are per token
            listen_port=listen_port,
            count_mode="observe",
            plugin_env={
                "HETERO_GATEWAY_PROFILE_DIR": str(profile_dir),
                "HETERO_GATEWAY_SLO_MAX_WAIT_MS": str(self.max_wait_ms),
            },
        )


def slo_fleet(bench: SloBench, profile_dir: Path, listen_port: int) -> LocalFleet:
    (profile_dir / bench.model).mkdir(parents=True, exist_ok=True)
    return LocalFleet(bench.fleet_spec(profile_dir, listen_port))


async def _profile_one(
    fleet: LocalFleet, bench: SloBench, preset: str, profile_dir: Path
) -> tuple[GpuProfile, int, int]:
    out = io.BytesIO()
    plan = SteadySweepPlan(
        (fleet.envoy_url,),
        bench.model,
        bench.inputs,
        bench.outputs,
        SloTarget(ttft_s=bench.ttft_slo_s),
        percentile=bench.percentile,
        rate_floor=bench.rate_floor,
        rate_limit=bench.rate_limit,
        headers={"external-filter": f"{DEPLOYMENT_LABEL}={preset}"},
        timeout_s=120.0,
    )
    tally = await run_steady_sweep(plan, out, progress=False)
    rows = [parse_row(orjson.loads(line), preset) for line in out.getvalue().splitlines()]
    profile = build_steady_profile(rows, preset, created=time.time()).profile
    write_profile(profile, str(profile_dir / bench.model / f"{preset}.json"))
    return profile, tally.requests, tally.failed


async def profile_fleet(
    fleet: LocalFleet, bench: SloBench, profile_dir: Path, log: Callable[[str], None] = print
) -> dict[str, GpuProfile]:
    """Sweep every GPU type through the gateway (each on its own pods, at the same time), build
    its profile, restart the plugin so it loads them; returns {deployment: profile}."""
    presets = list(dict.fromkeys(bench.presets))
    done = await asyncio.gather(*(_profile_one(fleet, bench, p, profile_dir) for p in presets))
    for preset, (_, sent, failed) in zip(presets, done, strict=True):
        log(f"swept {preset}: {sent} requests, {failed} failed")
    await fleet.stop_process(fleet.plugin)
    await fleet.start_plugin()  # loads the profiles at start-up
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{fleet.plugin_url}/debug/pods") as resp,
    ):
        pods = (await resp.json())["pods"]
    missing = [key for key, p in pods.items() if not p.get("profile")]
    if missing:
        raise RuntimeError(f"the plugin did not load a profile for {missing}")
    return {p: profile for p, (profile, _, _) in zip(presets, done, strict=True)}


@dataclass(frozen=True, slots=True)
class Sent:
    """One request of the mix and what became of it."""

    kind: str
    result: RequestResult


@dataclass(slots=True)
class MixResult:
    strategy: str
    requests: list[Sent] = field(default_factory=list)


async def run_mix(
    fleet: LocalFleet, bench: SloBench, strategy: str, url: str | None = None
) -> MixResult:
    """Offer the mix (each class its own Poisson stream) through Envoy with `strategy`: the
    fleet's own, or the one at `url`."""

    async def one(k: int, cls: RequestClass) -> list[Sent]:
        workload = Workload(
            rate_per_s=cls.rate_per_s,
            duration_s=bench.duration_s,
            prompt_words=LengthDist(cls.prompt_words, 0.0, cls.prompt_words, cls.prompt_words),
            output_tokens=LengthDist(cls.output_tokens, 0.0, cls.output_tokens, cls.output_tokens),
            seed=bench.seed * 100 + k,
        )
        results = await run_open_loop(
            url or fleet.envoy_url,
            bench.model,
            workload,
            strategy=strategy,
            request_timeout_s=120.0,
        )
        return [Sent(cls.name, r) for r in results]

    parts = await asyncio.gather(*(one(k, c) for k, c in enumerate(bench.mix)))
    return MixResult(strategy, [s for part in parts for s in part])


def _rejected(r: RequestResult) -> bool:
    return r.status == 503 and r.error is not None and "SLO" in r.error


def deadline_s(bench: SloBench, profiles: Mapping[str, GpuProfile], cls: RequestClass) -> float:
    """How long after arrival the gateway may still route a request of `cls` (see the module
    docstring); the prompt size is the gateway's estimate (`DEFAULT_TOKENIZER`)."""
    prompt = DEFAULT_TOKENIZER.count(prompt_text(cls.prompt_words))
    expected = []
    for p in profiles.values():
        i, j = p.cell(prompt, cls.output_tokens)  # clamped to the grid, as the gateway does
        if p.tputs[i][j] > 0 and p.ttft is not None:
            expected.append(p.ttft[i][j])
    slack = bench.ttft_slo_s - min(expected) if expected else 0.0
    return max(0.0, min(slack, bench.max_wait_ms / 1000.0))


def score(result: MixResult, bench: SloBench, profiles: Mapping[str, GpuProfile]) -> dict[str, Any]:
    """Attainment, goodput, p99 TTFT and TPOT, rejections and their lateness past the deadline."""
    sent = result.requests
    served = [s for s in sent if s.result.ok]
    met = [s for s in served if (t := s.result.ttft_s) is not None and t <= bench.ttft_slo_s]
    late = [s for s in served if s not in met]
    rejected = [s for s in sent if _rejected(s.result)]
    deadlines = {c.name: deadline_s(bench, profiles, c) for c in bench.mix}
    past = [(s.result.latency_s or 0.0) - deadlines[s.kind] for s in rejected]

    def p99(values: list[float | None]) -> float | None:
        return percentile([v for v in values if v is not None], 99)

    def by_kind(kind: str) -> dict[str, Any]:
        mine = [s for s in sent if s.kind == kind]
        ok = [s for s in mine if s.result.ok]
        shares: dict[str, int] = {}
        for s in ok:
            gpu = (s.result.replica or "?").rsplit("-", 1)[0]
            shares[gpu] = shares.get(gpu, 0) + 1
        return {
            "offered": len(mine),
            "served": len(ok),
            "met": sum(s in met for s in mine),
            "rejected": sum(_rejected(s.result) for s in mine),
            "deadline_s": deadlines[kind],
            "p99_ttft_s": p99([s.result.ttft_s for s in ok]),
            "p99_tpot_s": p99([s.result.tpot_s for s in ok]),
            "served_by_gpu": dict(sorted(shares.items())),
        }

    return {
        "strategy": result.strategy,
        "rejected_behind_s": [_behind(s, sent) for s in rejected],
        "offered": len(sent),
        "served": len(served),
        "met": len(met),
        "rejected": len(rejected),
        "failed": len(sent) - len(served) - len(rejected),
        "attainment": len(met) / len(sent) if sent else math.nan,
        "goodput_per_s": len(met) / bench.duration_s,
        "p99_ttft_s": p99([s.result.ttft_s for s in served]),
        "p99_tpot_s": p99([s.result.tpot_s for s in served]),
        "served_late": len(late),
        "max_reject_late_s": max(past) if past else None,
        "by_kind": {c.name: by_kind(c.name) for c in bench.mix},
    }


def _behind(rejected: Sent, sent: list[Sent]) -> float | None:
    """For a rejected request: how long after its arrival the first token came of the latest
    served request of its class that arrived before it and was still waiting for that token
    (a prompt still in prefill on the GPU type that serves the class); None if none was."""
    arrived = rejected.result.started_at
    ahead = [
        s.result.started_at + s.result.ttft_s - arrived
        for s in sent
        if s.kind == rejected.kind
        and s.result.ok
        and s.result.ttft_s is not None
        and s.result.started_at < arrived < s.result.started_at + s.result.ttft_s
    ]
    return max(ahead) if ahead else None


def saved_profiles(bench: SloBench, profile_dir: Path) -> dict[str, GpuProfile] | None:
    """The profiles an earlier run left in `profile_dir` (one per preset), or None if any is
    missing."""
    files = {p: profile_dir / bench.model / f"{p}.json" for p in dict.fromkeys(bench.presets)}
    if not all(f.is_file() for f in files.values()):
        return None
    return {p: parse_profile(orjson.loads(f.read_bytes())) for p, f in files.items()}


async def ensure_profiles(
    bench: SloBench,
    profile_dir: Path,
    log: Callable[[str], None] = print,
    fleet: LocalFleet | None = None,
) -> tuple[dict[str, GpuProfile], bool]:
    """The profiles an earlier run left in `profile_dir`, else swept there now on `fleet` (or
    a fleet of its own); and whether they were swept now."""
    from plugin_tools.demo.fleet import free_port

    saved = saved_profiles(bench, profile_dir)
    if saved is not None:
        log(f"routing by the profiles in {profile_dir} (no sweep)")
        return saved, False
    if fleet is not None:
        return await profile_fleet(fleet, bench, profile_dir, log), True
    async with slo_fleet(bench, profile_dir, bench.listen_port or free_port()) as own:
        return await profile_fleet(own, bench, profile_dir, log), True


def light_mix(bench: SloBench) -> SloBench:
    """The same mix at `bench.light` times its rates."""
    return replace(
        bench, mix=tuple(replace(c, rate_per_s=c.rate_per_s * bench.light) for c in bench.mix)
    )


async def run_bench(
    bench: SloBench,
    workdir: Path,
    log: Callable[[str], None] = print,
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    """The whole experiment on a fresh fleet: profiles, then each strategy in turn. With
    `profile_dir` holding a profile per preset (an earlier run's), the sweeps are skipped and
    those are routed by; else the sweeps write theirs there (or into `workdir`)."""
    from plugin_tools.demo.fleet import free_port

    port = bench.listen_port or free_port()
    profile_dir = profile_dir or workdir / "profiles"
    async with slo_fleet(bench, profile_dir, port) as fleet:
        profiles, swept = await ensure_profiles(bench, profile_dir, log, fleet)
        runs = []
        for label, mixed in (("full", bench), ("light", light_mix(bench))):
            for strategy in bench.strategies:
                result = await run_mix(fleet, mixed, strategy)
                scored = score(result, mixed, profiles) | {"mix": label}
                log(
                    f"{label} {strategy}: attainment {scored['attainment']:.3f}, goodput "
                    f"{scored['goodput_per_s']:.2f}/s, p99 TTFT {scored['p99_ttft_s']}, "
                    f"rejected {scored['rejected']}, late {scored['served_late']}, "
                    f"failed {scored['failed']}"
                )
                runs.append(scored)
                await asyncio.sleep(2.0 * bench.time_scale)  # let the engines drain
    return {
        "bench": _describe(bench),
        "profiles": {k: p.to_json() for k, p in profiles.items()},
        "swept": swept,  # False: routed by an earlier run's profiles
        "runs": runs,
    }


def _describe(bench: SloBench) -> dict[str, Any]:
    doc = {
        k: getattr(bench, k)
        for k in (
            "model",
            "presets",
            "time_scale",
            "ttft_slo_s",
            "percentile",
            "max_wait_ms",
            "duration_s",
            "seed",
            "light",
        )
    }
    doc["sweep"] = {
        "inputs": bench.inputs,
        "outputs": bench.outputs,
        "rates": [bench.rate_floor, bench.rate_limit],
    }
    doc["mix"] = [
        {
            "name": c.name,
            "prompt_words": c.prompt_words,
            "output_tokens": c.output_tokens,
            "rate_per_s": c.rate_per_s,
        }
        for c in bench.mix
    ]
    return doc
