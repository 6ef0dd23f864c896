"""Python's cyclic garbage collector, tuned for a gateway that holds a large pool view.

By default CPython runs a young collection every 700 net allocations of container objects.
Each scrape tick allocates far more than that (a page's parse, a peer's records: about
100,000 objects for a replica sharing 10,000 pods), and every young collection that runs
while they are alive promotes them, so they pile up in the oldest generation until a full
collection walks the whole heap: at 10,000 pods about 90 ms of CPU each, several a minute,
on the event loop that answers Envoy. With young collections every 10,000 allocations most
of a tick's objects are freed by reference counting before a collection sees them, and full
collections become rare (`benchmarks/fleet_overhead.py`: 262 -> 211 ms of CPU per scrape
tick of one of five replicas sharing 10,000 pods; no full collection in the run instead of
six). A young collection then looks at up to 10,000 objects instead of 700, well under a
millisecond.
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG_COLLECTION_EVERY", "collect_young_garbage_less_often"]

YOUNG_COLLECTION_EVERY = 10_000  # net container allocations between young collections


def collect_young_garbage_less_often() -> None:
    """Raise the young generation's threshold (the older ones keep theirs)."""
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, middle, oldest)
