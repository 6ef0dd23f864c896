"""Drawing `hetero-gateway top`: readings over HTTP, a rich table redrawn in place on a terminal
(the alternate screen; `q` quits, read in cbreak mode), plain lines when not on one."""

from __future__ import annotations

import http.client
import math
import os
import select
import sys
import termios
import time
import tty
import urllib.error
import urllib.request
from collections import deque

import orjson
from rich.console import Console, ConsoleRenderable, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from plugin_tools.top.view import Snapshot, View, parse_snapshot, view

__all__ = ["run"]

TIMEOUT_S = 2.0
# A plugin that does not answer, or answers something that is not its pages: shown, not fatal.
_READ_ERRORS = (OSError, urllib.error.URLError, http.client.HTTPException, ValueError)


def read(url: str) -> Snapshot:
    """One reading of the plugin at `url` (raises OSError when it does not answer)."""
    with urllib.request.urlopen(f"{url}/debug/pods", timeout=TIMEOUT_S) as resp:
        pods = orjson.loads(resp.read())
    with urllib.request.urlopen(f"{url}/metrics", timeout=TIMEOUT_S) as resp:
        text = resp.read().decode()
    return parse_snapshot(time.monotonic(), pods, text)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


COLUMNS = (
    "pod", "gpu", "state", "req share", "cap share", "in flight", "tok/s",
    "ttft p50 ms", "ttft p99 ms", "tpot p50 ms", "tpot p99 ms",
)  # fmt: skip


def _cells(v: View) -> list[list[str]]:
    return [
        [
            r.key,
            r.gpu or "-",
            r.state,
            _pct(r.request_share),
            _pct(r.capacity_share),
            f"{r.inflight}+{r.inflight_remote}" if r.inflight_remote else str(r.inflight),
            _num(r.tokens_per_s),
            _ms(r.ttft_p50),
            _ms(r.ttft_p99),
            _ms(r.tpot_p50),
            _ms(r.tpot_p99),
        ]
        for r in v.pods
    ]


def _window(v: View) -> str:
    return "since start" if math.isnan(v.window_s) else f"last {v.window_s:.0f} s"


def _queue(v: View) -> str:
    held = ", ".join(f"{m} {n:.0f}" for m, n in sorted(v.waiting.items())) or "none"
    return f"held at the gateway: {held}"


def table(url: str, v: View | None, error: str | None) -> Group:
    """The screen: a title, the pods' table, the queue, and how to quit."""
    title = Text(f"hetero-gateway top  {url}  ", style="bold")
    if v is not None:
        title.append(f"({_window(v)}, {len(v.pods)} pods)")
    grid = Table(expand=True, box=None, header_style="bold")
    for name in COLUMNS:  # names in full: a terminal too narrow wraps the numbers' headers
        text = name in ("pod", "gpu", "state")
        grid.add_column(name, justify="left" if text else "right", no_wrap=text)
    if v is not None:
        for row in _cells(v):
            grid.add_row(*row, style="red" if row[2] != "up" else None)
    lines: list[ConsoleRenderable] = [title, grid]
    if v is not None:
        lines.append(Text(_queue(v)))
    if error:
        lines.append(Text(f"cannot read the plugin: {error}", style="red"))
    lines.append(Text("q quits", style="dim"))
    return Group(*lines)


def plain(v: View) -> str:
    """The same reading as plain lines: one per pod, `name=value` pairs, then the queue."""
    lines = [f"# {_window(v)}, {len(v.pods)} pods"]
    for row in _cells(v):
        pairs = " ".join(f"{c.replace(' ', '_')}={x}" for c, x in zip(COLUMNS, row, strict=True))
        lines.append(pairs)
    lines.append(f"# {_queue(v)}")
    return "\n".join(lines)


class _History:
    """Readings over the window: the oldest within it is the window's start."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.readings: deque[Snapshot] = deque()

    def add(self, s: Snapshot) -> View:
        self.readings.append(s)
        while len(self.readings) > 2 and self.readings[1].at <= s.at - self.window_s:
            self.readings.popleft()
        old = self.readings[0] if len(self.readings) > 1 else None
        return view(s, old)


def _pressed_q(timeout_s: float) -> bool:
    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    if not ready:
        return False
    key = os.read(sys.stdin.fileno(), 16)
    return b"q" in key.lower()


def run(url: str, interval_s: float, window_s: float, once: bool) -> int:
    url = url.rstrip("/")
    history = _History(window_s)
    if once or not sys.stdout.isatty() or not sys.stdin.isatty():
        while True:
            try:
                print(plain(view(read(url), None) if once else history.add(read(url))), flush=True)
            except _READ_ERRORS as exc:
                print(f"# cannot read the plugin at {url}: {exc}", file=sys.stderr, flush=True)
                if once:
                    return 1
            if once:
                return 0
            time.sleep(interval_s)
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    console = Console()
    try:
        tty.setcbreak(fd)
        with Live(table(url, None, None), console=console, screen=True, auto_refresh=False) as live:
            while True:
                try:
                    current, error = history.add(read(url)), None
                except _READ_ERRORS as exc:
                    current, error = None, str(exc)
                live.update(table(url, current, error), refresh=True)
                if _pressed_q(interval_s):
                    return 0
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
