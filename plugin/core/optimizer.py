"""The cost-minimal GPU mix: how many replicas of each GPU type serve a workload within the SLO.

The workload is a request rate per profile cell (a bucket of input x output tokens); each
candidate (a deployment, one GPU type) has a price per replica and, per cell, the rate one of its
replicas sustains within the SLO (`tputs`, from its GPU profile; 0 where it cannot meet the SLO).
`solve` returns the replica counts that serve every cell at least cost, as a mixed-integer
program (SciPy's `milp`, which is HiGHS):

    minimise    sum_d cost_d * n_d
    subject to  sum_d x_kd = 1                                   for each cell k with traffic
                sum_k rate_k * headroom * x_kd / mix_dk <= n_d    for each candidate d
                rate_k * headroom * x_kd / tputs_dk <= n_d        for each cell k and candidate d
                n_d integer in [min_replicas_d, upper_d],  x_kd >= 0, x_kd only where tputs_dk > 0

`mix_dk` (`Candidate.mix_tputs`, default `tputs`) is the rate cell k counts for on d inside a
mix of sizes (`plugin.core.profile.GpuProfile.mix_tputs`): a long prompt's standalone `tputs`
is set by collisions between long prompts, so summed as work it would buy replicas for
collisions that a mix rarely has; the second row keeps each cell within what a replica
sustains of it alone. (Where `mix_dk = tputs_dk` the second row follows from the first and is
left out.)

`x_kd` is the fraction of cell k's requests that candidate d serves. It is fractional on purpose:
the gateway routes each request on its own, so a cell's traffic can be split across GPU types in
any proportion; only replicas come in whole units. (A 0/1 assignment of whole cells could cost
more and would model nothing the gateway does.) `upper_d` is the replicas d would need to serve
alone every cell it can serve, rounded up (at least `min_replicas`), or the availability cap
`max_replicas` if that is lower: no optimal plan needs more, and finite bounds keep
branch-and-bound tight.

Corner cases are answered, never dropped:

- no traffic at all (every rate 0): each candidate at `min_replicas`, status "idle";
- a cell with traffic that no candidate can serve (every `tputs` 0): listed in
  `infeasible_cells`, its whole rate in `unserved`; the plan serves the other cells, and keeps
  status "optimal" (with only such traffic: every candidate at `min_replicas`). A cell without
  traffic is never listed, whatever its `tputs`;
- an attainment target below 1 (`Problem.attainment`, say 0.99 for an SLO held for 99% of
  requests): the cheapest fleet that serves at least that share of all traffic within the SLO,
  the same program with each cell's share allowed below 1 and its shares' rate at least the
  target (then, on that fleet, the most it can serve in time). What is left out is in `exempt`:
  those requests are still routed and served late, so they still take their pods' time: each
  is charged to a candidate as the work of its cell in a mix (a share `y_kd`, in each
  candidate's row beside the `x`s but in no "alone" row), on a candidate that never meets the
  SLO at its size (`tputs` 0) at the profile's estimate (`Candidate.late_tputs`), and not at
  all where there is none. Cells no candidate serves count against the target first; status
  stays "optimal";
- caps that leave too few replicas for the traffic: two phases. Phase 1 (a linear program with
  every candidate at its upper bound) finds the most rate the capped fleet can serve; phase 2 is
  the MILP above with each cell's share allowed below 1, constrained to serve that much, at least
  cost (then phase 1's program once more, on phase 2's fleet, so the shares serve all that fleet
  can and not a solver tolerance less). Status "short", the rest per cell in `unserved`.

Units: `rates` and `unserved` are req/s as measured (headroom not applied); `headroom` (>= 1)
only scales the capacity each cell needs. Solver tolerances (about 1e-7) are mopped up after
solving: replica counts are rounded to integers and trimmed to the work they carry, shares are
clipped and renormalised, and no candidate is left with more work than replicas beyond a relative
1e-6 (`Plan.load` says how much work each candidate carries, in replicas).

Pure: no I/O, no clock. SciPy (and NumPy) are imported inside `solve` only, so the gateway's
runtime imports this module without them (`pip install 'hetero-gateway[optimizer]'`).

`ScaleDownGate` adds hysteresis for the caller that applies plans window after window: a higher
count goes through at once, a lower one only when the last N proposals all agree on it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from plugin.errors import OptimizerInputError

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["Candidate", "Plan", "Problem", "ScaleDownGate", "solve", "validate"]

# A candidate may carry this much more work than its replicas (relative, at least 1e-6 of a
# replica) before the plan counts as over capacity: HiGHS's own feasibility tolerance is 1e-7.
LOAD_TOLERANCE = 1e-6
# Unserved rate below this fraction of a cell's rate is solver noise, reported as 0.
UNSERVED_TOLERANCE = 1e-6
# Phase 2 of a short plan must serve phase 1's rate less this fraction of it.
SERVED_SLACK = 1e-7


@dataclass(frozen=True, slots=True)
class Candidate:
    """One deployment (GPU type) the plan may scale."""

    name: str  # "namespace/deployment"
    cost: float  # per replica (the profile's `cost`)
    tputs: tuple[float, ...]  # per cell: req/s ONE replica sustains within the SLO; 0: cannot
    min_replicas: int = 0
    max_replicas: int | None = None  # availability cap (None: unbounded)
    # per cell: req/s the cell counts for inside a mix (>= tputs, 0 where tputs is); None: tputs
    mix_tputs: tuple[float, ...] | None = None
    # per cell: the same for requests served late under an attainment target (the mix rate
    # where tputs > 0; where tputs is 0, an estimate, 0: it cannot take them); None: the mix's
    late_tputs: tuple[float, ...] | None = None

    @property
    def mix(self) -> tuple[float, ...]:
        return self.tputs if self.mix_tputs is None else self.mix_tputs

    @property
    def late(self) -> tuple[float, ...]:
        return self.mix if self.late_tputs is None else self.late_tputs


@dataclass(frozen=True, slots=True)
class Problem:
    rates: tuple[float, ...]  # req/s per workload cell, in the order of every Candidate.tputs
    candidates: tuple[Candidate, ...]
    headroom: float = 1.0  # plan capacity for rates x headroom (>= 1)
    # The least share of all requests the plan serves within the SLO, in (0, 1]; 1: every one.
    attainment: float = 1.0


@dataclass(frozen=True, slots=True)
class Plan:
    replicas: dict[str, int]  # per candidate name
    cost: float
    # [cell][candidate]: fraction of the cell's rate; all 0 for a cell without traffic.
    share: tuple[tuple[float, ...], ...]
    unserved: tuple[float, ...]  # req/s per cell the plan does not serve (caps, no tputs)
    infeasible_cells: tuple[int, ...]  # cells with traffic that every candidate has tputs 0 for
    status: str  # "optimal" | "short" (caps leave rate unserved) | "idle" (no traffic)
    # Per candidate (in Problem order): the work assigned to it in replicas (<= its replicas).
    load: tuple[float, ...] = field(default=())
    # req/s per cell served late under `Problem.attainment` (all 0 at 1): their work is in `load`.
    exempt: tuple[float, ...] = field(default=())


def _fail(message: str) -> OptimizerInputError:
    return OptimizerInputError(f"optimizer input: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_nonneg(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def validate(problem: Problem) -> None:
    """Raise `OptimizerInputError` naming the first bad field of `problem`."""
    cells = len(problem.rates)
    for k, rate in enumerate(problem.rates):
        if not _finite_nonneg(rate):
            raise _fail(f"rates[{k}] = {rate!r}: a rate must be a finite number >= 0")
    headroom = problem.headroom
    if not (_finite_nonneg(headroom) and headroom >= 1):
        raise _fail(f"headroom = {headroom!r}: must be a finite number >= 1")
    attainment = problem.attainment
    if not (_finite_nonneg(attainment) and 0 < attainment <= 1):
        raise _fail(f"attainment = {attainment!r}: must be a number in (0, 1]")
    seen: set[str] = set()
    for cand in problem.candidates:
        who = f"candidate {cand.name!r}"
        if not isinstance(cand.name, str) or not cand.name:
            raise _fail(f"{who}: the name must be a non-empty string")
        if cand.name in seen:
            raise _fail(f"{who}: named twice (names key the plan)")
        seen.add(cand.name)
        if not _finite_nonneg(cand.cost):
            raise _fail(f"{who}: cost = {cand.cost!r}: must be a finite number >= 0")
        if len(cand.tputs) != cells:
            raise _fail(
                f"{who}: tputs has {len(cand.tputs)} cells but rates has {cells} "
                "(every candidate's tputs must follow the rates' cells)"
            )
        for k, tput in enumerate(cand.tputs):
            if not _finite_nonneg(tput):
                raise _fail(f"{who}: tputs[{k}] = {tput!r}: must be a finite number >= 0")
        if cand.mix_tputs is not None:
            if len(cand.mix_tputs) != cells:
                raise _fail(f"{who}: mix_tputs has {len(cand.mix_tputs)} cells, not {cells}")
            for k, (tput, mix) in enumerate(zip(cand.tputs, cand.mix_tputs, strict=True)):
                if not (_finite_nonneg(mix) and (mix >= tput if tput > 0 else mix == 0)):
                    raise _fail(
                        f"{who}: mix_tputs[{k}] = {mix!r}: must be a finite number >= tputs[{k}]"
                        " (0 where tputs is 0)"
                    )
        if cand.late_tputs is not None:
            if len(cand.late_tputs) != cells:
                raise _fail(f"{who}: late_tputs has {len(cand.late_tputs)} cells, not {cells}")
            for k, (mix, late) in enumerate(zip(cand.mix, cand.late_tputs, strict=True)):
                if not (_finite_nonneg(late) and (late == mix if mix > 0 else True)):
                    raise _fail(
                        f"{who}: late_tputs[{k}] = {late!r}: must be a finite number >= 0,"
                        f" equal to the mix rate ({mix!r}) where that is above 0"
                    )
        if not (_is_int(cand.min_replicas) and cand.min_replicas >= 0):
            raise _fail(f"{who}: min_replicas = {cand.min_replicas!r}: must be an integer >= 0")
        cap = cand.max_replicas
        if cap is not None and not (_is_int(cap) and cap >= cand.min_replicas):
            raise _fail(
                f"{who}: max_replicas = {cap!r}: must be None or an integer >= min_replicas "
                f"({cand.min_replicas})"
            )


@dataclass(slots=True)
class _Model:
    """The solver's view: servable cells, the (cell, candidate) pairs that get an x, bounds."""

    cells: list[int]  # cells with traffic that some candidate serves
    pair_cell: list[int]  # per x variable: its cell's position in `cells`
    pair_cand: list[int]  # per x variable: its candidate
    need: list[float]  # per x variable: replicas of the candidate the whole cell needs in a mix
    alone: list[float]  # per x variable: replicas the whole cell needs by itself (>= need)
    lower: list[int]  # per candidate
    upper: list[int]  # per candidate
    total: float  # req/s over `cells`
    # Under an attainment target, a y variable per (cell, candidate) that serves anything: the
    # share of the cell it serves late, and the replicas the whole cell would take there.
    late_cell: list[int] = field(default_factory=list)
    late_cand: list[int] = field(default_factory=list)
    late_need: list[float] = field(default_factory=list)


def _model(problem: Problem, cells: list[int]) -> _Model:
    pair_cell: list[int] = []
    pair_cand: list[int] = []
    need: list[float] = []
    alone: list[float] = []
    total_need = [0.0] * len(problem.candidates)
    most_alone = [0.0] * len(problem.candidates)
    for i, k in enumerate(cells):
        for d, cand in enumerate(problem.candidates):
            tput = cand.tputs[k]
            if tput > 0:
                a = problem.rates[k] * problem.headroom / tput
                if not math.isfinite(a):
                    raise _fail(
                        f"candidate {cand.name!r}: cell {k} needs rates x headroom / tputs = "
                        f"{problem.rates[k]!r} x {problem.headroom!r} / {tput!r} replicas, "
                        "which overflows"
                    )
                mixed = problem.rates[k] * problem.headroom / cand.mix[k]
                pair_cell.append(i)
                pair_cand.append(d)
                need.append(mixed)
                alone.append(a)
                total_need[d] += mixed
                most_alone[d] = max(most_alone[d], a)
    upper: list[int] = []
    for d, cand in enumerate(problem.candidates):
        if not math.isfinite(total_need[d]):
            raise _fail(f"candidate {cand.name!r}: the replicas it needs overflow")
        bound = max(cand.min_replicas, math.ceil(max(total_need[d], most_alone[d])))
        upper.append(bound if cand.max_replicas is None else min(cand.max_replicas, bound))
    lower = [c.min_replicas for c in problem.candidates]
    total = math.fsum(problem.rates[k] for k in cells)
    m = _Model(cells, pair_cell, pair_cand, need, alone, lower, upper, total)
    if problem.attainment < 1:
        _late_pairs(problem, m)
    return m


def _late_pairs(problem: Problem, m: _Model) -> None:
    """The y variables: a request served late still takes its pod's time, what its cell costs
    in a mix (`Candidate.late`: where the candidate never meets the SLO at that size, the
    profile's estimate, `plugin.core.profile.late_rates`; a candidate with none for a cell
    cannot take that cell's requests, late or not)."""
    for d, cand in enumerate(problem.candidates):
        work = 0.0
        for i, k in enumerate(m.cells):
            rate = cand.late[k]
            if rate <= 0:
                continue
            m.late_cell.append(i)
            m.late_cand.append(d)
            m.late_need.append(problem.rates[k] * problem.headroom / rate)
            work += m.late_need[-1]
        # Every request on this candidate, late where it cannot be in time: no plan needs more.
        bound = max(m.upper[d], math.ceil(work))
        m.upper[d] = bound if cand.max_replicas is None else min(cand.max_replicas, bound)


def _milp(
    m: _Model,
    costs: Sequence[float],
    rates: Sequence[float],
    *,
    phase: Literal["all", "most", "cheapest"],  # serve every cell | phase 1 | phase 2
    served: float = 0.0,  # "cheapest": the least fraction of the servable rate to serve
    fleet: Sequence[int] | None = None,  # "most": these replicas instead of the upper bounds
    late: bool = False,  # the rest is served late (m's y variables), not left unserved
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]] | None:
    """Solve one program: (n, x, y), or None when HiGHS proves it infeasible."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    nd, nx, nk = len(m.lower), len(m.need), len(m.cells)
    ny = len(m.late_need) if late else 0
    pair_cell = np.asarray(m.pair_cell, dtype=np.int64)
    cols_x = np.arange(nd, nd + nx)
    cols_y = np.arange(nd + nx, nd + nx + ny)
    # Rows 0..nk-1: each cell's shares; rows nk..nk+nd-1: each candidate's work minus replicas.
    rows = np.concatenate(
        [
            pair_cell,
            nk + np.asarray(m.pair_cand, dtype=np.int64),
            nk + np.arange(nd),
            np.asarray(m.late_cell[:ny], dtype=np.int64),
            nk + np.asarray(m.late_cand[:ny], dtype=np.int64),
        ]
    )
    cols = np.concatenate([cols_x, cols_x, np.arange(nd), cols_y, cols_y])
    vals = np.concatenate(
        [np.ones(nx), np.asarray(m.need), -np.ones(nd), np.ones(ny), np.asarray(m.late_need[:ny])]
    )
    whole = phase == "all" or late  # every request goes somewhere, in time or late
    row_lb = np.concatenate([np.full(nk, 1.0 if whole else 0.0), np.full(nd, -np.inf)])
    row_ub = np.concatenate([np.ones(nk), np.zeros(nd)])
    # Then a row per pair whose cell costs less in a mix than alone: its share within what the
    # candidate's replicas sustain of that cell by itself.
    capped = [p for p in range(nx) if m.alone[p] > m.need[p]]
    if capped:
        base = len(row_lb)
        cap_rows = base + np.arange(len(capped))
        rows = np.concatenate([rows, cap_rows, cap_rows])
        cols = np.concatenate(
            [cols, nd + np.asarray(capped), np.asarray([m.pair_cand[p] for p in capped])]
        )
        vals = np.concatenate(
            [vals, np.asarray([m.alone[p] for p in capped]), -np.ones(len(capped))]
        )
        row_lb = np.concatenate([row_lb, np.full(len(capped), -np.inf)])
        row_ub = np.concatenate([row_ub, np.zeros(len(capped))])
    # Each x's weight in the rate served, as a fraction of all servable traffic.
    weight = np.asarray([rates[m.cells[i]] for i in m.pair_cell]) / m.total
    if phase == "cheapest":
        rows = np.concatenate([rows, np.full(nx, len(row_lb))])
        cols = np.concatenate([cols, cols_x])
        vals = np.concatenate([vals, weight])
        row_lb = np.append(row_lb, served * (1 - SERVED_SLACK))
        row_ub = np.append(row_ub, np.inf)
    nv = nd + nx + ny
    matrix = coo_array((vals, (rows, cols)), shape=(len(row_lb), nv)).tocsr()
    lower = np.concatenate([np.asarray(m.lower, dtype=float), np.zeros(nx + ny)])
    upper = np.concatenate([np.asarray(m.upper, dtype=float), np.ones(nx + ny)])
    if phase == "most":  # a fixed fleet (the upper bounds) serving as much rate as it can
        if fleet is not None:
            upper[:nd] = np.asarray(fleet, dtype=float)
        lower[:nd] = upper[:nd]
        c = np.concatenate([np.zeros(nd), -weight, np.zeros(ny)])
        integrality = np.zeros(nv)
    else:
        c = np.concatenate([np.asarray(costs, dtype=float), np.zeros(nx + ny)])
        integrality = np.concatenate([np.ones(nd), np.zeros(nx + ny)])
    # mip_rel_gap 0: prove the optimum (HiGHS's default stops within 0.01% of it). No presolve:
    # on programs this small it costs more than it saves, and the HiGHS in recent SciPy wheels
    # prints a stray debug line to stdout when it maps a presolved solution back.
    options: dict[str, Any] = {"disp": False, "mip_rel_gap": 0.0, "presolve": False}
    res = milp(
        c,
        integrality=integrality,
        bounds=Bounds(lower, upper),
        constraints=LinearConstraint(matrix, row_lb, row_ub),
        options=options,
    )
    if res.status == 2:
        return None
    if res.status != 0 or res.x is None:
        raise ArithmeticError(f"the MILP solver failed: {res.message} (status {res.status})")
    sol = np.asarray(res.x, dtype=np.float64)
    return sol[:nd], sol[nd : nd + nx], sol[nd + nx :]


def _plan(
    problem: Problem,
    m: _Model,
    x: Sequence[float],
    infeasible: list[int],
    y: Sequence[float] = (),
) -> Plan:
    """The plan from a solver's shares `x` (one per pair of `m`): shares clipped to [0, 1] and
    each cell's renormalised (to 1 when it sums to about 1, else to at most 1); replicas set to
    the work each candidate then carries, rounded up (at least min_replicas); where that would
    pass the cap (never, unless the solver's tolerances did), the candidate's shares shrink
    instead and the rest is unserved."""
    cands = problem.candidates
    nd, nk = len(cands), len(problem.rates)
    share = [[0.0] * nd for _ in range(nk)]
    for i, value in enumerate(x):
        share[m.cells[m.pair_cell[i]]][m.pair_cand[i]] = min(1.0, max(0.0, float(value)))
    for k in m.cells:
        row = share[k]
        total = math.fsum(row)
        if total > 1 - UNSERVED_TOLERANCE:  # 1 up to the solver's tolerance (or above it)
            share[k] = [v / total for v in row]
    key = [(m.cells[m.pair_cell[i]], m.pair_cand[i]) for i in range(len(m.need))]
    need = dict(zip(key, m.need, strict=True))
    alone = dict(zip(key, m.alone, strict=True))

    late = [0.0] * nd  # the work of requests served late (under an attainment target)
    for p, value in enumerate(y):
        late[m.late_cand[p]] += min(1.0, max(0.0, float(value))) * m.late_need[p]

    def work(d: int) -> float:
        served = math.fsum(share[k][d] * need[k, d] for k in m.cells if (k, d) in need)
        return served + late[d]

    def widest(d: int) -> float:  # the replicas d's largest share of one cell needs by itself
        return max((share[k][d] * alone[k, d] for k in m.cells if (k, d) in alone), default=0.0)

    replicas: list[int] = []
    load: list[float] = []
    for d, cand in enumerate(cands):
        w = work(d)
        required = max(w, widest(d))
        n = max(cand.min_replicas, math.ceil(required - LOAD_TOLERANCE * max(1.0, required)))
        if n > m.upper[d]:
            n = m.upper[d]
            for k in m.cells:
                share[k][d] *= n / required
            w = work(d)
        replicas.append(n)
        load.append(w)
    unserved = [0.0] * nk
    for k in infeasible:
        unserved[k] = problem.rates[k]
    for k in m.cells:
        left = problem.rates[k] * (1 - math.fsum(share[k]))
        unserved[k] = left if left > UNSERVED_TOLERANCE * problem.rates[k] else 0.0
    short = any(unserved[k] > 0 for k in m.cells)
    return Plan(
        replicas={c.name: n for c, n in zip(cands, replicas, strict=True)},
        cost=math.fsum(c.cost * n for c, n in zip(cands, replicas, strict=True)),
        share=tuple(tuple(row) for row in share),
        unserved=tuple(unserved),
        infeasible_cells=tuple(infeasible),
        status="short" if short else "optimal",
        load=tuple(load),
        exempt=(0.0,) * nk,
    )


def _exempting(plan: Plan) -> Plan:
    """`plan` with the rate it leaves out of servable cells moved from `unserved` to `exempt`."""
    nobody = set(plan.infeasible_cells)
    exempt = tuple(0.0 if k in nobody else u for k, u in enumerate(plan.unserved))
    unserved = tuple(u if k in nobody else 0.0 for k, u in enumerate(plan.unserved))
    return replace(plan, unserved=unserved, exempt=exempt, status="optimal")


def _cheapest_serving(
    m: _Model, costs: Sequence[float], rates: Sequence[float], served: float, late: bool = False
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]] | None:
    """The cheapest fleet serving at least `served` of the servable rate (`late`: and the rest
    late, its work counted), with the shares that serve the most it can in time (the first
    program may serve a hair less, its slack, or leave out more than it must); None when no
    fleet within the caps does."""
    cheapest = _milp(m, costs, rates, phase="cheapest", served=served, late=late)
    if cheapest is None:
        return None
    fleet = [
        max(lo, min(hi, round(float(v))))
        for lo, hi, v in zip(m.lower, m.upper, cheapest[0], strict=True)
    ]
    return _milp(m, costs, rates, phase="most", fleet=fleet, late=late) or cheapest


def solve(problem: Problem) -> Plan:
    """The cheapest replica counts that serve `problem` (see the module docstring).

    Raises `OptimizerInputError` on bad input, `ArithmeticError` if HiGHS fails (it should not:
    every program here is feasible and bounded, or proven infeasible). Needs SciPy (the
    `optimizer` extra) unless there is nothing to solve (no traffic any candidate can serve).
    """
    validate(problem)
    cands = problem.candidates
    rates = problem.rates
    busy = [k for k, r in enumerate(rates) if r > 0]
    infeasible = [k for k in busy if all(c.tputs[k] == 0 for c in cands)]
    cells = [k for k in busy if any(c.tputs[k] > 0 for c in cands)]
    m = _model(problem, cells)
    if not cells:
        plan = _plan(problem, m, [], infeasible)
        return plan if busy else replace(plan, status="idle")
    costs = [c.cost for c in cands]
    # The share of the servable rate the target asks for (cells nobody serves count first).
    target = min(1.0, problem.attainment * math.fsum(rates[k] for k in busy) / m.total)
    if target < 1 and (held := _cheapest_serving(m, costs, rates, target, late=True)):
        x, y = [float(v) for v in held[1]], [float(v) for v in held[2]]
        return _exempting(_plan(problem, m, x, infeasible, y))
    solved = _milp(m, costs, rates, phase="all")
    if solved is None:
        # The caps leave rate unserved: the most the capped fleet can serve, then its cheapest mix.
        most = _milp(m, costs, rates, phase="most")
        if most is None:  # cannot happen: x = 0 is feasible
            raise ArithmeticError("the MILP solver found no plan serving even part of the rate")
        weights = [rates[m.cells[i]] / m.total for i in m.pair_cell]
        served = math.fsum(w * float(v) for w, v in zip(weights, most[1], strict=True))
        solved = _cheapest_serving(m, costs, rates, served)
        if solved is None:
            raise ArithmeticError("the MILP solver found no plan serving phase 1's rate")
    return _plan(problem, m, [float(v) for v in solved[1]], infeasible)


class ScaleDownGate:
    """Hysteresis per deployment: `step` passes a higher count at once and a lower one only when
    the last `windows` proposals all agree on it (it returns the most of the last `windows`
    proposals). A plan that flaps between windows then keeps the larger fleet instead of
    churning pods; `windows=1` passes every proposal through."""

    __slots__ = ("_history", "_windows")

    def __init__(self, windows: int) -> None:
        if not (_is_int(windows) and windows >= 1):
            raise _fail(f"hysteresis windows = {windows!r}: must be an integer >= 1")
        self._windows = windows
        self._history: dict[str, deque[int]] = {}

    @property
    def windows(self) -> int:
        return self._windows

    def step(self, name: str, proposed: int) -> int:
        """Record this window's proposal for `name`; the count to apply now."""
        if not (_is_int(proposed) and proposed >= 0):
            raise _fail(f"{name!r}: proposed replicas = {proposed!r}: must be an integer >= 0")
        history = self._history.get(name)
        if history is None:
            history = self._history[name] = deque(maxlen=self._windows)
        history.append(proposed)
        return max(history)

    def forget(self, name: str) -> None:
        """Drop `name`'s history (its deployment went away, or an operator overrode it)."""
        self._history.pop(name, None)
