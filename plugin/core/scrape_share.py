"""Which gateway replica scrapes which engine: one scrape per pod per period for the fleet.

Rendezvous (highest random weight) hashing: a pod goes to the live scraper whose hash with the
pod's key is highest. Every replica that sees the same live scrapers computes the same owner
for every pod, with nothing to agree on beyond that list; when a scraper leaves, only its pods
move (each to the replica with the next-highest hash), and one that joins takes about 1/N of
the pods from the others. Chosen over a ring with virtual nodes: even shares in expectation
with nothing to tune, and a gateway fleet is a handful of replicas, so N hashes per pod is
cheap (and computed once per pod while the scrapers stay the same).
"""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import blake2b

__all__ = ["ScrapeShares"]


def _weight(scraper: str, pod_key: str) -> int:
    """A stable hash (the same on every replica and Python process, unlike `hash`)."""
    digest = blake2b(f"{scraper}\n{pod_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class ScrapeShares:
    """This replica's view of who scrapes which pod.

    `scrapers` are the replicas that publish their scrapes now (this one included); a replica
    alone, or one that cannot reach the shared store, owns every pod.
    """

    def __init__(self, me: str) -> None:
        self.me = me
        self.scrapers: tuple[str, ...] = (me,)
        self._owners: dict[str, str] = {}
        # What the last scrape tick did, for /debug/pods: pods scraped here, pods read from
        # the other replicas' scrapes.
        self.scraped = 0
        self.from_peers = 0

    def set_scrapers(self, scrapers: Iterable[str]) -> bool:
        """The live scrapers (this replica is always one); True when they changed."""
        live = tuple(sorted({*scrapers, self.me}))
        if live == self.scrapers:
            return False
        self.scrapers = live
        self._owners.clear()
        return True

    def owner(self, pod_key: str) -> str:
        owner = self._owners.get(pod_key)
        if owner is None:
            if len(self.scrapers) == 1:
                return self.me
            owner = max(self.scrapers, key=lambda scraper: _weight(scraper, pod_key))
            self._owners[pod_key] = owner
        return owner

    def mine(self, pod_key: str) -> bool:
        return self.owner(pod_key) == self.me

    def forget(self, present: set[str]) -> None:
        """Drop the owners of pods that left (bounded by the pods listed)."""
        if len(self._owners) > 2 * len(present) + 64:
            self._owners = {k: v for k, v in self._owners.items() if k in present}
