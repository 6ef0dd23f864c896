"""Fleet-wide completed-token counters, so every gateway learns each replica's capacity from all
of the replica's tokens, not only the ones it routed.

While they are shared, a counted token is not credited to the capacity estimator directly: it
waits in its pod record's unpublished count, which the sync loop (outside the core) adds to the
shared counter (`take`), and the estimator is credited with each shared counter's increase
since the previous read (`apply`), which holds this gateway's tokens and everyone else's exactly
once. When the shared store fails, `leave` credits what was taken but maybe not stored, and
tokens go to the estimator directly again; the next successful read only sets new baselines, so
nothing is credited twice across a switch. Pods whose engine exports its own generated-token
counter are left out: every gateway reads the same counter.
"""

from __future__ import annotations

from collections.abc import Mapping

from plugin.core.capacity import CapacityEstimator
from plugin.core.pool_state import PodRecord

__all__ = ["SharedTokens"]


class SharedTokens:
    """Whether the estimator is fed from the shared counters (`active`), and the moves between
    local and shared counting over the pool's records."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = False

    def credit(self, capacity: CapacityEstimator, key: str, record: PodRecord, tokens: int) -> None:
        """Output tokens this gateway counted on the pod: to the estimator, or held for the
        shared counter while shared."""
        if self.active:
            record.unpublished += tokens
        else:
            capacity.add_tokens(key, tokens)

    @staticmethod
    def take(records: Mapping[str, PodRecord]) -> dict[str, int]:
        """Tokens counted while shared and not yet handed out, per pod key (now handed out)."""
        taken: dict[str, int] = {}
        for key, record in records.items():
            if record.unpublished:
                taken[key], record.unpublished = record.unpublished, 0
        return taken

    def apply(
        self,
        capacity: CapacityEstimator,
        records: Mapping[str, PodRecord],
        totals: Mapping[str, int | None],
    ) -> None:
        """The shared counters as just read: credit each listed pod's increase since the
        previous read; the first read after local counting only sets baselines. A missing
        counter reads as 0; one that went backwards (the store restarted or the key expired)
        started again from 0, so all of its value is new."""
        entering = not self.active
        for key, total in totals.items():
            record = records.get(key)
            if record is None or not record.listed or record.speed.engine_tokens is not None:
                continue
            value = 0 if total is None or total < 0 else total
            last, record.shared_seen = record.shared_seen, value
            if entering or last is None:
                continue
            gained = value - last if value >= last else value  # backwards: a restart from 0
            if gained > 0:
                capacity.add_tokens(key, gained)
        self.active = True

    def leave(
        self,
        capacity: CapacityEstimator,
        records: Mapping[str, PodRecord],
        taken: Mapping[str, int],
    ) -> None:
        """The shared store failed: credit `taken` (maybe never stored) and anything unpublished
        to the estimator directly, forget the baselines, and count locally from now on."""
        for key, tokens in taken.items():
            record = records.get(key)
            if tokens > 0 and record is not None and record.listed:
                capacity.add_tokens(key, tokens)
        for key, record in records.items():
            if record.unpublished > 0 and record.listed:
                capacity.add_tokens(key, record.unpublished)
            record.unpublished, record.shared_seen = 0, None
        self.active = False
