"""The Envoy SLO benchmark's reuse of an earlier run's profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugin.core.profile import GpuProfile
from plugin_tools.bench.slo import (
    MixResult,
    Sent,
    SloBench,
    ensure_profiles,
    light_mix,
    saved_profiles,
    score,
)
from plugin_tools.demo.report import RequestResult
from plugin_tools.profile.store import write_profile

pytestmark = pytest.mark.unit


def _profile(gpu: str, rate: float) -> GpuProfile:
    return GpuProfile(gpu, 1.0, (32,), (64, 4096), ((rate, rate / 10),), 0.0)


def test_saved_profiles_reads_one_per_preset_or_none(tmp_path: Path) -> None:
    bench = SloBench()
    (tmp_path / bench.model).mkdir()
    assert saved_profiles(bench, tmp_path) is None
    write_profile(_profile("a100", 20.0), str(tmp_path / bench.model / "a100.json"))
    assert saved_profiles(bench, tmp_path) is None  # v100's is missing: sweep again
    write_profile(_profile("v100", 8.0), str(tmp_path / bench.model / "v100.json"))
    saved = saved_profiles(bench, tmp_path)
    assert saved is not None
    assert list(saved) == ["a100", "v100"]
    assert saved["a100"].tputs == ((20.0, 2.0),)
    assert saved["v100"].gpu == "v100"


async def test_saved_profiles_are_routed_by_without_a_sweep(tmp_path: Path) -> None:
    bench = SloBench()
    (tmp_path / bench.model).mkdir()
    for gpu, rate in (("a100", 20.0), ("v100", 8.0)):
        write_profile(_profile(gpu, rate), str(tmp_path / bench.model / f"{gpu}.json"))
    said: list[str] = []
    # No fleet is given or started: a sweep would need engines and fail here.
    profiles, swept = await ensure_profiles(bench, tmp_path, said.append)
    assert (sorted(profiles), swept) == (["a100", "v100"], False)
    assert said == [f"routing by the profiles in {tmp_path} (no sweep)"]


def test_the_light_mix_scales_every_class_and_nothing_else() -> None:
    bench = SloBench()
    light = light_mix(bench)
    assert [c.rate_per_s for c in light.mix] == [c.rate_per_s * bench.light for c in bench.mix]
    assert [(c.name, c.prompt_words) for c in light.mix] == [
        (c.name, c.prompt_words) for c in bench.mix
    ]
    assert light.duration_s == bench.duration_s


def _sent(kind: str, started: float, ttft: float | None, status: int = 200) -> Sent:
    error = None if status == 200 else "the SLO of this request can no longer be met"
    return Sent(
        kind,
        RequestResult(
            replica="a100-0" if status == 200 else None,
            status=status,
            started_at=started,
            ttft_s=ttft,
            latency_s=(ttft or 0.0) + 0.1 if status == 200 else 0.5,
            output_tokens=32 if status == 200 else 0,
            error=error,
        ),
    )


def test_a_reject_is_told_behind_the_prefill_of_its_own_class() -> None:
    """A rejected long prompt that arrived while an earlier long prompt still waited for its
    first token is reported with how long that token took after its arrival; a short prompt
    in prefill at the time is no reason, nor is a long prompt already streaming."""
    bench = SloBench()
    sent = [
        _sent("long", 10.0, 0.9),  # first token at 10.9
        _sent("long", 10.2, 0.6),  # first token at 10.8
        _sent("short", 10.25, 0.5),  # another class: ignored
        _sent("long", 10.3, None, status=503),  # behind both: the later token counts
        _sent("long", 11.0, None, status=503),  # both long prompts stream by then
    ]
    scored = score(MixResult("slo", sent), bench, {})
    behind = scored["rejected_behind_s"]
    assert len(behind) == 2
    assert behind[0] == pytest.approx(0.6)
    assert behind[1] is None
