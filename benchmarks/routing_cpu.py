"""Plugin CPU per routed request through the real gRPC ext_proc API, by pool size and strategy.

Starts `hetero-gateway serve` as its own process with a static pods file of N pods of one model,
then plays Envoy's routing stream for each request from a gRPC client: request headers, the
buffered body with end of stream, the response headers, end of the stream; `--concurrency`
streams at a time. Plugin CPU (user + system, /proc) over the run divided by the requests is the
figure; no Envoy and no engines, so nothing else shares the process's cost.

    python benchmarks/routing_cpu.py                       # 16, 256, 1000 pods; a few minutes
    python benchmarks/routing_cpu.py --pods 16 --rounds 3 \\
        --serve base='/path/to/other/venv/bin/hetero-gateway serve'   # A/B against a baseline

With several `--serve` commands the runs interleave round by round and each figure is also given
as a ratio to the first command's (the machine is shared: compare within one run). The pods point
at loopback addresses with nothing listening and the scrape interval is 30 s, so scraping adds
little and every pod looks cold to the strategies (no engine metrics, no learned capacity): this
measures the request path, not the decision quality.

Writes its table into docs/plugin-cost.md between the routing-cpu markers unless `--no-write`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc
import orjson
import yaml
from hetero_gateway_protos.envoy.config.core.v3 import base_pb2
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hetero_gateway_protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from routing_decision import (  # the same ~2 KB chat body and GPU profiles as in process
    BODY,
    MODEL,
    gpu_profiles,
)

from plugin.config import DEFAULT_DEPLOYMENT_LABEL as DEPLOYMENT_LABEL
from plugin_tools.demo.fleet import PURE_STRATEGIES, free_port, process_cpu_seconds
from plugin_tools.docsection import write_section

DOC = Path(__file__).resolve().parent.parent / "docs" / "plugin-cost.md"
STRATEGIES = (
    "load-balance",
    "least-request",
    "power-of-two",
    "round-robin",
    "random",
    "slo",
    "slo-least-load",
    "slo-pack-load",
)


def _headers(pairs: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )


def _exchange(i: int) -> list[pb.ProcessingRequest]:
    """What Envoy sends on the routing stream of one request (observe count mode)."""
    request = {
        ":path": "/v1/chat/completions",
        ":method": "POST",
        ":authority": "gateway",
        "content-type": "application/json",
        "x-request-id": f"bench-{i}",
    }
    response = {":status": "200", "content-type": "text/event-stream"}
    return [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers(request))),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True)),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers(response))),
    ]


def pods_document(n: int, gpus: list[str]) -> dict[str, object]:
    """N pods, the GPU types in turn (the deployment label names each pod's profile)."""
    pods = [
        {
            "name": f"p{i}",
            "address": f"127.1.{i // 250}.{i % 250 + 1}",
            "port": 8000,
            "labels": {DEPLOYMENT_LABEL: gpus[i % len(gpus)]},
        }
        for i in range(n)
    ]
    return {"models": {MODEL: {"pods": pods}}}


def write_profiles(folder: Path) -> list[str]:
    """AIBrix's sample profiles as the gateway's profile directory (`<model>/<gpu>.json`)."""
    for gpu, profile in gpu_profiles().items():
        path = folder / MODEL / f"{gpu}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orjson.dumps(profile.to_json()))
    return sorted(gpu_profiles())


class Plugin:
    """One `serve` process on free ports with a pods file of N pods."""

    def __init__(
        self, command: list[str], pods_file: Path, profile_dir: Path, strategy: str
    ) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        env = {**PURE_STRATEGIES, **os.environ}  # each strategy as named, not auto-blended
        env.update(
            HETERO_GATEWAY_PODS_FILE=str(pods_file),
            HETERO_GATEWAY_PROFILE_DIR=str(profile_dir),
            HETERO_GATEWAY_GRPC_PORT=str(self.grpc_port),
            HETERO_GATEWAY_HTTP_PORT=str(self.http_port),
            AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS="30000",
            ROUTING_ALGORITHM=strategy,
            HETERO_GATEWAY_LOG_LEVEL="ERROR",
        )
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)

    async def ready(self, limit_s: float = 30.0) -> None:
        url = f"http://127.0.0.1:{self.http_port}/readyz"
        deadline = time.monotonic() + limit_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"plugin exited with {self.proc.returncode}")
                try:
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError("plugin not ready in time")

    def cpu(self) -> float:
        return process_cpu_seconds(self.proc.pid) or 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def drive(port: int, requests: int, concurrency: int, first: int = 0) -> int:
    """Play `requests` routing streams, `concurrency` at a time; returns how many were routed."""
    routed = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        queue = iter(range(first, first + requests))

        async def worker() -> None:
            nonlocal routed
            for i in queue:
                call = stub.Process()
                for message in _exchange(i):
                    await call.write(message)
                    reply = await call.read()
                    if reply.WhichOneof("response") == "immediate_response":
                        raise RuntimeError(f"request {i} answered directly: {reply}")
                    if reply.HasField("request_body"):
                        routed += 1
                await call.done_writing()
                while await call.read() is not grpc.aio.EOF:
                    pass

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return routed


async def measure(
    command: list[str], n: int, strategy: str, requests: int, concurrency: int
) -> tuple[float, float]:
    """(plugin CPU ms per routed request, routed requests per second of wall time)."""
    with tempfile.TemporaryDirectory() as tmp:
        gpus = write_profiles(Path(tmp) / "profiles")
        pods_file = Path(tmp) / "pods.yaml"
        pods_file.write_text(yaml.safe_dump(pods_document(n, gpus)), encoding="utf-8")
        plugin = Plugin(command, pods_file, Path(tmp) / "profiles", strategy)
        try:
            await plugin.ready()
            await drive(plugin.grpc_port, min(300, requests), concurrency)  # warm up
            cpu0, t0 = plugin.cpu(), time.perf_counter()
            routed = await drive(plugin.grpc_port, requests, concurrency, first=requests)
            cpu1, t1 = plugin.cpu(), time.perf_counter()
        finally:
            plugin.stop()
    if routed != requests:
        raise RuntimeError(f"{routed} of {requests} requests routed")
    return (cpu1 - cpu0) * 1000.0 / routed, routed / (t1 - t0)


def parse_serve(values: list[str] | None) -> list[tuple[str, list[str]]]:
    if not values:
        here = Path(sys.executable).parent / "hetero-gateway"
        return [("this", [str(here), "serve"])]
    out = []
    for value in values:
        name, _, command = value.partition("=")
        if not command:
            raise SystemExit(f"--serve wants NAME=COMMAND, got {value!r}")
        out.append((name, shlex.split(command)))
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", default="16,256,1000", help="pool sizes, comma separated")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--requests", type=int, default=3000, help="measured requests per run")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="runs per figure (median kept)")
    parser.add_argument("--serve", action="append", help="NAME=COMMAND to start a plugin")
    parser.add_argument("--no-write", action="store_true", help="do not update the document")
    args = parser.parse_args()
    sizes = [int(x) for x in args.pods.split(",")]
    strategies = args.strategies.split(",")
    serves = parse_serve(args.serve)
    samples: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    for round_ in range(args.rounds):
        for n in sizes:
            for strategy in strategies:
                for name, command in serves:
                    ms, rate = await measure(command, n, strategy, args.requests, args.concurrency)
                    samples.setdefault((name, n, strategy), []).append((ms, rate))
                    print(
                        f"  round {round_ + 1} {name:6s} {n:5d} pods {strategy:15s} "
                        f"{ms:.3f} ms CPU/request, {rate:.0f} requests/s",
                        file=sys.stderr,
                        flush=True,
                    )

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2]

    base, smallest = serves[0][0], sizes[0]
    vs_base = len(serves) > 1
    head = f"| plugin | pods | strategy | CPU ms/request | requests/s | CPU vs {smallest} pods |"
    rule = "| --- | --- | --- | --- | --- | --- |"
    if vs_base:
        head += f" CPU vs {base} |"
        rule += " --- |"
    lines = [head, rule]
    for (name, n, strategy), runs in samples.items():
        ms = median([r[0] for r in runs])
        rate = median([r[1] for r in runs])
        small = median([r[0] for r in samples[(name, smallest, strategy)]])
        row = f"| {name} | {n} | {strategy} | {ms:.3f} | {rate:.0f} | {ms / small:.2f} |"
        if vs_base:
            ref = median([r[0] for r in samples[(base, n, strategy)]])
            row += f" {ms / ref:.2f} |"
        lines.append(row)
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    text = (
        "## Plugin CPU per routed request by pool size\n\n"
        f"Generated by `python benchmarks/routing_cpu.py --pods {args.pods} --rounds "
        f"{args.rounds}`: the plugin as its own process with a pods file of N pods, driven "
        "through the real gRPC ext_proc API as Envoy's routing stream does it (request headers, "
        "the ~2 KB buffered body, response headers, end of stream), "
        f"{args.concurrency} streams at a time, {args.requests:,} measured requests per row "
        "after a warm-up; median of the rounds. No Envoy and no engines: the pods are "
        "unreachable loopback addresses scraped every 30 s, so every pod is cold to the "
        "strategies. Half the pods are A100 and half A40, with AIBrix's sample GPU profiles "
        "in the plugin's profile directory, so the SLO strategies route by them.\n\n"
        f"{table}\n"
    )
    print(f"wrote {write_section(DOC, 'routing-cpu', text).name}", file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main())
