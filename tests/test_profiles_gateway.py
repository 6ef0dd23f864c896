"""GPU profiles in the gateway: which pod has one (its deployment label), where they are read
from (Redis keys `aibrix:profile_*` or a directory), and how a newer profile wins."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from plugin.adapters.discovery import parse_pods
from plugin.adapters.kubernetes import MODEL_KEY, pod_from_object
from plugin.adapters.profiles import DirectoryProfiles, RedisProfiles
from plugin.config import RedisSettings
from plugin.core.profile import GpuProfile, ProfileBook, profile_key
from plugin.core.types import Pod
from plugin.errors import ConfigError
from plugin_tools.demo.redis_server import RedisServer
from tests.helpers import StartGateway, debug_pods, write_pods_file

pytestmark = pytest.mark.component

MODEL = "llama-3-8b"


def profile(gpu: str, created: float, tput: float = 10.0) -> GpuProfile:
    return GpuProfile(gpu, 1.0, (4, 8), (128,), ((tput,), (tput / 2,)), created, ((0.5,), (1.0,)))


def test_book_keeps_the_newest_and_drops_what_is_gone() -> None:
    book = ProfileBook()
    a, b = profile_key(MODEL, "a100"), profile_key(MODEL, "l20")
    assert sorted(book.replace({a: profile("a100", 10.0), b: profile("l20", 10.0)})) == [a, b]
    assert book.replace({a: profile("a100", 5.0, tput=99.0), b: profile("l20", 10.0)}) == []
    found = book.lookup(MODEL, "a100")
    assert found is not None and found.tputs[0][0] == 10.0  # the older copy did not win
    assert book.replace({a: profile("a100", 11.0, tput=12.0)}) == [b, a]
    assert book.lookup(MODEL, "l20") is None  # deleted upstream
    assert book.lookup(MODEL, None) is None and book.lookup("other", "a100") is None


def test_both_discovery_sources_read_the_deployment_label() -> None:
    doc = {
        "models": {
            MODEL: {
                "pods": [
                    {
                        "name": "p0",
                        "address": "10.0.0.1",
                        "port": 8000,
                        "labels": {"app.kubernetes.io/name": "a100", "gpu": "A100"},
                    },
                    {"name": "p1", "address": "10.0.0.2", "port": 8000},
                ]
            }
        }
    }
    p0, p1 = parse_pods(doc, "pods.yaml")
    assert (p0.deployment, p1.deployment) == ("a100", None)
    (custom, _) = parse_pods(doc, "pods.yaml", deployment_label="gpu")
    assert custom.deployment == "A100"
    obj: dict[str, Any] = {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "labels": {MODEL_KEY: MODEL, "app.kubernetes.io/name": "l20"},
        },
        "status": {"podIP": "10.0.0.3", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    pod = pod_from_object(obj)
    assert pod is not None and pod.deployment == "l20"
    other = pod_from_object(obj, deployment_label="missing")
    assert other is not None and other.deployment is None


async def test_redis_profiles_scan_their_own_database(redis_server: RedisServer) -> None:
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=3)
    key_a, key_l = profile_key(MODEL, "a100"), profile_key(MODEL, "l20")
    try:
        client.set(key_a, json.dumps(profile("a100", 10.0).to_json()))
        client.set(key_l, json.dumps(profile("l20", 10.0).to_json()))
        client.set(profile_key(MODEL, "broken"), b"{not json")
        client.set("aibrix:other", b"x")
        redis.Redis(host="127.0.0.1", port=redis_server.port, db=0).set(
            profile_key(MODEL, "db0"), json.dumps(profile("db0", 1.0).to_json())
        )
        book = ProfileBook()
        loader = RedisProfiles(book, RedisSettings("127.0.0.1", redis_server.port, db=3))
        try:
            assert await loader.load_once()
            assert book.keys() == sorted([key_a, key_l])  # not db 0's, not the broken one
            client.set(key_a, json.dumps(profile("a100", 20.0, tput=30.0).to_json()))
            client.delete(key_l)
            assert await loader.load_once()
            found = book.lookup(MODEL, "a100")
            assert found is not None and found.tputs[0][0] == 30.0
            assert book.lookup(MODEL, "l20") is None
            await redis_server.kill()
            assert not await loader.load_once()  # Redis down: nothing changes
            assert book.keys() == [key_a] and loader.status()["last_error"]
        finally:
            await loader.close()
    finally:
        client.close()


async def test_directory_profiles_and_debug_pods(
    tmp_path: Path, start_gateway: StartGateway
) -> None:
    profiles = tmp_path / "profiles"
    (profiles / MODEL).mkdir(parents=True)
    (profiles / MODEL / "a100.json").write_text(json.dumps(profile("a100", 1.0).to_json()))
    (profiles / MODEL / "bad.json").write_text("[]")
    pods = [
        Pod(
            "a",
            "default",
            MODEL,
            "127.0.0.1",
            18001,
            18001,
            labels={"app.kubernetes.io/name": "a100"},
        ),
        Pod(
            "b",
            "default",
            MODEL,
            "127.0.0.1",
            18002,
            18002,
            labels={"app.kubernetes.io/name": "v100"},
        ),
    ]
    pods_file = write_pods_file(tmp_path / "pods.yaml", pods)
    gateway = await start_gateway(pods_file, {"HETERO_GATEWAY_PROFILE_DIR": str(profiles)})
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            doc = await debug_pods(session, f"http://127.0.0.1:{gateway.http_port}")
            if doc["profiles"]["keys"]:
                break
            await asyncio.sleep(0.05)
    assert doc["profiles"]["source"] == "directory"
    assert doc["profiles"]["keys"] == [profile_key(MODEL, "a100")]
    a, b = doc["pods"]["default/a"], doc["pods"]["default/b"]
    assert (a["deployment"], a["profile"]) == ("a100", True)
    assert (b["deployment"], b["profile"]) == ("v100", False)


def test_a_profile_dir_that_is_not_a_directory_stops_start_up(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="HETERO_GATEWAY_PROFILE_DIR"):
        DirectoryProfiles(ProfileBook(), str(tmp_path / "missing"))
