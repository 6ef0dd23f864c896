"""`serve` collects young garbage less often; the older generations keep their thresholds."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from plugin.adapters.gc_tuning import YOUNG_COLLECTION_EVERY, collect_young_garbage_less_often

pytestmark = pytest.mark.unit


@pytest.fixture
def restored_thresholds() -> Iterator[tuple[int, int, int]]:
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_only_the_young_threshold_is_raised(restored_thresholds: tuple[int, int, int]) -> None:
    gc.set_threshold(700, 11, 12)
    collect_young_garbage_less_often()
    assert gc.get_threshold() == (YOUNG_COLLECTION_EVERY, 11, 12)
    assert YOUNG_COLLECTION_EVERY > 700
