"""The GPU-mix solver: its cost equals brute force on random small instances; caps, headroom,
min_replicas, infeasible cells, no traffic and the scale-down gate each behave as documented.

The brute force is independent of the MILP: it enumerates every replica vector within bounds and
decides, for each, the most rate that fleet can serve by linear-programming duality (not by a
solver). For a fleet n, the most rate served, max sum_k rate_k sum_d x_kd subject to
sum_d x_kd <= 1 and sum_k need_kd x_kd <= n_d, equals its dual,

    min over y >= 0 of  F(y) = sum_k max(0, rate_k - min_{d serves k} need_kd y_d) + n . y

(`need_kd` = rate_k x headroom / tputs_dk). Every y >= 0 bounds it from above (weak duality),
and the minimum is at a vertex of the arrangement of the hyperplanes where F bends: y_d = 0,
need_kd y_d = rate_k, need_ki y_i = need_kj y_j. On each cell of that arrangement F is linear
(the argmin and the sign of each term are fixed) and the cells lie in the orthant, so they hold no
line and a linear function bounded below (F >= 0) takes its minimum at a vertex. So F's minimum
over the finitely many vertices (D hyperplanes meeting, in the orthant) is exact; numpy evaluates
it for every fleet at once, a few milliseconds per instance. The most any fleet within bounds can
serve (all at their caps) is checked against `scipy.optimize.linprog` as well; the cheapest fleet
that serves that much is the brute-force optimum.
"""

from __future__ import annotations

import ast
import itertools
import math
import random
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray
from scipy.optimize import linprog

from plugin.core import optimizer
from plugin.core.optimizer import Candidate, Plan, Problem, ScaleDownGate, solve
from plugin.errors import GatewayError, OptimizerInputError

pytestmark = pytest.mark.unit

TOL = 1e-6


# -- the brute force ------------------------------------------------------------------------------


def servable(problem: Problem) -> list[int]:
    return [
        k
        for k, r in enumerate(problem.rates)
        if r > 0 and any(c.tputs[k] > 0 for c in problem.candidates)
    ]


def needs(problem: Problem, cells: Sequence[int]) -> NDArray[np.float64]:
    """need[k, d]: replicas of d that cell k needs alone; inf where d cannot serve it."""
    out = np.full((len(cells), len(problem.candidates)), np.inf)
    for i, k in enumerate(cells):
        for d, c in enumerate(problem.candidates):
            if c.tputs[k] > 0:
                out[i, d] = problem.rates[k] * problem.headroom / c.tputs[k]
    return out


def dual_vertices(rates: NDArray[np.float64], need: NDArray[np.float64]) -> NDArray[np.float64]:
    """Every y >= 0 where D of F's bend hyperplanes meet (rows h with h . y = rhs)."""
    nk, nd = need.shape
    planes: list[tuple[NDArray[np.float64], float]] = [(np.eye(nd)[d], 0.0) for d in range(nd)]
    for k in range(nk):
        ok = [d for d in range(nd) if math.isfinite(need[k, d])]
        for d in ok:
            planes.append((need[k, d] * np.eye(nd)[d], float(rates[k])))
        for i, j in itertools.combinations(ok, 2):
            planes.append((need[k, i] * np.eye(nd)[i] - need[k, j] * np.eye(nd)[j], 0.0))
    combos = list(itertools.combinations(range(len(planes)), nd))
    mats = np.array([[planes[p][0] for p in combo] for combo in combos])
    rhs = np.array([[planes[p][1] for p in combo] for combo in combos])
    keep = np.abs(np.linalg.det(mats)) > 1e-12
    ys = np.linalg.solve(mats[keep], rhs[keep][..., None])[..., 0]
    ys = ys[(ys >= -1e-9).all(axis=1)].clip(min=0.0)
    return np.unique(ys.round(12), axis=0)


def most_served(
    rates: NDArray[np.float64], need: NDArray[np.float64], fleets: NDArray[np.float64]
) -> NDArray[np.float64]:
    """The most rate each fleet (a row of `fleets`) can serve: min of F over the vertices."""
    ys = dual_vertices(rates, need)
    work = np.where(
        np.isfinite(need)[None], np.nan_to_num(need, posinf=0.0)[None] * ys[:, None, :], np.inf
    )
    z = np.maximum(0.0, rates[None, :] - work.min(axis=2)).sum(axis=1)  # (vertices,)
    result: NDArray[np.float64] = (z[None, :] + fleets @ ys.T).min(axis=1)
    return result


def most_served_lp(
    rates: NDArray[np.float64], need: NDArray[np.float64], fleet: Sequence[int]
) -> float:
    """The same for one fleet, by scipy's linprog: the cross-check of the duality argument."""
    pairs = [
        (k, d)
        for k in range(need.shape[0])
        for d in range(need.shape[1])
        if math.isfinite(need[k, d])
    ]
    a = np.zeros((need.shape[0] + need.shape[1], len(pairs)))
    for v, (k, d) in enumerate(pairs):
        a[k, v] = 1.0
        a[need.shape[0] + d, v] = need[k, d]
    b = np.concatenate([np.ones(need.shape[0]), np.asarray(fleet, dtype=float)])
    res = linprog(-np.array([rates[k] for k, _ in pairs]), A_ub=a, b_ub=b, bounds=(0, None))
    assert res.status == 0
    return float(-res.fun)


def brute_force(problem: Problem) -> tuple[float, float, float]:
    """(cheapest cost, most rate served, servable rate) by enumeration; every candidate capped."""
    cells = servable(problem)
    rates = np.array([problem.rates[k] for k in cells])
    need = needs(problem, cells)
    bounds = [range(c.min_replicas, (c.max_replicas or 0) + 1) for c in problem.candidates]
    fleets = np.array(list(itertools.product(*bounds)), dtype=float)
    costs = fleets @ np.array([c.cost for c in problem.candidates])
    if not cells:
        return float(costs.min()), 0.0, 0.0
    served = most_served(rates, need, fleets)
    caps = [c.max_replicas or 0 for c in problem.candidates]
    best = float(served.max())  # the fleet at its caps serves the most
    assert best == pytest.approx(most_served_lp(rates, need, caps), rel=1e-7, abs=1e-9)
    total = float(rates.sum())
    enough = served >= best - 1e-7 * total
    # The first fleet, in increasing cost, that serves that much.
    order = np.argsort(costs, kind="stable")
    first = next(int(i) for i in order if enough[i])
    return float(costs[first]), best, total


def check_plan(problem: Problem, plan: Plan) -> float:
    """The plan is feasible as reported; returns the rate it serves."""
    cands = problem.candidates
    assert set(plan.replicas) == {c.name for c in cands}
    assert len(plan.share) == len(problem.rates) == len(plan.unserved)
    for c in cands:
        n = plan.replicas[c.name]
        assert c.min_replicas <= n <= (c.max_replicas if c.max_replicas is not None else n)
    assert plan.cost == pytest.approx(sum(c.cost * plan.replicas[c.name] for c in cands))
    load = [0.0] * len(cands)
    served = 0.0
    for k, (rate, row) in enumerate(zip(problem.rates, plan.share, strict=True)):
        assert len(row) == len(cands)
        assert all(v >= 0 for v in row)
        for d, c in enumerate(cands):
            if c.tputs[k] == 0 or rate == 0:
                assert row[d] == 0
            else:
                load[d] += rate * problem.headroom * row[d] / c.mix[k]
                # and the cell alone within what the candidate's replicas sustain of it
                n = plan.replicas[c.name]
                assert rate * problem.headroom * row[d] / c.tputs[k] <= n + TOL * max(1.0, n)
        total = math.fsum(row)
        assert total <= 1 + 1e-9
        if rate > 0 and k not in plan.infeasible_cells:
            left = plan.unserved[k] + plan.exempt[k]
            assert left == pytest.approx(rate * (1 - total), abs=TOL * rate)
            assert plan.unserved[k] == 0 or plan.exempt[k] == 0  # short or exempt, not both
            if plan.status == "optimal":
                assert plan.unserved[k] == 0
                if problem.attainment == 1:
                    assert total == pytest.approx(1.0, abs=1e-9)
        else:
            assert plan.unserved[k] == rate
            assert plan.exempt[k] == 0
        served += rate * total
    for d, c in enumerate(cands):
        n = plan.replicas[c.name]
        assert load[d] <= n + TOL * max(1.0, n), (c.name, load[d], n)
        if any(plan.exempt):  # the work of what is served late is in the load too
            assert load[d] - 1e-9 <= plan.load[d] <= n + TOL * max(1.0, n)
        else:
            assert plan.load[d] == pytest.approx(load[d], rel=1e-9, abs=1e-12)
    return served


def random_problem(rng: random.Random) -> Problem:
    nd, nk = rng.choice((2, 3)), rng.randint(1, 6)
    rates = tuple(0.0 if rng.random() < 0.15 else rng.uniform(0.05, 6.0) for _ in range(nk))
    cands = []
    for d in range(nd):
        tputs = tuple(0.0 if rng.random() < 0.25 else rng.uniform(0.3, 4.0) for _ in range(nk))
        cap = rng.randint(1, 8)
        low = rng.randint(0, cap) if rng.random() < 0.25 else 0
        cands.append(Candidate(f"ns/gpu{d}", rng.uniform(0.1, 5.0), tputs, low, cap))
    headroom = 1.0 if rng.random() < 0.5 else rng.uniform(1.0, 1.6)
    return Problem(rates, tuple(cands), headroom)


def test_milp_cost_equals_brute_force_on_200_random_instances() -> None:
    rng = random.Random(20240613)
    statuses: Counter[str] = Counter()
    for trial in range(200):
        problem = random_problem(rng)
        plan = solve(problem)
        cost, best, total = brute_force(problem)
        where = f"instance {trial}: {problem}\n{plan}"
        assert plan.cost == pytest.approx(cost, rel=1e-9, abs=1e-9), where
        served = check_plan(problem, plan)
        assert served == pytest.approx(best, rel=1e-6, abs=1e-9), where
        if total == 0:
            assert plan.status == ("idle" if not any(problem.rates) else "optimal"), where
        else:
            assert plan.status == ("short" if best < total * (1 - 1e-6) else "optimal"), where
        statuses[plan.status] += 1
        statuses["infeasible cells"] += bool(plan.infeasible_cells)
    # The seed covers every branch, so a change to the generator cannot quietly skip one.
    assert statuses["optimal"] >= 50 and statuses["short"] >= 20, statuses
    assert statuses["infeasible cells"] >= 5 and statuses["idle"] >= 1, statuses


def most_in_time_lp(problem: Problem, fleet: Sequence[int]) -> float | None:
    """The most rate `fleet` serves within the SLO while every other servable request is served
    late with its work counted (the module docstring's `y`: at `Candidate.late`, nowhere it is
    0), by scipy's linprog; None when the fleet cannot even take every request."""
    cells = servable(problem)
    cands = problem.candidates
    h = problem.headroom
    xs = [(i, d) for i, k in enumerate(cells) for d, c in enumerate(cands) if c.tputs[k] > 0]
    ys = [
        (i, d, problem.rates[k] * h / c.late[k])
        for d, c in enumerate(cands)
        for i, k in enumerate(cells)
        if c.late[k] > 0
    ]
    n = len(xs) + len(ys)
    a_eq = np.zeros((len(cells), n))
    a_ub = np.zeros((2 * len(cands) + len(xs), n))
    for v, (i, d) in enumerate(xs):
        k = cells[i]
        a_eq[i, v] = 1.0
        a_ub[d, v] = problem.rates[k] * h / cands[d].mix[k]
        a_ub[len(cands) + v, v] = problem.rates[k] * h / cands[d].tputs[k]  # alone
    for v, (i, d, w) in enumerate(ys, start=len(xs)):
        a_eq[i, v] = 1.0
        a_ub[d, v] = w
    b_ub = np.zeros(a_ub.shape[0])
    b_ub[: len(cands)] = fleet
    for v, (_, d) in enumerate(xs):
        b_ub[len(cands) + v] = fleet[d]
    gain = np.zeros(n)
    gain[: len(xs)] = [problem.rates[cells[i]] for i, _ in xs]
    res = linprog(-gain, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=np.ones(len(cells)), bounds=(0, 1))
    return None if res.status == 2 else float(-res.fun)


def test_an_attainment_target_buys_the_cheapest_fleet_serving_that_share() -> None:
    """Against a brute force: the cheapest fleet that takes every request and serves at least
    the target's share of all traffic within the SLO (cells nobody serves counted as missed),
    the rest late with its work counted; on that fleet the plan serves the most it can in
    time."""
    rng = random.Random(20261206)
    seen: Counter[str] = Counter()
    for trial in range(160):
        problem = replace(random_problem(rng), attainment=rng.choice((0.99, 0.95, 0.8, 0.5)))
        # Some candidates estimate what the sizes they never serve in time cost late.
        problem = replace(
            problem,
            candidates=tuple(
                replace(
                    c,
                    late_tputs=tuple(
                        t or rng.choice((0.0, rng.uniform(0.2, 2.0))) for t in c.tputs
                    ),
                )
                if rng.random() < 0.6
                else c
                for c in problem.candidates
            ),
        )
        plan = solve(problem)
        where = f"instance {trial}: {problem}\n{plan}"
        served = check_plan(problem, plan)
        cells = servable(problem)
        if not cells:
            continue
        total = sum(problem.rates[k] for k in cells)
        asked = min(total, problem.attainment * sum(problem.rates))
        bounds = [range(c.min_replicas, (c.max_replicas or 0) + 1) for c in problem.candidates]
        fleets = sorted(
            itertools.product(*bounds),
            key=lambda f: sum(c.cost * n for c, n in zip(problem.candidates, f, strict=True)),
        )
        found = None
        for fleet in fleets:
            most = most_in_time_lp(problem, fleet)
            if most is not None and most >= asked * (1 - 1e-7):
                found = fleet
                break
        if found is None:  # the caps cannot take every request so: the plan as without a target
            assert plan.status == "short" or sum(plan.exempt) == 0, where
            seen["fallback"] += 1
            continue
        cheapest = sum(c.cost * n for c, n in zip(problem.candidates, found, strict=True))
        assert plan.cost == pytest.approx(cheapest, rel=1e-9, abs=1e-9), where
        assert plan.status == "optimal", where
        assert served >= asked * (1 - 1e-6), where
        mine = [plan.replicas[c.name] for c in problem.candidates]
        best = most_in_time_lp(problem, mine)
        assert best is not None and served == pytest.approx(best, rel=1e-6, abs=1e-9), where
        assert sum(plan.exempt) == pytest.approx(total - served, abs=1e-6), where
        # Every request is taken: what is not in time is exempt, and its work is in the load.
        seen["exempt" if sum(plan.exempt) > 0 else "all"] += 1
        seen["cheaper"] += cheapest < brute_force(problem)[0] - 1e-9
    assert seen["exempt"] >= 5 and seen["cheaper"] >= 5 and seen["fallback"] >= 3, seen


def test_a_rare_costly_cell_is_served_late_where_its_work_fits() -> None:
    # 99 req/s of short requests an l20 serves at 10 each; 1 req/s of long ones only an a100
    # serves in time, 2 per replica. Every request in time: an a100 (the long ones and 10 req/s
    # of the short) and 9 l20, $12.
    l20 = Candidate("ns/l20", 1.0, (10.0, 0.0), late_tputs=(10.0, 10.0))
    problem = Problem((99.0, 1.0), (l20, cand("ns/a100", 3.0, 20.0, 2.0)))
    assert solve(problem).replicas == {"ns/l20": 9, "ns/a100": 1}
    # 99% in time: the long ones late on the l20s, each charged its estimate (a tenth of an
    # l20, as a short one): 9.9 + 0.1 replicas, $10.
    held = replace(problem, attainment=0.99)
    plan = solve(held)
    assert plan.replicas == {"ns/l20": 10, "ns/a100": 0}
    assert plan.exempt == (0.0, 1.0) and plan.unserved == (0.0, 0.0)
    assert plan.load[0] == pytest.approx(10.0)  # the late work is in the load
    assert plan.status == "optimal"
    check_plan(held, plan)
    # Costlier late (half an l20 each): 9.9 + 0.5 needs 11 l20, still less than the a100.
    dear = replace(held, candidates=(replace(l20, late_tputs=(10.0, 2.0)), problem.candidates[1]))
    assert solve(dear).replicas == {"ns/l20": 11, "ns/a100": 0}
    # No estimate for the long size on the l20: it cannot take them, late or not.
    blind = replace(held, candidates=(replace(l20, late_tputs=None), problem.candidates[1]))
    assert solve(blind).replicas == {"ns/l20": 9, "ns/a100": 1}
    # 99.5%: half the long cell at least in time, so the a100 again.
    tighter = replace(problem, attainment=0.995)
    assert solve(tighter).replicas == {"ns/l20": 9, "ns/a100": 1}


def test_cells_nobody_serves_count_against_the_target_first() -> None:
    # 1 req/s nobody serves is already 1% missed: at 0.99 every servable cell is planned.
    problem = Problem(
        (98.0, 1.0, 1.0),
        (cand("ns/l20", 1.0, 10.0, 0.0, 0.0), cand("ns/a100", 3.0, 20.0, 2.0, 0.0)),
        attainment=0.99,
    )
    plan = solve(problem)
    assert plan.infeasible_cells == (2,)
    assert plan.unserved == (0.0, 0.0, 1.0) and plan.exempt == (0.0, 0.0, 0.0)
    assert plan.replicas["ns/a100"] >= 1
    check_plan(problem, plan)


# -- caps, headroom, min_replicas ----------------------------------------------------------------


def cand(name: str, cost: float, *tputs: float, low: int = 0, cap: int | None = None) -> Candidate:
    return Candidate(name, cost, tuple(tputs), low, cap)


def test_a_cap_forces_the_pricier_type() -> None:
    cheap, dear = cand("ns/l20", 1.0, 1.0), cand("ns/a100", 3.0, 2.0)
    assert solve(Problem((6.0,), (cheap, dear))).replicas == {"ns/l20": 6, "ns/a100": 0}
    capped = Problem((6.0,), (cand("ns/l20", 1.0, 1.0, cap=2), dear))
    plan = solve(capped)
    # 2 L20 serve 2 req/s; the other 4 need 2 A100.
    assert plan.replicas == {"ns/l20": 2, "ns/a100": 2}
    assert plan.cost == pytest.approx(8.0)
    assert plan.status == "optimal"
    check_plan(capped, plan)


def test_the_cell_is_split_across_types_when_that_is_cheaper() -> None:
    # 2.5 req/s: A100s alone need 2 (cost 4), L20s alone 3 (cost 3.6), one of each serves 3 for 3.2.
    problem = Problem((2.5,), (cand("ns/a100", 2.0, 2.0), cand("ns/l20", 1.2, 1.0)))
    plan = solve(problem)
    assert plan.replicas == {"ns/a100": 1, "ns/l20": 1}
    assert plan.cost == pytest.approx(3.2)
    assert 0 < plan.share[0][0] < 1 and 0 < plan.share[0][1] < 1
    check_plan(problem, plan)


@pytest.mark.parametrize(
    ("headroom", "unserved"),
    [(1.0, 3.0), (1.5, 5.0 - 2 / 1.5), (2.0, 4.0)],
    ids=["no-headroom", "headroom-1.5", "headroom-2"],
)
def test_caps_too_low_leave_the_rest_unserved(headroom: float, unserved: float) -> None:
    problem = Problem((5.0,), (cand("ns/a100", 1.0, 1.0, cap=2),), headroom)
    plan = solve(problem)
    assert plan.status == "short"
    assert plan.replicas == {"ns/a100": 2}
    assert plan.unserved[0] == pytest.approx(unserved, rel=1e-9)
    assert plan.infeasible_cells == ()
    check_plan(problem, plan)


def test_a_short_plan_serves_the_most_then_spends_the_least() -> None:
    # Cell 0 (4 req/s) only the capped A100s serve: 2 of it is served, 2 unserved. Cell 1 either
    # type serves; the A100s are full, so a cheap L20 takes it. A third, unused type stays at 0.
    problem = Problem(
        (4.0, 1.0),
        (
            cand("ns/a100", 3.0, 1.0, 1.0, cap=2),
            cand("ns/l20", 1.0, 0.0, 1.0),
            cand("ns/h100", 9.0, 0.0, 5.0),
        ),
    )
    plan = solve(problem)
    assert plan.status == "short"
    assert plan.replicas == {"ns/a100": 2, "ns/l20": 1, "ns/h100": 0}
    assert plan.unserved == pytest.approx((2.0, 0.0))
    assert plan.share[1] == pytest.approx((0.0, 1.0, 0.0))
    check_plan(problem, plan)


@pytest.mark.parametrize(
    ("headroom", "replicas"),
    [(1.0, 4), (1.1, 5), (1.25, 5), (2.0, 8)],
    ids=["1.0", "1.1", "1.25", "2.0"],
)
def test_headroom_scales_the_replicas_needed(headroom: float, replicas: int) -> None:
    problem = Problem((4.0,), (cand("ns/a100", 1.0, 1.0),), headroom)
    plan = solve(problem)
    assert plan.replicas == {"ns/a100": replicas}
    assert plan.unserved == (0.0,)
    assert plan.load == pytest.approx((4.0 * headroom,))


@pytest.mark.parametrize(
    ("rates", "replicas", "status"),
    [
        ((0.0, 0.0), {"ns/a100": 2, "ns/l20": 1}, "idle"),
        ((1.0, 0.0), {"ns/a100": 2, "ns/l20": 1}, "optimal"),  # the minimum already serves it
        ((3.5, 0.0), {"ns/a100": 2, "ns/l20": 2}, "optimal"),  # 2 A100 (free to use) + 1.5 L20
        ((0.0, 6.0), {"ns/a100": 2, "ns/l20": 6}, "optimal"),  # the A100 cannot serve cell 1
    ],
    ids=["no-traffic", "within-minimum", "above-minimum", "unusable-minimum"],
)
def test_min_replicas_are_kept(
    rates: tuple[float, ...], replicas: dict[str, int], status: str
) -> None:
    problem = Problem(
        rates, (cand("ns/a100", 5.0, 1.0, 0.0, low=2), cand("ns/l20", 1.0, 1.0, 1.0, low=1))
    )
    plan = solve(problem)
    assert plan.replicas == replicas
    assert plan.status == status
    check_plan(problem, plan)


# -- infeasible cells, no traffic -----------------------------------------------------------------


def test_an_infeasible_cell_is_reported_and_the_rest_planned() -> None:
    problem = Problem(
        (2.0, 7.0, 0.0), (cand("ns/a100", 2.0, 1.0, 0.0, 0.0), cand("ns/l20", 1.0, 0.0, 0.0, 0.0))
    )
    plan = solve(problem)
    # Cell 1 has traffic nobody serves; cell 2 nobody serves either, but it has no traffic.
    assert plan.infeasible_cells == (1,)
    assert plan.unserved == (0.0, 7.0, 0.0)
    assert plan.share[1] == (0.0, 0.0)
    assert plan.replicas == {"ns/a100": 2, "ns/l20": 0}
    assert plan.status == "optimal"  # every cell that can be served is
    check_plan(problem, plan)


def test_only_infeasible_traffic_keeps_the_minimum() -> None:
    problem = Problem((3.0,), (cand("ns/a100", 2.0, 0.0, low=1),))
    plan = solve(problem)
    assert plan.replicas == {"ns/a100": 1}
    assert plan.infeasible_cells == (0,)
    assert plan.unserved == (3.0,)


@pytest.mark.parametrize("rates", [(0.0, 0.0, 0.0), ()], ids=["zero-rates", "no-cells"])
def test_no_traffic_is_idle_at_min_replicas(rates: tuple[float, ...]) -> None:
    cells = len(rates)
    problem = Problem(
        rates,
        (cand("ns/a100", 2.0, *([1.0] * cells), low=1), cand("ns/l20", 1.0, *([1.0] * cells))),
    )
    plan = solve(problem)
    assert plan.status == "idle"
    assert plan.replicas == {"ns/a100": 1, "ns/l20": 0}
    assert plan.cost == 2.0
    assert plan.unserved == rates
    assert plan.infeasible_cells == ()


def test_nothing_to_solve_needs_no_scipy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("scipy", "scipy.optimize", "scipy.sparse", "numpy"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    problem = Problem((0.0, 3.0), (cand("ns/a100", 2.0, 1.0, 0.0, low=1),))
    assert solve(problem).replicas == {"ns/a100": 1}
    with pytest.raises(ImportError):
        solve(Problem((1.0,), (cand("ns/a100", 2.0, 1.0),)))


def test_the_module_imports_scipy_and_numpy_only_inside_functions() -> None:
    tree = ast.parse(Path(optimizer.__file__).read_text(encoding="utf-8"))
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
    assert not {m for m in names if m.split(".")[0] in {"scipy", "numpy"}}


# -- solver noise ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "share"),
    [
        ((0.5000001, 0.5000001), (0.5, 0.5)),  # shares over 1 by noise: renormalised
        ((0.49999999, 0.5), (0.49999999 / 0.99999999, 0.5 / 0.99999999)),  # under 1: too
        ((0.5000001, 0.4999999), (0.5000001, 0.4999999)),  # work over a replica by noise: kept
        ((-1e-9, 1.0 + 1e-9), (0.0, 1.0)),  # outside [0, 1]: clipped
    ],
    ids=["over-one", "under-one", "work-over-replicas", "outside-0-1"],
)
def test_solver_noise_is_mopped_up(x: tuple[float, float], share: tuple[float, float]) -> None:
    # One cell of 4 req/s, split between two types of tput 2 and 4: each half is one replica's work.
    problem = Problem((4.0,), (cand("ns/a", 1.0, 2.0), cand("ns/b", 1.0, 4.0)))
    m = optimizer._model(problem, [0])
    plan = optimizer._plan(problem, m, list(x), [])
    assert plan.share[0] == pytest.approx(share, rel=1e-12)
    assert plan.replicas == {"ns/a": 1 if share[0] else 0, "ns/b": 1}
    assert plan.status == "optimal"
    check_plan(problem, plan)


def test_work_beyond_the_tolerance_adds_a_replica_or_is_cut_at_the_cap() -> None:
    problem = Problem((4.0,), (cand("ns/a", 1.0, 1.0, cap=2), cand("ns/b", 1.0, 1.0)))
    m = optimizer._model(problem, [0])
    # 0.6 x 4 = 2.4 replicas of work for a (capped at 2), 1.6 for b: a's share is cut to 0.5.
    plan = optimizer._plan(problem, m, [0.6, 0.4], [])
    assert plan.replicas == {"ns/a": 2, "ns/b": 2}
    assert plan.share[0] == pytest.approx((0.5, 0.4))
    assert plan.unserved[0] == pytest.approx(0.4)
    assert plan.status == "short"
    check_plan(problem, plan)


# -- cells that cost less inside a mix than alone (mix_tputs) ------------------------------------


def test_a_long_prompt_cell_is_planned_by_what_it_costs_in_the_mix() -> None:
    # Short prompts at 10 req/s a replica; long ones 0.5 alone (collisions) but 5 in a mix.
    alone = Candidate("ns/a100", 1.0, (10.0, 0.5))
    mixed = Candidate("ns/a100", 1.0, (10.0, 0.5), mix_tputs=(10.0, 5.0))
    traffic = (8.0, 0.4)  # 0.8 + 0.08 replicas in a mix; 0.8 + 0.8 charged alone
    assert solve(Problem(traffic, (alone,))).replicas == {"ns/a100": 2}
    plan = solve(Problem(traffic, (mixed,)))
    assert plan.replicas == {"ns/a100": 1}
    assert plan.load == pytest.approx((0.88,))
    check_plan(Problem(traffic, (mixed,)), plan)


def test_a_cell_stays_within_what_a_replica_sustains_of_it_alone() -> None:
    # Nothing but long prompts: 2 req/s is 0.4 replicas of work in a mix, but one replica
    # sustains 0.5 req/s of them, so 4 replicas; a cheaper type's share obeys the same row.
    mixed = Candidate("ns/a100", 1.0, (10.0, 0.5), mix_tputs=(10.0, 5.0))
    problem = Problem((0.0, 2.0), (mixed,))
    plan = solve(problem)
    assert plan.replicas == {"ns/a100": 4}
    check_plan(problem, plan)
    capped = Problem((0.0, 2.0), (replace(mixed, max_replicas=2),))
    short = solve(capped)
    assert short.status == "short" and short.unserved[1] == pytest.approx(1.0)
    check_plan(capped, short)


def cheapest_by_lp(problem: Problem) -> float | None:
    """The cheapest fleet (each candidate up to its cap) whose replicas serve every servable
    cell within both rows, each fleet checked by linprog; None if no fleet serves them all."""
    cells = servable(problem)
    cands = problem.candidates
    pairs = [(k, d) for k in cells for d, c in enumerate(cands) if c.tputs[k] > 0]
    bounds = [range(c.min_replicas, (c.max_replicas or 0) + 1) for c in cands]
    fleets = sorted(
        itertools.product(*bounds),
        key=lambda f: sum(c.cost * n for c, n in zip(cands, f, strict=True)),
    )
    h = problem.headroom
    if not pairs:  # nothing to serve: the cheapest fleet, every candidate at its minimum
        return float(sum(c.cost * n for c, n in zip(cands, fleets[0], strict=True)))
    for fleet in fleets:
        a_ub, b_ub = [], []
        for d, c in enumerate(cands):  # work in a mix
            a_ub.append([problem.rates[k] * h / c.mix[k] if e == d else 0 for k, e in pairs])
            b_ub.append(fleet[d])
        for v, (k, d) in enumerate(pairs):  # each cell alone
            a_ub.append(
                [
                    problem.rates[k] * h / cands[d].tputs[k] if w == v else 0
                    for w in range(len(pairs))
                ]
            )
            b_ub.append(fleet[d])
        a_eq = [[1.0 if kk == k else 0.0 for kk, _ in pairs] for k in cells]
        res = linprog(
            np.zeros(len(pairs)),
            A_ub=a_ub,
            b_ub=b_ub,
            A_eq=a_eq,
            b_eq=np.ones(len(cells)),
            bounds=(0, 1),
        )
        if res.status == 0:
            return float(sum(c.cost * n for c, n in zip(cands, fleet, strict=True)))
    return None


def test_milp_with_mix_rates_equals_the_cheapest_fleet_by_lp_on_random_instances() -> None:
    rng = random.Random(20261203)
    checked = 0
    for trial in range(60):
        base = random_problem(rng)
        cands = tuple(
            replace(
                c,
                max_replicas=min(c.max_replicas or 4, 4),
                min_replicas=min(c.min_replicas, 4),
                mix_tputs=tuple(t * rng.choice((1.0, 1.0, rng.uniform(1.0, 6.0))) for t in c.tputs),
            )
            for c in base.candidates
        )
        problem = replace(base, candidates=cands)
        plan = solve(problem)
        check_plan(problem, plan)
        cost = cheapest_by_lp(problem)
        where = f"instance {trial}: {problem}\n{plan}"
        if cost is None:
            assert plan.status == "short" or not servable(problem), where
        else:
            assert plan.status in ("optimal", "idle"), where
            assert plan.cost == pytest.approx(cost, rel=1e-9, abs=1e-9), where
            checked += 1
    assert checked >= 20  # the seed keeps enough instances that some fleet serves in full


# -- bad input -------------------------------------------------------------------------------------


GOOD = cand("ns/a100", 1.0, 1.0, 2.0)


@pytest.mark.parametrize(
    ("problem", "match"),
    [
        (Problem((1.0,), (GOOD,)), r"'ns/a100': tputs has 2 cells but rates has 1"),
        (Problem((1.0, -1.0), (GOOD,)), r"rates\[1\] = -1.0: a rate must be a finite number >= 0"),
        (Problem((1.0, math.nan), (GOOD,)), r"rates\[1\] = nan"),
        (Problem((1.0, math.inf), (GOOD,)), r"rates\[1\] = inf"),
        (Problem((1.0, 1.0), (GOOD,), 0.9), r"headroom = 0.9: must be a finite number >= 1"),
        (Problem((1.0, 1.0), (GOOD,), math.inf), r"headroom = inf"),
        (Problem((1.0, 1.0), (GOOD,), attainment=0.0), r"attainment = 0.0: .* in \(0, 1\]"),
        (Problem((1.0, 1.0), (GOOD,), attainment=1.5), r"attainment = 1.5"),
        (Problem((1.0, 1.0), (GOOD,), attainment=math.nan), r"attainment = nan"),
        (Problem((1.0, 1.0), (cand("ns/a", 1.0, 1.0, -2.0),)), r"'ns/a': tputs\[1\] = -2.0"),
        (Problem((1.0, 1.0), (cand("ns/a", 1.0, 1.0, math.inf),)), r"'ns/a': tputs\[1\] = inf"),
        (Problem((1.0,), (cand("ns/a", -1.0, 1.0),)), r"'ns/a': cost = -1.0"),
        (Problem((1.0,), (cand("ns/a", math.nan, 1.0),)), r"'ns/a': cost = nan"),
        (Problem((1.0,), (cand("ns/a", 1.0, 1.0, low=3, cap=2),)), r"max_replicas = 2: .* \(3\)"),
        (Problem((1.0,), (cand("ns/a", 1.0, 1.0, low=-1),)), r"min_replicas = -1"),
        (Problem((1.0,), (cand("ns/a", 1.0, 1.0), cand("ns/a", 2.0, 1.0))), r"'ns/a': named twice"),
        (Problem((1.0,), (cand("", 1.0, 1.0),)), r"name must be a non-empty string"),
        (Problem((1e300,), (cand("ns/a", 1.0, 1e-300),)), r"'ns/a': cell 0 needs .* overflows"),
        (
            Problem((1.0,), (Candidate("ns/a", 1.0, (2.0,), mix_tputs=(1.0,)),)),
            r"'ns/a': mix_tputs\[0\] = 1.0: must be a finite number >= tputs\[0\]",
        ),
        (
            Problem((1.0,), (Candidate("ns/a", 1.0, (2.0,), mix_tputs=(2.0, 2.0)),)),
            r"'ns/a': mix_tputs has 2 cells, not 1",
        ),
    ],
    ids=[
        "length-mismatch",
        "negative-rate",
        "nan-rate",
        "infinite-rate",
        "headroom-below-1",
        "infinite-headroom",
        "zero-attainment",
        "attainment-above-1",
        "nan-attainment",
        "negative-tput",
        "infinite-tput",
        "negative-cost",
        "nan-cost",
        "min-above-max",
        "negative-min",
        "duplicate-name",
        "empty-name",
        "overflowing-need",
        "mix-below-tputs",
        "mix-length",
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(problem: Problem, match: str) -> None:
    with pytest.raises(OptimizerInputError, match=match) as info:
        solve(problem)
    assert isinstance(info.value, GatewayError) and isinstance(info.value, ValueError)
    assert str(info.value).startswith("optimizer input: ")


# -- hysteresis ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("windows", "proposals", "applied"),
    [
        (3, [5, 3, 3, 3], [5, 5, 5, 3]),  # down after 3 windows agree
        (3, [2, 6], [2, 6]),  # up at once
        (3, [5, 3, 3, 4, 3, 3, 3], [5, 5, 5, 4, 4, 4, 3]),  # a higher proposal restarts the wait
        (3, [6, 5, 4, 3, 3], [6, 6, 6, 5, 4]),  # a steady decline follows it N windows late
        (1, [5, 3, 7, 0], [5, 3, 7, 0]),  # one window: no hysteresis
        (2, [0, 0, 1, 0, 0], [0, 0, 1, 1, 0]),
    ],
    ids=["down-after-n", "up-at-once", "restart", "decline", "one-window", "two-windows"],
)
def test_scale_down_gate(windows: int, proposals: list[int], applied: list[int]) -> None:
    gate = ScaleDownGate(windows)
    assert [gate.step("ns/a100", p) for p in proposals] == applied


def test_scale_down_gate_keeps_deployments_apart_and_forgets() -> None:
    gate = ScaleDownGate(3)
    assert gate.step("ns/a100", 5) == 5
    assert gate.step("ns/l20", 1) == 1
    assert gate.step("ns/a100", 2) == 5
    gate.forget("ns/a100")
    assert gate.step("ns/a100", 2) == 2  # no memory of the 5
    gate.forget("ns/unknown")  # forgetting a stranger is harmless
    assert gate.step("ns/l20", 0) == 1


@pytest.mark.parametrize("windows", [0, -1, True], ids=["zero", "negative", "bool"])
def test_scale_down_gate_rejects_bad_windows(windows: int) -> None:
    with pytest.raises(OptimizerInputError, match="windows"):
        ScaleDownGate(windows)


def test_scale_down_gate_rejects_negative_proposals() -> None:
    with pytest.raises(OptimizerInputError, match="'ns/a100': proposed replicas = -1"):
        ScaleDownGate(2).step("ns/a100", -1)
