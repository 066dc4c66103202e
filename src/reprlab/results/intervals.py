"""95 % intervals over seeds, chosen by what a summary key measures.

Three kinds of key, each with its interval (the method's name goes into ``summary.json`` as ``K.ci_method``
and into the report):

* ``continuous`` (the default: losses, correlations, norms, drops): Student's t interval of the mean,
  ``mean ± t(0.975, n−1)·sd/√n`` with ``ddof=1``. With 3–10 seeds a normal interval is too narrow and a
  bootstrap over so few values is unstable.
* ``proportion`` (a share of items on each seed: ASR, exact match, accuracy, compliance): the Wilson score
  interval of the mean at an effective sample size ``n_eff = p̂(1−p̂)·n / s²`` (the number of Bernoulli
  draws whose mean would vary as much as the seeds' values do: Kish's design effect, as Korn & Graubard
  (1998) use it for proportions from clustered samples), with the t quantile on ``n−1`` degrees of
  freedom. Away from 0 and 1 it matches the t interval; near them it bends inwards and never leaves [0, 1]
  (a t interval around an ASR of 0.025 over ten seeds reached −0.03). When every seed gives the same value
  there is no spread to measure and the interval is that value, as the t interval's would be.
* ``share`` (0 or 1 on each seed: a claim holding): the Wilson score interval of k successes in n seeds.

Which keys are proportions is declared, never guessed from the values: a recipe's entry module lists
``fnmatch`` patterns in ``SUMMARY_KINDS`` (e.g. ``{"*.asr_*": "proportion"}``); ``claims.<name>`` keys are
shares. A key declared a proportion whose values leave [0, 1] falls back to the t interval, and says so.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

KINDS = ("continuous", "proportion", "share")
T_METHOD = "student-t"
WILSON_EFF_METHOD = "wilson-eff"
WILSON_METHOD = "wilson"
METHOD_TEXT = {
    T_METHOD: "Student t interval of the mean over seeds (sd with ddof=1)",
    WILSON_EFF_METHOD: "Wilson score interval of the mean at the effective sample size p(1-p)·n/s² "
    "(t quantile, n-1 df); stays inside [0, 1]",
    WILSON_METHOD: "Wilson score interval of k of n seeds",
}


@dataclass(frozen=True)
class Interval:
    """A mean over seeds with its 95 % interval; ``lo``/``hi`` are ``None`` with one seed."""

    mean: float
    sd: float
    lo: float | None
    hi: float | None
    n: int
    method: str


def _t_quantile(level: float, df: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.5 + level / 2, df))


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, sd


def t_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Student's t interval of the mean of ``values``."""
    mean, sd = _mean_sd(values)
    n = len(values)
    if n < 2:
        return Interval(mean, 0.0, None, None, n, T_METHOD)
    half = _t_quantile(level, n - 1) * sd / math.sqrt(n)
    return Interval(mean, sd, mean - half, mean + half, n, T_METHOD)


def wilson_bounds(p: float, n: float, z: float) -> tuple[float, float]:
    """Wilson score interval of a proportion ``p`` observed in ``n`` draws (``n`` may be fractional or inf)."""
    if math.isinf(n):
        return p, p
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def wilson_share(values: Sequence[float], level: float = 0.95) -> Interval:
    """Wilson interval of the share of seeds on which a 0/1 value is 1."""
    from scipy import stats

    mean, sd = _mean_sd(values)
    n = len(values)
    if n < 2:
        return Interval(mean, 0.0, None, None, n, WILSON_METHOD)
    lo, hi = wilson_bounds(mean, n, float(stats.norm.ppf(0.5 + level / 2)))
    return Interval(mean, sd, lo, hi, n, WILSON_METHOD)


def wilson_mean(values: Sequence[float], level: float = 0.95) -> Interval:
    """Wilson interval of the mean of per-seed proportions at the effective sample size (module docstring)."""
    mean, sd = _mean_sd(values)
    n = len(values)
    if n < 2:
        return Interval(mean, 0.0, None, None, n, WILSON_EFF_METHOD)
    n_eff = math.inf if sd <= 1e-12 else mean * (1 - mean) * n / (sd * sd)  # equal seeds: rounding-level sd
    lo, hi = wilson_bounds(mean, n_eff, _t_quantile(level, n - 1))
    return Interval(mean, sd, lo, hi, n, WILSON_EFF_METHOD)


def kind_of(key: str, kinds: Mapping[str, str] | None) -> str:
    """The declared kind of a summary key: ``claims.*`` are shares, then the first matching pattern."""
    if key.startswith("claims."):
        return "share"
    for pattern, kind in (kinds or {}).items():
        if fnmatch.fnmatchcase(key, pattern):
            return kind
    return "continuous"


def interval(values: Sequence[float], kind: str = "continuous", level: float = 0.95) -> Interval:
    """The interval of ``values`` for a key of ``kind`` (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"unknown summary-key kind {kind!r}; expected one of {KINDS}")
    if kind != "continuous" and all(0.0 <= v <= 1.0 for v in values):
        if kind == "share" and all(v in (0.0, 1.0) for v in values):
            return wilson_share(values, level)
        return wilson_mean(values, level)
    res = t_interval(values, level)
    if kind != "continuous":  # a declared proportion outside [0, 1]: the declaration is wrong, say so
        return Interval(
            res.mean, res.sd, res.lo, res.hi, res.n, f"{T_METHOD} (declared {kind}, values outside [0, 1])"
        )
    return res


def check_kinds(kinds: Mapping[str, str], where: str) -> None:
    """Refuse a ``SUMMARY_KINDS`` mapping with an unknown kind, naming where it was declared."""
    from reprlab.errors import ConfigError

    for pattern, kind in kinds.items():
        if kind not in KINDS:
            raise ConfigError(f"{where}: SUMMARY_KINDS[{pattern!r}] = {kind!r}; expected one of {KINDS}")
