"""Where the gateway finds GPU profiles: Redis keys `aibrix:profile_*` or a directory of files.

Both re-read everything every 10 s (AIBrix's period) and hand the complete set to the
`ProfileBook`; a profile that does not parse is logged once (until it changes) and left out, and
a pass that fails (Redis down, directory gone) changes nothing. Redis is read on a connection of
its own, never the shared-state client's: a slow scan must not delay the 100 ms sync.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from plugin.config import RedisSettings
from plugin.core.profile import REDIS_PROFILE_PREFIX, GpuProfile, ProfileBook, parse_profile
from plugin.core.profile import profile_key as key_of
from plugin.errors import ConfigError

log = logging.getLogger(__name__)

REFRESH_S = 10.0
SCAN_COUNT = 100


class ProfileLoader(ABC):
    """Re-reads every profile each `interval_s` and hands the set to the book."""

    source = "none"

    def __init__(
        self,
        book: ProfileBook,
        interval_s: float,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.book = book
        self._on_change = on_change
        self.interval_s = interval_s
        self._bad: dict[str, str] = {}  # key -> why, logged once until it changes
        self.last_error: str | None = None  # of the last pass; None while passes succeed

    def _parse(self, key: str, raw: bytes | str | None) -> GpuProfile | None:
        try:
            if raw is None:
                return None
            profile = parse_profile(orjson.loads(raw))
        except (orjson.JSONDecodeError, ConfigError) as exc:
            why = str(exc)
            if self._bad.get(key) != why:
                self._bad[key] = why
                log.warning("ignoring GPU profile %s: %s", key, why)
            return None
        if self._bad.pop(key, None) is not None:
            log.info("GPU profile %s is valid again", key)
        return profile

    # What a subclass reads from, the errors that mean "the source failed" (not a bad profile).
    where = ""
    read_errors: tuple[type[BaseException], ...] = (OSError,)

    @abstractmethod
    async def read_all(self) -> dict[str, bytes | str | None]:
        """Every profile document, by AIBrix's key (`aibrix:profile_<model>_<deployment>`)."""

    async def load_once(self) -> bool:
        """One complete pass; False when the source failed (the book is left as it was)."""
        try:
            documents = await self.read_all()
        except self.read_errors as exc:
            if self.last_error is None:
                log.warning(
                    "reading GPU profiles from %s failed: %r; keeping the last", self.where, exc
                )
            self.last_error = repr(exc)
            return False
        if self.last_error is not None:
            log.info("reading GPU profiles from %s recovered", self.where)
            self.last_error = None
        found = {k: p for k, raw in documents.items() if (p := self._parse(k, raw)) is not None}
        changed = self.book.replace(found)
        if changed:
            log.info("GPU profiles: %d known, changed %s", len(self.book), ", ".join(changed))
            if self._on_change is not None:
                self._on_change()  # the pool looks its candidates' profiles up again
        return True

    def status(self) -> dict[str, object]:
        return {"source": self.source, "keys": self.book.keys(), "last_error": self.last_error}

    async def close(self) -> None:
        return None

    async def run(self) -> None:
        while True:
            await self.load_once()
            await asyncio.sleep(self.interval_s)


class RedisProfiles(ProfileLoader):
    """Profiles from Redis keys `aibrix:profile_<model>_<deployment>` (SCAN, then MGET)."""

    source = "redis"
    read_errors = (RedisError, OSError, TimeoutError)

    def __init__(
        self,
        book: ProfileBook,
        settings: RedisSettings,
        interval_s: float = REFRESH_S,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(book, interval_s, on_change)
        self._client = Redis(
            host=settings.host,
            port=settings.port,
            db=settings.db,
            password=settings.password,
            socket_timeout=5.0,
            socket_connect_timeout=5.0,
        )
        self.where = f"Redis {settings.host}:{settings.port}/{settings.db}"

    async def read_all(self) -> dict[str, bytes | str | None]:
        keys = [
            k.decode() if isinstance(k, bytes) else str(k)
            async for k in self._client.scan_iter(
                match=f"{REDIS_PROFILE_PREFIX}*", count=SCAN_COUNT
            )
        ]
        values = await self._client.mget(keys) if keys else []
        return dict(zip(keys, values, strict=True))

    async def close(self) -> None:
        await self._client.aclose()


class DirectoryProfiles(ProfileLoader):
    """Profiles from files `<dir>/<model>/<deployment>.json`."""

    source = "directory"

    def __init__(
        self,
        book: ProfileBook,
        path: str,
        interval_s: float = REFRESH_S,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(book, interval_s, on_change)
        self.path = Path(path)
        self.where = str(path)
        if not self.path.is_dir():
            raise ConfigError(f"HETERO_GATEWAY_PROFILE_DIR={path!r} is not a directory")

    async def read_all(self) -> dict[str, bytes | str | None]:
        return await asyncio.to_thread(self._read)

    def _read(self) -> dict[str, bytes | str | None]:
        return {
            key_of(f.parent.name, f.stem): f.read_bytes()
            for f in sorted(self.path.glob("*/*.json"))
            if f.is_file()
        }
