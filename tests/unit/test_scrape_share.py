"""Which gateway replica scrapes which engine (`plugin.core.scrape_share`)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import orjson
import pytest

from plugin.adapters.scraper import decode_scrape, encode_scrape
from plugin.core.scrape_share import ScrapeShares
from plugin.core.types import EngineMetrics

pytestmark = pytest.mark.unit

PODS = [f"ns/pod-{i}" for i in range(3000)]


def _owners(me: str, scrapers: list[str]) -> dict[str, str]:
    shares = ScrapeShares(me)
    shares.set_scrapers(scrapers)
    return {pod: shares.owner(pod) for pod in PODS}


def test_every_replica_names_the_same_owner_for_every_pod() -> None:
    scrapers = ["gw-a", "gw-b", "gw-c"]
    views = [_owners(me, scrapers) for me in scrapers]
    assert views[0] == views[1] == views[2]


def test_shares_are_even() -> None:
    counts = Counter(_owners("gw-a", ["gw-a", "gw-b", "gw-c"]).values())
    assert set(counts) == {"gw-a", "gw-b", "gw-c"}
    assert all(900 <= n <= 1100 for n in counts.values()), counts


def test_a_replica_that_leaves_moves_only_its_own_pods() -> None:
    before = _owners("gw-a", ["gw-a", "gw-b", "gw-c"])
    after = _owners("gw-a", ["gw-a", "gw-b"])
    moved = {pod for pod in PODS if before[pod] != after[pod]}
    assert moved == {pod for pod in PODS if before[pod] == "gw-c"}


def test_alone_a_replica_owns_every_pod_and_counts_itself_among_the_scrapers() -> None:
    shares = ScrapeShares("gw-a")
    assert all(shares.mine(pod) for pod in PODS[:100])
    assert shares.set_scrapers(["gw-b"])  # itself included whatever it is told
    assert shares.scrapers == ("gw-a", "gw-b")
    assert not shares.set_scrapers(["gw-b", "gw-a"])  # the same set: no change
    assert shares.set_scrapers([])
    assert list(shares.scrapers) == ["gw-a"]
    assert all(shares.mine(pod) for pod in PODS[:100])


def test_another_process_names_the_same_owners() -> None:
    """Replicas are separate processes: the owners must not depend on a per-process salt
    (Python's `hash` of a str has one)."""
    scrapers = ["gw-a", "gw-b", "gw-c"]
    here = [owner for _, owner in sorted(_owners("gw-a", scrapers).items())[:200]]
    code = (
        "from plugin.core.scrape_share import ScrapeShares\n"
        "s = ScrapeShares('gw-b'); s.set_scrapers(['gw-a', 'gw-c'])\n"
        f"print([s.owner(p) for p in sorted({PODS!r})[:200]])"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert there.strip() == str(here)


@pytest.mark.parametrize("stepwise", [True, False])
def test_a_shared_scrape_reads_back_field_for_field(stepwise: bool) -> None:
    """Every field through the record the replicas publish (as JSON), each a different value,
    so a field read into another's place shows; ints from JSON come back as floats."""
    values: dict[str, object] = {
        name: float(i + 1)
        for i, name in enumerate(EngineMetrics._fields)
        if name != "generation_tokens_stepwise"
    }
    values["cpu_kv_usage"] = None
    values["running"] = 7  # an int, as JSON may carry it
    metrics = EngineMetrics(**values, generation_tokens_stepwise=stepwise)  # type: ignore[arg-type]
    learned = (1234.5, True, 48, "learned")
    record = orjson.loads(orjson.dumps(encode_scrape(metrics, learned)))
    decoded, read = decode_scrape(record)
    assert decoded == metrics
    assert read == learned
    assert isinstance(decoded.running, float)
    with pytest.raises(ValueError):
        decode_scrape(record[:-1])
    with pytest.raises((TypeError, ValueError)):
        decode_scrape([*record[:2], "x", *record[3:]])
    with pytest.raises(ValueError):  # a cap from nowhere this release knows
        decode_scrape([*record[:-1], "guessed"])
    with pytest.raises(ValueError):  # a cap of no request would fence the engine off
        decode_scrape([*record[:-2], 0, "learned"])
    with pytest.raises(TypeError):  # a short window that is no yes or no
        decode_scrape([*record[:-3], "false", *record[-2:]])


def test_a_record_without_what_its_replica_learned_is_learned_here() -> None:
    """An earlier release publishes the scrape alone: read, with nothing to adopt."""
    metrics = EngineMetrics(running=3.0, waiting=0.0, generation_tokens=10.0)
    plain = orjson.loads(orjson.dumps(encode_scrape(metrics)))
    decoded, learned = decode_scrape(plain)
    assert decoded == metrics
    assert learned is None
    nothing_yet = orjson.loads(orjson.dumps(encode_scrape(metrics, (None, False, None, None))))
    assert decode_scrape(nothing_yet) == (metrics, (None, False, None, None))
