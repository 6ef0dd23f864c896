"""Request streams for the simulator: prompt/output lengths and arrival times, seeded.

Pure: traces come in as rows (loaded by `plugin_tools.sim.traces`), randomness from a
`random.Random`.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "CHAT",
    "LONG",
    "Arrivals",
    "LengthSource",
    "LogNormalLengths",
    "MixedLengths",
    "SharedPrefix",
    "SimRequest",
    "SyntheticLengths",
    "TraceLengths",
    "generate",
]


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival: float  # seconds from the start
    prompt_tokens: int
    output_tokens: int
    # Requests of one group share their first `shared_tokens` prompt tokens (-1: no group), and
    # `prompt_parts` is the prompt's text as a gateway would hash it (empty: none given).
    prefix_group: int = -1
    shared_tokens: int = 0
    prompt_parts: tuple[str, ...] = field(default=(), repr=False)
    tenant: str = "default"  # who sent it (admission's fair queue)


class LengthSource(Protocol):
    """Sources are frozen values: what is derived from one (a profile grid) is cached by it."""

    def __hash__(self) -> int: ...

    def sample(self, rng: random.Random) -> tuple[int, int]:
        """(prompt tokens, output tokens) of one request."""
        ...

    @property
    def mean_output(self) -> float: ...

    @property
    def max_output(self) -> int:
        """The longest output the source makes: what a client would send as `max_tokens`."""
        ...


@dataclass(frozen=True, slots=True)
class LogNormalLengths:
    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        value = rng.lognormvariate(math.log(self.median), self.sigma) if self.sigma else self.median
        return int(min(self.high, max(self.low, round(value))))


@dataclass(frozen=True, slots=True)
class SyntheticLengths:
    prompt: LogNormalLengths
    output: LogNormalLengths
    name: str = "synthetic"

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return self.prompt.sample(rng), self.output.sample(rng)

    @property
    def mean_output(self) -> float:
        """Mean of the clipped lognormal, by a fixed-seed estimate (cheap, deterministic)."""
        rng = random.Random(0)
        return sum(self.output.sample(rng) for _ in range(20_000)) / 20_000

    @property
    def max_output(self) -> int:
        return self.output.high


# ShareGPT-like chat (shared/data/README.md): prompt median 40 sigma 1.7 clipped at 4k, output
# median 280 sigma 1.2 clipped at 1k.
CHAT = SyntheticLengths(
    LogNormalLengths(40, 1.7, 1, 4096), LogNormalLengths(280, 1.2, 1, 1024), name="chat"
)
# Long prompts with short answers (documents to summarise or classify, retrieval context): prompt
# median 6k sigma 0.3 clipped to 4097..16k, output median 24 sigma 0.8 clipped at 128.
LONG = SyntheticLengths(
    LogNormalLengths(6000, 0.3, 4097, 16384), LogNormalLengths(24, 0.8, 1, 128), name="long"
)


@dataclass(frozen=True, slots=True)
class TraceLengths:
    """Lengths drawn at random from a trace's (prompt, output) rows."""

    rows: tuple[tuple[int, int], ...]
    name: str = "trace"

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError(f"{self.name}: no rows")

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return self.rows[rng.randrange(len(self.rows))]

    @property
    def mean_output(self) -> float:
        return sum(o for _, o in self.rows) / len(self.rows)

    @property
    def max_output(self) -> int:
        return max(o for _, o in self.rows)


@dataclass(frozen=True, slots=True)
class MixedLengths:
    """Each request comes from one part, chosen with the parts' weights."""

    parts: tuple[tuple[float, LengthSource], ...]
    name: str = "mix"

    def __post_init__(self) -> None:
        if not self.parts or any(w <= 0 for w, _ in self.parts):
            raise ValueError("a mix needs parts with positive weights")

    def sample(self, rng: random.Random) -> tuple[int, int]:
        total = sum(w for w, _ in self.parts)
        x = rng.random() * total
        for weight, part in self.parts:
            x -= weight
            if x < 0:
                return part.sample(rng)
        return self.parts[-1][1].sample(rng)

    @property
    def mean_output(self) -> float:
        total = sum(w for w, _ in self.parts)
        return sum(w * p.mean_output for w, p in self.parts) / total

    @property
    def max_output(self) -> int:
        return max(p.max_output for _, p in self.parts)


@dataclass(frozen=True, slots=True)
class Arrivals:
    """Poisson (cv 1), Gamma with coefficient of variation `cv` (burstier when > 1), or a trace's
    own inter-arrival gaps rescaled to the target rate."""

    kind: str = "poisson"  # poisson | gamma | trace
    cv: float = 1.0
    trace_times: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("poisson", "gamma", "trace"):
            raise ValueError(f"unknown arrival process {self.kind!r}")
        if self.cv <= 0:
            raise ValueError("cv must be positive")
        if self.kind == "trace" and len(self.trace_times) < 2:
            raise ValueError("trace arrivals need at least two timestamps")

    def times(self, rate: float, n: int, rng: random.Random) -> list[float]:
        if rate <= 0:
            raise ValueError("rate must be positive")
        if self.kind == "trace":
            return self._trace_times(rate, n, rng)
        # Unit-rate gaps scaled by the rate: the same seed gives the same pattern at every rate,
        # only compressed, which keeps a bisection over rates comparing like with like.
        out: list[float] = []
        t = 0.0
        shape = 1.0 / (self.cv * self.cv)
        for _ in range(n):
            if self.kind == "poisson":
                t += rng.expovariate(1.0) / rate
            else:
                t += rng.gammavariate(shape, 1.0 / shape) / rate
            out.append(t)
        return out

    def _trace_times(self, rate: float, n: int, rng: random.Random) -> list[float]:
        """The trace's gaps from a random start, scaled so their mean rate is `rate`;
        wraps around the trace if more requests are asked for than it holds."""
        src = sorted(self.trace_times)
        gaps = [b - a for a, b in itertools.pairwise(src)]
        mean_gap = (src[-1] - src[0]) / len(gaps)
        scale = 1.0 / (rate * mean_gap) if mean_gap > 0 else 0.0
        start = rng.randrange(len(gaps))
        t = 0.0
        out: list[float] = []
        for i in range(n):
            t += gaps[(start + i) % len(gaps)] * scale
            out.append(t)
        return out


def generate(
    lengths: LengthSource, arrivals: Arrivals, rate: float, n: int, rng: random.Random
) -> list[SimRequest]:
    """`n` requests. Arrival times and lengths come from two streams split off `rng`, so the
    k-th request has the same lengths whatever the rate and however many requests are asked."""
    seed = rng.getrandbits(64)
    times = arrivals.times(rate, n, random.Random(f"arrivals-{seed}"))
    sizes = random.Random(f"lengths-{seed}")
    return [SimRequest(t, *lengths.sample(sizes)) for t in times]


_FILLER = "the quick brown fox jumps over the lazy dog while the engine caches its prefix "


def _text(head: str, chars: int) -> str:
    """`head` padded with filler to `chars` characters (at least the head)."""
    if len(head) >= chars:
        return head
    reps = (chars - len(head)) // len(_FILLER) + 1
    return (head + _FILLER * reps)[:chars]


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Prompts that open with one of `groups` shared prefixes of `shared_tokens` tokens (a
    system prompt, a document asked many questions), then a question of their own.

    Groups are drawn with Zipf weights 1 / rank^`zipf` (0: uniform). Each prompt comes with its
    text, `chars_per_token` characters a token, so a gateway's prefix index can hash it: one
    text per group (different from the first character on), then the request's own question.
    As a `LengthSource` it gives the same lengths without the sharing.
    """

    groups: int = 32
    shared_tokens: int = 1500
    zipf: float = 0.0
    question: LogNormalLengths = LogNormalLengths(60, 0.8, 8, 512)
    output: LogNormalLengths = LogNormalLengths(200, 0.9, 8, 1024)
    chars_per_token: int = 4
    name: str = "shared-prefix"

    def __post_init__(self) -> None:
        if self.groups < 1 or self.shared_tokens < 1 or self.chars_per_token < 1:
            raise ValueError("groups, shared_tokens and chars_per_token must be >= 1")
        if self.zipf < 0:
            raise ValueError("zipf must be >= 0")

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return self.shared_tokens + self.question.sample(rng), self.output.sample(rng)

    @property
    def mean_output(self) -> float:
        return SyntheticLengths(self.question, self.output).mean_output

    @property
    def max_output(self) -> int:
        return self.output.high

    def requests(
        self, arrivals: Arrivals, rate: float, n: int, rng: random.Random
    ) -> list[SimRequest]:
        """`n` requests with their groups and texts; seeded streams as in `generate`."""
        seed = rng.getrandbits(64)
        times = arrivals.times(rate, n, random.Random(f"arrivals-{seed}"))
        draw = random.Random(f"prefix-{seed}")
        cum = list(
            itertools.accumulate(1.0 / rank**self.zipf for rank in range(1, self.groups + 1))
        )
        groups = range(self.groups)
        cpt = self.chars_per_token
        heads = [
            _text(f"<document {g:05d}> ", self.shared_tokens * cpt) for g in range(self.groups)
        ]
        out: list[SimRequest] = []
        for k, t in enumerate(times):
            group = draw.choices(groups, cum_weights=cum)[0]
            question = self.question.sample(draw)
            output = self.output.sample(draw)
            parts = (heads[group], _text(f" question {k}: ", question * cpt))
            out.append(
                SimRequest(
                    t, self.shared_tokens + question, output, group, self.shared_tokens, parts
                )
            )
        return out
