"""From trace windows and profiles to the optimizer's problem (plugin.core.workload): the rate
per size, the profile cell each size lands on, and which deployments become candidates."""

from __future__ import annotations

import pytest

from plugin.core.profile import GpuProfile, nearest_tick
from plugin.core.trace import TraceWindow
from plugin.core.workload import Deployment, build_problem, traffic

pytestmark = pytest.mark.unit

MODEL = "m"
TICKS = (128, 256, 512, 1024)


def window(start: int, counts: dict[str, int], total: int) -> TraceWindow:
    doc: dict[str, int] = {
        **counts,
        "meta_v": 4,
        "meta_interval_sec": 10,
        "meta_precision": 10,
        "meta_total_reqs": total,
        "meta_pending_reqs": 0,
        "meta_queueing_reqs": 0,
    }
    return TraceWindow.parse(MODEL, start, doc)


def profile(name: str, cost: float, scale: float) -> GpuProfile:
    """Outputs (16, 64) x inputs TICKS; one replica's rate falls as requests grow."""
    tputs = tuple(tuple(scale * 1000 / (o * i) for i in TICKS) for o in (16, 64))
    return GpuProfile(name, cost, (16, 64), TICKS, tputs, 0.0)


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [(1, 0), (100, 0), (128, 0), (180, 0), (181.02, 1), (182, 1), (300, 1), (1024, 3),
     (100_000, 3)],
    ids=["one", "below-grid", "first", "nearer-first", "tie-to-the-larger", "nearer-second",
         "between", "last", "beyond"],
)  # fmt: skip
def test_nearest_tick_is_clamped(tokens: float, expected: int) -> None:
    assert nearest_tick(TICKS, tokens) == expected


def test_traffic_takes_the_mix_from_completions_and_the_level_from_arrivals() -> None:
    # 512-in/64-out is "90:60", 128-in/16-out is "70:40".
    windows = [
        window(0, {"90:60": 30, "70:40": 10}, total=40),
        window(10, {"90:60": 30, "70:40": 10}, total=80),  # arrivals ahead of completions
        window(20, {}, total=0),
    ]
    load = traffic(windows, lookback_s=60)
    assert (load.arrivals, load.completions, load.windows) == (120, 80, 3)
    assert load.rate == pytest.approx(120 / 60)
    by_size = {(round(c.input_tokens), round(c.output_tokens)): c.rate for c in load.cells}
    assert by_size == {(128, 16): pytest.approx(0.5), (512, 64): pytest.approx(1.5)}


def test_traffic_without_completions_is_empty() -> None:
    load = traffic([window(0, {}, total=5)], lookback_s=240)
    assert load.cells == () and load.rate == 0 and load.arrivals == 5


def test_problem_merges_sizes_that_share_cells_and_leaves_unprofiled_out() -> None:
    # 512 and 600 input tokens land on the 512 tick of both profiles: one cell.
    windows = [window(0, {"90:60": 10, "92:60": 10, "70:40": 20}, total=40)]
    deployments = [
        Deployment("ns", "a100", MODEL, replicas=2, min_replicas=1),
        Deployment("ns", "l20", MODEL, replicas=1),
        Deployment("ns", "h100", MODEL, replicas=3),  # no profile
        Deployment("ns", "other", "another-model", replicas=1),
    ]
    profiles = {"a100": profile("a100", 2.0, 4.0), "l20": profile("l20", 1.0, 1.0)}
    built = build_problem(
        MODEL, deployments, profiles, traffic(windows, 10), headroom=1.5, caps={"ns/l20": 3}
    )
    p = built.problem
    assert [c.name for c in p.candidates] == ["ns/a100", "ns/l20"]
    assert [d.key for d in built.unprofiled] == ["ns/h100"]
    assert p.rates == pytest.approx((2.0, 2.0))  # 128/16 and the merged 512/64
    assert p.headroom == 1.5
    a100, l20 = p.candidates
    assert a100.tputs == pytest.approx((4000 / (16 * 128), 4000 / (64 * 512)))
    assert l20.tputs == pytest.approx((1000 / (16 * 128), 1000 / (64 * 512)))
    assert (a100.min_replicas, a100.max_replicas, a100.cost) == (1, None, 2.0)
    assert (l20.min_replicas, l20.max_replicas) == (0, 3)


def test_a_size_beyond_a_profile_is_planned_at_its_largest_cell_and_reported() -> None:
    # 4096 input tokens: beyond the grid (1024, + half a doubling). Planned at the edge cell as
    # AIBrix's optimizer does, and its rate reported.
    windows = [window(0, {"120:40": 10, "70:40": 10}, total=20)]
    built = build_problem(
        MODEL,
        [Deployment("ns", "a100", MODEL, replicas=1)],
        {"a100": profile("a100", 1.0, 1.0)},
        traffic(windows, 10),
        caps={"a100": 0},
    )
    assert built.problem.candidates[0].tputs == pytest.approx(
        (1000 / (16 * 128), 1000 / (16 * 1024))
    )
    assert built.beyond_grid == pytest.approx(1.0)
    assert built.problem.candidates[0].max_replicas == 0  # a cap by bare name


def test_the_rate_is_taken_over_the_span_the_windows_cover() -> None:
    # Two windows found of a 240 s look-back ending at 100: Redis lost the rest (or tracing just
    # started), so the rate is over 20 s, not 240.
    windows = [window(80, {"70:40": 10}, total=10), window(90, {"70:40": 10}, total=10)]
    load = traffic(windows, lookback_s=240, until=100)
    assert load.span_s == 20.0 and load.rate == pytest.approx(1.0)
    # Traffic that stopped: its silent windows after the last one found still count.
    load = traffic([window(0, {"70:40": 20}, total=20)], lookback_s=240, until=100)
    assert load.span_s == 100.0 and load.rate == pytest.approx(0.2)
    # Never longer than the look-back.
    load = traffic([window(0, {"70:40": 20}, total=20)], lookback_s=60, until=1000)
    assert load.span_s == 60.0


def test_a_cap_below_the_floor_lowers_the_floor() -> None:
    built = build_problem(
        MODEL,
        [Deployment("ns", "a100", MODEL, replicas=1, min_replicas=4)],
        {"a100": profile("a100", 1.0, 1.0)},
        traffic([], 240),
        caps={"a100": 2},
    )
    c = built.problem.candidates[0]
    assert (c.min_replicas, c.max_replicas) == (2, 2)
    assert built.problem.rates == ()
