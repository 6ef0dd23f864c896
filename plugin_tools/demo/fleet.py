"""A whole local stack as child processes: mock engines, the plugin, a real Envoy.

`hetero-gateway up` runs it for people; the data-plane tests run the same class, so what the
README promises is what CI exercises. Every process is stopped by `stop()`, also after a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import yaml

from plugin.adapters.envoy_config import EnvoyOptions, envoy_binary
from plugin_tools.demo.envoy_layout import BenchLayout, bench_bootstrap_yaml
from plugin_tools.mock_engine.model import PRESETS, EngineParams, saturated_output_tokens_per_s

_rng = random.SystemRandom()


def _ephemeral_start() -> int:
    """Where the kernel starts handing out source ports for outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()  # ports `free_port` returned (bounded)

# "K/N": draw ports from the K-th of N equal parts of the range only. Parallel test workers
# (tests/conftest.py) each take their own part, so two never hand out the same port; their
# child processes (`up`, benchmarks) inherit it.
PORT_SLICE_ENV = "HETERO_GATEWAY_PORT_SLICE"


def _port_range() -> tuple[int, int]:
    high = _ephemeral_start()
    low = max(1024, high - 12000)
    part = os.environ.get(PORT_SLICE_ENV)
    if not part:
        return low, high
    try:
        k, n = (int(x) for x in part.split("/"))
    except ValueError:
        raise ValueError(f"{PORT_SLICE_ENV}={part!r}: expected K/N, e.g. 0/2") from None
    if not 0 <= k < n:
        raise ValueError(f"{PORT_SLICE_ENV}={part!r}: K must be in 0..N-1")
    width = (high - low) // n
    return low + k * width, low + (k + 1) * width


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on, chosen below the ephemeral range.

    A port the kernel picks for `bind(0)` lies in the ephemeral range, where every outgoing
    connection (Envoy to an engine, a client to Envoy) also takes its source port; between our
    check and the child's bind, one of them could take it ("Address already in use"). Ports below
    that range are only ever taken by someone binding them on purpose.
    """
    low, high = _port_range()
    for _ in range(64):
        port = _rng.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        # Not handed out twice by this process: a fleet asks for a few dozen ports before its
        # children bind any, and twenty draws from 12,000 ports meet about once in sixty
        # fleets (seen once here: a benchmark's Envoy found its admin port in use).
        if len(_handed_out) >= 4096:
            _handed_out.clear()
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# The tools compare strategies as named: auto-blend (load-balance added behind least-request
# and others; `plugin.core.strategies.blend`) and the load-imbalance gate ahead of them
# (`plugin.core.strategies.gate`) are off in their fleets unless the environment or a
# FleetSpec's plugin_env turns them on.
PURE_STRATEGIES = {
    "AIBRIX_ROUTING_AUTO_BLEND_LOAD_BALANCE_WEIGHT": "0",
    "HETERO_GATEWAY_IMBALANCE_GATE": "off",
}


@dataclass(frozen=True, slots=True)
class FleetSpec:
    model: str = "llama-3-8b"
    presets: tuple[str, ...] = ("a100", "l20", "v100")
    time_scale: float = 4.0
    tokens_per_chunk: int = 8
    max_num_seqs: int | None = None
    # Also declare `max_num_seqs` in the pods file (`maxNumSeqs`: the batch cap the gateway then
    # knows from the start, as an operator declares it), rather than leave it to be learned.
    declare_max_num_seqs: bool = False
    listen_port: int = 8888
    namespace: str = "default"
    fail_open: bool = False
    count_mode: str = "observe"
    steering: str = "original-dst"  # or "override-host" (EnvoyOptions.steering)
    plugin_env: dict[str, str] = field(default_factory=dict)
    # `serve --workers N` (needs REDIS_HOST in plugin_env); Envoy then runs N worker threads,
    # one connection each to the shared port, which the kernel spreads over the workers.
    plugin_workers: int = 1


@dataclass(slots=True)
class EngineProc:
    name: str
    preset: str
    port: int
    params: EngineParams
    proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def saturated_tokens_per_s(self) -> float:
        return saturated_output_tokens_per_s(self.params)


class StartError(RuntimeError):
    """A child process did not come up; the message carries the tail of its log."""


@dataclass(slots=True)
class ExtraGateway:
    """A second plugin (same pods, its own environment) with its own Envoy in front of it."""

    name: str
    grpc_port: int
    http_port: int
    listen_port: int
    admin_port: int
    plugin: asyncio.subprocess.Process | None = None
    envoy: asyncio.subprocess.Process | None = None

    @property
    def plugin_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def envoy_url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"


class LocalFleet:
    def __init__(self, spec: FleetSpec, workdir: str | None = None) -> None:
        self.spec = spec
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="hetero-gateway-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.engines: list[EngineProc] = []
        counts: dict[str, int] = {}
        for preset in spec.presets:
            index = counts.get(preset, 0)
            counts[preset] = index + 1
            params = replace(
                PRESETS[preset], time_scale=spec.time_scale, tokens_per_chunk=spec.tokens_per_chunk
            )
            if spec.max_num_seqs is not None:
                params = replace(params, max_num_seqs=spec.max_num_seqs)
            self.engines.append(EngineProc(f"{preset}-{index}", preset, free_port(), params))
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.admin_port = free_port()
        self.plugin: asyncio.subprocess.Process | None = None
        self.envoy: asyncio.subprocess.Process | None = None
        self.extra_envoys: list[asyncio.subprocess.Process] = []
        self.extra_gateways: list[ExtraGateway] = []
        self._logs: dict[str, Path] = {}

    @property
    def envoy_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.listen_port}"

    @property
    def plugin_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pods_file(self) -> Path:
        return self.workdir / "pods.yaml"

    def pods_document(self) -> dict[str, object]:
        declared = self.spec.max_num_seqs if self.spec.declare_max_num_seqs else None
        return {
            "models": {
                self.spec.model: {
                    **({"maxNumSeqs": declared} if declared is not None else {}),
                    "pods": [
                        {
                            "name": e.name,
                            "namespace": self.spec.namespace,
                            "address": "127.0.0.1",
                            "port": e.port,
                            "engine": "vllm",
                            # The GPU type as /debug/pods shows it (AIBRIX_POD_DEPLOYMENT_LABEL).
                            "labels": {"gpu": e.preset, "app.kubernetes.io/name": e.preset},
                        }
                        for e in self.engines
                    ],
                }
            }
        }

    async def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> asyncio.subprocess.Process:
        log = self.workdir / f"{name}.log"
        self._logs[name] = log
        with open(log, "wb") as fh:
            return await asyncio.create_subprocess_exec(
                *argv,
                stdout=fh,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self._logs.get(name)
        if path is None or not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    async def _wait_http(
        self, name: str, proc: asyncio.subprocess.Process, url: str, timeout_s: float = 30.0
    ) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if proc.returncode is not None:
                    break
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.1)
        raise StartError(f"{name} did not become ready at {url}:\n{self.log_tail(name)}")

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        for e in self.engines:
            e.proc = await self._spawn_engine(e)
        for e in self.engines:
            assert e.proc is not None
            await self._wait_http(e.name, e.proc, f"{e.url}/health")

        self.pods_file.write_text(yaml.safe_dump(self.pods_document(), sort_keys=False))
        await self.start_plugin()

        self.envoy = await self._spawn_envoy(
            "envoy", self.envoy_options(self.spec.listen_port, self.admin_port)
        )
        await self._wait_http("envoy", self.envoy, f"http://127.0.0.1:{self.admin_port}/ready")

    async def _spawn_engine(self, e: EngineProc) -> asyncio.subprocess.Process:
        p = e.params
        return await self._spawn(
            e.name,
            [
                *(sys.executable, "-m", "plugin", "mock-engine"),
                *("--preset", e.preset, "--name", e.name, "--model", self.spec.model),
                *("--host", "127.0.0.1", "--port", str(e.port)),
                *("--time-scale", repr(p.time_scale)),
                *("--tokens-per-chunk", str(p.tokens_per_chunk)),
                *("--max-num-seqs", str(p.max_num_seqs)),
            ],
        )

    async def restart_engine(self, e: EngineProc) -> None:
        """Start an engine again on its port (after `stop_process(e.proc)`); wait until ready."""
        e.proc = await self._spawn_engine(e)
        await self._wait_http(e.name, e.proc, f"{e.url}/health")

    async def start_plugin(self) -> None:
        """Start (or, after `stop_process(fleet.plugin)`, restart) the plugin; wait until ready."""
        self.plugin = await self._spawn_plugin("plugin", self.grpc_port, self.http_port, {})
        await self._wait_http("plugin", self.plugin, f"{self.plugin_url}/readyz")

    async def _spawn_plugin(
        self, name: str, grpc_port: int, http_port: int, env: dict[str, str]
    ) -> asyncio.subprocess.Process:
        py = [sys.executable, "-m", "plugin"]
        return await self._spawn(
            name,
            [
                *py,
                "serve",
                "--pods",
                str(self.pods_file),
                "--host",
                "127.0.0.1",
                "--grpc-port",
                str(grpc_port),
                "--http-port",
                str(http_port),
                *("--workers", str(self.spec.plugin_workers)),
            ],
            env={**PURE_STRATEGIES, **os.environ, **self.spec.plugin_env, **env},
        )

    async def start_extra_gateway(self, name: str, plugin_env: dict[str, str]) -> ExtraGateway:
        """Another plugin over the same engines and pods file, with `plugin_env` on top of the
        spec's, behind its own Envoy; `stop()` stops both. Several gateway replicas sharing state
        (REDIS_HOST, a distinct POD_NAME each) are tested this way."""
        gw = ExtraGateway(name, free_port(), free_port(), free_port(), free_port())
        self.extra_gateways.append(gw)  # before the waits: a failed start is stopped too
        gw.plugin = await self._spawn_plugin(
            f"{name}-plugin", gw.grpc_port, gw.http_port, plugin_env
        )
        await self._wait_http(f"{name}-plugin", gw.plugin, f"{gw.plugin_url}/readyz")
        opts = replace(self.envoy_options(gw.listen_port, gw.admin_port), extproc_port=gw.grpc_port)
        gw.envoy = await self._spawn_envoy(f"{name}-envoy", opts)
        await self._wait_http(f"{name}-envoy", gw.envoy, f"http://127.0.0.1:{gw.admin_port}/ready")
        return gw

    async def start_plugin_replica(self, name: str, plugin_env: dict[str, str]) -> ExtraGateway:
        """Another plugin over the same engines and pods file, with `plugin_env` on top of the
        spec's and no Envoy of its own: put it behind one with `EnvoyOptions.extproc_replicas`
        (`start_extra_envoy`). Replicas must share Redis (REDIS_HOST, a POD_NAME each)."""
        gw = ExtraGateway(name, free_port(), free_port(), 0, 0)
        self.extra_gateways.append(gw)  # before the wait: a failed start is stopped too
        gw.plugin = await self._spawn_plugin(
            f"{name}-plugin", gw.grpc_port, gw.http_port, plugin_env
        )
        await self._wait_http(f"{name}-plugin", gw.plugin, f"{gw.plugin_url}/readyz")
        return gw

    async def start_replicas(
        self, count: int, plugin_env: dict[str, str]
    ) -> tuple[str, list[ExtraGateway]]:
        """`count` plugin replicas behind one Envoy: the fleet's own plugin and `count - 1`
        more (`start_plugin_replica`, `plugin_env` on top of the spec's and a POD_NAME each);
        the Envoy's URL and the replicas started here."""
        extra = [
            await self.start_plugin_replica(f"replica-{i}", {**plugin_env, "POD_NAME": f"r-{i}"})
            for i in range(1, count)
        ]
        return await self.start_replicas_envoy(extra), extra

    async def start_replicas_envoy(self, replicas: Sequence[ExtraGateway]) -> str:
        """An Envoy whose ext_proc cluster holds the fleet's own plugin and `replicas`
        (`start_plugin_replica`); returns its URL. `stop()` stops it too."""
        port = free_port()
        grpc_ports = [self.grpc_port, *(r.grpc_port for r in replicas)]
        opts = replace(
            self.envoy_options(port, free_port()),
            extproc_replicas=tuple(f"127.0.0.1:{p}" for p in grpc_ports),
        )
        await self.start_extra_envoy("replicas-envoy", opts)
        return f"http://127.0.0.1:{port}"

    def envoy_options(self, listen_port: int, admin_port: int) -> EnvoyOptions:
        """The fleet's Envoy options (plugin address, fail mode, count mode) on other ports."""
        return EnvoyOptions(
            listen_host="127.0.0.1",
            listen_port=listen_port,
            admin_port=admin_port,
            extproc_port=self.grpc_port,
            fail_open=self.spec.fail_open,
            count_mode=self.spec.count_mode,
            steering=self.spec.steering,
            endpoints=tuple(f"127.0.0.1:{e.port}" for e in self.engines),
        )

    async def _spawn_envoy(
        self, name: str, opts: EnvoyOptions, layout: BenchLayout | None = None
    ) -> asyncio.subprocess.Process:
        return await self._spawn_envoy_text(name, bench_bootstrap_yaml(opts, layout))

    async def start_envoy_bootstrap(self, name: str, text: str, admin_port: int) -> None:
        """Another Envoy from a bootstrap of the caller's (YAML `text`, its admin on
        `admin_port`); `stop()` stops it too."""
        proc = await self._spawn_envoy_text(name, text)
        self.extra_envoys.append(proc)  # before the wait: a failed start is stopped too
        await self._wait_http(name, proc, f"http://127.0.0.1:{admin_port}/ready")

    async def _spawn_envoy_text(self, name: str, text: str) -> asyncio.subprocess.Process:
        bootstrap = self.workdir / f"{name}.yaml"
        bootstrap.write_text(text)
        return await self._spawn(
            name,
            [
                envoy_binary(),
                "-c",
                str(bootstrap),
                "--log-level",
                "warn",
                "--disable-hot-restart",
                "--concurrency",
                str(self.spec.plugin_workers),
            ],
        )

    async def start_extra_envoy(
        self, name: str, opts: EnvoyOptions, layout: BenchLayout | None = None
    ) -> asyncio.subprocess.Process:
        """Another Envoy in front of the same plugin and engines; `stop()` stops it too.

        The benchmark compares bootstraps side by side on one stack; `name` names the log.
        """
        proc = await self._spawn_envoy(name, opts, layout)
        self.extra_envoys.append(proc)  # before the wait: a failed start is stopped too
        await self._wait_http(name, proc, f"http://127.0.0.1:{opts.admin_port}/ready")
        return proc

    async def stop_process(self, proc: asyncio.subprocess.Process | None) -> None:
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def stop(self) -> None:
        await asyncio.gather(*(self.stop_process(p) for p in self.extra_envoys))
        await asyncio.gather(*(self.stop_process(g.envoy) for g in self.extra_gateways))
        await asyncio.gather(*(self.stop_process(g.plugin) for g in self.extra_gateways))
        await self.stop_process(self.envoy)
        await self.stop_process(self.plugin)
        await asyncio.gather(*(self.stop_process(e.proc) for e in self.engines))
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def __aenter__(self) -> LocalFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc); None where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks
