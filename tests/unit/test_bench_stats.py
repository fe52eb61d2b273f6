"""Percentile, median and spread: the one definition every bench figure uses."""

import math

import pytest

from ebpf_proxy.bench.stats import is_figure, median, percentile, spread


def test_percentile_is_nearest_rank():
    data = list(range(1, 101))  # 1..100
    assert percentile(data, 50) == 50
    assert percentile(data, 90) == 90
    assert percentile(data, 99) == 99
    assert percentile(data, 100) == 100
    assert percentile([7], 99) == 7
    # nearest rank never interpolates: the answer is always one of the samples
    assert percentile([1, 2, 3, 4], 50) == 2
    assert percentile([1, 2, 3, 4], 51) == 3
    assert percentile([10, 1, 5], 1) == 1  # order of the input does not matter


def test_percentile_rejects_nonsense():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 0)
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_median_and_spread():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 2, 3]) == 2.5
    assert spread([10, 10, 10]) == 0
    assert spread([9, 10, 12]) == pytest.approx(0.3)
    assert spread([5]) == 0
    assert math.isinf(spread([0, 0, 1]))
    with pytest.raises(ValueError):
        median([])


def test_is_figure():
    assert is_figure(1) and is_figure(0.001)
    for bad in (0, -1, float("nan"), float("inf"), None, "3", True):
        assert not is_figure(bad)
