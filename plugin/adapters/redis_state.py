"""State shared by several gateway replicas, kept in Redis.

Off unless `REDIS_HOST` is set. A background loop syncs every `HETERO_GATEWAY_REDIS_SYNC_MS`
(100 ms, as AIBrix's gateway does) in one pipelined MULTI/EXEC round trip; the request path never
waits for Redis. Each round trip:

- publishes this gateway's in-flight count per pod, and the SLO load its requests take of each
  pod (SLO routing's accounting: each request's share of its pod's profile), replacing its
  previous entry, and renews the entry's expiry (`HETERO_GATEWAY_REDIS_TTL_MS`): a gateway that
  dies stops renewing, and its counts vanish from everyone's view when the entry expires (no
  phantom load);
- reads every other live gateway's entry and hands the per-pod sums to the pool, which adds them
  to its own counts and loads when it scores candidates (so the SLO strategies and their queue
  see the fleet's load, not one gateway's share of it);
- adds the output tokens counted since the previous round trip to per-pod counters shared by all
  gateways, and reads those counters back: the pool credits each counter's increase to its
  capacity estimator, so every gateway learns from the whole fleet's output, not its own share;
- hands requests over between gateways (`LeaseHandoff`): when a request's counting stream reached
  this gateway and its routing stream another, this gateway holds its count and pushes a claim
  to the routing gateway's list; it takes its own list in the same transaction and gives back
  the leases claimed. A gateway reads another's new count and the claim that ends its own in one
  round trip, so a request moving between gateways is never counted twice by either view for
  longer than a sync period.

Keys (a pod key is `namespace/name`; a gateway id is `POD_NAME`, or `POD_NAMESPACE/POD_NAME`,
else the host name):

    hetero-gateway:gateways               sorted set: gateway id -> last sync (unix seconds)
    hetero-gateway:state:<gateway id>     string: JSON `{"inflight": {pod key: in-flight count},
                                          "load": {pod key: SLO load}}`, non-zero entries only;
                                          expires TTL after its last sync
    hetero-gateway:instance:<gateway id>  string: a random id of the publishing process (two
                                          processes with one gateway id are reported); expires
                                          with the state
    hetero-gateway:tokens:<pod key>       integer: output tokens completed by the pod, counted by
                                          every gateway; expires after an hour without tokens
    hetero-gateway:claims:<gateway id>    list: `IP:PORT request-id` of requests this gateway
                                          routed whose count another gateway took over; emptied
                                          by its owner at each sync, expires after 30 s
    hetero-gateway:prefixes               stream: per entry, a gateway's prompts routed since its
                                          previous sync (`g`: its id, `e`: JSON list of [pod key,
                                          block hashes]), read by the others into their
                                          `prefix-cache` index; about the last 2,000 entries kept
    hetero-gateway:usage:<gateway id>     string: JSON `{tenant: [requests, tokens, GPU-seconds]}`,
                                          this gateway's usage of the tenants' rate limits in
                                          the last window (`plugin.core.limits`); rewritten
                                          every sync, expires a window and a TTL after its last:
                                          a gateway that dies still counts what it served, and a
                                          process restarting under its name reads it first
    hetero-gateway:scrapes:<gateway id>   string: JSON `{"seq": n, "pods": {pod key: record}}`,
                                          what this gateway read from the engines it scraped in
                                          its last scrape tick (`plugin.adapters.scraper`);
                                          rewritten every tick, expires soon after a missed one

One scrape per pod per period for the whole gateway fleet: the gateways whose scrapes key
exists are the live scrapers (each sync checks them), and each pod is scraped by one of them
(`plugin.core.scrape_share`); the others read its record. A gateway that stops writing drops
out of the scrapers when its key expires (the scrape period plus half of it, or the scrape
timeout if longer), and its pods are scraped by the survivors from their next sync on.

The sorted set only lists whom to read (members not seen for five minutes are dropped); liveness
is the state's expiry, which Redis enforces with its own clock. The state is one JSON string, not
a hash of a field per pod: at 10,000 pods a hash cost each sync about 20,000 arguments to encode
and as many replies to decode per gateway in Python, where one string is one C-level JSON call
(`docs/plugin-cost.md`).

Failures degrade, never fail a request: a round trip that errors or takes longer than its timeout
switches this gateway to local-only mode (the `hetero_gateway_shared_state_up` gauge drops to 0,
one warning is logged), tokens are credited locally, other gateways' counts are kept until they
are older than the TTL and then dropped, and the connection is retried with backoff (from one
sync period, doubling, up to a second). The first round trip that succeeds again restores the
shared view by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import orjson
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from plugin.config import RedisSettings
from plugin.core.limits import RateLimits
from plugin.core.pool import PodPool
from plugin.core.prefix import PrefixIndex
from plugin.core.scrape_share import ScrapeShares

__all__ = [
    "GATEWAYS_KEY",
    "KEY_PREFIX",
    "PREFIXES_KEY",
    "RedisState",
    "claims_key",
    "connect",
    "instance_key",
    "scrapes_key",
    "state_key",
    "tokens_key",
    "usage_key",
]

log = logging.getLogger(__name__)

KEY_PREFIX = "hetero-gateway"
GATEWAYS_KEY = f"{KEY_PREFIX}:gateways"
PREFIXES_KEY = f"{KEY_PREFIX}:prefixes"
PREFIXES_KEPT = 2000  # stream entries (one per gateway per sync with prompts to publish)
PREFIXES_READ = 500  # entries read per sync at most: a gateway far behind catches up over syncs
TOKENS_TTL_S = 3600
FORGET_GATEWAY_S = 300.0  # members silent this long leave the sorted set (clock skew margin)
MAX_BACKOFF_S = 1.0
CLAIMS_TTL_S = 30  # longer than a parked lease waits for its claim (10 s)
REMINDER_S = 60.0  # while local-only, a reminder in the log at most this often


def connect(settings: RedisSettings, timeout_s: float) -> Redis:
    """A client for the gateway's background loops: every call fails within `timeout_s` and is
    not retried by the client (the loop retries, with backoff, and degrades meanwhile)."""
    return Redis(
        host=settings.host,
        port=settings.port,
        db=settings.db,
        password=settings.password,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
        max_connections=2,
    )


def state_key(gateway_id: str) -> str:
    return f"{KEY_PREFIX}:state:{gateway_id}"


def instance_key(gateway_id: str) -> str:
    return f"{KEY_PREFIX}:instance:{gateway_id}"


def tokens_key(pod_key: str) -> str:
    return f"{KEY_PREFIX}:tokens:{pod_key}"


def claims_key(gateway_id: str) -> str:
    return f"{KEY_PREFIX}:claims:{gateway_id}"


def usage_key(gateway_id: str) -> str:
    return f"{KEY_PREFIX}:usage:{gateway_id}"


def scrapes_key(gateway_id: str) -> str:
    return f"{KEY_PREFIX}:scrapes:{gateway_id}"


# A gateway's scrapes, as another read them: (gateway id, seconds since it wrote them, its
# write count, {pod key: record}).
PeerScrapes = tuple[str, float, int, dict[str, Any]]


ClaimKey = tuple[str, str]  # (request id, IP:PORT of the pod)


class Claims(Protocol):
    """The requests handed over between gateways (`plugin.adapters.extproc.LeaseHandoff`)."""

    def take_claims(self) -> dict[str, list[ClaimKey]]: ...

    def return_claims(self, claims: dict[str, list[ClaimKey]]) -> None: ...

    def claimed_elsewhere(self, keys: Iterable[ClaimKey]) -> int: ...

    adopted: int
    released_elsewhere: int


def _claim_keys(entries: Any) -> list[ClaimKey]:
    """The claims read back: `IP:PORT request-id` each (the request id may hold spaces)."""
    keys: list[ClaimKey] = []
    if isinstance(entries, list):
        for entry in entries:
            endpoint, _, request_id = str(entry).partition(" ")
            keys.append((request_id, endpoint))
    return keys


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _usage_sums(reply: Any) -> dict[str, list[float]]:
    """The other gateways' published rate-limit usage, summed per tenant."""
    sums: dict[str, list[float]] = {}
    for text in reply if isinstance(reply, list) else []:
        if not text:
            continue  # expired: nothing of that gateway's is left in the window
        try:
            read = {
                str(t): [float(v[0]), float(v[1]), float(v[2])]
                for t, v in orjson.loads(text).items()
            }
        except (orjson.JSONDecodeError, AttributeError, LookupError, TypeError, ValueError):
            log.warning("unreadable tenant usage in Redis: ignored")
            continue  # all of that gateway's entry, not half of it
        for tenant, values in read.items():
            total = sums.setdefault(tenant, [0.0, 0.0, 0.0])
            for k in range(3):
                total[k] += values[k]
    return sums


def describe_error(exc: BaseException) -> str:
    """An exception in one log line: its class, and its message when it has one."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class RedisState:
    """The sync loop between one gateway's `PodPool` and Redis."""

    def __init__(
        self,
        pool: PodPool,
        settings: RedisSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        max_backoff_s: float = MAX_BACKOFF_S,
        claims: Claims | None = None,
        shares: ScrapeShares | None = None,
        scrape_expiry_s: float = 1.5,
        on_scrapers_changed: Callable[[], None] | None = None,
        prefixes: PrefixIndex | None = None,
        limits: RateLimits | None = None,
    ) -> None:
        self._pool = pool
        # The tenants' rate limits, held across the gateways (None: no limits).
        self._limits = limits
        self._usage_published = False
        self._claims = claims
        # Scrapes shared with the other gateways (None: this gateway scrapes every pod).
        self.shares = shares
        self._scrape_expiry_ms = max(1, round(scrape_expiry_s * 1000))
        self._scrape_writes = 0
        self._on_scrapers_changed = on_scrapers_changed
        # The prefix-cache index shared with the other gateways (None: each keeps its own).
        self._prefixes = prefixes
        self._prefixes_read: str | None = None  # the last stream entry read
        self.prefixes_added = 0  # prompts the other gateways routed, added to the index
        self.settings = settings
        self._clock = clock
        self._wall = wall_clock
        self._max_backoff_s = max(max_backoff_s, settings.sync_interval_s)
        # A round trip slower than this counts as a failure; below the TTL so that a slow Redis
        # cannot keep this gateway's entry alive with stale counts.
        self.timeout_s = max(settings.sync_interval_s, min(0.5, settings.ttl_s / 2))
        self._instance = secrets.token_hex(8)
        self._client: Redis | None = None
        self._members: list[str] = []  # gateway ids from the previous round trip
        self._published = False
        self._warned_collision_at: float | None = None
        self._reminded_at = 0.0
        self._last_ok: float | None = None
        self.up = False  # True while the last round trip succeeded
        self.sync_errors_total = 0
        self.last_error: str | None = None
        self.other_gateways = 0  # gateways other than this one that published counts

    # ---------------------------------------------------------------------------------------
    def _connect(self) -> Redis:
        return connect(self.settings, self.timeout_s)

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s):
                    await client.aclose()

    async def sync_once(self) -> bool:
        """One publish-and-read round trip; False when it failed (state is then local-only)."""
        pool = self._pool
        me = self.settings.gateway_id
        taken = pool.take_unpublished_tokens()
        owed = {} if self._claims is None else self._claims.take_claims()
        prefixes = self._prefixes
        routed = [] if prefixes is None else prefixes.take_recorded()
        pod_keys = [p.key for p in pool.pods()]
        state = orjson.dumps(
            {
                "inflight": {k: n for k in pod_keys if (n := pool.inflight(k)) > 0},
                "load": {k: round(x, 6) for k in pod_keys if (x := pool.load(k)) > 0},
            }
        )
        others = [m for m in self._members if m != me]
        ttl_ms = round(self.settings.ttl_s * 1000)
        try:
            if self._client is None:
                self._client = self._connect()
            async with asyncio.timeout(self.timeout_s):
                pipe = self._client.pipeline(transaction=True)
                pipe.getset(instance_key(me), self._instance)
                pipe.pexpire(instance_key(me), ttl_ms)
                pipe.set(state_key(me), state, px=ttl_ms)
                now = self._wall()
                pipe.zadd(GATEWAYS_KEY, {me: now})
                pipe.zremrangebyscore(GATEWAYS_KEY, "-inf", now - FORGET_GATEWAY_S)
                pipe.zrange(GATEWAYS_KEY, 0, -1)
                for gateway in others:
                    pipe.get(state_key(gateway))
                if self.shares is not None:
                    for gateway in others:
                        pipe.exists(scrapes_key(gateway))
                for key, tokens in taken.items():
                    pipe.incrby(tokens_key(key), tokens)
                    pipe.expire(tokens_key(key), TOKENS_TTL_S)
                if pod_keys:
                    pipe.mget([tokens_key(k) for k in pod_keys])
                if self._claims is not None:
                    for origin, keys in owed.items():
                        pipe.rpush(claims_key(origin), *(f"{ep} {rid}" for rid, ep in keys))
                        pipe.expire(claims_key(origin), CLAIMS_TTL_S)
                    pipe.lrange(claims_key(me), 0, -1)
                    pipe.delete(claims_key(me))
                if prefixes is not None:
                    if routed:
                        pipe.xadd(
                            PREFIXES_KEY,
                            {"g": me, "e": orjson.dumps(routed)},
                            maxlen=PREFIXES_KEPT,
                            approximate=True,
                        )
                    if self._prefixes_read is None:  # from now on: history is not replayed
                        pipe.xrevrange(PREFIXES_KEY, count=1)
                    else:
                        pipe.xread({PREFIXES_KEY: self._prefixes_read}, count=PREFIXES_READ)
                limits = self._limits
                first = not self._usage_published  # read what a previous process left first
                if limits is not None:
                    if first:
                        pipe.get(usage_key(me))
                    usage = orjson.dumps(limits.totals(now))
                    usage_ms = round(limits.table.window_s * 1000) + ttl_ms
                    pipe.set(usage_key(me), usage, px=usage_ms)
                    if others:
                        pipe.mget([usage_key(g) for g in others])
                replies = await pipe.execute()
            peers_usage: dict[str, list[float]] = {}
            if limits is not None:
                # The usage comes last: the replies before it keep their places.
                count = 1 + bool(others) + first
                usage_replies, replies = replies[-count:], replies[:-count]
                peers_usage = _usage_sums(usage_replies[-1] if others else [])
                if first:
                    self._usage_published = True
                    limits.carry_over(_usage_sums([usage_replies[0]]), now)
            if prefixes is not None:
                # The prefixes come last: the replies before them keep their places.
                self._read_prefixes(prefixes, replies[-1])
                replies = replies[: -2 if routed else -1]
            if self._claims is not None:
                # The claims come last: the replies before them keep their places.
                self._claims.claimed_elsewhere(_claim_keys(replies[-2]))
                replies = replies[: -2 - 2 * len(owed)]
            self._succeeded(replies, others, pod_keys)
            if limits is not None:  # shared by this gateway and those whose state is live
                limits.set_shared(peers_usage, 1 + self.other_gateways)
        except asyncio.CancelledError:
            self._give_back(taken, owed, routed)
            raise
        except (RedisError, OSError, TimeoutError) as exc:
            await self._failed(exc, taken, owed, routed)
            return False
        except Exception as exc:  # a bug or an unexpected reply must not end the loop
            log.exception("shared state sync failed unexpectedly")
            await self._failed(exc, taken, owed, routed)
            return False
        return True

    def _read_prefixes(self, prefixes: PrefixIndex, reply: Any) -> None:
        """Add the prompts the other gateways routed (stream entries after the last read)."""
        if self._prefixes_read is None:  # the newest entry, or none yet
            self._prefixes_read = str(reply[0][0]) if reply else "0-0"
            return
        entries: list[Any] = reply[0][1] if reply else []  # [[stream, entries]]
        me = self.settings.gateway_id
        for entry_id, fields in entries:
            self._prefixes_read = str(entry_id)
            if fields.get("g") == me:
                continue
            try:
                for pod_key, hashes in orjson.loads(fields["e"]):
                    prefixes.add(str(pod_key), [int(h) for h in hashes])
                    self.prefixes_added += 1
            except (KeyError, TypeError, ValueError, orjson.JSONDecodeError):
                log.warning("unreadable prefix entry %s in Redis: skipped", entry_id)

    def _give_back(
        self,
        taken: Mapping[str, int],
        owed: dict[str, list[ClaimKey]],
        routed: list[tuple[str, list[int]]] | None = None,
    ) -> None:
        """What a failed round trip did not deliver waits for the next one."""
        self._pool.leave_shared_tokens(taken)
        if self._claims is not None and owed:
            self._claims.return_claims(owed)
        if self._prefixes is not None and routed:
            self._prefixes.return_recorded(routed)

    def _succeeded(self, replies: list[Any], others: list[str], pod_keys: list[str]) -> None:
        previous_instance = replies[0]
        if (
            self._published
            and previous_instance is not None
            and previous_instance != self._instance
        ):
            self._warn_collision()
        self._published = True
        members = replies[5]
        self._members = [str(m) for m in members] if isinstance(members, list) else []
        remote: dict[str, int] = {}
        loads: dict[str, float] = {}
        contributing = 0
        for entry in replies[6 : 6 + len(others)]:
            if not entry:
                continue  # expired: that gateway stopped syncing
            try:
                state = orjson.loads(entry)
                counts, their_loads = state["inflight"], state["load"]
                for pod, count in counts.items():
                    if isinstance(count, int) and count > 0:
                        remote[pod] = remote.get(pod, 0) + count
                for pod, load in their_loads.items():
                    if isinstance(load, int | float) and 0 < load < math.inf:
                        loads[pod] = loads.get(pod, 0.0) + load
            except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                log.warning("unreadable gateway state in Redis: ignored")
                continue
            contributing += 1
        self.other_gateways = contributing
        if self.shares is not None:
            alive = replies[6 + len(others) : 6 + 2 * len(others)]
            self._set_scrapers([g for g, up in zip(others, alive, strict=True) if up])
        totals: dict[str, int | None] = {}
        if pod_keys:
            values = replies[-1]
            if isinstance(values, list) and len(values) == len(pod_keys):
                totals = {k: _int(v) for k, v in zip(pod_keys, values, strict=True)}
        self._pool.set_remote_inflight(remote, loads)
        self._pool.apply_shared_tokens(totals)
        self._last_ok = self._clock()
        if not self.up:
            self.up = True
            log.info(
                "shared state in Redis at %s:%d: in-flight counts and token counters shared"
                " (gateway %s, %d other gateways)",
                self.settings.host,
                self.settings.port,
                self.settings.gateway_id,
                contributing,
            )

    def _warn_collision(self) -> None:
        now = self._clock()
        if self._warned_collision_at is None or now - self._warned_collision_at >= REMINDER_S:
            self._warned_collision_at = now
            log.warning(
                "another process publishes shared state as gateway %r: give each gateway replica"
                " its own POD_NAME, or their in-flight counts overwrite each other",
                self.settings.gateway_id,
            )

    async def _failed(
        self,
        exc: BaseException,
        taken: Mapping[str, int],
        owed: dict[str, list[ClaimKey]],
        routed: list[tuple[str, list[int]]] | None = None,
    ) -> None:
        self._give_back(taken, owed, routed)
        if self._limits is not None:  # each tenant held to this gateway's share of its limits
            self._limits.set_local()
        self.sync_errors_total += 1
        self.last_error = describe_error(exc)
        now = self._clock()
        if self._last_ok is None or now - self._last_ok > self.settings.ttl_s:
            # What other gateways had in flight is older than their entries would live: drop it.
            self._pool.set_remote_inflight({})
            self.other_gateways = 0
        self._set_scrapers([])  # unseen, the others may be gone: scrape every pod here
        if self.up:
            self.up = False
            self._reminded_at = now
            log.warning(
                "shared state in Redis at %s:%d unavailable (%s): routing on this gateway's local"
                " state only; reconnecting with backoff",
                self.settings.host,
                self.settings.port,
                self.last_error,
            )
        elif now - self._reminded_at >= REMINDER_S:
            self._reminded_at = now
            log.warning(
                "shared state in Redis at %s:%d still unavailable (%s): local state only",
                self.settings.host,
                self.settings.port,
                self.last_error,
            )
        await self._drop_client()

    def _set_scrapers(self, others: list[str]) -> None:
        if self.shares is not None and self.shares.set_scrapers(others):
            log.info("engine scrapes shared by %d gateways", len(self.shares.scrapers))
            if self._on_scrapers_changed is not None:
                self._on_scrapers_changed()

    async def exchange_scrapes(self, records: Mapping[str, list[Any]]) -> Iterator[PeerScrapes]:
        """Publish this tick's scrapes and read the other live scrapers' latest, in one round
        trip. Raises on a Redis failure (the sync loop handles the connection). Each peer's
        scrapes are decoded as the caller reaches them: with one of them alive at a time
        (2,000 records at 10,000 pods and five replicas, not 8,000) a tick stays under the young
        garbage collection's threshold (`plugin.adapters.gc_tuning`), where decoding them all
        at once set one off each tick, over every object the tick had made."""
        shares, client = self.shares, self._client
        if shares is None or client is None or not self.up:
            return iter(())
        me = self.settings.gateway_id
        others = [g for g in shares.scrapers if g != me]
        self._scrape_writes += 1
        blob = orjson.dumps({"seq": self._scrape_writes, "pods": records})
        async with asyncio.timeout(self.timeout_s):
            pipe = client.pipeline(transaction=False)
            pipe.set(scrapes_key(me), blob, px=self._scrape_expiry_ms)
            for gateway in others:
                pipe.get(scrapes_key(gateway))
                pipe.pttl(scrapes_key(gateway))
            replies = await pipe.execute()
        return self._peer_scrapes(others, replies[1:])

    def _peer_scrapes(self, others: list[str], replies: list[Any]) -> Iterator[PeerScrapes]:
        """Each other scraper's scrapes as the caller reaches them (`replies`: a GET and a PTTL
        per gateway of `others`); an expired or unreadable one is skipped (logged)."""
        for i, gateway in enumerate(others):
            text, left_ms = replies[2 * i], replies[2 * i + 1]
            if not text or not isinstance(left_ms, int) or left_ms < 0:
                continue  # expired between the check and now
            try:
                data = orjson.loads(text)
                seq, pods = int(data["seq"]), data.pop("pods")
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                log.warning("unreadable scrapes of gateway %s in Redis: ignored", gateway)
                continue
            if isinstance(pods, dict):
                age_s = max(0, self._scrape_expiry_ms - left_ms) / 1000
                yield gateway, age_s, seq, pods
            del pods  # freed as the caller lets go of it, before the next is decoded

    # ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Sync until cancelled: every period while Redis answers, with backoff while not."""
        interval = self.settings.sync_interval_s
        backoff = interval
        task = asyncio.current_task()
        while True:
            # On Python 3.11 the client's `asyncio.wait_for` can swallow a cancellation that
            # lands as its operation completes; the task stays marked as cancelling, so honour it
            # here, or shutting down would wait for this loop forever.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            started = self._clock()
            if await self.sync_once():
                backoff = interval
                wait = interval - (self._clock() - started)
            else:
                wait = random.uniform(backoff / 2, backoff)  # jitter: replicas do not align
                backoff = min(backoff * 2, self._max_backoff_s)
            await asyncio.sleep(max(0.0, wait))

    async def close(self) -> None:
        """Leave the shared view at once (best effort): remove this gateway's entry and publish
        the tokens counted since the last sync; then close the connection."""
        taken = self._pool.take_unpublished_tokens()
        owed = {} if self._claims is None else self._claims.take_claims()
        me = self.settings.gateway_id
        if self._client is not None and self.up:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s):
                    pipe = self._client.pipeline(transaction=True)
                    pipe.delete(state_key(me), instance_key(me))
                    pipe.delete(scrapes_key(me))  # the others scrape its pods from now on
                    pipe.zrem(GATEWAYS_KEY, me)
                    for key, tokens in taken.items():
                        pipe.incrby(tokens_key(key), tokens)
                        pipe.expire(tokens_key(key), TOKENS_TTL_S)
                    for origin, keys in owed.items():
                        pipe.rpush(claims_key(origin), *(f"{ep} {rid}" for rid, ep in keys))
                        pipe.expire(claims_key(origin), CLAIMS_TTL_S)
                    await pipe.execute()
        self.up = False
        await self._drop_client()

    def status(self) -> dict[str, Any]:
        """JSON-ready view for /debug/pods."""
        age = None if self._last_ok is None else round(self._clock() - self._last_ok, 3)
        return {
            "mode": "shared" if self.up else "local-only",
            "redis": f"{self.settings.host}:{self.settings.port}",
            "gateway": self.settings.gateway_id,
            "other_gateways": self.other_gateways,
            "tokens_shared": self._pool.shared_tokens,
            "last_sync_age_s": age,
            "sync_errors_total": self.sync_errors_total,
            "last_error": self.last_error,
            # Requests whose counting stream reached another gateway than their routing stream.
            "counts_taken_over": None if self._claims is None else self._claims.adopted,
            "counts_handed_over": None if self._claims is None else self._claims.released_elsewhere,
            # Prompts other gateways routed, added to this one's prefix-cache index (null: the
            # index is not shared).
            "prefixes_added": None if self._prefixes is None else self.prefixes_added,
            # Tenants' rate limits: checked against every gateway's usage (shared), or held to
            # this gateway's share of them (null: no limits).
            "limits": None
            if self._limits is None
            else {
                "shared": self._limits.shared,
                "gateways_sharing": self._limits.sharing,
            },
            # Engine scrapes shared among the gateways (null: each gateway scrapes every pod).
            "scrapes": None
            if self.shares is None
            else {
                "scrapers": list(self.shares.scrapers),
                "scraped_here_last_tick": self.shares.scraped,
                "read_from_peers_last_tick": self.shares.from_peers,
            },
        }
