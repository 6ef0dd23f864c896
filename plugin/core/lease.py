"""A routed request's hold on a pod: its in-flight slot and its share of the pod's load, given
back exactly once (`plugin.core.pool.PodPool` takes and ends leases)."""

from __future__ import annotations

from typing import Protocol

from plugin.core.types import Pod

__all__ = ["Lease", "LeaseHolder"]


class LeaseHolder(Protocol):
    """What keeps the counts a lease holds (the pool)."""

    def lease_ended(
        self, lease: Lease, output_tokens: int, status: int, now: float | None, estimated: bool
    ) -> None: ...

    def lease_streaming(self, lease: Lease) -> None: ...


class Lease:
    """One routed request's hold on a pod's in-flight slot (and its share of the pod's load:
    `load` until its response streams, `streaming_load` from then on)."""

    __slots__ = ("_pool", "key", "load", "pod", "prompt_tokens", "released", "streaming_load")

    def __init__(
        self,
        pool: LeaseHolder,
        pod: Pod,
        load: float = 0.0,
        prompt_tokens: int = 0,
        streaming_load: float | None = None,
    ) -> None:
        self._pool = pool
        self.pod = pod
        self.key = pod.key
        self.load = load
        self.prompt_tokens = prompt_tokens
        self.streaming_load = load if streaming_load is None else min(streaming_load, load)
        self.released = False

    def streaming(self) -> None:
        """The response's first chunk came: the engine is done with the prompt, and the
        request's share of the pod drops to `streaming_load` (held requests are asked again).
        Later calls, or a call after the release, do nothing."""
        if not self.released and self.streaming_load < self.load:
            self._pool.lease_streaming(self)

    def release(
        self,
        output_tokens: int = 0,
        status: int = 0,
        now: float | None = None,
        estimated: bool = False,
    ) -> bool:
        """Give the slot back, credit tokens and report the upstream status (0: none seen);
        `estimated`: the engine did not report the count, the gateway estimated it.

        Later calls do nothing (returns False).
        """
        if self.released:
            return False
        self.released = True
        self._pool.lease_ended(self, output_tokens, status, now, estimated)
        return True
