"""The Envoy SLO benchmark's reuse of an earlier run's profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugin.core.profile import GpuProfile
from plugin_tools.bench.slo import SloBench, ensure_profiles, light_mix, saved_profiles
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
