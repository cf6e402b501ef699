"""Chi-square tests for sampling distributions (no scipy: the survival function is torch's regularized upper
incomplete gamma)."""
from __future__ import annotations

from collections import Counter

import torch


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def goodness_of_fit(samples: list, expected: dict, min_expected: float = 5.0) -> float:
    """p-value of ``samples`` (hashable outcomes) drawn from ``expected`` (outcome -> probability). Outcomes expected
    fewer than ``min_expected`` times are pooled into one cell, as the test's approximation needs."""
    n = len(samples)
    counts = Counter(samples)
    assert set(counts) <= {k for k, p in expected.items() if p > 0}, \
        f"outcomes the distribution cannot produce: {sorted(set(counts) - set(expected))[:5]}"
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for k, p in expected.items():
        if p * n >= min_expected:
            cells.append((counts.get(k, 0), p * n))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts.get(k, 0), pooled_exp + p * n
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return chi2_sf(stat, len(cells) - 1)


def homogeneity(a: list, b: list, min_expected: float = 5.0) -> float:
    """p-value that two samples of outcomes come from one distribution (chi-square test of homogeneity; rare
    outcomes pooled)."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    cells, pool = [], [0, 0]
    for k in set(ca) | set(cb):
        tot = ca.get(k, 0) + cb.get(k, 0)
        if tot * min(na, nb) / (na + nb) >= min_expected:
            cells.append((ca.get(k, 0), cb.get(k, 0)))
        else:
            pool[0] += ca.get(k, 0)
            pool[1] += cb.get(k, 0)
    if sum(pool):
        cells.append(tuple(pool))
    stat = 0.0
    for oa, ob in cells:
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    return chi2_sf(stat, len(cells) - 1)
