"""Per-model candidate state kept current as events arrive, so routing costs the same at any size.

`PodPool` keeps one `CandidateView` per model: one `Candidate` per pod, updated in place when a
lease is taken or released, a scrape lands, capacities refresh or other gateways' counts
arrive, and the list of routable candidates (ready, not ejected) in discovery order. A request
then gets the view itself instead of a list built for it.

A strategy whose rule is "the smallest key, ties at random" asks the view for an `OrderedIndex`
on its key (`view.sorted_by(spec)`): a sorted list the view updates with each candidate change, so
the pick costs O(log n) instead of a pass over the pool. The index answers exactly what the
straightforward pass over the same candidates answers, random tie-break included (it draws
from the same `rng` the same way); `tests/test_view.py` holds both to that on random pools.
`docs/architecture.md` ("Routing at scale") says which strategy uses what.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, overload

from sortedcontainers import SortedList

from plugin.core.types import Candidate

__all__ = ["CandidateView", "IndexSpec", "OrderedIndex"]


class IndexSpec(Protocol):
    """How an index orders candidates. A view keeps one index per spec object: a strategy makes
    its specs once and passes the same objects on every request (identity hashing keeps the
    lookup cheap: `@dataclass(frozen=True, eq=False)`)."""

    def key(self, candidate: Candidate) -> tuple[float, ...]:
        """Smaller is better; must be a pure function of the candidate's fields, never NaN."""
        ...

    def member(self, candidate: Candidate) -> bool:
        """Whether the candidate belongs in the index (all routable candidates by default)."""
        ...


_Entry = tuple[tuple[float, ...], int]  # (key, position in the model's discovery order)


class OrderedIndex:
    """The view's routable candidates that are `spec.member`s, sorted by (`spec.key`, order)."""

    __slots__ = ("_entries", "_slots", "_sorted", "spec", "used")

    def __init__(self, spec: IndexSpec, slots: Sequence[Candidate], members: Sequence[int]) -> None:
        self.spec = spec
        self._slots = slots
        self._entries: dict[int, _Entry] = {}
        for order in members:
            candidate = slots[order]
            if spec.member(candidate):
                self._entries[order] = (spec.key(candidate), order)
        self._sorted: Any = SortedList(self._entries.values())
        self.used = True  # asked for since the last reindex

    def __len__(self) -> int:
        return len(self._entries)

    def update(self, order: int, routable: bool) -> None:
        """The candidate at `order` changed (or joined or left the routable set)."""
        old = self._entries.pop(order, None)
        if old is not None:
            self._sorted.remove(old)
        candidate = self._slots[order]
        if routable and self.spec.member(candidate):
            entry = (self.spec.key(candidate), order)
            self._entries[order] = entry
            self._sorted.add(entry)

    def min_key(self) -> tuple[float, ...] | None:
        return self._sorted[0][0] if self._entries else None

    def pick_min(self, rng: random.Random) -> Candidate:
        """A member with the smallest key, ties at random: the same member, drawn the same way,
        as `rng.choice` over the tied candidates in discovery order (no draw for one)."""
        if not self._entries:
            raise IndexError("empty index")
        count = int(self._sorted.bisect_right((self._sorted[0][0], math.inf)))  # tied at the min
        i = 0 if count == 1 else rng.choice(range(count))
        order: int = self._sorted[i][1]
        return self._slots[order]


class CandidateView(Sequence[Candidate]):
    """One model's routable candidates in discovery order, kept current by the pool.

    As a `Sequence` it is what every strategy has always seen; `sorted_by` adds the sorted indexes.
    The candidates are live: a strategy reads them during `admit` and keeps none of them.
    """

    __slots__ = (
        "_indexes",
        "_members",
        "_routable",
        "known_capacities",
        "model",
        "slots",
    )

    def __init__(self, model: str, slots: list[Candidate]) -> None:
        self.model = model
        self.slots = slots  # every pod of the model, in discovery order
        self._members: list[int] = []  # orders of the routable ones
        self._routable: list[bool] = [False] * len(slots)
        self._indexes: dict[IndexSpec, OrderedIndex] = {}
        self.known_capacities = 0  # routable candidates with a usable capacity estimate

    # Sequence ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._members)

    @overload
    def __getitem__(self, i: int) -> Candidate: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Candidate]: ...

    def __getitem__(self, i: int | slice) -> Candidate | Sequence[Candidate]:
        if isinstance(i, slice):
            return [self.slots[o] for o in self._members[i]]
        return self.slots[self._members[i]]

    def __iter__(self) -> Iterator[Candidate]:
        slots = self.slots
        return (slots[o] for o in self._members)

    def __repr__(self) -> str:
        return f"CandidateView({self.model!r}, {len(self)} of {len(self.slots)} routable)"

    # indexes -----------------------------------------------------------------------------------
    def sorted_by(self, spec: IndexSpec) -> OrderedIndex:
        """The sorted index for `spec`, built on first use and kept current from then on."""
        found = self._indexes.get(spec)
        if found is None:
            found = self._indexes[spec] = OrderedIndex(spec, self.slots, self._members)
        else:
            found.used = True
        return found

    # maintenance (the pool calls these) --------------------------------------------------------
    def set_members(self, orders: list[int]) -> None:
        """A new routable set (discovery, ejection): indexes are rebuilt."""
        self._members = orders
        routable = [False] * len(self.slots)
        for o in orders:
            routable[o] = True
        self._routable = routable
        self.reindex()

    def reindex(self) -> None:
        """Many candidates changed at once (a capacity refresh, a new routable set): rebuild the
        indexes asked for since the last reindex and drop the others, so an index no strategy
        uses any more (a header named it once) stops costing every lease."""
        self.known_capacities = sum(
            1 for o in self._members if usable_capacity(self.slots[o].capacity)
        )
        self._indexes = {
            spec: OrderedIndex(spec, self.slots, self._members)
            for spec, index in self._indexes.items()
            if index.used
        }
        for index in self._indexes.values():
            index.used = False

    def changed(self, order: int) -> None:
        """One candidate's fields changed."""
        if self._indexes:
            routable = self._routable[order]
            for index in self._indexes.values():
                index.update(order, routable)


def usable_capacity(capacity: float | None) -> bool:
    """A capacity estimate a score may divide by: present, positive and finite."""
    return capacity is not None and capacity > 0 and math.isfinite(capacity)
