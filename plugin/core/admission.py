"""Admission's pure rules: who sent a request, which priority class it waits in, when the fleet
is full, and which waiting request goes next. The router holds requests by them (`Admission`).

- **Tenant.** The value of a configured header (an auth layer in front of the gateway sets it),
  else the request's bearer token looked up by its SHA-256 digest in the operator's table (the
  token itself is never kept, logged or exported: `token_digest` is what the table holds), else
  the default tenant. A header value is taken as given: the operator decides whether clients may
  set it (Envoy can strip it from outside traffic).
- **Class.** Classes are ranked, highest first (`interactive`, `batch`, say). A tenant waits in
  its own class (the operator's table, else the default class); a request may ask for a lower
  one by header, and for a higher one only up to the ceiling its tenant is allowed.
- **Fair order in GPU time.** Within a class the next request is the oldest one of the tenant
  with the least recent usage per weight (virtual-time fair queuing, as AIBrix's VTC strategy
  does with token counts), usage counted in GPU-seconds: prompt tokens over the serving
  replica's prefill speed plus output tokens over its learned decode throughput (`gpu_seconds`).
  A token on a replica that learned 500 tokens/s holds the GPU three times as long as one on a
  replica at 1,600 (docs/admission.md, "GPU-seconds"): counting tokens or requests, a tenant
  whose requests land on the slow type gets three times the GPU time of one on the fast type.
  A tenant is charged an estimate when its request is dispatched and the difference when it
  ends (`FairQueue.charge`), so a long stream counts from its start. A tenant that starts
  waiting after an idle spell starts at the least usage among those waiting: idling earns no
  credit (VTC's counter lift), and a newcomer does not jump ahead of everyone for as long as its
  zero counter lasts.
- **Full.** A model's fleet is full when no candidate has room: in flight at or above its batch
  cap (`Candidate.saturation`: declared, exported or learned; `UNKNOWN_CAP` before any is known)
  or, with a GPU profile whose SLO sets a time per token, at the batch that keeps it
  (`GpuProfile.slo_batch`: an engine's cap is what fits its memory, not what keeps an SLO), or
  its engine queueing (`waiting`
  at least 1 in its last fresh scrape: a KV cache fills before a declared cap). A request sent to
  a queueing engine only waits there, in arrival order, instead of here in fair order; a scrape
  as old as the scrape period may keep the fleet full that long after its queue drained.
  Overload is judged from what the fleet learned of itself, not from a fixed count. While a
  model's fleet is full, or others of its requests already wait, a new request joins the model's
  `FairQueue`; each released lease (and each pool change) lets the queue's head go to its
  strategy while there is room.
  A replica keeps `TOP_CLASS_SHARE` of its room for the highest class: the others see it full
  that much sooner.
- **A head held by its selector.** A request whose `external-filter` matches only full
  replicas does not hold back those behind it: while it waits at the head, the next ones (up to
  `LOOK_PAST` of them, in queue order) whose own replicas have room go first.
- **Shedding.** A request that waits longer than its class may is answered 503 (OpenAI's
  `overloaded_error`) with `retry-after`; when the queue is at its bound, an arrival of a higher
  class sheds the newest request of the most-used tenant in the lowest class waiting, else it is
  refused itself. `retry-after` says how long the class's oldest waiter has waited (at least 1 s):
  what a retry would likely wait again.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from plugin.core.auth import bearer_token
from plugin.core.config_profile import ConfigProfile
from plugin.core.limits import OTHER_TENANTS, LimitTable, RateLimits
from plugin.core.types import Candidate, RequestInfo
from plugin.core.view import CandidateView

__all__ = [
    "DEFAULT_TENANT",
    "OTHER_TENANTS",
    "Admission",
    "AdmissionSettings",
    "Charge",
    "ClassTable",
    "FairQueue",
    "Tenancy",
    "gpu_seconds",
    "has_room",
    "token_digest",
    "with_room",
]

DEFAULT_TENANT = "default"

T = TypeVar("T")


def token_digest(token: str) -> str:
    """What the tenant table holds for a bearer token: its SHA-256, hex."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Tenancy:
    """How a request's tenant is found (module docstring)."""

    header: str | None = None  # lower-case header name, e.g. "x-tenant"; None: not read
    tokens: Mapping[str, str] = field(default_factory=dict)  # token digest -> tenant
    default: str = DEFAULT_TENANT

    def tenant(self, header_value: str | None, authorization: str | None) -> str:
        """The tenant of a request with this header value and `authorization` header."""
        if self.header is not None and header_value:
            return header_value
        if self.tokens:
            token = bearer_token(authorization)
            if token is not None:
                return self.tokens.get(token_digest(token), self.default)
        return self.default


@dataclass(frozen=True, slots=True)
class ClassTable:
    """Priority classes, highest first, and which tenant waits in which."""

    names: tuple[str, ...] = ("default",)
    tenants: Mapping[str, str] = field(default_factory=dict)  # tenant -> its class
    default: str = "default"  # the class of a tenant the table does not name
    # Tenants that may ask for a class by header, and the highest each may ask for.
    may_ask: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.names or len(set(self.names)) != len(self.names):
            raise ValueError(f"priority classes must be distinct and at least one: {self.names}")
        named = {self.default, *self.tenants.values(), *self.may_ask.values()}
        unknown = sorted(named - set(self.names))
        if unknown:
            raise ValueError(f"unknown priority class {unknown[0]!r}; classes: {self.names}")

    def rank(self, tenant: str, asked: str | None = None) -> int:
        """The class a request waits in, as its rank (0 is the highest): the one it asked for,
        no higher than its tenant's ceiling (`may_ask`, else the tenant's own class: any request
        may step down, which costs others nothing); else its tenant's. An unknown class asked
        for is ignored."""
        names = self.names
        own = names.index(self.tenants.get(tenant, self.default))
        if asked is None or asked not in names:
            return own
        ceiling = self.may_ask.get(tenant)
        limit = own if ceiling is None else min(own, names.index(ceiling))
        return max(names.index(asked), limit)


def gpu_seconds(
    prompt_tokens: int,
    output_tokens: int,
    decode_tokens_per_s: float | None,
    prefill_tokens_per_s: float | None = None,
) -> float:
    """GPU time a request took on the replica that served it: output tokens over the replica's
    learned throughput (its whole batch's, so a token's share of the GPU), plus prompt tokens
    over its prefill speed where known. 0 for what no speed prices: a replica not learned yet
    charges nothing rather than a guess."""
    spent = 0.0
    if decode_tokens_per_s is not None and decode_tokens_per_s > 0:
        spent += max(output_tokens, 0) / decode_tokens_per_s
    if prefill_tokens_per_s is not None and prefill_tokens_per_s > 0:
        spent += max(prompt_tokens, 0) / prefill_tokens_per_s
    return spent if math.isfinite(spent) else 0.0


@dataclass(slots=True)
class _Waiting(Generic[T]):
    item: T
    tenant: str
    rank: int
    seq: int


class FairQueue(Generic[T]):
    """Waiting requests by class, then tenant usage per weight (module docstring).

    `push` is O(tenants waiting in its class) when its tenant joins the class (the lift), else
    O(1); `pop` and `peek` are O(tenants waiting in the top class); `remove` is O(its tenant's
    queue). Usage is kept for every tenant seen and forgotten by `forget_idle` (bounded by the
    caller)."""

    __slots__ = ("_by_rank", "_items", "_seq", "usage", "weights")

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self.weights = dict(weights or {})
        for tenant, weight in self.weights.items():
            if not weight > 0 or not math.isfinite(weight):
                raise ValueError(f"the weight of tenant {tenant!r} must be positive: {weight}")
        self.usage: dict[str, float] = {}  # tenant -> GPU-seconds charged / weight
        # rank -> tenant -> its waiting requests, oldest first (tenants with none removed)
        self._by_rank: dict[int, dict[str, deque[_Waiting[T]]]] = {}
        self._items: dict[int, _Waiting[T]] = {}  # id(item) -> entry
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def waiting(self, rank: int | None = None) -> int:
        """Requests waiting, in one class or all."""
        if rank is None:
            return len(self._items)
        return sum(len(q) for q in self._by_rank.get(rank, {}).values())

    def push(self, item: T, tenant: str, rank: int) -> None:
        """`item` waits in class `rank` for `tenant`. A tenant with nothing waiting in that
        class starts at the least usage among those that have (no credit for idling)."""
        if id(item) in self._items:
            raise ValueError("this request already waits")
        tenants = self._by_rank.setdefault(rank, {})
        if tenant not in tenants:
            floor = min((self.usage.get(t, 0.0) for t in tenants), default=None)
            if floor is not None and self.usage.get(tenant, 0.0) < floor:
                self._set_usage(tenant, floor)
        entry = _Waiting(item, tenant, rank, next(self._seq))
        tenants.setdefault(tenant, deque()).append(entry)
        self._items[id(item)] = entry

    def pop(self) -> tuple[T, str] | None:
        """The next request and its tenant: the highest class with any waiting, in it the
        tenant with the least usage (ties: the one whose oldest request came first), its
        oldest request. None when none waits."""
        if not self._by_rank:
            return None
        rank = min(self._by_rank)
        tenants = self._by_rank[rank]
        tenant = self._next_tenant(tenants)
        queue = tenants[tenant]
        entry = queue.popleft()
        if not queue:
            del tenants[tenant]
            if not tenants:
                del self._by_rank[rank]
        del self._items[id(entry.item)]
        return entry.item, tenant

    def peek(self) -> T | None:
        """What `pop` would return next, left waiting."""
        if not self._by_rank:
            return None
        tenants = self._by_rank[min(self._by_rank)]
        return tenants[self._next_tenant(tenants)][0].item

    def in_order(self, limit: int) -> list[T]:
        """Up to `limit` waiting requests in the order `pop` takes them while no usage changes:
        class by class, tenants by usage (then their oldest request), each tenant's oldest
        first. O(tenants log tenants) per class looked at: for the rare path that looks past
        the head."""
        found: list[T] = []
        usage = self.usage
        for rank in sorted(self._by_rank):
            tenants = self._by_rank[rank]
            for tenant in sorted(tenants, key=lambda t: (usage.get(t, 0.0), tenants[t][0].seq)):
                for entry in tenants[tenant]:
                    if len(found) >= limit:
                        return found
                    found.append(entry.item)
        return found

    def items(self) -> list[T]:
        """Every waiting request (any order)."""
        return [e.item for e in self._items.values()]

    def oldest(self, rank: int) -> T | None:
        """The request that has waited longest in class `rank`, None if none waits there."""
        tenants = self._by_rank.get(rank)
        if not tenants:
            return None
        return min((q[0] for q in tenants.values()), key=lambda e: e.seq).item

    def shed(self, rank: int) -> T | None:
        """A request to refuse so that one of class `rank` may wait: in the lowest class
        waiting, if it is below `rank`, the newest request of the tenant with the most usage
        there; taken out. None when nothing waits below `rank`."""
        if not self._by_rank:
            return None
        lowest = max(self._by_rank)
        if lowest <= rank:
            return None
        tenants = self._by_rank[lowest]
        usage = self.usage
        tenant = max(tenants, key=lambda t: (usage.get(t, 0.0), tenants[t][-1].seq))
        item = tenants[tenant][-1].item
        self.remove(item)
        return item

    def remove(self, item: T) -> bool:
        """Take `item` out (it was cancelled or timed out); False if it was not waiting."""
        entry = self._items.pop(id(item), None)
        if entry is None:
            return False
        tenants = self._by_rank[entry.rank]
        queue = tenants[entry.tenant]
        queue.remove(entry)  # O(its tenant's queue): removals are the rare path
        if not queue:
            del tenants[entry.tenant]
            if not tenants:
                del self._by_rank[entry.rank]
        return True

    def charge(self, tenant: str, gpu_s: float) -> None:
        """Add GPU-seconds to `tenant`'s usage (an estimate at dispatch; the difference,
        possibly negative, when the request ends), scaled by its weight (default 1)."""
        if not math.isfinite(gpu_s):
            return
        weight = self.weights.get(tenant, 1.0)
        self._set_usage(tenant, max(0.0, self.usage.get(tenant, 0.0) + gpu_s / weight))

    def forget_idle(self, keep: int) -> None:
        """Drop the usage of the least recently charged tenants with nothing waiting until at
        most `keep` are left (a bound on memory for many tenants; a dropped tenant that returns
        while others wait starts at their floor anyway)."""
        excess = len(self.usage) - keep
        if excess <= 0:
            return
        waiting = {e.tenant for e in self._items.values()}
        for tenant in [t for t in self.usage if t not in waiting][:excess]:
            del self.usage[tenant]

    def _next_tenant(self, tenants: dict[str, deque[_Waiting[T]]]) -> str:
        """Of the tenants waiting in one class: the least usage, then the oldest request."""
        usage = self.usage
        return min(tenants, key=lambda t: (usage.get(t, 0.0), tenants[t][0].seq))

    def _set_usage(self, tenant: str, value: float) -> None:
        """Set and move to the end: `usage` is kept in order of last change."""
        self.usage.pop(tenant, None)
        self.usage[tenant] = value


# The batch cap admission assumes of a replica whose cap is not known yet: vLLM's default
# `--max-num-seqs`. Without one, the engine's queue (read once a scrape period) is the only
# bound, and a whole queue would pass in the period before the next scrape shows it.
UNKNOWN_CAP = 256


# The share of each replica's room kept for the highest priority class: below the top class a
# replica is full this much sooner, so a top-class request finds room while the others wait,
# and a batch held at its SLO size by lower classes is smaller by this much (the margin against
# the long prefills that stretch a full batch's steps).
TOP_CLASS_SHARE = 0.1

_ROOM, _TOP_ONLY = 0, 1

# Waiting requests looked at past a head whose `external-filter` matches only full replicas.
LOOK_PAST = 16  # room for every class; room for the highest class only


def _room(candidate: Candidate) -> int | None:
    """`_ROOM`, `_TOP_ONLY` or None (full): below its batch cap (`UNKNOWN_CAP` while none is
    known) and its GPU profile's SLO batch, less `TOP_CLASS_SHARE` of it below the top class;
    and its engine not queueing (module docstring)."""
    waiting = candidate.waiting
    if waiting is not None and waiting >= 1:
        return None
    cap = candidate.saturation
    if cap is None:
        cap = UNKNOWN_CAP
    profile = candidate.profile
    if profile is not None and profile.slo_batch is not None and profile.slo_batch < cap:
        cap = profile.slo_batch
    running = candidate.running
    if running >= cap:
        return None
    return _ROOM if running < cap - math.floor(cap * TOP_CLASS_SHARE) else _TOP_ONLY


@dataclass(frozen=True, slots=True, eq=False)
class _ByRoom:
    """Group spec: the candidates with room, by whom it is for (a view counts them in O(1))."""

    def group(self, candidate: Candidate) -> Hashable | None:
        return _room(candidate)

    def key(self, candidate: Candidate) -> tuple[float, ...]:
        return ()


_BY_ROOM = _ByRoom()


def has_room(candidates: Sequence[Candidate], top: bool = True) -> bool:
    """Whether some candidate can take a request of the highest class (`top`), or of any
    class, without queueing it (module docstring): O(1) on a pool's `CandidateView` (an index
    kept current per lease), a pass over a plain list."""
    if isinstance(candidates, CandidateView):
        counts = candidates.counted_by(_BY_ROOM).counts
        return bool(counts) if top else _ROOM in counts
    if top:
        return any(_room(c) is not None for c in candidates)
    return any(_room(c) == _ROOM for c in candidates)


def with_room(candidates: Sequence[Candidate], top: bool = True) -> Sequence[Candidate]:
    """The candidates with room for a request of the highest class (`top`) or of any:
    `candidates` itself when all have (O(1) on a view, the common case), else those (a pass).
    A request admitted for room goes where the room is; a strategy free to pick a full replica
    would queue it there and leave the room unused, letting the whole queue through."""
    if isinstance(candidates, CandidateView):
        counts = candidates.counted_by(_BY_ROOM).counts
        count = counts.get(_ROOM, 0) + (counts.get(_TOP_ONLY, 0) if top else 0)
        if count == len(candidates):
            return candidates
    if top:
        return [c for c in candidates if _room(c) is not None]
    return [c for c in candidates if _room(c) == _ROOM]


class Charge(NamedTuple):
    """GPU-seconds charged to a request's tenant when it was routed, and the speeds they were
    priced at (its replica's, then): the settlement prices the real output the same way."""

    gpu_s: float
    decode_tokens_per_s: float | None
    prefill_tokens_per_s: float | None


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """Admission as the operator declares it (`plugin.config`: the HETERO_GATEWAY_ADMISSION_*
    and HETERO_GATEWAY_TENANT_* variables)."""

    tenancy: Tenancy = field(default_factory=Tenancy)
    classes: ClassTable = field(default_factory=ClassTable)
    class_header: str = "x-priority-class"  # the class a request asks for, where allowed
    weights: Mapping[str, float] = field(default_factory=dict)  # tenant -> weight (default 1)
    max_wait_s: float = 30.0  # the longest a request waits in the queue
    class_max_wait_s: Mapping[str, float] = field(default_factory=dict)  # class -> its own
    max_waiting: int = 1000  # per model; beyond, the lowest class is shed
    max_tenants: int = 1000  # tenants whose usage is remembered per model
    # What fairness counts: `gpu-seconds` (the point), or, to compare with peers' rules,
    # `tokens` (prompt and output, as AIBrix's VTC) or `requests` (as the endpoint picker's flow
    # control): benchmarks/admission.py runs all three.
    measure: str = "gpu-seconds"
    # Per-tenant limits a minute, across gateways (`plugin.core.limits`); empty: none.
    limits: LimitTable = field(default_factory=LimitTable)

    def __post_init__(self) -> None:
        if self.measure not in MEASURES:
            raise ValueError(f"measure must be one of {MEASURES}: {self.measure!r}")


MEASURES = ("gpu-seconds", "tokens", "requests")


class Admission:
    """Per model, the fair queue of requests held for room, and every tenant's GPU time.

    The router asks `should_hold` on arrival, `pushes` what it holds, dispatches the `head`
    while `has_room`, and charges what it routes (`estimate`, then `settle` at the end). Items
    are the router's waiters; nothing here reads a clock or keeps a pod.
    """

    __slots__ = ("_named", "gpu_seconds", "limits", "queues", "settings", "shed")

    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        # The tenants' rate limits, checked before a request is routed (None: no limits).
        self.limits = RateLimits(settings.limits, settings.max_tenants) if settings.limits else None
        self.queues: dict[str, FairQueue[object]] = {}  # model -> its queue (made on first use)
        # For /metrics: GPU-seconds the requests of each (model, tenant) took, settled (at most
        # `max_tenants` tenants a model by name, the rest as OTHER_TENANTS), and requests shed
        # per (model, class, why).
        self.gpu_seconds: dict[tuple[str, str], float] = {}
        self.shed: dict[tuple[str, str, str], int] = {}
        self._named: dict[str, int] = {}  # model -> tenants named in `gpu_seconds`

    def rank(self, request: RequestInfo) -> int:
        return self.settings.classes.rank(request.tenant, request.priority_class)

    def max_wait_s(self, rank: int, profile: ConfigProfile | None = None) -> float:
        """The longest a request of class `rank` waits: its config profile's for its class,
        else the profile's own (`routingConfig.admission`), else its class's, else the
        default; a profile's never beyond the longest the settings allow (Envoy's hold timeout
        is set from them)."""
        settings = self.settings
        names = settings.classes.names
        name = names[min(rank, len(names) - 1)]
        wait = settings.class_max_wait_s.get(name, settings.max_wait_s)
        if profile is not None:
            own_ms = profile.admission_class_wait_ms.get(name, profile.admission_wait_ms)
            if own_ms is not None:
                longest = max([settings.max_wait_s, *settings.class_max_wait_s.values()])
                wait = min(own_ms / 1000.0, longest)
        return wait

    def queue(self, model: str) -> FairQueue[object]:
        found = self.queues.get(model)
        if found is None:
            found = self.queues[model] = FairQueue(self.settings.weights)
        return found

    def waiting(self, model: str) -> int:
        found = self.queues.get(model)
        return len(found) if found is not None else 0

    def should_hold(self, model: str, candidates: Sequence[Candidate], rank: int) -> bool:
        """Whether an arrival of class `rank` waits: others of its model already do, or none
        has room for its class."""
        return self.waiting(model) > 0 or not has_room(candidates, rank == 0)

    def estimate(
        self, request: RequestInfo, candidate: Candidate, predicted: int | None = None
    ) -> Charge:
        """What the tenant is charged when the request is routed to `candidate`: its prompt and
        `predicted` output (else `max_tokens`, else none) at the replica's speeds, which the
        settlement at the end prices the real output by. With a GPU profile, its prefill and
        decode speeds (`GpuProfile.prefill_tokens_per_s`, `decode_tokens_per_s`); without, the
        output at the replica's learned throughput and the prompt free: that throughput counts
        output tokens over all the replica's busy time, its prefills included, so it prices
        them inside the output (well for a mix like the fleet's, poorly for a tenant of long
        prompts and short answers on a replica busy with others')."""
        output = predicted or request.max_tokens or 0
        profile = candidate.profile
        prefill = profile.prefill_tokens_per_s if profile is not None else None
        decode = profile.decode_tokens_per_s if profile is not None else None
        charge = Charge(0.0, decode or candidate.capacity, prefill)
        return charge._replace(gpu_s=self._amount(request.prompt_tokens, output, charge))

    def settle(self, request: RequestInfo, output_tokens: int, charge: Charge) -> None:
        """The request ended with `output_tokens`: charge its tenant the difference between
        what it took and the estimate (possibly negative)."""
        spent = self._amount(request.prompt_tokens, output_tokens, charge)
        self.charge(request.model, request.tenant, spent - charge.gpu_s)
        took = gpu_seconds(
            request.prompt_tokens,
            output_tokens,
            charge.decode_tokens_per_s,
            charge.prefill_tokens_per_s,
        )
        model = request.model
        key = (model, request.tenant)
        totals = self.gpu_seconds
        if key not in totals:
            named = self._named.get(model, 0)
            if named >= self.settings.max_tenants:
                key = (model, OTHER_TENANTS)  # a bound on the metric's series
            else:
                self._named[model] = named + 1
        totals[key] = totals.get(key, 0.0) + took

    def count_shed(self, request: RequestInfo, why: str) -> None:
        """A request of this class was refused (`why`: `timeout`, `displaced`, `full`)."""
        names = self.settings.classes.names
        key = (request.model, names[min(self.rank(request), len(names) - 1)], why)
        self.shed[key] = self.shed.get(key, 0) + 1

    def waiting_by_class(self) -> dict[tuple[str, str], int]:
        """Requests waiting per (model, class)."""
        names = self.settings.classes.names
        return {
            (model, name): queue.waiting(rank)
            for model, queue in self.queues.items()
            for rank, name in enumerate(names)
        }

    def _amount(self, prompt_tokens: int, output_tokens: int, charge: Charge) -> float:
        measure = self.settings.measure
        if measure == "gpu-seconds":
            return gpu_seconds(
                prompt_tokens,
                output_tokens,
                charge.decode_tokens_per_s,
                charge.prefill_tokens_per_s,
            )
        if measure == "tokens":
            return float(max(prompt_tokens, 0) + max(output_tokens, 0))
        return 1.0

    def charge(self, model: str, tenant: str, gpu_s: float) -> None:
        """Add to the tenant's usage in the model's queue (an estimate, or a settlement's
        difference), bounding how many tenants are remembered."""
        queue = self.queue(model)
        queue.charge(tenant, gpu_s)
        if len(queue.usage) > self.settings.max_tenants:
            queue.forget_idle(self.settings.max_tenants)
