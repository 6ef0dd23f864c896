"""Native memory the plugin frees goes back to the OS (glibc only; other C libraries: nothing).

Large request bodies pass through gRPC's C core and its threads before Python sees them. glibc
keeps what those threads free in per-thread arenas, fragmented, so the plugin's resident memory
stays where the largest burst left it. Three measures (`benchmarks/fault_suite.py`, 1,000
requests naming a 4 MB model: RSS 2.4x its baseline without them, 1.31-1.49x with the first
alone, 1.01-1.10x with all three in 9 of 10 runs and 1.19x in one):

- at start-up, a fixed mmap threshold: blocks of 256 KiB or more are mmap'd and unmapped when
  freed (by default glibc raises the threshold after each such free, up to 32 MiB, after which
  they come from the heap and stay resident);
- `MemoryTrimmer`: once a second it reads the process's resident size (one read of
  /proc/self/statm) and, when that stands more than `slack_bytes` above the lowest it has seen,
  calls `malloc_trim(0)` in a worker thread, which hands the free pages inside every arena back
  to the OS. Steady memory costs one read a second; each trim is a few milliseconds of a
  worker thread, and trims that return little back off;
- the gRPC server reads a connection in chunks of at most 256 KiB (`plugin.adapters.serve`):
  otherwise it grows a connection's read buffer to the largest message it read and keeps it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable

__all__ = ["MemoryTrimmer", "glibc", "return_large_buffers_to_the_os"]

log = logging.getLogger(__name__)

# glibc's mallopt parameter: blocks this large or larger are mmap'd, and unmapped when freed.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 256 * 1024
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (it has `malloc_trim` and `mallopt`), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - glibc's; musl has none
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def return_large_buffers_to_the_os() -> None:
    """Fix glibc's mmap threshold so large freed buffers are unmapped (see the module doc)."""
    libc = glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)


def resident_bytes() -> int:
    """This process's resident set size (bytes), from /proc/self/statm; 0 where there is none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


class MemoryTrimmer:
    """Hands free native memory back to the OS when the resident size stands above its low
    mark (module doc). While trims return little (the memory is in use), they back off up to
    `max_pause_s` apart, so a busy plugin does not trim for nothing every second."""

    def __init__(
        self,
        trim: Callable[[], object],
        interval_s: float = 1.0,
        slack_bytes: int = 4 << 20,
        max_pause_s: float = 4.0,
        rss: Callable[[], int] = resident_bytes,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._trim = trim
        self.interval_s = interval_s
        self.slack_bytes = slack_bytes
        self.max_pause_s = max_pause_s
        self._rss = rss
        self._clock = clock
        self.low = rss()  # the lowest resident size seen (after trims, or when idle)
        self._pause = interval_s
        self._next = 0.0
        self.trims = 0
        self.returned_bytes = 0

    @classmethod
    def for_this_process(cls) -> MemoryTrimmer | None:
        """A trimmer calling glibc's `malloc_trim(0)`; None under another C library."""
        libc = glibc()
        if libc is None:
            return None
        malloc_trim = libc.malloc_trim
        return cls(lambda: malloc_trim(0))

    async def check(self) -> None:
        """One look: trim if the resident size stands more than the slack above the low mark
        and the back-off allows it."""
        before = self._rss()
        if before <= self.low + self.slack_bytes:
            self.low = min(self.low, before)
            return
        if self._clock() < self._next:
            return
        await asyncio.to_thread(self._trim)
        after = self._rss()
        returned = max(0, before - after)
        self.trims += 1
        self.returned_bytes += returned
        self.low = min(self.low, after)
        # Little came back: the memory is in use; ask less often until some does.
        self._pause = (
            self.interval_s
            if returned >= self.slack_bytes // 2
            else min(self._pause * 2, self.max_pause_s)
        )
        self._next = self._clock() + self._pause
        log.debug("malloc_trim: resident %.1f -> %.1f MB", before / 2**20, after / 2**20)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check()
