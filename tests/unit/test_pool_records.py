"""The pool keeps one record per pod: pods added, removed and added again while their streams
run never lose or leak an in-flight count, and a pod that comes back learns everything anew."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import EjectionPolicy, Lease, PodPool
from plugin.core.types import EngineMetrics
from tests.helpers import make_pod

pytestmark = pytest.mark.unit

PODS = tuple(make_pod(f"p{i}", address=f"10.0.0.{i}") for i in range(3))


@dataclasses.dataclass
class _Open:
    lease: Lease
    started: bool = False


class PoolRecords(RuleBasedStateMachine):
    """Random discovery updates, leases, streams, scrapes and failures against a model of what
    the pool must show."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PodPool(CapacityEstimator(), 3.0, EjectionPolicy(2, 5.0, 60.0))
        self.listed: set[str] = set()
        self.open: list[_Open] = []
        self.now = 0.0
        # Since each pod was last added: did a scrape reach it, did a request on it fail.
        self.scraped_since_added: set[str] = set()
        self.failed_since_added: set[str] = set()

    @rule(keep=st.sets(st.sampled_from(range(len(PODS)))))
    def discover(self, keep: set[int]) -> None:
        pods = [PODS[i] for i in sorted(keep)]
        keys = {p.key for p in pods}
        for key in keys - self.listed:  # (re-)added: nothing learned yet
            self.scraped_since_added.discard(key)
            self.failed_since_added.discard(key)
        self.pool.set_pods(pods)
        self.listed = keys

    @rule(
        i=st.sampled_from(range(len(PODS))),
        load=st.sampled_from((0.0, 0.1, 0.25)),
        p=st.integers(0, 50),
        streaming=st.sampled_from((None, 0.0, 0.05)),
    )
    def acquire(self, i: int, load: float, p: int, streaming: float | None) -> None:
        # A request routed just before its pod left still takes (and later gives back) a lease.
        self.open.append(_Open(self.pool.acquire(PODS[i], load, p, streaming)))

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.open))
        if not entry.started:
            entry.started = True
            self.pool.stream_started(entry.lease.key, entry.lease.prompt_tokens)
            entry.lease.streaming()  # its share may drop; the counts below follow it

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data(), status=st.sampled_from((200, 503)), tokens=st.integers(0, 40))
    def release(self, data: st.DataObject, status: int, tokens: int) -> None:
        entry = data.draw(st.sampled_from(self.open))
        self.open.remove(entry)
        key = entry.lease.key
        if entry.started:
            self.pool.stream_ended(key, entry.lease.prompt_tokens, tokens, 1)
        self.now += 0.1
        assert entry.lease.release(tokens, status, self.now)
        assert not entry.lease.release(tokens, status, self.now)  # once only
        if status >= 500 and key in self.listed:
            self.failed_since_added.add(key)

    @rule(i=st.sampled_from(range(len(PODS))), running=st.integers(1, 8), waiting=st.integers(0, 3))
    def scrape(self, i: int, running: int, waiting: int) -> None:
        key = PODS[i].key
        self.now += 0.5
        metrics = EngineMetrics(float(running), float(waiting), 0.2, max_batch=8.0)
        self.pool.update_metrics(key, metrics, self.now)
        if key in self.listed:
            self.scraped_since_added.add(key)

    @rule(i=st.sampled_from(range(len(PODS))))
    def scrape_fails(self, i: int) -> None:
        self.pool.scrape_failed(PODS[i].key)
        if PODS[i].key in self.listed:
            self.scraped_since_added.add(PODS[i].key)  # its state changed since it was added

    @invariant()
    def counts_follow_the_open_leases(self) -> None:
        view = self.pool.candidates("m", self.now) if self.listed else None
        slots = {} if view is None else {c.pod.key: c for c in view.slots}
        orphans: dict[str, int] = {}
        for pod in PODS:
            key = pod.key
            mine = [e for e in self.open if e.lease.key == key]
            load = sum(e.lease.load for e in mine)
            prompt = sum(e.lease.prompt_tokens for e in mine)
            started = sum(e.lease.prompt_tokens for e in mine if e.started)
            assert self.pool.inflight(key) == len(mine)
            assert self.pool.load(key) == pytest.approx(load, abs=1e-9)
            assert self.pool.prompt_tokens(key) == (prompt, started)
            if key in self.listed:
                assert slots[key].running == len(mine)
                assert slots[key].load == pytest.approx(load, abs=1e-9)
            elif mine:
                orphans[key] = len(mine)
        assert self.pool.snapshot(self.now)["inflight_removed_pods"] == orphans

    @invariant()
    def a_pod_added_again_learns_anew(self) -> None:
        for pod in PODS:
            key = pod.key
            fresh = key not in self.listed or key not in self.scraped_since_added
            if fresh:
                assert self.pool.scraped(key) is None
                assert self.pool.saturation(key) is None
                assert not self.pool.unreachable(key)
            if key not in self.listed or key not in self.failed_since_added:
                assert not self.pool.ejected(key, self.now)
            if key not in self.listed:
                assert self.pool.output_tokens_total(key) == 0
                assert self.pool.speed(key) is None


TestPoolRecords = PoolRecords.TestCase
TestPoolRecords.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
