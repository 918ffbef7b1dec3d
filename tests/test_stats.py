"""Student's t intervals of the benchmark tables (rafl.reports.stats)."""

from __future__ import annotations

import math

import pytest

from rafl.reports.stats import format_points, from_se, paired_interval, t_factor, t_interval


def test_t_factor_is_students_quantile_with_n_minus_1_degrees_of_freedom():
    assert t_factor(3) == pytest.approx(4.3027, abs=1e-4)     # 3 seeds: 4.30, not 2
    assert t_factor(2) == pytest.approx(12.706, abs=1e-3)
    assert t_factor(20) == pytest.approx(2.0930, abs=1e-4)    # 20 clients
    assert t_factor(10_000) == pytest.approx(1.960, abs=1e-3)
    with pytest.raises(ValueError, match="at least 2"):
        t_factor(1)
    with pytest.raises(ValueError, match="coverage"):
        t_factor(3, coverage=1.0)


def test_t_interval_of_three_seeds_and_its_mark():
    iv = t_interval([0.01, 0.02, 0.03])                       # sd 0.01, SE 0.00577
    assert iv.n == 3 and iv.mean == pytest.approx(0.02)
    assert iv.half == pytest.approx(4.3027 * 0.01 / math.sqrt(3), rel=1e-4)
    assert not iv.excludes_zero and format_points(iv) == "+2.0 ± 2.5"
    assert format_points(t_interval([0.05, 0.06, 0.07])) == "+6.0 ± 2.5 *"
    assert format_points(t_interval([-0.05, -0.06, -0.07])) == "-6.0 ± 2.5 *"


def test_t_interval_drops_missing_values_and_says_what_it_cannot_give():
    assert format_points(t_interval([])) == "-"
    assert format_points(t_interval([None, float("nan"), 0.02])) == "+2.0"   # one value: no interval
    assert t_interval([0.02]).n == 1 and math.isnan(t_interval([0.02]).half)
    assert math.isnan(from_se(0.1, float("nan"), 5).half)


def test_paired_interval_uses_the_common_units_and_their_differences():
    a = {"0": 0.8, "1": 0.7, "2": 0.9, "3": 0.5}
    b = {"0": 0.7, "1": 0.6, "2": 0.7}
    iv = paired_interval(a, b)                                 # differences 0.1, 0.1, 0.2 over clients 0..2
    assert iv.n == 3 and iv.mean == pytest.approx(0.4 / 3)
    assert iv.half == pytest.approx(t_factor(3) * iv.se)
    assert paired_interval(a, b, units=["0", "1"]).n == 2
    assert paired_interval(a, {}).n == 0
