"""One inference engine, modelled per scheduler iteration (continuous batching, vLLM-like).

Each step serves every decoding sequence one token and spends the rest of a per-step token budget
on prefill chunks (chunked prefill). A step costs `a + b * decoding` ms plus `p` ms per prefill
token. Admission is FCFS up to `max_num_seqs`; KV cache is counted in tokens (prompt + generated
per sequence) and, when the next step would not fit, the most recently admitted sequence is
preempted and later recomputed (its prompt and the tokens it already produced are prefilled again),
as vLLM's recompute preemption does.

Prefix caching: a request may share its first `shared_tokens` with others of its `prefix_group`
(a system prompt, a document asked several questions). An engine remembers the groups whose
prefix it prefilled, least recently used first out, up to `prefix_cache_share` of its KV cache;
a request admitted where its group is cached skips that part of its prefill (its KV is still
held, as vLLM's shared blocks are). What it hit and what it asked for are counted in tokens, as
vLLM's `vllm:prefix_cache_hits_total` and `..._queries_total` are. Limits: a prefix is cached
once its request's whole prefill ran (vLLM caches block by block), the cache is a fixed
share of the KV cache rather than whatever blocks are free, and each running request of a group
holds its own copy of the prefix in the KV count (vLLM shares one), which overstates KV pressure
when many requests of one group run at once.

The bookkeeping is per event, not per sequence per step: a decoding sequence's KV grows by one
token a step, so the total is kept as `constant + decoding * steps` and finishes come off a heap by
step number. A step costs O(1) plus what is admitted, finished or preempted in it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

__all__ = [
    "PRESETS",
    "EngineSnapshot",
    "GpuProfile",
    "SimEngine",
    "SimSeq",
    "parse_fleet",
]


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """Step-cost model of one GPU type serving a 7-8B model (times in ms)."""

    name: str
    a_ms: float  # fixed cost of a step
    b_ms: float  # per decoding sequence in the step
    p_ms: float  # per prefill token in the step
    kv_tokens: int
    max_num_seqs: int = 256
    max_batched_tokens: int = 2048  # per-step token budget (decode tokens count against it)
    prefix_cache_share: float = 0.25  # of kv_tokens kept for cached prefixes (module doc)

    def __post_init__(self) -> None:
        if min(self.a_ms, self.b_ms, self.p_ms) < 0 or self.a_ms + self.b_ms <= 0:
            raise ValueError(f"{self.name}: step costs must be >= 0 and a + b > 0")
        if self.kv_tokens < 1 or self.max_num_seqs < 1 or self.max_batched_tokens < 1:
            raise ValueError(f"{self.name}: kv_tokens, max_num_seqs, max_batched_tokens >= 1")
        if not 0.0 <= self.prefix_cache_share <= 1.0:
            raise ValueError(f"{self.name}: prefix_cache_share must be within 0..1")

    def step_ms(self, decoding: int, prefill_tokens: int = 0) -> float:
        return self.a_ms + self.b_ms * decoding + self.p_ms * prefill_tokens

    def saturated_tokens_per_s(self, batch: int | None = None) -> float:
        """Decode-only output rate with `batch` (default: max_num_seqs) sequences in every step."""
        n = self.max_num_seqs if batch is None else batch
        return 1000.0 * n / self.step_ms(n)


PRESETS: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        GpuProfile("h100", 5.0, 0.06, 0.03, 440_000),
        GpuProfile("a100", 9.0, 0.12, 0.09, 440_000),
        GpuProfile("l20", 20.0, 0.30, 0.25, 210_000),
        GpuProfile("a40", 24.0, 0.35, 0.20, 210_000),
        GpuProfile("v100", 22.0, 0.35, 0.35, 100_000),
        GpuProfile("a10", 30.0, 0.45, 0.25, 45_000),
        GpuProfile("l4", 60.0, 0.8, 0.25, 45_000),
    )
}


def parse_fleet(spec: str, **overrides: float | int) -> list[GpuProfile]:
    """`a100,l20,v100` or `3xa100,l4` -> profiles; overrides (e.g. max_num_seqs=32) apply to all.

    An override may name one GPU type as `a100.max_num_seqs`.
    """
    fleet: list[GpuProfile] = []
    for raw in spec.split(","):
        item = raw.strip().lower()
        if not item:
            continue
        count = 1
        if "x" in item and item.split("x", 1)[0].isdigit():
            n, item = item.split("x", 1)
            count = int(n)
        if item not in PRESETS:
            raise ValueError(f"unknown GPU type {item!r}; known: {', '.join(PRESETS)}")
        fleet.extend([PRESETS[item]] * count)
    if not fleet:
        raise ValueError("the fleet is empty")
    out: list[GpuProfile] = []
    for profile in fleet:
        changes: dict[str, float | int] = {}
        for key, value in overrides.items():
            gpu, _, field = key.rpartition(".")
            if not gpu or gpu == profile.name:
                changes[field] = value
        out.append(replace(profile, **changes) if changes else profile)  # type: ignore[arg-type]
    return out


class SimSeq:
    """One request inside an engine. Times are simulated seconds; -1 means not yet."""

    __slots__ = (
        "arrival",
        "base",
        "decode_mark",
        "epoch",
        "finish_at",
        "first_token_at",
        "generated",
        "gpu_s",
        "output_tokens",
        "preemptions",
        "prefill_target",
        "prefilled",
        "prefix_group",
        "prompt_tokens",
        "rid",
        "shared_tokens",
    )

    def __init__(
        self,
        rid: int,
        arrival: float,
        prompt_tokens: int,
        output_tokens: int,
        prefix_group: int = -1,
        shared_tokens: int = 0,
    ) -> None:
        self.rid = rid
        self.prefix_group = prefix_group  # -1: shares no prefix with other requests
        self.shared_tokens = shared_tokens if prefix_group >= 0 else 0
        self.arrival = arrival
        self.prompt_tokens = max(1, prompt_tokens)
        self.output_tokens = max(1, output_tokens)
        self.prefill_target = self.prompt_tokens
        self.prefilled = 0
        self.generated = 0  # tokens emitted before the current decoding run began
        self.base = 0  # decoding: KV at step k is base + k
        self.epoch = 0  # bumped on preemption: stale heap entries are skipped
        self.first_token_at = -1.0
        self.finish_at = -1.0
        self.preemptions = 0
        # GPU time it took: its share of each step it was in, by marginal cost (`finish_step`);
        # recomputation after a preemption included.
        self.gpu_s = 0.0
        self.decode_mark = 0.0  # the engine's per-token integral when it began decoding


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the engine's /metrics would say (vLLM's names): what a gateway may scrape."""

    running: int
    waiting: int
    kv_usage: float


class SimEngine:
    """A continuous-batching engine driven step by step by the fleet simulator."""

    __slots__ = (
        "_decoding",
        "_heap",
        "_kv_const",
        "_prefill_kv",
        "_prefilling",
        "_prefix_tokens",
        "_prefixes",
        "_running",
        "busy_s",
        "generated_tokens",
        "name",
        "per_token_s",
        "preemptions",
        "prefix_hit_tokens",
        "prefix_query_tokens",
        "profile",
        "steps",
        "waiting",
    )

    def __init__(self, name: str, profile: GpuProfile) -> None:
        self.name = name
        self.profile = profile
        self.waiting: deque[SimSeq] = deque()
        self._running: dict[int, SimSeq] = {}  # admission order: the last one is preempted first
        self._prefilling: dict[int, SimSeq] = {}  # subset of running still in prefill
        self._decoding = 0
        self._kv_const = 0  # sum over decoding seqs of (base); their KV is this + decoding * steps
        self._prefill_kv = 0  # KV held by sequences still prefilling
        self._heap: list[tuple[int, int, int, SimSeq]] = []  # (finish step, rid, epoch, seq)
        self.steps = 0
        self.busy_s = 0.0
        self.generated_tokens = 0
        self.per_token_s = 0.0  # sum over steps of one decoding sequence's share of the step
        self.preemptions = 0
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # group -> tokens, LRU first
        self._prefix_tokens = 0
        self.prefix_query_tokens = 0  # prompt tokens admitted (each admission, as vLLM counts)
        self.prefix_hit_tokens = 0  # of those, found in the prefix cache

    # state ---------------------------------------------------------------------------------
    def fits(self, seq: SimSeq) -> bool:
        """A request whose whole sequence exceeds the KV cache can never finish here."""
        return seq.prompt_tokens + seq.output_tokens <= self.profile.kv_tokens

    def kv_used(self) -> int:
        return self._prefill_kv + self._kv_const + self._decoding * self.steps

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            len(self._running), len(self.waiting), self.kv_used() / self.profile.kv_tokens
        )

    def idle(self) -> bool:
        return not self._running and not self.waiting

    def submit(self, seq: SimSeq) -> None:
        self.waiting.append(seq)

    # one iteration -------------------------------------------------------------------------
    def plan_step(self) -> tuple[float, list[tuple[SimSeq, int]]] | None:
        """Schedule the next step: preempt if KV would overflow, then fill the token budget.

        Returns the step's duration in seconds and the prefill chunks it runs, or None when
        there is nothing to do.
        """
        profile = self.profile
        cap = profile.kv_tokens
        while self._running and self.kv_used() + self._decoding > cap:
            self._preempt_last()
        budget = profile.max_batched_tokens - self._decoding
        chunks: list[tuple[SimSeq, int]] = []
        free = cap - self.kv_used() - self._decoding
        for seq in self._prefilling.values():
            if budget <= 0 or free <= 0:
                break
            n = min(seq.prefill_target - seq.prefilled, budget, free)
            chunks.append((seq, n))
            budget -= n
            free -= n
        waiting = self.waiting
        while waiting and budget > 0 and len(self._running) < profile.max_num_seqs:
            seq = waiting[0]
            hit = self._cached(seq)
            n = min(seq.prefill_target - hit, budget)
            if n + hit > free:
                break  # FCFS: the head waits for KV, nothing overtakes it
            waiting.popleft()
            self._running[seq.rid] = seq
            self._prefilling[seq.rid] = seq
            self.prefix_query_tokens += seq.prefill_target
            if hit:
                self.prefix_hit_tokens += hit
                seq.prefilled = hit
                self._prefill_kv += hit
                free -= hit
            chunks.append((seq, n))
            budget -= n
            free -= n
        prefill_tokens = sum(n for _, n in chunks)
        if self._decoding == 0 and prefill_tokens == 0:
            if not self._running:
                return None
            # Partial prefills hold all the KV and none can go on: free the newest and retry.
            self._preempt_last()
            return self.plan_step()
        for seq, n in chunks:
            seq.prefilled += n
            self._prefill_kv += n
        return profile.step_ms(self._decoding, prefill_tokens) / 1000.0, chunks

    @property
    def decoding(self) -> int:
        """Sequences past their prefill: each gets a token from the next step."""
        return self._decoding

    def finish_step(
        self, now: float, duration: float, chunks: Iterable[tuple[SimSeq, int]]
    ) -> list[SimSeq]:
        """End the planned step at `now`: emit tokens, move finished prefills to decoding.

        Returns the sequences that finished (first tokens are stamped on the sequences).
        """
        self.busy_s += duration
        self.generated_tokens += self._decoding
        self.steps += 1
        k = self.steps
        chunks = list(chunks)
        # The step's time split by marginal cost: a decoding sequence weighs `b`, a prefill
        # token `p` (the fixed cost `a` goes in the same proportion).
        weight_decode, weight_prefill = self.profile.b_ms, self.profile.p_ms
        if weight_decode <= 0 or weight_prefill <= 0:
            weight_decode = weight_prefill = 1.0
        work = weight_decode * self._decoding + weight_prefill * sum(n for _, n in chunks)
        per_work = duration / work if work > 0 else 0.0
        self.per_token_s += weight_decode * per_work  # each decoding sequence's share
        for seq, n in chunks:
            seq.gpu_s += n * weight_prefill * per_work
        for seq, _ in chunks:
            if seq.prefilled < seq.prefill_target or seq.rid not in self._prefilling:
                continue
            # The last prefill chunk emits a token, as in vLLM.
            del self._prefilling[seq.rid]
            self._prefill_kv -= seq.prefilled
            if seq.prefix_group >= 0:
                self._remember(seq.prefix_group, seq.shared_tokens)
            seq.generated += 1
            self.generated_tokens += 1
            if seq.first_token_at < 0:
                seq.first_token_at = now
            seq.base = seq.prompt_tokens + seq.generated - k
            seq.decode_mark = self.per_token_s
            self._kv_const += seq.base
            self._decoding += 1
            heapq.heappush(
                self._heap, (k + seq.output_tokens - seq.generated, seq.rid, seq.epoch, seq)
            )
        done: list[SimSeq] = []
        heap = self._heap
        while heap and heap[0][0] <= k:
            _, rid, epoch, seq = heapq.heappop(heap)
            if epoch != seq.epoch:
                continue
            seq.generated = seq.output_tokens
            seq.finish_at = now
            seq.gpu_s += self.per_token_s - seq.decode_mark
            self._kv_const -= seq.base
            self._decoding -= 1
            del self._running[rid]
            done.append(seq)
        return done

    def _cached(self, seq: SimSeq) -> int:
        """Tokens of `seq`'s prefill its cached group prefix covers (at least one is computed:
        the last prefill chunk is what emits the first token)."""
        if seq.prefix_group < 0 or seq.prefix_group not in self._prefixes:
            return 0
        self._prefixes.move_to_end(seq.prefix_group)
        return min(seq.shared_tokens, seq.prefill_target - 1)

    def _remember(self, group: int, tokens: int) -> None:
        budget = int(self.profile.kv_tokens * self.profile.prefix_cache_share)
        if tokens <= 0 or tokens > budget:
            return
        prefixes = self._prefixes
        if group in prefixes:
            prefixes.move_to_end(group)
            return
        prefixes[group] = tokens
        self._prefix_tokens += tokens
        while self._prefix_tokens > budget:
            _, dropped = prefixes.popitem(last=False)
            self._prefix_tokens -= dropped

    def _preempt_last(self) -> None:
        rid, seq = self._running.popitem()
        if rid in self._prefilling:
            del self._prefilling[rid]
            self._prefill_kv -= seq.prefilled
        else:
            seq.generated = seq.base + self.steps - seq.prompt_tokens
            seq.gpu_s += self.per_token_s - seq.decode_mark
            self._kv_const -= seq.base
            self._decoding -= 1
        seq.epoch += 1
        seq.preemptions += 1
        self.preemptions += 1
        seq.prefill_target = seq.prompt_tokens + seq.generated
        seq.prefilled = 0
        self.waiting.appendleft(seq)
