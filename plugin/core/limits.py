"""Per-tenant rate limits: requests, tokens and GPU-seconds a window (a minute), held across
gateway replicas. The router checks them before it routes (`RateLimits.reserve`).

- **A rolling window.** Each tenant's usage is kept in buckets of a sixtieth of the window, and
  what counts is the last 61 of them: at least the whole window, at most a bucket more. A fixed
  minute would let a tenant take its limit at the end of one minute and again at the start of
  the next (twice the limit within a minute); a rolling one holds any window to the limit, and
  a tenant held at its limit gets about 60/60.5 of it.
- **Reserved before routing, settled at the end.** A request passes when its tenant's usage plus
  what the request may take fits under each of the tenant's limits: one request; its prompt and
  `max_tokens` (else its predicted output) in tokens; in GPU-seconds, those tokens at the
  GPU-seconds a token the tenant's requests took lately (nothing before one has ended). Its
  reservation counts at once, is priced again at the replica it is routed to (`priced`), and is
  settled at the end with the tokens counted and the GPU time they took (`settle`): a stream
  counts at its whole `max_tokens` from its start, so it cannot run past its budget unnoticed.
  A request refused, shed, or given up before it was routed gives its reservation back.
- **Across gateways.** Each gateway publishes its own usage totals (`totals`; through Redis:
  `plugin.adapters.redis_state`) and reads the others' sum (`set_shared`): a request is checked
  against this gateway's usage, current to the request, plus the others', at most a sync period
  old. What the others admitted in their last period is the overshoot: at most the usage they
  admit in one sync period, and a request each.
- **Without the shared view** (Redis unreachable, or before the first sync), each gateway holds
  its tenants to its share of each limit: the limit over the number of gateways last seen
  sharing it (`set_local`). A gateway alone holds the whole limit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from plugin.errors import RateLimited

__all__ = [
    "BUCKETS",
    "HEADERS",
    "KINDS",
    "Limit",
    "LimitTable",
    "RateLimits",
    "Reservation",
    "duration_text",
]

KINDS = ("requests", "tokens", "gpu-seconds")  # a limit's kinds, in `Limit.values()` order
_GPU = 2  # the GPU-seconds' place in a limit's values
# The response headers `RateLimits.headers` may send (OpenAI's names, GPU-seconds beside them).
_HEADER_NAMES = tuple(
    tuple(f"x-ratelimit-{what}-{kind}" for what in ("limit", "remaining", "reset"))
    for kind in KINDS
)
HEADERS = tuple(name for names in _HEADER_NAMES for name in names)
BUCKETS = 60  # buckets a window; one more is counted (module docstring)
OTHER_TENANTS = "(other)"  # the metric label of tenants beyond the bound
# How fast a tenant's GPU-seconds a token follows its ended requests (exponential mean).
_PER_TOKEN_WEIGHT = 0.2


@dataclass(frozen=True, slots=True)
class Limit:
    """A tenant's limits a window; None: that kind is not limited."""

    requests: float | None = None
    tokens: float | None = None
    gpu_seconds: float | None = None

    def __post_init__(self) -> None:
        for kind, value in zip(KINDS, self.values(), strict=True):
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"a {kind} limit must be a positive number: {value}")

    def values(self) -> tuple[float | None, float | None, float | None]:
        return self.requests, self.tokens, self.gpu_seconds


@dataclass(frozen=True, slots=True)
class LimitTable:
    """The operator's limits: per tenant, and for each tenant not named (`every`)."""

    tenants: Mapping[str, Limit] = field(default_factory=dict)
    every: Limit | None = None
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and math.isfinite(self.window_s)):
            raise ValueError(f"the limit window must be a positive number: {self.window_s}")

    def __bool__(self) -> bool:
        return bool(self.tenants) or self.every is not None

    def of(self, tenant: str) -> Limit | None:
        found = self.tenants.get(tenant)
        return found if found is not None else self.every


class Reservation:
    """What one request holds of its tenant's limits: its bucket and amounts, until settled or
    given back (then `open` is False and nothing more changes)."""

    __slots__ = ("amounts", "bucket", "open", "tenant")

    def __init__(self, tenant: str, bucket: int, amounts: list[float]) -> None:
        self.tenant = tenant
        self.bucket = bucket
        self.amounts = amounts  # [requests, tokens, GPU-seconds]
        self.open = True


class _Usage:
    """One tenant's usage on this gateway: `[bucket, requests, tokens, GPU-seconds]` entries,
    oldest first, buckets increasing, and their sums."""

    __slots__ = ("entries", "sums")

    def __init__(self) -> None:
        self.entries: deque[list[float]] = deque()
        self.sums = [0.0, 0.0, 0.0]

    def expire(self, oldest: int) -> None:
        """Drop the buckets before `oldest`."""
        entries, sums = self.entries, self.sums
        while entries and entries[0][0] < oldest:
            gone = entries.popleft()
            sums[0] -= gone[1]
            sums[1] -= gone[2]
            sums[2] -= gone[3]
        if not entries:
            sums[0] = sums[1] = sums[2] = 0.0  # no rounding residue kept

    def add(self, bucket: int, amounts: Sequence[float]) -> None:
        """Add to `bucket` (the newest, usually; an older one when a settlement corrects it)."""
        entries = self.entries
        entry: list[float] | None = None
        if entries and entries[-1][0] == bucket:
            entry = entries[-1]
        elif not entries or entries[-1][0] < bucket:
            entry = [float(bucket), 0.0, 0.0, 0.0]
            entries.append(entry)
        else:
            for i in range(len(entries) - 1, -1, -1):
                here = entries[i][0]
                if here == bucket:
                    entry = entries[i]
                    break
                if here < bucket:
                    entry = [float(bucket), 0.0, 0.0, 0.0]
                    entries.insert(i + 1, entry)
                    break
            else:
                entry = [float(bucket), 0.0, 0.0, 0.0]
                entries.appendleft(entry)
        sums = self.sums
        for k in range(3):
            entry[k + 1] += amounts[k]
            sums[k] += amounts[k]


class RateLimits:
    """Every limited tenant's usage on this gateway, the other gateways' last published sums,
    and the checks (module docstring). Times are wall-clock seconds, the same on every gateway
    (the buckets must line up across them); nothing here reads a clock."""

    __slots__ = (
        "_bucket_s",
        "_others",
        "_tidy_at",
        "_usage",
        "max_tenants",
        "per_token",
        "refused",
        "shared",
        "sharing",
        "table",
    )

    def __init__(self, table: LimitTable, max_tenants: int = 10_000) -> None:
        self.table = table
        self._bucket_s = table.window_s / BUCKETS
        self._usage: dict[str, _Usage] = {}
        self._others: dict[str, Sequence[float]] = {}  # tenant -> the other gateways' sums
        self.shared = False  # the others' sums are current (a sync succeeded lately)
        self.sharing = 1  # gateways last seen sharing the limits: the divisor without the view
        self.max_tenants = max_tenants
        self._tidy_at = max_tenants
        # Tenant -> GPU-seconds a token its requests took lately: prices a reservation before
        # its replica is known.
        self.per_token: dict[str, float] = {}
        # (tenant, kind) -> requests refused, for /metrics (bounded by the caller's tenants).
        self.refused: dict[tuple[str, str], int] = {}

    # the request path ------------------------------------------------------------------------
    def reserve(self, tenant: str, tokens: int, now: float) -> Reservation | None:
        """Reserve one request and `tokens` (prompt and `max_tokens`) for `tenant`, or raise
        `RateLimited` (429) naming the first limit it would exceed. None: not limited."""
        limit = self.table.of(tenant)
        if limit is None:
            return None
        bucket = math.floor(now / self._bucket_s)
        usage = self._usage.get(tenant)
        if usage is None:
            if len(self._usage) >= self._tidy_at:
                self._tidy(bucket)
            usage = self._usage[tenant] = _Usage()
        else:
            usage.expire(bucket - BUCKETS)
        need = [1.0, float(max(tokens, 0)), max(tokens, 0) * self.per_token.get(tenant, 0.0)]
        others = self._others.get(tenant) if self.shared else None
        scale = 1.0 if self.shared else 1.0 / self.sharing
        sums = usage.sums
        for k, full in enumerate(limit.values()):
            if full is None:
                continue
            cap = full * scale
            # Alone, a negative own sum (refunds of requests reserved elsewhere) counts as none.
            own = sums[k] if others is not None else max(sums[k], 0.0)
            used = own + (others[k] if others is not None else 0.0)
            if (used < cap and used + need[k] <= cap) or (used <= 0.0 and need[k] <= full):
                continue  # fits; a share smaller than one request still serves one at a time
            key = (tenant, KINDS[k])
            if key not in self.refused and len(self.refused) >= 3 * self.max_tenants:
                key = (OTHER_TENANTS, KINDS[k])  # a bound on the metric's series
            self.refused[key] = self.refused.get(key, 0) + 1
            refusal = self._refusal(tenant, k, cap, full, used, need[k], usage, others, now)
            refusal.extra_headers += tuple(self.headers(tenant, now))
            raise refusal
        usage.add(bucket, need)
        return Reservation(tenant, bucket, need)

    def priced(self, reservation: Reservation | None, gpu_s: float, now: float) -> None:
        """The request was routed: its GPU-seconds as priced at its replica."""
        if reservation is not None and reservation.open:
            limit = self.table.of(reservation.tenant)
            if limit is None or limit.gpu_seconds is None:
                return  # not limited in GPU time: settled at the end like the rest
            amounts = reservation.amounts
            self._correct(reservation, [amounts[0], amounts[1], max(gpu_s, 0.0)], now)

    def settle(
        self, reservation: Reservation | None, tokens: int, gpu_s: float, now: float
    ) -> None:
        """The request ended having taken `tokens` (prompt and output) and `gpu_s`."""
        if reservation is None or not reservation.open:
            return
        tokens = max(tokens, 0)
        if tokens > 0 and gpu_s > 0 and math.isfinite(gpu_s):
            seen = self.per_token.get(reservation.tenant)
            per = gpu_s / tokens
            w = _PER_TOKEN_WEIGHT
            self.per_token[reservation.tenant] = per if seen is None else seen + w * (per - seen)
        self._correct(reservation, [1.0, float(tokens), max(gpu_s, 0.0)], now)
        reservation.open = False

    def settle_handed(
        self,
        tenant: str,
        bucket: int,
        reserved: Sequence[float],
        tokens: int,
        gpu_s: float,
        now: float,
    ) -> None:
        """Settle here a request another gateway reserved (its usage holds `reserved`, taken in
        `bucket`): the difference goes into this gateway's usage, in that bucket, and the sum
        over the gateways is what the request used. Nothing for a tenant not limited here."""
        limit = self.table.of(tenant)
        if limit is None or len(reserved) != 3:
            return
        current = math.floor(now / self._bucket_s)
        if not current - BUCKETS <= bucket <= current:
            return  # not a bucket a live reservation can be in: refund nothing
        # No refund beyond what a reservation within the limits could hold.
        caps = [c if c is not None else math.inf for c in limit.values()]
        held = [min(float(x), caps[k]) for k, x in enumerate(reserved)]
        self.settle(Reservation(tenant, bucket, held), tokens, gpu_s, now)

    def release(self, reservation: Reservation | None, now: float) -> None:
        """The request was refused or given up before it ran: its reservation is given back."""
        if reservation is None or not reservation.open:
            return
        self._correct(reservation, [0.0, 0.0, 0.0], now)
        reservation.open = False

    def headers(self, tenant: str, now: float) -> list[tuple[str, str]]:
        """`x-ratelimit-*` headers, as OpenAI sends them, for each kind `tenant` is limited in:
        the limit, what remains of it now, and the time until it is whole again (a Go duration,
        as OpenAI writes it: `1m0s`, `250ms`). Empty when the tenant is not limited. Once per
        routed request: kept to plain arithmetic and one string each."""
        limit = self.table.of(tenant)
        if limit is None:
            return []
        bs = self._bucket_s
        usage = self._usage.get(tenant)
        entries: deque[list[float]] | Sequence[list[float]] = ()
        sums: Sequence[float] = (0.0, 0.0, 0.0)
        if usage is not None:
            usage.expire(math.floor(now / bs) - BUCKETS)
            entries, sums = usage.entries, usage.sums
        others = self._others.get(tenant) if self.shared else None
        scale = 1.0 if self.shared else 1.0 / self.sharing
        window = self.table.window_s
        out: list[tuple[str, str]] = []
        for k, cap in enumerate(limit.values()):
            if cap is None:
                continue
            cap *= scale
            mine = sums[k]
            if others is not None:
                theirs = others[k]
            else:
                theirs = 0.0
                mine = mine if mine > 0.0 else 0.0
            left = cap - mine - theirs
            # Whole again when this gateway's newest usage of the kind leaves the window, and
            # the others' (their timing unknown here) within a window.
            reset = window if theirs > 1e-9 else 0.0
            for entry in reversed(entries):
                if entry[k + 1] > 1e-9:
                    mine_s = (entry[0] + BUCKETS + 1) * bs - now
                    reset = mine_s if mine_s > reset else reset
                    break
            names = _HEADER_NAMES[k]
            out.append((names[0], _amount_text(k, cap)))
            left = min(max(left, 0.0), cap)
            out.append((names[1], _amount_text(k, left, down=True)))
            out.append((names[2], duration_text(reset)))
        return out

    # sharing ---------------------------------------------------------------------------------
    def totals(self, now: float) -> dict[str, list[float]]:
        """This gateway's usage in the window per tenant, for the others (tenants whose
        buckets have all left the window are forgotten and left out)."""
        bucket = math.floor(now / self._bucket_s)
        self._tidy(bucket)
        return {tenant: [round(s, 6) for s in usage.sums] for tenant, usage in self._usage.items()}

    def carry_over(self, previous: Mapping[str, Sequence[float]], now: float) -> None:
        """Usage a previous process under this gateway's name published (a restart keeps the
        pod's name): counted as used now, a whole window from now (when in the last minute it
        was used is not known: the safe side), so a restart frees no tenant's limit."""
        bucket = math.floor(now / self._bucket_s)
        for tenant, values in previous.items():
            if self.table.of(tenant) is None or len(values) != 3:
                continue
            usage = self._usage.get(tenant)
            if usage is None:
                usage = self._usage[tenant] = _Usage()
            usage.add(bucket, [v if v > 0.0 and math.isfinite(v) else 0.0 for v in values])

    def set_shared(self, others: Mapping[str, Sequence[float]], gateways: int) -> None:
        """The other gateways' usage sums per tenant, just read, and how many gateways share
        the limits (this one included): checks count the others' usage from now on."""
        self._others = {
            t: v
            for t, v in others.items()
            if len(v) == 3 and self.table.of(t) is not None and all(math.isfinite(x) for x in v)
        }
        self.shared = True
        self.sharing = max(1, gateways)

    def set_local(self) -> None:
        """The shared view is lost: each tenant is held to this gateway's share of its limits
        (the limits over the gateways last seen sharing them)."""
        self.shared = False
        self._others = {}

    # inside ----------------------------------------------------------------------------------
    def _correct(self, reservation: Reservation, amounts: list[float], now: float) -> None:
        """Move the reservation to `amounts`: a refund in its own bucket while that still counts
        (none once it has left the window), an increase in the current bucket (used now: it
        must count for a window from now, not from when the request was reserved)."""
        delta = [amounts[k] - reservation.amounts[k] for k in range(3)]
        reservation.amounts = amounts
        if not any(delta):
            return
        bucket = math.floor(now / self._bucket_s)
        usage = self._usage.get(reservation.tenant)
        if usage is None:
            usage = self._usage[reservation.tenant] = _Usage()
        usage.expire(bucket - BUCKETS)
        refund = [d if d < 0.0 else 0.0 for d in delta]
        if any(refund) and reservation.bucket >= bucket - BUCKETS:
            usage.add(reservation.bucket, refund)
        increase = [d if d > 0.0 else 0.0 for d in delta]
        if any(increase):
            usage.add(bucket, increase)

    def _tidy(self, bucket: int) -> None:
        """Forget the tenants with no usage left in the window."""
        oldest = bucket - BUCKETS
        for tenant in list(self._usage):
            usage = self._usage[tenant]
            usage.expire(oldest)
            if not usage.entries:
                del self._usage[tenant]
        if len(self.per_token) > self.max_tenants:
            for tenant in [t for t in self.per_token if t not in self._usage]:
                del self.per_token[tenant]
        self._tidy_at = max(self.max_tenants, 2 * len(self._usage))

    def _refusal(
        self,
        tenant: str,
        k: int,
        cap: float,
        full: float,
        used: float,
        need: float,
        usage: _Usage,
        others: Sequence[float] | None,
        now: float,
    ) -> RateLimited:
        name = KINDS[k]
        share = "" if self.shared else f" (this gateway's share: 1/{self.sharing})"
        if need > full:  # larger than the whole limit: no wait makes it fit
            return RateLimited(
                name,
                f"request too large for tenant {tenant!r}: it needs {_amount_text(k, need)} of"
                f" {_amount_text(k, full)} {name} per {self.table.window_s:g} s",
                None,
            )
        theirs = others[k] if others is not None else 0.0
        wait = self._fits_in_s(k, used + need - cap, usage, theirs, now)
        return RateLimited(
            name,
            f"rate limit reached for tenant {tenant!r} on {name} per {self.table.window_s:g} s"
            f"{share}: limit {_amount_text(k, cap)}, used {_amount_text(k, used)}, requested"
            f" {_amount_text(k, need)}; try again in {duration_text(wait)}",
            wait,
        )

    def _fits_in_s(self, k: int, excess: float, usage: _Usage, theirs: float, now: float) -> float:
        """When `excess` of kind `k` will have left the window, if no more is used: this
        gateway's buckets as they expire, the others' usage taken as spread evenly."""
        bs = self._bucket_s
        window = self.table.window_s
        excess = max(excess, 1e-9)
        first_expiry = bs - (now % bs)  # the oldest counted bucket leaves at the next boundary
        oldest = math.floor(now / bs) - BUCKETS
        entries = list(usage.entries)
        freed_mine = 0.0
        i = 0
        for step in range(BUCKETS + 2):
            t = first_expiry + step * bs
            while i < len(entries) and entries[i][0] <= oldest + step:
                freed_mine += entries[i][k + 1]
                i += 1
            if freed_mine + theirs * min(1.0, t / window) >= excess:
                return t
        return window + bs


def _amount_text(k: int, value: float, down: bool = False) -> str:
    """Requests and tokens as whole numbers (remaining rounded down), GPU-seconds to the ms."""
    if k == _GPU:
        return f"{math.floor(value * 1000) / 1000 if down else round(value, 3):g}"
    return str(math.floor(value + 1e-9) if down else round(value))


def duration_text(seconds: float) -> str:
    """A duration as Go writes one (`time.Duration.String`, what OpenAI's `x-ratelimit-reset-*`
    carry): `0s`, `250ms`, `1.5s`, `1m0s`, to the millisecond."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    rest = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"
