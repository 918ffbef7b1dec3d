"""Confidence intervals for benchmark tables: Student's t over a few seeds or over clients.

With ``n`` independent measurements (seeds of a run, or one paired difference per client) the 95 %
interval of their mean is ``mean ± t_{0.975, n-1} · sd / sqrt(n)`` (Student 1908; any statistics
text, e.g. Wasserman, *All of Statistics*, Sec. 10.4), not ``± 2 SE``: with 3 seeds the factor is
4.30, with 20 clients 2.09. A difference is *marked* only when that interval excludes 0.
``scipy.stats`` is imported inside :func:`t_factor` (heavy: about 60 MB resident), so a module that
imports this one for its types loads nothing until it computes an interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

#: the two-sided coverage every interval of this module has
COVERAGE = 0.95


@lru_cache(maxsize=256)
def t_factor(n: int, coverage: float = COVERAGE) -> float:
    """Student's t quantile ``t_{(1+coverage)/2, n-1}``: the half-width of a mean's interval in SEs.

    ``n``: the number of measurements (>= 2; the degrees of freedom are ``n - 1``). ``t_factor(3)``
    is 4.303, ``t_factor(20)`` 2.093; it tends to 1.960 as ``n`` grows. Raises ``ValueError`` for
    ``n < 2`` (one measurement has no spread) or a coverage outside (0, 1).
    """
    if n < 2:
        raise ValueError(f"a t interval needs at least 2 measurements, got {n}")
    if not 0 < coverage < 1:
        raise ValueError(f"coverage must be in (0, 1), got {coverage}")
    # scipy.stats: heavy (~60 MB resident), loaded only when an interval is computed
    from scipy.stats import t  # noqa: PLC0415

    return float(t.ppf(0.5 + coverage / 2, n - 1))


class Interval(NamedTuple):
    """A mean with its t interval: ``mean ± half`` (``half`` = t_{0.975, n-1} · SE), over ``n`` values.

    ``half`` is ``nan`` when ``n < 2``; ``mean`` is ``nan`` when ``n == 0``.
    """

    mean: float
    se: float
    n: int
    half: float

    @property
    def excludes_zero(self) -> bool:
        """True when the interval lies wholly above or below 0 (the difference is marked)."""
        return not math.isnan(self.half) and abs(self.mean) > self.half


def from_se(mean: float, se: float, n: int, coverage: float = COVERAGE) -> Interval:
    """The t interval of a mean whose standard error ``se`` came from ``n`` values (``n - 1`` d.o.f.)."""
    half = t_factor(n, coverage) * se if n >= 2 and not math.isnan(se) else float("nan")
    return Interval(mean, se, n, half)


def t_interval(values: Sequence[float], coverage: float = COVERAGE) -> Interval:
    """Mean of ``values`` (NaN and None dropped) with its t interval over ``len - 1`` degrees of freedom.

    ``values``: one number per independent unit (seed, client), any unit (accuracy, points). No
    value: mean ``nan``; one value: that value, ``half`` ``nan``.
    """
    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return Interval(float("nan"), float("nan"), 0, float("nan"))
    if len(xs) == 1:
        return Interval(xs[0], float("nan"), 1, float("nan"))
    se = statistics.stdev(xs) / math.sqrt(len(xs))
    return from_se(statistics.mean(xs), se, len(xs), coverage)


def paired_interval(a: dict, b: dict, units: Sequence | None = None, coverage: float = COVERAGE) -> Interval:
    """The t interval of ``a[u] - b[u]`` over the units both have (or those of ``units``): a paired test.

    ``a``, ``b``: unit id (a client, a seed) -> value. Pairing removes what the units share (a client's
    test split, a seed's partition), so the interval is over ``n - 1`` d.o.f. of the differences.
    """
    common = (set(a) & set(b)) if units is None else (set(units) & set(a) & set(b))
    return t_interval([a[u] - b[u] for u in sorted(common, key=str)], coverage)


def format_points(iv: Interval, star: bool = True) -> str:
    """``+1.2 ± 0.8 *`` in points (100 x): the mean, the t half-width, ``*`` when it excludes 0; ``-`` for no
    value, the mean alone for one."""
    if math.isnan(iv.mean):
        return "-"
    if math.isnan(iv.half):
        return f"{100 * iv.mean:+.1f}"
    return f"{100 * iv.mean:+.1f} ± {100 * iv.half:.1f}{' *' if star and iv.excludes_zero else ''}"
