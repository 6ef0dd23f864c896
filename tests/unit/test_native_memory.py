"""The memory trimmer: when it hands native memory back, when it backs off, and that the real
glibc call runs in this process."""

from __future__ import annotations

import asyncio

import pytest

from plugin.adapters.native_memory import MemoryTrimmer, glibc, resident_bytes

pytestmark = pytest.mark.unit

MB = 1 << 20


class FakeProcess:
    """A resident size the test sets, a trim that returns what the test says, a clock."""

    def __init__(self, rss: int) -> None:
        self.rss = rss
        self.returns = 0  # bytes the next trim gives back
        self.trims = 0
        self.t = 0.0

    def trim(self) -> None:
        self.trims += 1
        self.rss -= self.returns

    def trimmer(self) -> MemoryTrimmer:
        return MemoryTrimmer(
            self.trim,
            interval_s=1.0,
            slack_bytes=4 * MB,
            max_pause_s=4.0,
            rss=lambda: self.rss,
            clock=lambda: self.t,
        )


def run(trimmer: MemoryTrimmer) -> None:
    asyncio.run(trimmer.check())


def test_memory_within_the_slack_of_its_low_mark_is_left_alone() -> None:
    proc = FakeProcess(70 * MB)
    trimmer = proc.trimmer()
    proc.rss = 74 * MB  # exactly the slack above the low mark
    run(trimmer)
    assert proc.trims == 0
    proc.rss = 60 * MB  # lower: the mark follows it down
    run(trimmer)
    assert trimmer.low == 60 * MB and proc.trims == 0


def test_memory_above_the_slack_is_trimmed_and_what_came_back_is_counted() -> None:
    proc = FakeProcess(70 * MB)
    trimmer = proc.trimmer()
    proc.rss, proc.returns = 100 * MB, 28 * MB
    run(trimmer)
    assert proc.trims == 1 and proc.rss == 72 * MB
    assert trimmer.returned_bytes == 28 * MB and trimmer.trims == 1
    proc.t += 1.0
    run(trimmer)  # 72 MB is within the slack of 70: nothing to do
    assert proc.trims == 1


def test_trims_that_return_little_back_off_and_a_productive_one_resets_the_pause() -> None:
    proc = FakeProcess(70 * MB)
    trimmer = proc.trimmer()
    proc.rss, proc.returns = 90 * MB, 0  # memory in use: a trim returns nothing
    times = []
    for second in range(16):
        proc.t = float(second)
        before = proc.trims
        run(trimmer)
        if proc.trims > before:
            times.append(second)
    # Paused 2, 4, then at most 4 s apart (never every second).
    assert times == [0, 2, 6, 10, 14]
    proc.returns = 18 * MB  # the burst ended: the next allowed trim returns it
    proc.t = 18.0
    run(trimmer)
    assert proc.rss == 72 * MB
    proc.rss, proc.returns = 90 * MB, 18 * MB
    proc.t = 19.0  # a productive trim leaves a pause of one interval
    run(trimmer)
    assert proc.trims == 7


def test_the_real_trim_runs_in_this_process() -> None:
    """On glibc, `for_this_process` calls the real `malloc_trim(0)`; the resident size reads
    from /proc. (musl has no malloc_trim: the plugin then runs without a trimmer.)"""
    assert resident_bytes() > 0
    if glibc() is None:
        assert MemoryTrimmer.for_this_process() is None
        return
    trimmer = MemoryTrimmer.for_this_process()
    assert trimmer is not None
    trimmer.low = 0  # any resident size is above the slack now: the check must trim
    run(trimmer)
    assert trimmer.trims == 1
