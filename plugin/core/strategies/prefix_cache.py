"""`prefix-cache`: send a prompt where its longest prefix was sent before (AIBrix's algorithm).

Engines with prefix caching skip the prefill of a prompt's cached prefix, so a request whose
system prompt (or earlier turns) a pod already holds is served sooner and cheaper there. The
strategy keeps a `PrefixIndex` of the prompts it routed (`routed`, which the router calls after
every request this strategy routes, alone or in a blend) and:

- as a `Picker`: the candidate with the longest cached prefix; ties (no match anywhere
  included) by fewest requests in flight, then at random (`random_min`'s draw);
- as a `Scorer` (blends; `prefix-cache:5,load-balance:4` is AIBrix's auto-blend): the share
  of the prompt's full blocks the candidate holds, 0.0 to 1.0, higher is better.

Where AIBrix differs (`pkg/plugins/gateway/algorithms/prefix_cache.go`, `routeOriginal` and
`getTargetPodFromMatchedPodsFromCounts`): among matched pods, sorted by match percent then
running requests, it takes the first whose running count is at most mean + k x stddev of all
ready pods (`AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR`, k = 1), else least-request over
all pods; and a load-imbalance gate may first narrow the pods. Here the picker is the plain
rule: load is the business of the imbalance gate and of load-balance in the blend (auto-blend
gives a bare `prefix-cache` both), and the mean and deviation would cost a pass over every
pod per request. Its `ScoreAll` scores integer match percents (0..100); the share here is the
same ranking without the rounding.

Cost per request: hashing O(prompt) and matching O(matched blocks x pods holding them) (see
`plugin.core.prefix`); with a match the pick reads each candidate once (a dict lookup each),
without one it is least-request's O(log pods) on the pool's view; scores read each candidate
once; `routed` records the prompt's blocks. A request routed by another strategy pays nothing.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from plugin.core.prefix import PrefixIndex
from plugin.core.strategies.base import Picker, Strategy, register_strategy, require_candidates
from plugin.core.strategies.simple import LeastRequest, random_min
from plugin.core.types import Candidate, RequestInfo

__all__ = ["PrefixCache", "PrefixCacheSettings", "PrefixStats"]


@dataclass(frozen=True, slots=True)
class PrefixCacheSettings:
    """Block size and budget of the prefix index (AIBrix's variables, see the module doc)."""

    # Characters a block (AIBRIX_PREFIX_CACHE_BLOCK_SIZE). AIBrix's default tokenizer
    # (`character`, AIBRIX_PREFIX_CACHE_TOKENIZER_TYPE) makes a prompt's UTF-8 bytes its
    # tokens, and its docs give 128 as the default and the recommended block for it
    # (`pkg/plugins/gateway/algorithms/README.md`, `prefix_cache_readme.md`; `hash.go`'s
    # constant reads 4): 128 characters are about 32 tokens, two of vLLM's 16-token KV blocks,
    # the unit an engine's prefix cache reuses. Smaller blocks match shorter shared prefixes
    # but cost a hash each on every request.
    block_chars: int = 128
    # Block hashes the index keeps over all models, LRU (AIBRIX_PREFIX_CACHE_BLOCK_NUMBER,
    # AIBrix's default 200,000: `pkg/utils/prefixcacheindexer/hash.go`). About 190 bytes each.
    max_blocks: int = 200_000


@dataclass(slots=True)
class PrefixStats:
    """One model's routed prompts as the index saw them: the hit rate is matched / prompt blocks."""

    requests: int = 0
    prompt_blocks: int = 0  # full blocks of the routed prompts
    matched_blocks: int = 0  # of those, already cached at the pod they were routed to


_LEAST_REQUEST = LeastRequest()


@register_strategy("prefix-cache", PrefixCacheSettings)
class PrefixCache(Picker):
    """Longest cached prefix wins; ties by fewest in flight, then at random (module doc)."""

    __slots__ = ("index", "settings", "stats")
    name = "prefix-cache"
    higher_is_better = True  # as a blend member: a larger cached share is better

    def __init__(self, settings: PrefixCacheSettings | None = None) -> None:
        self.settings = settings or PrefixCacheSettings()
        self.index = PrefixIndex(self.settings.block_chars, self.settings.max_blocks)
        self.stats: dict[str, PrefixStats] = {}  # per model; a plain dict for the metrics

    def pick(
        self, candidates: Sequence[Candidate], request: RequestInfo, rng: random.Random
    ) -> Candidate:
        require_candidates(candidates)
        depth = self.index.match(request.model, request.prompt_parts)
        if depth:
            best = 0
            tied: list[Candidate] = []
            for c in candidates:
                d = depth.get(c.pod.key, 0)
                if d > best:
                    best, tied = d, [c]
                elif d == best and d:
                    tied.append(c)
            if tied:
                return random_min(tied, [(float(c.running),) for c in tied], rng)
        return _LEAST_REQUEST.pick(candidates, request, rng)

    def scores(self, candidates: Sequence[Candidate], request: RequestInfo) -> list[float]:
        """The share of the prompt's full blocks each candidate holds; 0.0 without a match (and
        for every candidate when the prompt is shorter than a block)."""
        index = self.index
        total = len(index.hashes(request.model, request.prompt_parts))
        depth = index.match(request.model, request.prompt_parts) if total else None
        if not depth:
            return [0.0] * len(candidates)
        return [depth.get(c.pod.key, 0) / total for c in candidates]

    def routed(self, candidate: Candidate, request: RequestInfo) -> None:
        """The request went to `candidate`: count its hit, then record its blocks there."""
        index, model, parts = self.index, request.model, request.prompt_parts
        total = len(index.hashes(model, parts))
        stats = self.stats.get(model)
        if stats is None:
            stats = self.stats[model] = PrefixStats()
        stats.requests += 1
        if total:
            key = candidate.pod.key
            stats.prompt_blocks += total
            stats.matched_blocks += index.match(model, parts).get(key, 0)
            index.record(model, key, parts)

    def forget(self, *keys: str) -> None:
        """Pods that left discovery: their cached prefixes no longer count (`PrefixIndex`)."""
        self.index.forget(*keys)


def prefix_stats(strategy: Strategy | None) -> dict[str, tuple[int, int, int]]:
    """Per model: (requests, prompt blocks, matched blocks) of the requests `strategy` (the
    gateway's prefix-cache) routed, alone or blended; none for another strategy."""
    if not isinstance(strategy, PrefixCache):
        return {}
    return {m: (s.requests, s.prompt_blocks, s.matched_blocks) for m, s in strategy.stats.items()}
