"""The mock engine's performance model: a continuous-batching scheduler with injected time.

Pure on purpose (no I/O, no asyncio, no clock): the HTTP server drives it in real time, while tests
and simulators drive it with simulated time and get the same numbers the server would produce.

The model is the one the load-balance design reasons about (`docs/benchmarks.md`): every engine
step decodes one token for each running sequence and costs ``a + b * batch`` milliseconds, plus
``prefill_ms_per_token`` for each prompt token admitted in that step. Admission is FCFS, capped
by ``max_num_seqs`` and by a KV-cache budget reserved up front (prompt + max_tokens), so there is
never any preemption.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TypeAlias

from plugin_tools.sim.engine import PRESETS as GPU_PRESETS

SeqId: TypeAlias = Hashable


@dataclass(frozen=True, slots=True)
class EngineParams:
    """Cost model and limits of one mock engine.

    Durations are milliseconds of the model; ``time_scale`` multiplies every one of them, so a
    test can run an engine 100x faster (0.01) or a demo 2x slower (2.0) with the same ratios.
    """

    a_ms: float
    """Fixed cost of one decode step (weights read once per step, whatever the batch)."""
    b_ms: float
    """Added cost of one decode step per running sequence."""
    prefill_ms_per_token: float
    """Added cost of a step per prompt token of the sequences admitted in that step."""
    kv_tokens: int
    """KV-cache capacity in tokens; a sequence reserves prompt + max_tokens while it runs."""
    max_num_seqs: int = 256
    """Batch cap: at most this many sequences run at once, the rest wait."""
    time_scale: float = 1.0
    """Multiplies every duration; >1 slows the engine, <1 speeds it up, ratios unchanged."""
    tokens_per_chunk: int = 1
    """Tokens carried by one streamed SSE chunk."""
    default_max_tokens: int = 128
    """Output tokens of a request that names neither max_tokens nor max_completion_tokens."""

    def __post_init__(self) -> None:
        # a_ms must be > 0: a zero-cost step would let the step loop spin without advancing time.
        _check_float("a_ms", self.a_ms, allow_zero=False)
        _check_float("b_ms", self.b_ms, allow_zero=True)
        _check_float("prefill_ms_per_token", self.prefill_ms_per_token, allow_zero=True)
        _check_float("time_scale", self.time_scale, allow_zero=False)
        for name in ("kv_tokens", "max_num_seqs", "tokens_per_chunk", "default_max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_float(name: str, value: object, *, allow_zero: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


# One table of GPU types for the mock engine and the simulator (plugin_tools.sim.engine): the same
# step-cost numbers, so a demo and a simulation of one fleet describe the same hardware.
PRESETS: dict[str, EngineParams] = {
    name: EngineParams(
        a_ms=gpu.a_ms,
        b_ms=gpu.b_ms,
        prefill_ms_per_token=gpu.p_ms,
        kv_tokens=gpu.kv_tokens,
        max_num_seqs=gpu.max_num_seqs,
    )
    for name, gpu in GPU_PRESETS.items()
}


def step_duration_s(params: EngineParams, batch: int, prefill_tokens: int = 0) -> float:
    """Seconds one step takes with ``batch`` running sequences and ``prefill_tokens`` admitted."""
    ms = params.a_ms + params.b_ms * batch + params.prefill_ms_per_token * prefill_tokens
    return ms * params.time_scale / 1000.0


def saturated_output_tokens_per_s(params: EngineParams) -> float:
    """Decode throughput (output tokens/s) with the batch full at ``max_num_seqs``.

    Prefill is excluded: this is the steady-state ceiling of long generations, the number a
    capacity-aware router should learn. Short requests with long prompts complete fewer tokens/s.
    """
    return params.max_num_seqs / step_duration_s(params, params.max_num_seqs)


@dataclass(slots=True)
class _Seq:
    prompt_tokens: int
    max_tokens: int
    generated: int = 0

    @property
    def reserved(self) -> int:
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one engine step did; the tokens exist at ``end`` (= start + duration_s).

    Every running sequence emits exactly one token per step, so ``emitted`` lists each one with
    its cumulative token count after the step (a consumer needs no per-sequence bookkeeping).
    """

    start: float
    duration_s: float
    admitted: tuple[SeqId, ...] = ()
    """Sequences prefilled in this step; their first token comes out of it."""
    emitted: tuple[tuple[SeqId, int], ...] = ()
    """(seq_id, tokens generated so far) for every sequence in the batch."""
    finished: tuple[SeqId, ...] = ()
    """Sequences that reached max_tokens in this step; their slot and KV are already free."""
    prefill_tokens: int = 0

    @property
    def end(self) -> float:
        return self.start + self.duration_s

    @property
    def batch(self) -> int:
        return len(self.emitted)


@dataclass(slots=True)
class BatchScheduler:
    """Continuous-batching core: FCFS admission under batch and KV caps, one token per step.

    Time is whatever the caller passes to :meth:`step` (seconds, float); nothing here sleeps.
    Per-step cost is O(batch + admitted) with dict/list operations only, so a Python server can
    run hundreds of sequences at real step rates.
    """

    params: EngineParams
    _waiting: OrderedDict[SeqId, _Seq] = field(default_factory=OrderedDict, init=False)
    _running: dict[SeqId, _Seq] = field(default_factory=dict, init=False)
    _reserved: int = field(default=0, init=False)
    generation_tokens_total: int = field(default=0, init=False)
    """Tokens decoded so far (aborted sequences' tokens included: the engine did the work)."""
    prompt_tokens_total: int = field(default=0, init=False)
    """Prompt tokens prefilled so far (counted at admission)."""
    finished_total: int = field(default=0, init=False)
    """Sequences that ran to max_tokens."""

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_reserved_tokens(self) -> int:
        return self._reserved

    @property
    def kv_usage(self) -> float:
        """Fraction of KV tokens reserved by running sequences, 0..1."""
        return self._reserved / self.params.kv_tokens

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._running or seq_id in self._waiting

    def submit(self, seq_id: SeqId, prompt_tokens: int, max_tokens: int) -> None:
        """Queue a sequence; it is admitted by a later :meth:`step`.

        Raises ValueError for a duplicate id, non-positive sizes, or a sequence that could never
        fit the KV cache even alone (it would otherwise block the FCFS queue forever).
        """
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError(
                f"prompt_tokens and max_tokens must be >= 1, got {prompt_tokens}, {max_tokens}"
            )
        if seq_id in self:
            raise ValueError(f"sequence {seq_id!r} is already submitted")
        need = prompt_tokens + max_tokens
        if need > self.params.kv_tokens:
            raise ValueError(
                f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {need} tokens,"
                f" more than this engine's KV cache of {self.params.kv_tokens} tokens"
            )
        self._waiting[seq_id] = _Seq(prompt_tokens, max_tokens)

    def abort(self, seq_id: SeqId) -> bool:
        """Drop a waiting or running sequence and free its slot and KV; False if unknown."""
        seq = self._running.pop(seq_id, None)
        if seq is not None:
            self._reserved -= seq.reserved
            return True
        return self._waiting.pop(seq_id, None) is not None

    def step(self, now: float) -> StepResult:
        """Run one engine step starting at ``now``: admit, prefill, decode one token each.

        With nothing to run it returns an empty result of zero duration. Finished sequences are
        released immediately; the caller delivers the tokens at ``result.end``.
        """
        params = self.params
        running = self._running
        waiting = self._waiting
        admitted: list[SeqId] = []
        prefill = 0
        while waiting and len(running) < params.max_num_seqs:
            seq_id, seq = next(iter(waiting.items()))
            if self._reserved + seq.reserved > params.kv_tokens:
                break  # strict FCFS: the head waits for KV, nothing overtakes it
            del waiting[seq_id]
            running[seq_id] = seq
            self._reserved += seq.reserved
            prefill += seq.prompt_tokens
            admitted.append(seq_id)
        batch = len(running)
        if batch == 0:
            return StepResult(start=now, duration_s=0.0)
        self.prompt_tokens_total += prefill
        self.generation_tokens_total += batch
        emitted: list[tuple[SeqId, int]] = []
        finished: list[SeqId] = []
        for seq_id, seq in running.items():
            seq.generated += 1
            emitted.append((seq_id, seq.generated))
            if seq.generated >= seq.max_tokens:
                finished.append(seq_id)
        for seq_id in finished:
            self._reserved -= running.pop(seq_id).reserved
        self.finished_total += len(finished)
        return StepResult(
            start=now,
            duration_s=step_duration_s(params, batch, prefill),
            admitted=tuple(admitted),
            emitted=tuple(emitted),
            finished=tuple(finished),
            prefill_tokens=prefill,
        )
