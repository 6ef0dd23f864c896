"""Load request traces (CSV with `arrived_at`, `num_prefill_tokens`, `num_decode_tokens`), such as
the Azure LLM inference traces of 2023, and turn workload names into length sources."""

from __future__ import annotations

import csv
from pathlib import Path

from plugin.errors import ConfigError
from plugin_tools.sim.workload import CHAT, LONG, LengthSource, MixedLengths, TraceLengths

__all__ = ["TRACE_FILES", "Trace", "load_trace", "parse_workload"]

# Workload name -> file name in the trace directory (shared/data/traces in this repository's
# checkout layout).
TRACE_FILES = {"azure-conv": "azure2023_conv.csv", "azure-code": "azure2023_code.csv"}
SYNTHETIC: dict[str, LengthSource] = {"chat": CHAT, "long": LONG}


class Trace:
    __slots__ = ("lengths", "times")

    def __init__(self, times: tuple[float, ...], lengths: TraceLengths) -> None:
        self.times = times
        self.lengths = lengths


def load_trace(path: Path, name: str) -> Trace:
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror}") from None
    times: list[float] = []
    lengths: list[tuple[int, int]] = []
    try:
        for row in rows:
            prompt, output = int(row["num_prefill_tokens"]), int(row["num_decode_tokens"])
            if prompt < 1 or output < 1:
                continue  # a request with no prompt or no output says nothing about speed
            times.append(float(row["arrived_at"]))
            lengths.append((prompt, output))
    except (KeyError, ValueError) as exc:
        raise ConfigError(
            f"{path}: expected columns arrived_at, num_prefill_tokens, num_decode_tokens ({exc})"
        ) from None
    if len(lengths) < 2:
        raise ConfigError(f"{path}: fewer than two usable rows")
    return Trace(tuple(times), TraceLengths(tuple(lengths), name=name))


def parse_workload(spec: str, trace_dir: Path) -> tuple[LengthSource, dict[str, Trace]]:
    """`chat`, `long`, `azure-conv`, `azure-code`, or a mix such as `chat:0.8,long:0.2`.

    Returns the length source and the traces it loaded (their arrival times can drive arrivals).
    """
    parts: list[tuple[float, LengthSource]] = []
    traces: dict[str, Trace] = {}
    for item in spec.split(","):
        name, _, weight_s = item.strip().partition(":")
        try:
            weight = float(weight_s) if weight_s else 1.0
        except ValueError:
            raise ConfigError(f"workload weight {weight_s!r} is not a number") from None
        if weight <= 0:
            raise ConfigError(f"workload weight of {name} must be positive")
        if name in SYNTHETIC:
            parts.append((weight, SYNTHETIC[name]))
        elif name in TRACE_FILES:
            trace = traces.get(name) or load_trace(trace_dir / TRACE_FILES[name], name)
            traces[name] = trace
            parts.append((weight, trace.lengths))
        else:
            known = ", ".join([*SYNTHETIC, *TRACE_FILES])
            raise ConfigError(f"unknown workload {name!r} (known: {known})")
    if len(parts) == 1:
        return parts[0][1], traces
    return MixedLengths(tuple(parts), name=spec), traces
