"""Per-model candidate state kept current as events arrive, so routing costs the same at any size.

`PodPool` keeps one `CandidateView` per model: one `Candidate` per pod, updated in place when a
lease is taken or released, a scrape lands, capacities refresh or other gateways' counts
arrive, and the list of routable candidates (ready, not ejected) in discovery order. A request
then gets the view itself instead of a list built for it.

A strategy whose rule is "the smallest key, ties at random" asks the view for an `OrderedIndex`
on its key (`view.sorted_by(spec)`): a sorted list the view updates with each candidate change, so
the pick costs O(log n) instead of a pass over the pool. The index answers exactly what the
straightforward pass over the same candidates answers, random tie-break included (it draws
from the same `rng` the same way); `tests/unit/test_view.py` holds both to that on random pools.

A strategy whose rule first splits the pool (SLO routing: by deployment, whose GPU profile
decides what a request costs there) asks for a `GroupedIndex` (`view.grouped_by(spec)`): one
sorted list per group, kept current the same way, so it reads a few groups' ends instead of
every candidate. `tied_run`/`choose_tied` then draw among candidates tied across groups exactly
as `rng.choice` over them in discovery order would. A rule that only asks how many candidates
are in each group (admission: how many have room) asks for `GroupCounts` (`view.counted_by`):
a count per group, O(1) to keep.
`docs/architecture.md` ("Routing at scale") says which strategy uses what.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, Protocol, overload

from sortedcontainers import SortedList

from plugin.core.types import Candidate

__all__ = [
    "CandidateView",
    "GroupCounts",
    "GroupSpec",
    "GroupedIndex",
    "IndexSpec",
    "OrderedIndex",
    "Run",
    "choose_tied",
    "tied_run",
]


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

    def rebuilt(self, members: Sequence[int]) -> OrderedIndex:
        return OrderedIndex(self.spec, self._slots, members)

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


class GroupSpec(Protocol):
    """How a grouped index splits and orders candidates (identity-hashed, made once, like
    `IndexSpec`)."""

    def group(self, candidate: Candidate) -> Hashable | None:
        """The candidate's group; None: not in the index."""
        ...

    def key(self, candidate: Candidate) -> tuple[float, ...]:
        """Order within the group; smaller first; never NaN."""
        ...


class GroupedIndex:
    """The view's routable candidates by `spec.group`, each group sorted by (`spec.key`, order).

    `groups` maps a group to its sorted entries (`(key, order)`, a `SortedList`); an emptied
    group is dropped, so it lists exactly the groups that have a routable member.
    """

    __slots__ = ("_slots", "_where", "groups", "spec", "used")

    def __init__(self, spec: GroupSpec, slots: Sequence[Candidate], members: Sequence[int]) -> None:
        self.spec = spec
        self._slots = slots
        self._where: dict[int, tuple[Hashable, _Entry]] = {}
        self.groups: dict[Hashable, Any] = {}
        for order in members:
            self._add(order)
        self.used = True

    def rebuilt(self, members: Sequence[int]) -> GroupedIndex:
        return GroupedIndex(self.spec, self._slots, members)

    def _add(self, order: int) -> None:
        candidate = self._slots[order]
        group = self.spec.group(candidate)
        if group is None:
            return
        entry = (self.spec.key(candidate), order)
        self._where[order] = (group, entry)
        entries = self.groups.get(group)
        if entries is None:
            entries = self.groups[group] = SortedList()
        entries.add(entry)

    def update(self, order: int, routable: bool) -> None:
        """The candidate at `order` changed (or joined or left the routable set)."""
        old = self._where.pop(order, None)
        if old is not None:
            group, entry = old
            entries = self.groups[group]
            entries.remove(entry)
            if not entries:
                del self.groups[group]
        if routable:
            self._add(order)

    def first(self, group: Hashable) -> Candidate:
        """Some member of `group` (its first entry)."""
        order: int = self.groups[group][0][1]
        return self._slots[order]


class GroupCounts:
    """How many of the view's routable candidates are in each `spec.group` (`key` unused);
    a group with none is dropped, so `counts` lists exactly the groups that have a member."""

    __slots__ = ("_slots", "_where", "counts", "spec", "used")

    def __init__(self, spec: GroupSpec, slots: Sequence[Candidate], members: Sequence[int]) -> None:
        self.spec = spec
        self._slots = slots
        self._where: dict[int, Hashable] = {}
        self.counts: dict[Hashable, int] = {}
        for order in members:
            self._add(order)
        self.used = True

    def rebuilt(self, members: Sequence[int]) -> GroupCounts:
        return GroupCounts(self.spec, self._slots, members)

    def _add(self, order: int) -> None:
        group = self.spec.group(self._slots[order])
        if group is not None:
            self._where[order] = group
            self.counts[group] = self.counts.get(group, 0) + 1

    def update(self, order: int, routable: bool) -> None:
        """The candidate at `order` changed (or joined or left the routable set)."""
        old = self._where.pop(order, None)
        if old is not None:
            left = self.counts[old] - 1
            if left:
                self.counts[old] = left
            else:
                del self.counts[old]
        if routable:
            self._add(order)


_FEW_TIED = 32

# A run of tied entries in one group's sorted list: (entries, key, start, stop).
Run = tuple[Any, tuple[float, ...], int, int]


def tied_run(entries: Any, key: tuple[float, ...]) -> Run:
    """The entries of a sorted list whose key equals `key` (a contiguous run, by order)."""
    start = int(entries.bisect_left((key, -1)))
    stop = int(entries.bisect_right((key, math.inf)))
    return entries, key, start, stop


def choose_tied(runs: Sequence[Run], slots: Sequence[Candidate], rng: random.Random) -> Candidate:
    """One candidate of the runs (all tied), drawn as `rng.choice` over them in discovery order
    draws it (no draw for one): the i-th smallest order across runs, by bisection on the order,
    O(runs x log^2 n) however many are tied."""
    total = sum(stop - start for _, _, start, stop in runs)
    if total <= 0:
        raise IndexError("no tied candidate")
    i = 0 if total == 1 else rng.choice(range(total))
    if len(runs) == 1:
        entries, _, start, _ = runs[0]
        order: int = entries[start + i][1]
        return slots[order]
    if total <= _FEW_TIED:  # cheaper to list them
        orders: list[int] = sorted(
            entries[k][1] for entries, _, start, stop in runs for k in range(start, stop)
        )
        return slots[orders[i]]

    def at_most(x: int) -> int:  # tied entries with order <= x
        return sum(
            min(stop, int(entries.bisect_right((key, x)))) - start
            for entries, key, start, stop in runs
        )

    lo, hi = 0, len(slots) - 1
    while lo < hi:  # the smallest order x with at_most(x) > i
        mid = (lo + hi) // 2
        if at_most(mid) > i:
            hi = mid
        else:
            lo = mid + 1
    return slots[lo]


class CandidateView(Sequence[Candidate]):
    """One model's routable candidates in discovery order, kept current by the pool.

    As a `Sequence` it is what every strategy has always seen; `sorted_by` adds the sorted indexes.
    The candidates are live: a strategy reads them during `admit` and keeps none of them.
    """

    __slots__ = (
        "_indexes",
        "_members",
        "_routable",
        "_running",
        "capacity_total",
        "known_capacities",
        "model",
        "running_total",
        "slots",
    )

    def __init__(self, model: str, slots: list[Candidate]) -> None:
        self.model = model
        self.slots = slots  # every pod of the model, in discovery order
        self._members: list[int] = []  # orders of the routable ones
        self._routable: list[bool] = [False] * len(slots)
        self._indexes: dict[IndexSpec | GroupSpec, OrderedIndex | GroupedIndex | GroupCounts] = {}
        self.known_capacities = 0  # routable candidates with a usable capacity estimate
        self.capacity_total = 0.0  # the sum of those estimates (set with known_capacities)
        self._running = [0] * len(slots)  # each routable candidate's running, as summed
        self.running_total = 0  # requests in flight over the routable candidates, kept current

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
        assert isinstance(found, OrderedIndex)
        return found

    def grouped_by(self, spec: GroupSpec) -> GroupedIndex:
        """The grouped index for `spec`, built on first use and kept current from then on."""
        found = self._indexes.get(spec)
        if found is None:
            found = self._indexes[spec] = GroupedIndex(spec, self.slots, self._members)
        else:
            found.used = True
        assert isinstance(found, GroupedIndex)
        return found

    def counted_by(self, spec: GroupSpec) -> GroupCounts:
        """The group counts for `spec`, built on first use and kept current from then on."""
        found = self._indexes.get(spec)
        if found is None:
            found = self._indexes[spec] = GroupCounts(spec, self.slots, self._members)
        else:
            found.used = True
        assert isinstance(found, GroupCounts)
        return found

    # maintenance (the pool calls these) --------------------------------------------------------
    def set_members(self, orders: list[int]) -> None:
        """A new routable set (discovery, ejection): indexes are rebuilt."""
        self._members = orders
        routable = [False] * len(self.slots)
        for o in orders:
            routable[o] = True
        self._routable = routable
        running = [0] * len(self.slots)
        for o in orders:
            running[o] = self.slots[o].running
        self._running = running
        self.running_total = sum(running)
        self.reindex()

    def reindex(self) -> None:
        """Many candidates changed at once (a capacity refresh, a new routable set): rebuild the
        indexes asked for since the last reindex and drop the others, so an index no strategy
        uses any more (a header named it once) stops costing every lease."""
        known = [
            capacity
            for o in self._members
            if (capacity := self.slots[o].capacity) is not None and usable_capacity(capacity)
        ]
        self.known_capacities = len(known)
        self.capacity_total = sum(known)
        self._indexes = {
            spec: index.rebuilt(self._members)
            for spec, index in self._indexes.items()
            if index.used
        }
        for index in self._indexes.values():
            index.used = False

    def changed(self, order: int) -> None:
        """One candidate's fields changed."""
        routable = self._routable[order]
        if routable:
            running = self.slots[order].running
            self.running_total += running - self._running[order]
            self._running[order] = running
        if self._indexes:
            for index in self._indexes.values():
                index.update(order, routable)


def usable_capacity(capacity: float | None) -> bool:
    """A capacity estimate a score may divide by: present, positive and finite."""
    return capacity is not None and capacity > 0 and math.isfinite(capacity)
