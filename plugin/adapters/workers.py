"""`serve --workers N`: N plugin processes on one host behind one gRPC port.

One Python process routes on one core. The workers bind the same gRPC port with SO_REUSEPORT
(the kernel spreads Envoy's connections over them: one per Envoy worker thread, so give Envoy at
least as many) and share their state through Redis like any other gateway replicas, each under
its own name (POD_NAME-w<i>); a request whose two streams reach different workers is handed over
as between replicas (`plugin.adapters.extproc.tokens.LeaseHandoff`). Worker i serves HTTP
(/metrics, /readyz, /debug/pods) on the HTTP port + i.

This process only supervises: it starts the workers, starts again one that exits on its own
(after 1 s, doubling up to 30 s while it keeps failing within a minute of its start), and on
SIGTERM or SIGINT passes the signal on and waits for every worker to drain and exit.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType

from plugin.config import GRPC_PORT, HTTP_PORT, POD_NAME, WORKERS, Settings

log = logging.getLogger(__name__)

__all__ = ["supervise", "worker_environment"]

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # a worker that lived this long starts again after the first backoff
POLL_S = 0.2


def worker_environment(env: Mapping[str, str], settings: Settings, index: int) -> dict[str, str]:
    """Worker `index`'s environment: the gateway's, its own name and HTTP port."""
    name = env.get(POD_NAME.name) or socket.gethostname() or "gateway"
    http_port = settings.http_port + index if settings.http_port else 0
    return {
        **env,
        WORKERS.name: str(settings.workers),
        GRPC_PORT.name: str(settings.grpc_port),
        HTTP_PORT.name: str(http_port),
        POD_NAME.name: f"{name}-w{index}",
    }


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes]
    started: float
    backoff_s: float = FIRST_BACKOFF_S
    restart_at: float | None = None


def supervise(settings: Settings, env: Mapping[str, str], host: str) -> int:
    """Run `settings.workers` workers until SIGTERM or SIGINT; 0 once all have exited."""
    stopping = False

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        if not stopping:
            log.info(
                "supervisor: %s, stopping %d workers", signal.Signals(signum).name, len(workers)
            )
        stopping = True
        for w in workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signum)

    def spawn(index: int) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "plugin", "serve", "--host", host]
        argv += ["--worker-index", str(index)]
        return subprocess.Popen(argv, env=worker_environment(env, settings, index))

    workers = [_Worker(i, spawn(i), time.monotonic()) for i in range(settings.workers)]
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info(
        "supervisor: %d workers on gRPC port %d (pids %s)",
        len(workers),
        settings.grpc_port,
        ", ".join(str(w.proc.pid) for w in workers),
    )
    while True:
        now = time.monotonic()
        alive = 0
        for w in workers:
            code = w.proc.poll()
            if code is None:
                alive += 1
                continue
            if stopping:
                continue
            if w.restart_at is None:
                if now - w.started >= STABLE_S:
                    w.backoff_s = FIRST_BACKOFF_S
                w.restart_at = now + w.backoff_s
                log.error(
                    "supervisor: worker %d (pid %d) exited with %d; starting it again in %.0f s",
                    w.index,
                    w.proc.pid,
                    code,
                    w.backoff_s,
                )
                w.backoff_s = min(2 * w.backoff_s, MAX_BACKOFF_S)
            elif now >= w.restart_at:
                w.proc, w.started, w.restart_at = spawn(w.index), now, None
                alive += 1
        if stopping and not alive:
            return 0
        time.sleep(POLL_S)
