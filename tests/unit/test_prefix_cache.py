"""prefix-cache: the block-hash index, the strategy's pick and scores, and shared-prefix workloads
routed through the real `Router` and `PodPool`."""

from __future__ import annotations

import random
import subprocess
import sys
from array import array
from collections import Counter, defaultdict
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.core.capacity import CapacityEstimator
from plugin.core.pool import PodPool
from plugin.core.prefix import (
    MAX_OUTBOX,
    PART_SEPARATOR,
    PrefixIndex,
    block_hashes,
    stable_block_hashes,
)
from plugin.core.request import parse_request
from plugin.core.router import Decision, Router
from plugin.core.strategies import build_strategies
from plugin.core.strategies.base import Scorer, Strategy
from plugin.core.strategies.prefix_cache import PrefixCache, PrefixCacheSettings
from plugin.core.strategies.simple import RandomPick
from plugin.core.types import Candidate, Pod, RequestInfo
from plugin.errors import RoutingFailed
from tests.helpers import make_pod

pytestmark = pytest.mark.unit

MODEL = "m"
B = 8  # block characters in the index tests: short prompts, many blocks


def pod(name: str, model: str = MODEL) -> Pod:
    return make_pod(name, model=model)


def cand(name: str, running: int = 0) -> Candidate:
    return Candidate(pod(name), running, None, None, None)


def key(name: str) -> str:
    return f"ns/{name}"


def blocks(*fill: str) -> tuple[str]:
    """One text part made of whole blocks, one block per character given."""
    return ("".join(c * B for c in fill),)


def req(parts: tuple[str, ...], model: str = MODEL) -> RequestInfo:
    return RequestInfo(model, prompt_parts=parts)


# The index ---------------------------------------------------------------------------------------


def test_blocks_are_whole_and_chained_from_the_model() -> None:
    assert block_hashes(MODEL, ("x" * (B - 1),), B) == []  # a partial block is not hashed
    two = block_hashes(MODEL, blocks("a", "b"), B)
    assert len(two) == 2 and two[0] != two[1]
    assert block_hashes(MODEL, ("a" * B + "b" * B + "c" * (B - 1),), B) == two
    # a hash names the whole prefix: the same block after another start hashes differently
    assert block_hashes(MODEL, blocks("z", "b"), B)[1] != two[1]
    # and the model
    assert block_hashes("other", blocks("a", "b"), B) != two
    # parts are joined with a separator: ["ab", "c"] is not ["a", "bc"]
    assert block_hashes(MODEL, ("ab", "c"), 2) != block_hashes(MODEL, ("a", "bc"), 2)
    joined = ("ab" + PART_SEPARATOR + "c",)
    assert block_hashes(MODEL, ("ab", "c"), 2) == block_hashes(MODEL, joined, 2)
    assert block_hashes(MODEL, (), B) == []


def test_match_is_each_pods_longest_cached_prefix() -> None:
    index = PrefixIndex(B)
    index.record(MODEL, key("a"), blocks("s", "y", "s", "1"))
    index.record(MODEL, key("b"), blocks("s", "y", "x"))
    index.record(MODEL, key("c"), blocks("q"))
    assert index.match(MODEL, blocks("s", "y", "s", "1", "more")) == {key("a"): 4, key("b"): 2}
    assert index.match(MODEL, blocks("s", "y", "x")) == {key("a"): 2, key("b"): 3}
    assert index.match(MODEL, blocks("s")) == {key("a"): 1, key("b"): 1}
    assert index.match(MODEL, blocks("n", "o")) == {}
    assert index.match("other-model", blocks("s", "y")) == {}  # per model
    assert index.match(MODEL, ("short",)) == {}  # no full block: nothing to match


def test_a_shared_middle_block_without_the_shared_start_is_no_match() -> None:
    index = PrefixIndex(B)
    index.record(MODEL, key("a"), blocks("s", "m", "t"))
    assert index.match(MODEL, blocks("z", "m", "t")) == {}
    # nor does a pod match past a block it was not sent, though it holds the blocks after it
    index.record(MODEL, key("b"), blocks("s"))
    index.record(MODEL, key("b"), blocks("z", "m", "t"))
    assert index.match(MODEL, blocks("s", "m", "t")) == {key("a"): 3, key("b"): 1}


def test_eviction_bounds_the_index_and_takes_the_ends_of_old_prompts_first() -> None:
    index = PrefixIndex(B, max_blocks=12)
    index.record(MODEL, key("a"), blocks(*"ABCDEFGHIJ"))  # 10 blocks
    index.record(MODEL, key("b"), blocks(*"wxyz"))  # 4 more: 2 must go
    assert len(index) == 12
    # the old prompt lost its last two blocks, its start (shared by its followers) stays
    assert index.match(MODEL, blocks(*"ABCDEFGHIJ")) == {key("a"): 8}
    assert index.match(MODEL, blocks(*"wxyz")) == {key("b"): 4}
    # recording refreshes: the old prompt's start becomes the most recent again
    index.record(MODEL, key("a"), blocks("A"))
    index.record(MODEL, key("c"), blocks(*"0123456789"))
    assert index.match(MODEL, blocks(*"ABCDEFGHIJ")) == {key("a"): 1}
    # of the others, the least recently recorded went first: all but the start of "wxyz"
    assert index.match(MODEL, blocks(*"wxyz")) == {key("b"): 1}
    assert index.match(MODEL, blocks(*"0123456789")) == {key("c"): 10}
    assert len(index) == 12


def test_a_prompt_longer_than_the_budget_keeps_its_start() -> None:
    index = PrefixIndex(B, max_blocks=3)
    index.record(MODEL, key("a"), blocks(*"ABCDEF"))
    assert len(index) == 3
    assert index.match(MODEL, blocks(*"ABCDEF")) == {key("a"): 3}


def test_forget_drops_a_pod_and_the_blocks_only_it_held() -> None:
    index = PrefixIndex(B)
    index.record(MODEL, key("a"), blocks("s", "a"))
    index.record(MODEL, key("b"), blocks("s", "b"))
    assert len(index) == 3
    assert index.forget(key("a")) == 2
    assert len(index) == 2  # "s" stays for b, "s a" is gone
    assert index.match(MODEL, blocks("s", "a")) == {key("b"): 1}
    assert index.forget(key("a")) == 0
    assert index.forget(key("b"), key("zz")) == 2
    assert len(index) == 0


def test_the_last_requests_hashes_are_reused_until_recorded() -> None:
    index = PrefixIndex(B)
    parts = blocks("s", "t")
    first = index.hashes(MODEL, parts)
    assert index.hashes(MODEL, parts) is first  # same request: hashed once
    assert index.match(MODEL, parts) == {}
    index.record(MODEL, key("a"), parts)  # the index changed: the match is recomputed
    assert index.match(MODEL, parts) == {key("a"): 2}
    assert index.hashes("other", parts) != first


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(0)
    with pytest.raises(ValueError):
        PrefixIndex(B, max_blocks=0)


prompt_st = st.lists(st.sampled_from("abc"), min_size=0, max_size=6)
record_st = st.tuples(st.sampled_from(["p", "q", "r"]), prompt_st)


@given(st.lists(record_st, max_size=25), prompt_st)
def test_match_agrees_with_the_longest_recorded_prefix_of_each_pod(
    records: list[tuple[str, list[str]]], query: list[str]
) -> None:
    index = PrefixIndex(B)
    sent: dict[str, list[list[str]]] = defaultdict(list)
    for name, prompt in records:
        index.record(MODEL, key(name), blocks(*prompt))
        sent[key(name)].append(prompt)

    def common(a: list[str], b: list[str]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    expected = {}
    for pod_key, prompts in sent.items():
        longest = max(common(query, p) for p in prompts)  # blocks shared with the query
        if longest:
            expected[pod_key] = longest
    assert index.match(MODEL, blocks(*query)) == expected


@settings(max_examples=50)
@given(st.lists(record_st, max_size=40), st.integers(1, 10))
def test_the_index_never_holds_more_than_its_budget(
    records: list[tuple[str, list[str]]], cap: int
) -> None:
    index = PrefixIndex(B, max_blocks=cap)
    for name, prompt in records:
        index.record(MODEL, key(name), blocks(*prompt))
        assert len(index) <= cap
        if prompt:  # what was just recorded is matched as far as the budget goes
            assert index.match(MODEL, blocks(*prompt))[key(name)] == min(len(prompt), cap)


# The strategy ------------------------------------------------------------------------------------


def strategy(block_chars: int = B, max_blocks: int = 1000) -> PrefixCache:
    built = build_strategies(PrefixCacheSettings(block_chars, max_blocks))["prefix-cache"]
    assert isinstance(built, PrefixCache)
    return built


def test_registered_with_its_settings_and_aibrix_defaults() -> None:
    default = build_strategies()["prefix-cache"]
    assert isinstance(default, PrefixCache)
    assert default.settings == PrefixCacheSettings(block_chars=128, max_blocks=200_000)
    assert isinstance(default, Scorer) and default.higher_is_better
    with pytest.raises(RoutingFailed):
        default.admit([], req(blocks("a")), random.Random(0), 0.0)


def test_the_longest_match_wins_over_load() -> None:
    s = strategy()
    s.routed(cand("a"), req(blocks("s", "u")))
    s.routed(cand("b"), req(blocks("s")))
    cands = [cand("a", running=9), cand("b", running=0), cand("c", running=0)]
    for seed in range(20):
        assert s.pick(cands, req(blocks("s", "u", "v")), random.Random(seed)).pod.name == "a"


def test_ties_go_to_the_fewest_in_flight_then_at_random() -> None:
    s = strategy()
    for name in ("a", "b", "c"):
        s.routed(cand(name), req(blocks("s")))
    cands = [cand("a", running=3), cand("b", running=1), cand("c", running=1), cand("d")]
    picks = Counter(
        s.pick(cands, req(blocks("s", "u")), random.Random(seed)).pod.name for seed in range(200)
    )
    assert set(picks) == {"b", "c"}  # d is idle but holds nothing


def test_no_match_anywhere_is_least_request() -> None:
    s = strategy()
    s.routed(cand("gone"), req(blocks("s")))  # a match on a pod that is no candidate
    cands = [cand("a", running=2), cand("b", running=0), cand("c", running=0)]
    for parts in (blocks("s"), blocks("n"), ("short",), ()):
        picks = Counter(
            s.pick(cands, req(parts), random.Random(seed)).pod.name for seed in range(100)
        )
        assert set(picks) == {"b", "c"}


def test_scores_are_the_cached_share_of_the_prompts_blocks() -> None:
    s = strategy()
    s.routed(cand("a"), req(blocks("s", "u", "v", "w")))
    s.routed(cand("b"), req(blocks("s")))
    cands = [cand("a"), cand("b"), cand("c")]
    assert s.scores(cands, req(blocks("s", "u", "x", "y"))) == [0.5, 0.25, 0.0]
    assert s.scores(cands, req(blocks("n"))) == [0.0, 0.0, 0.0]
    assert s.scores(cands, req(("short",))) == [0.0, 0.0, 0.0]


def test_routed_counts_hits_per_model_and_records() -> None:
    s = strategy()
    s.routed(cand("a"), req(blocks("s", "u")))
    s.routed(cand("a"), req(blocks("s", "v")))
    s.routed(cand("b"), req(blocks("s", "w")))
    s.routed(cand("a"), req(("short",)))
    stats = s.stats[MODEL]
    assert (stats.requests, stats.prompt_blocks, stats.matched_blocks) == (4, 6, 1)
    assert len(s.index) == 4  # s, s u, s v, s w


def test_a_reused_request_object_sees_what_it_recorded() -> None:
    s = strategy()
    again = req(blocks("s", "u"))
    cands = [cand("a", running=5), cand("b")]
    assert s.pick(cands, again, random.Random(0)).pod.name == "b"
    s.routed(cands[1], again)
    cands[1].running = 9
    assert s.pick(cands, again, random.Random(0)).pod.name == "b"


# Through the router ------------------------------------------------------------------------------

N_PODS = 8
SYSTEMS = 4
USERS = 40


def words(rng: random.Random, n: int) -> str:
    vocabulary = ["route", "cache", "prefix", "token", "model", "replica", "GPU", "block", "hit"]
    return " ".join(rng.choice(vocabulary) for _ in range(n))


def workload(seed: int = 7) -> list[tuple[int, bytes]]:
    """SYSTEMS system prompts of about 2,000 characters, each with USERS users' own questions,
    shuffled: (system prompt index, chat body)."""
    rng = random.Random(seed)
    systems = [f"You are assistant {k}. " + words(rng, 300) for k in range(SYSTEMS)]
    bodies = [
        (
            k,
            orjson.dumps(
                {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": systems[k]},
                        {"role": "user", "content": f"user {u}: " + words(rng, 40)},
                    ],
                }
            ),
        )
        for k in range(SYSTEMS)
        for u in range(USERS)
    ]
    rng.shuffle(bodies)
    return bodies


class Fleet:
    """A pool of N_PODS pods and a router over it, with a strategy of our choice."""

    def __init__(self, chosen: Strategy, observer: PrefixCache) -> None:
        self.pool = PodPool(CapacityEstimator())
        self.pool.set_pods([pod(f"p{i}") for i in range(N_PODS)])
        self.strategy = chosen
        self.observer = observer  # learns every routed request (the hit rate of any strategy)
        strategies = {chosen.name: chosen}
        self.router = Router(self.pool, strategies, chosen.name, random.Random(0), lambda: 0.0)

    def candidate(self, decision: Decision) -> Candidate:
        found = [c for c in self.pool.candidates(MODEL, 0.0) if c.pod is decision.lease.pod]
        assert len(found) == 1
        return found[0]

    def route(self, request: RequestInfo) -> Decision:
        """Admit through the router, which tells the routing strategy where the request went
        (`routed`); the observer, if it is another, is told here."""
        decision = self.router.admit(request, self.strategy)
        assert isinstance(decision, Decision)
        if self.strategy is not self.observer:
            self.observer.routed(self.candidate(decision), request)
        return decision

    def run(self, bodies: list[tuple[int, bytes]]) -> dict[int, Counter[str]]:
        """Route every body, each released before the next: system prompt -> pods it went to."""
        landed: dict[int, Counter[str]] = defaultdict(Counter)
        for k, body in bodies:
            decision = self.route(parse_request(body))
            landed[k][decision.lease.pod.name] += 1
            decision.lease.release()
        return landed


def hit_rate(s: PrefixCache) -> float:
    stats = s.stats[MODEL]
    return stats.matched_blocks / stats.prompt_blocks


def test_shared_prefixes_land_together_and_hit_the_cache() -> None:
    pc = PrefixCache()  # the defaults: 128-character blocks
    fleet = Fleet(pc, pc)
    landed = fleet.run(workload())
    assert all(len(pods) == 1 for pods in landed.values())  # one pod per system prompt
    assert pc.stats[MODEL].requests == SYSTEMS * USERS  # the router told it of each
    # every request after each system prompt's first finds that prompt cached
    assert hit_rate(pc) > 0.8

    # random routing spreads every prompt over the fleet: each pod caches every prompt
    observer = PrefixCache()
    spread = Fleet(RandomPick(), observer).run(workload())
    assert all(len(pods) > N_PODS // 2 for pods in spread.values())
    assert hit_rate(observer) < hit_rate(pc)  # each pod misses each prompt once


def test_the_router_tells_prefix_cache_in_a_blend_where_requests_went() -> None:
    strategies = build_strategies()
    pc = strategies["prefix-cache"]
    assert isinstance(pc, PrefixCache)
    pool = PodPool(CapacityEstimator())
    pool.set_pods([pod(f"p{i}") for i in range(N_PODS)])
    router = Router(pool, strategies, "least-request", random.Random(0), lambda: 0.0)
    blend = router.strategy_for("prefix-cache:5,load-balance:4")
    landed: dict[int, Counter[str]] = defaultdict(Counter)
    for k, body in workload():
        decision = router.admit(parse_request(body), blend)
        assert isinstance(decision, Decision)
        landed[k][decision.lease.pod.name] += 1
        decision.lease.release()
    assert pc.stats[MODEL].requests == SYSTEMS * USERS  # told by the router alone
    assert all(len(pods) == 1 for pods in landed.values())  # idle pods: the prefix decides
    assert hit_rate(pc) > 0.8


def test_a_bounded_index_keeps_routing_the_recent_prefixes_together() -> None:
    pc = PrefixCache(PrefixCacheSettings(max_blocks=40))  # ~2 system prompts' worth
    fleet = Fleet(pc, pc)
    bodies = sorted(workload(), key=lambda kb: kb[0])  # one system prompt after another
    landed = fleet.run(bodies)
    assert len(pc.index) <= 40
    assert all(len(pods) == 1 for pods in landed.values())
    assert hit_rate(pc) > 0.8


def test_a_removed_pod_is_forgotten() -> None:
    pc = PrefixCache()
    fleet = Fleet(pc, pc)
    bodies = workload()
    landed = fleet.run(bodies[:40])
    k, pods = next(iter(landed.items()))
    (home,) = pods
    fleet.pool.set_pods([pod(f"p{i}") for i in range(N_PODS) if f"p{i}" != home])
    request = parse_request(next(body for kk, body in bodies if kk == k))
    assert key(home) in pc.index.match(MODEL, request.prompt_parts)
    pc.forget(key(home))
    assert key(home) not in pc.index.match(MODEL, request.prompt_parts)
    # the prompt finds a new home and sticks to it
    again = fleet.run([(kk, body) for kk, body in bodies[40:] if kk == k])
    assert list(again[k]) != [home] and len(again[k]) == 1
    # the pod coming back (same name, empty cache) claims nothing
    fleet.pool.set_pods([pod(f"p{i}") for i in range(N_PODS)])
    assert key(home) not in pc.index.match(MODEL, request.prompt_parts)


# What the request parser hands over --------------------------------------------------------------


def parts_of(doc: dict[str, Any]) -> tuple[str, ...]:
    return parse_request(orjson.dumps({"model": MODEL, **doc})).prompt_parts


def ids_text(ids: list[int]) -> str:
    return array("i", ids).tobytes().decode("latin-1")


@pytest.mark.parametrize(
    ("doc", "parts"),
    [
        (
            {"messages": [{"role": "system", "content": "be brief"}, {"content": "hi"}]},
            ("be brief", "hi"),
        ),
        (
            {
                "messages": [
                    {
                        "content": [
                            {"type": "text", "text": "ab"},
                            {"type": "image_url", "image_url": {"url": "data:..."}},
                            {"type": "text", "text": "cd"},
                        ]
                    }
                ]
            },
            ("ab", "cd"),
        ),
        ({"messages": [{"content": None}, "junk", 7]}, ()),
        ({"prompt": "once upon"}, ("once upon",)),
        ({"prompt": ["ab", "c"]}, ("ab", "c")),
        ({"prompt": [1, 2, 70000]}, (ids_text([1, 2, 70000]),)),
        ({"prompt": [[1, 2], [3]]}, (ids_text([1, 2]), ids_text([3]))),
        ({"prompt": []}, ()),
        ({"prompt": [2**40, 1]}, ()),  # not int32 ids: counted, not hashed
        ({"prompt": {"not": "a prompt"}}, ()),
        ({}, ()),
    ],
    ids=[
        "chat",
        "chat-text-parts",
        "chat-junk",
        "completion",
        "completion-strings",
        "token-ids",
        "token-id-batches",
        "empty",
        "huge-ids",
        "bad-prompt",
        "none",
    ],
)
def test_the_prompt_parts_are_the_bodys_text_in_order(
    doc: dict[str, Any], parts: tuple[str, ...]
) -> None:
    assert parts_of(doc) == parts


def test_token_ids_count_as_before_and_hash_as_four_characters_an_id() -> None:
    info = parse_request(orjson.dumps({"model": MODEL, "prompt": list(range(64))}))
    assert (info.prompt_chars, info.prompt_tokens) == (0, 64)
    assert len(info.prompt_parts[0]) == 256
    assert info.prompt_tokens == 64 and "prompt_parts" not in repr(info)


def test_the_router_makes_prefix_cache_forget_pods_that_left_discovery() -> None:
    """`Router.pods_removed` (the gateway calls it on every discovery update) reaches the
    strategy, so a pod that comes back under the same name is not credited with its old cache."""
    pool = PodPool(CapacityEstimator())
    pods = [Pod(f"p{i}", "ns", MODEL, "10.0.0.1", 8000 + i, 8000) for i in range(3)]
    pool.set_pods(pods)
    chosen = strategy()
    router = Router(pool, {"prefix-cache": chosen}, "prefix-cache", random.Random(0), lambda: 0.0)
    prompt = req(blocks("a", "b", "c"))
    first = router.admit(prompt, chosen)
    assert isinstance(first, Decision)
    first.lease.release()
    held = first.lease.pod.key
    assert chosen.scores(pool.candidates(MODEL, 0.0), prompt).count(1.0) == 1
    router.pods_removed([held])
    assert chosen.scores(pool.candidates(MODEL, 0.0), prompt) == [0.0, 0.0, 0.0]


# --- an index shared by gateway replicas ---------------------------------------------------------


def test_stable_hashes_are_the_same_in_another_process() -> None:
    """Replicas match each other's prefixes only if every process hashes a prompt alike
    (Python's `hash` of a str is salted per process)."""
    parts = ("You are a helpful assistant. " * 20, "What is 2 + 2?")
    here = stable_block_hashes("m", parts, 16)
    code = (
        "from plugin.core.prefix import stable_block_hashes;"
        f"print(stable_block_hashes('m', {parts!r}, 16))"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert len(here) == len("\x1e".join(parts).encode()) // 16
    assert there.strip() == str(here)
    assert stable_block_hashes("other", parts, 16)[0] != here[0]  # the model starts the chain


def test_a_prompt_one_replica_routed_matches_at_another() -> None:
    a, b = PrefixIndex(block_chars=16), PrefixIndex(block_chars=16)
    a.share()
    b.share()
    prompt = ("a long system prompt shared by many requests",)
    a.record("m", "ns/p1", prompt)
    for pod, hashes in a.take_recorded():
        b.add(pod, hashes)
    assert b.match("m", prompt) == {"ns/p1": len(a.hashes("m", prompt))}
    assert b.take_recorded() == []  # what it was told is not told again
    assert a.take_recorded() == []


def test_the_outbox_keeps_what_could_not_be_published_first_and_bounded() -> None:
    index = PrefixIndex(block_chars=4)
    index.record("m", "ns/p", ("abcdefgh",))
    assert index.take_recorded() == []  # not shared: nothing kept
    index.share()
    index.record("m", "ns/p", ("abcdefgh",))
    first = index.take_recorded()
    index.record("m", "ns/q", ("ijklmnop",))
    index.return_recorded(first)
    assert [pod for pod, _ in index.take_recorded()] == ["ns/p", "ns/q"]
    for i in range(MAX_OUTBOX + 5):
        index.record("m", f"ns/p{i}", ("abcdefgh",))
    kept = index.take_recorded()
    assert len(kept) <= MAX_OUTBOX and kept[-1][0] == f"ns/p{MAX_OUTBOX + 4}"
