"""GPU profiles checked against live traffic: how far each profile cell is from what the requests
it routed then took, and how many requests were larger than any cell.

A profile is one sweep of one deployment; an engine upgrade, a new model revision or another
prompt mix moves what the deployment really does. The router hands every served request an SLO
strategy routed (`Route.profiled`) to `ProfileDrift`, which keeps per model, deployment and cell
(output tick, input tick) what the requests took against what the profile predicted, so an
operator knows when to sweep again:

- **Predicted**: the cell's E2E at the load the pod had when the request was routed, its SLO load
  with the request (`GpuProfile.e2e_at`). A profile's `e2e[out][in]` is the mean E2E at the rate
  it sustained, on a loaded replica; an idle replica is faster. Where the profile has
  `e2e_idle`, the prediction is `e2e_idle + (e2e - e2e_idle) x min(load, 1)`. Without it
  (AIBrix's own profiles) it is `e2e`, and only requests routed at a load of at least
  `DRIFT_MIN_LOAD` (0.5) count, so a lightly loaded deployment is not called off for being
  faster than its profile ran. Load is this gateway's own accounting.
- **Actual**: from the routing decision (after any wait at the gateway) to the end of the
  response, for served (200) requests, as `hetero_gateway_slo_e2e_ratio` measures it.
- **Drift ratio** of a cell: the mean actual E2E over the mean predicted E2E of its recent
  requests. Both means are exponentially weighted: the n-th request weighs 1/n up to
  `DRIFT_REQUESTS` (50), so the first 50 make a plain mean, and 1/50 after that, so the
  ratio follows about the last 50 requests. A ratio of means rather than a mean of ratios,
  because a profile cell is a mean E2E, and one slow request should not count for more than
  its time.
- **Warning**: from `DRIFT_MIN_REQUESTS` (20) counted requests on, a ratio above `DRIFT_LIMIT`
  (2) or below its inverse makes `observe` return a warning, once; it re-arms when the ratio
  is back within [0.5, 2]. A cell whose profile was replaced (another `created`) starts over.

`BeyondGrid` counts routed requests whose size lies more than half a doubling above a
profile's grid (routed at its border cell, a guess), per model and axis, and returns a warning
the first time a model has one. The core does not log: the router passes warnings to its
`on_warning` callback, which the gateway logs.

A completed request costs a dict lookup and a few float operations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from plugin.core.profile import ProfiledRoute

__all__ = [
    "DRIFT_LIMIT",
    "DRIFT_MIN_LOAD",
    "DRIFT_MIN_REQUESTS",
    "DRIFT_REQUESTS",
    "BeyondGrid",
    "CellDrift",
    "ProfileDrift",
    "cell_label",
]

DRIFT_REQUESTS = 50  # the means follow about this many of a cell's latest requests
DRIFT_MIN_REQUESTS = 20  # no verdict on fewer
DRIFT_LIMIT = 2.0  # off: actual / predicted above this or below its inverse
DRIFT_MIN_LOAD = 0.5  # without an idle E2E, only requests routed at this load or more count


def cell_label(out_tick: int, in_tick: int) -> str:
    """A profile cell as metrics and /debug/pods name it: `out=<tick>,in=<tick>`."""
    return f"out={out_tick},in={in_tick}"


@dataclass(slots=True)
class CellDrift:
    """One cell of one deployment's profile against the requests it predicted."""

    created: float  # the `created` of the profile these requests were checked against
    requests: int = 0  # counted so far (served, with a prediction that counts)
    actual_s: float = 0.0  # weighted mean actual E2E
    predicted_s: float = 0.0  # weighted mean predicted E2E
    off: bool = False  # warned, and not back within range since

    @property
    def ratio(self) -> float:
        """Mean actual over mean predicted E2E (NaN before the first request)."""
        return self.actual_s / self.predicted_s if self.predicted_s > 0 else math.nan

    def observe(self, predicted_s: float, actual_s: float) -> None:
        self.requests += 1
        weight = 1.0 / min(self.requests, DRIFT_REQUESTS)
        self.actual_s += (actual_s - self.actual_s) * weight
        self.predicted_s += (predicted_s - self.predicted_s) * weight


class ProfileDrift:
    """Per (model, deployment, output tick, input tick): the cell's `CellDrift`."""

    __slots__ = ("cells",)

    def __init__(self) -> None:
        self.cells: dict[tuple[str, str, int, int], CellDrift] = {}

    def observe(
        self, model: str, deployment: str, route: ProfiledRoute, actual_s: float
    ) -> str | None:
        """A served request took `actual_s`; returns a warning when this makes its cell off
        (once until the cell is back within range), else None."""
        predicted = route.e2e_s
        if predicted is None or not predicted > 0 or not actual_s >= 0:
            return None
        profile = route.profile
        if route.load < DRIFT_MIN_LOAD and profile.idle_e2e(route.cell) is None:
            return None  # a lightly loaded pod against a loaded-replica E2E: no verdict
        out_tick, in_tick = route.ticks
        key = (model, deployment, out_tick, in_tick)
        cell = self.cells.get(key)
        if cell is None or cell.created != profile.created:
            cell = self.cells[key] = CellDrift(profile.created)
        cell.observe(predicted, actual_s)
        if cell.requests < DRIFT_MIN_REQUESTS:
            return None
        ratio = cell.ratio
        if 1.0 / DRIFT_LIMIT <= ratio <= DRIFT_LIMIT:
            cell.off = False
            return None
        if cell.off:
            return None
        cell.off = True
        return (
            f"the GPU profile of {model} on deployment {deployment} is off at {out_tick} output"
            f" x {in_tick} input tokens: its requests took {ratio:.4g}x the E2E it predicts"
            f" (the last ~{min(cell.requests, DRIFT_REQUESTS)} of {cell.requests}); sweep it"
            " again"
        )

    def snapshot(self) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
        """JSON-ready, for /debug/pods: model -> deployment -> cell label -> ratio, requests,
        off."""
        doc: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
        for (model, deployment, out_tick, in_tick), cell in sorted(self.cells.items()):
            cells = doc.setdefault(model, {}).setdefault(deployment, {})
            cells[cell_label(out_tick, in_tick)] = {
                "ratio": round(cell.ratio, 4),
                "requests": cell.requests,
                "off": cell.off,
            }
        return doc


class BeyondGrid:
    """Routed requests whose size lies above their profile's grid, per (model, axis): a request
    above it on both axes counts once on each."""

    __slots__ = ("_warned", "counts")

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self._warned: set[str] = set()

    def observe(
        self, model: str, deployment: str, route: ProfiledRoute, prompt_tokens: int
    ) -> str | None:
        """Count a routed request (nothing when it lies within the grid); returns a warning the
        first time a model has one, else None."""
        if not route.above:
            return None
        counts = self.counts
        for axis in route.above:
            counts[model, axis] = counts.get((model, axis), 0) + 1
        if model in self._warned:
            return None
        self._warned.add(model)
        profile = route.profile
        return (
            f"{model}: a request of {prompt_tokens} prompt and about {route.output_tokens}"
            f" output tokens lies above the GPU profile of deployment {deployment} on its"
            f" {' and '.join(route.above)} axis (largest ticks: {profile.out_ticks[-1]} output,"
            f" {profile.in_ticks[-1]} input tokens); routed at the border cell, whose figures"
            " are a guess for it. Further such requests of this model are counted, not logged"
        )
