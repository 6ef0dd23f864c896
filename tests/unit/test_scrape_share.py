"""Which gateway replica scrapes which engine (`plugin.core.scrape_share`)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from plugin.core.scrape_share import ScrapeShares

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
