"""Where `profile build` puts a profile: a file, or Redis under AIBrix's key."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlparse

import orjson
import redis

from plugin.core.profile import GpuProfile, profile_key
from plugin.errors import ConfigError

__all__ = ["write_profile"]


def write_profile(profile: GpuProfile, target: str) -> str:
    """Write to `target` (a path, or redis://[user:password@]host:port[/db]?model=M); returns
    what was written where, for the user."""
    data = orjson.dumps(profile.to_json())
    if not target.startswith("redis://"):
        Path(target).write_bytes(data)
        return f"profile written to {target}"
    url = urlparse(target)
    model = parse_qs(url.query).get("model", [""])[0]
    if not model:
        raise ConfigError(f"{target}: the Redis URL needs ?model=MODEL (the key names the model)")
    db_text = url.path.strip("/") or "0"
    if not db_text.isdigit():
        raise ConfigError(f"{target}: the database must be a number, got {db_text!r}")
    key = profile_key(model, profile.gpu)
    client = redis.Redis(
        host=url.hostname or "localhost",
        port=url.port or 6379,
        db=int(db_text),
        username=url.username,
        password=url.password,
        socket_timeout=10.0,
    )
    try:
        client.set(key, data)
    except redis.RedisError as exc:
        raise ConfigError(f"{target}: could not store the profile: {exc}") from exc
    finally:
        client.close()
    return f"profile stored in Redis as {key}"
