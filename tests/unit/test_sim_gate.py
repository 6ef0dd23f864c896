"""The load-imbalance gate in the fleet simulator, on a small case: AIBrix's raw-count gate fences
off the fast replica that rightly carries more requests and costs time per token and SLO
attainment; the capacity-aware gate leaves load-balance's split as it was."""

from __future__ import annotations

import pytest

from plugin_tools.sim.imbalance import VARIANTS, GateRow, format_markdown, gate_study, main

pytestmark = pytest.mark.unit


def test_raw_count_gate_hurts_a_mixed_fleet_and_the_capacity_aware_one_does_not() -> None:
    study = gate_study("a100,3xa10", (1.0,), measured_requests=400, warmup_s=30.0, seed=1)
    assert study.replicas == ("a100-0", "a10-0", "a10-1", "a10-2")
    rows: dict[str, GateRow] = {row.variant: row for row in study.rows}
    assert list(rows) == [name for name, _ in VARIANTS]
    none, raw, aware = rows["no gate"], rows["raw-count gate (AIBrix)"], rows["capacity-aware gate"]
    assert none.fired == 0 and raw.fired > 0.2 > aware.fired
    # load-balance gives the A100 most of the requests; the raw gate takes a share off it
    assert none.shares[0] > 0.6
    assert raw.shares[0] < none.shares[0] - 0.1
    assert raw.tpot_p99 > 1.05 * none.tpot_p99
    assert raw.attainment < none.attainment - 0.03
    # the capacity-aware gate keeps the split and the figures
    assert abs(aware.shares[0] - none.shares[0]) < 0.06
    assert aware.tpot_p99 < 1.1 * none.tpot_p99
    assert aware.attainment >= none.attainment - 0.01

    table = format_markdown(study)
    assert "| load (x G*) | req/s | gate | attainment | TPOT p99 ms |" in table
    assert table.count("\n| 1 | ") == 3


def test_the_module_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--fleet", "a100,a10", "--loads", "0.5", "--requests", "50", "--warmup", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Fleet a100,a10 (a100-0 / a10-0)")
    assert sum(line.startswith("| 0.5 | ") for line in out.splitlines()) == len(VARIANTS)
    with pytest.raises(SystemExit):
        main(["--loads", "fast"])
