"""The Lua filter that takes an engine's usage-only chunk out of a marked stream, run in a real
Envoy in front of an upstream that writes a stream in the pieces each case chooses (a chunk
boundary anywhere), with the mark set as the plugin would set it. Whatever the split, the client
gets the stream minus usage-only events, or (a split before the event shows it is one) the
stream as sent: never fewer bytes of anything else."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from plugin.adapters.envoy_config import EnvoyOptions, render_bootstrap
from plugin_tools.demo.fleet import free_port
from tests.helpers import bootstrap_hcm, poll

pytestmark = [pytest.mark.dataplane, pytest.mark.asyncio(loop_scope="module")]


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


HEAD = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
CONTENT = _event({**HEAD, "choices": [{"index": 0, "delta": {"content": "hi"}}]})
USAGE = _event({**HEAD, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
FILTER = _event({**HEAD, "choices": [], "prompt_filter_results": [{"prompt_index": 0}]})
DONE = b"data: [DONE]\n\n"
SPLIT_AFTER_CHOICES = USAGE.index(b'"usage"')  # the first part already shows "choices":[]
SPLIT_BEFORE_CHOICES = USAGE.index(b'"model"')

CASES: dict[str, tuple[list[bytes], bytes]] = {
    # name: (the pieces the upstream writes, what the client must receive)
    "usage-with-done": ([CONTENT, CONTENT, USAGE + DONE], CONTENT + CONTENT + DONE),
    "usage-alone": ([CONTENT, USAGE, DONE], CONTENT + DONE),
    "split-after-choices": (
        [CONTENT, USAGE[:SPLIT_AFTER_CHOICES], USAGE[SPLIT_AFTER_CHOICES:] + DONE],
        CONTENT + DONE,
    ),
    "split-in-its-last-byte": ([CONTENT, USAGE[:-1], USAGE[-1:], DONE], CONTENT + DONE),
    "split-before-choices-is-left-in": (
        [CONTENT, USAGE[:SPLIT_BEFORE_CHOICES], USAGE[SPLIT_BEFORE_CHOICES:] + DONE],
        CONTENT + USAGE + DONE,
    ),
    "empty-choices-without-usage-kept": ([FILTER, CONTENT, USAGE, DONE], FILTER + CONTENT + DONE),
    "no-final-newline-kept": (
        [CONTENT, b'data: {"choices":[{"x":1}]}'],
        CONTENT + b'data: {"choices":[{"x":1}]}',
    ),
    "usage-in-a-content-event-kept": (
        [_event({**HEAD, "choices": [{"delta": {}}], "usage": {"completion_tokens": 1}}), DONE],
        _event({**HEAD, "choices": [{"delta": {}}], "usage": {"completion_tokens": 1}}) + DONE,
    ),
}


async def _stream(request: web.Request) -> web.StreamResponse:
    pieces, _ = CASES[request.match_info["case"]]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for piece in pieces:
        await resp.write(piece)
        await asyncio.sleep(0.05)  # each piece reaches Envoy as its own chunk
    await resp.write_eof()
    return resp


def _bootstrap(listen: int, upstream: int, marked: bool) -> dict[str, object]:
    """The product's Lua filter alone, behind a filter that marks the stream as the plugin does."""
    product = render_bootstrap(EnvoyOptions())
    lua: dict[str, Any] = next(
        f for f in bootstrap_hcm(product)["http_filters"] if "strip_usage" in f["name"]
    )
    mark: dict[str, Any] = {
        "name": "mark",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [
                {"metadata_namespace": "hetero_gateway", "value": {"strip_usage": marked}}
            ],
        },
    }
    router: dict[str, Any] = {
        "name": "router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        },
    }
    address = {"socket_address": {"address": "127.0.0.1", "port_value": upstream}}
    return {
        "static_resources": {
            "listeners": [
                {
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "hcm",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters"
                                        ".network.http_connection_manager.v3.HttpConnectionManager",
                                        "stat_prefix": "t",
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "all",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "route": {
                                                                "cluster": "up",
                                                                "timeout": "0s",
                                                            },
                                                        }
                                                    ],
                                                }
                                            ]
                                        },
                                        "http_filters": [mark, lua, router],
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "up",
                    "type": "STATIC",
                    "load_assignment": {
                        "cluster_name": "up",
                        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
                    },
                }
            ],
        }
    }


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def envoys(
    tmp_path_factory: pytest.TempPathFactory, envoy_binary: str
) -> AsyncIterator[dict[bool, str]]:
    """Two Envoys in front of the upstream, by mark: True strips, False must not."""
    app = web.Application()
    app.router.add_get("/{case}", _stream)
    runner = web.AppRunner(app)
    await runner.setup()
    upstream = free_port()
    await web.TCPSite(runner, "127.0.0.1", upstream).start()
    procs, urls = [], {}
    workdir: Path = tmp_path_factory.mktemp("lua")
    try:
        for marked in (True, False):
            listen = free_port()
            path = workdir / f"envoy-{marked}.yaml"
            path.write_text(yaml.safe_dump(_bootstrap(listen, upstream, marked)))
            procs.append(
                await asyncio.create_subprocess_exec(
                    envoy_binary,
                    "-c",
                    str(path),
                    "--disable-hot-restart",
                    "--concurrency",
                    "1",
                    "--log-level",
                    "warn",
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
            )
            urls[marked] = f"http://127.0.0.1:{listen}"
        async with aiohttp.ClientSession() as session:
            for url in urls.values():

                async def up(url: str = url) -> bool:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.get(f"{url}/usage-alone") as resp:
                            return resp.status == 200
                    return False

                await poll(up, bool, "Envoy listening", limit_s=20, interval_s=0.1)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            await proc.wait()
        await runner.cleanup()


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_marked_stream_loses_its_usage_only_events_and_nothing_else(
    envoys: dict[bool, str], case: str
) -> None:
    pieces, expected = CASES[case]
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{envoys[True]}/{case}") as resp:
            assert await resp.read() == expected
        async with session.get(f"{envoys[False]}/{case}") as resp:  # unmarked: untouched
            assert await resp.read() == b"".join(pieces)
