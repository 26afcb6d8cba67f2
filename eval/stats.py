"""Statistics for paired accuracy comparisons: one arm against another on the same problems.

Two arms that answer the same problems are compared by the per-problem difference of their 0/1 scores, not by two
separate accuracies: the problems both get right (or both wrong) carry no information about the difference, so the
paired interval is much narrower than two independent ones. Intervals are percentile bootstraps over problems
(seeded: the same records always give the same interval); McNemar's exact test counts the discordant problems.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_SAMPLES = 10_000


def wilson_interval(correct: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion correct/n: (p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)."""
    if n == 0:
        return math.nan, math.nan
    z = normal_quantile(0.5 + confidence / 2)
    p = correct / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    scale = 1 + z * z / n
    return max((centre - half) / scale, 0.0), min((centre + half) / scale, 1.0)


def normal_quantile(q: float) -> float:
    """Φ⁻¹(q) by bisection on Φ(x) = (1 + erf(x/√2)) / 2 (exact to 1e-12; no scipy needed)."""
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if (1 + math.erf(mid / math.sqrt(2))) / 2 < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Two-sided exact McNemar p-value: under H0 each of the n = b + c discordant problems favours either arm with
    probability 1/2, so p = min(1, 2 · P(Binomial(n, 1/2) <= min(b, c)))."""
    n = only_first + only_second
    if n == 0:
        return 1.0
    k = min(only_first, only_second)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def bootstrap_indices(n: int, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> np.ndarray:
    """(samples, n) problem indices drawn with replacement: one resampled benchmark per row."""
    return np.random.default_rng(seed).integers(0, n, size=(samples, n))


def percentile_interval(values: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    alpha = (1 - confidence) / 2
    low, high = np.quantile(values, [alpha, 1 - alpha])
    return float(low), float(high)


@dataclass(frozen=True)
class PairedDifference:
    """second − first accuracy over the same problems, with its paired bootstrap interval and McNemar's test."""

    problems: int
    difference: float       # mean of (second − first) scores: accuracy(second) − accuracy(first)
    low: float
    high: float
    only_first: int         # problems only the first arm got right
    only_second: int        # problems only the second arm got right
    p_value: float          # McNemar exact, two-sided


def paired_difference(first: list[bool], second: list[bool], confidence: float = 0.95, seed: int = 0,
                      samples: int = BOOTSTRAP_SAMPLES) -> PairedDifference:
    """first[i], second[i]: the two arms' scores on problem i."""
    if len(first) != len(second):
        raise ValueError(f"paired scores need the same problems: {len(first)} vs {len(second)}")
    a, b = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    n = len(a)
    if n == 0:
        return PairedDifference(0, math.nan, math.nan, math.nan, 0, 0, 1.0)
    d = b - a
    low, high = percentile_interval(d[bootstrap_indices(n, samples, seed)].mean(axis=1), confidence)
    only_first, only_second = int((d < 0).sum()), int((d > 0).sum())
    return PairedDifference(n, float(d.mean()), low, high, only_first, only_second,
                            mcnemar_exact(only_first, only_second))


def paired_speedup(tokens: list[int], seconds: list[float], base_tokens: list[int], base_seconds: list[float],
                   confidence: float = 0.95, seed: int = 0, samples: int = BOOTSTRAP_SAMPLES):
    """(ratio, low, high): tokens/s of an arm over tokens/s of the base arm on the same problems,
    (Σ tokens / Σ seconds) / (Σ base tokens / Σ base seconds), with a paired bootstrap interval over problems."""
    t, s = np.asarray(tokens, dtype=float), np.asarray(seconds, dtype=float)
    bt, bs = np.asarray(base_tokens, dtype=float), np.asarray(base_seconds, dtype=float)
    if len(t) == 0 or s.sum() == 0 or bs.sum() == 0:
        return math.nan, math.nan, math.nan
    ratio = (t.sum() / s.sum()) / (bt.sum() / bs.sum())
    idx = bootstrap_indices(len(t), samples, seed)
    ratios = (t[idx].sum(1) / s[idx].sum(1)) / (bt[idx].sum(1) / bs[idx].sum(1))
    low, high = percentile_interval(ratios, confidence)
    return float(ratio), low, high


def paired_answer_time(seconds: list[float], base_seconds: list[float], confidence: float = 0.95, seed: int = 0,
                       samples: int = BOOTSTRAP_SAMPLES):
    """(ratio, low, high): time per finished answer, the base arm's over this arm's on the same problems,
    Σ base seconds / Σ seconds (> 1: this arm finishes the answers sooner, replies that grow included), with a paired
    bootstrap interval over problems."""
    s, bs = np.asarray(seconds, dtype=float), np.asarray(base_seconds, dtype=float)
    if len(s) == 0 or s.sum() == 0:
        return math.nan, math.nan, math.nan
    idx = bootstrap_indices(len(s), samples, seed)
    low, high = percentile_interval(bs[idx].sum(1) / s[idx].sum(1), confidence)
    return float(bs.sum() / s.sum()), low, high


def repeated_ngram_share(words: list[str], n: int = 4) -> float:
    """The share of a reply's word n-grams that already occurred earlier in it: 0 for a reply that never repeats
    itself, near 1 for one that loops; 0 for a reply shorter than n words."""
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0
