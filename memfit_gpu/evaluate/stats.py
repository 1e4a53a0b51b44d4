"""Uncertainty for reported numbers and for configuration comparisons (SPEC "Evaluation").

- Percentile bootstrap 95 % intervals for a mean and for the mean of category means (the LoCoMo
  "Average"). Resamples are drawn as multinomial counts, so every resample of every metric column is
  one matrix product: counts [B, n] @ values [n, m] / n.
- Paired sign-flip permutation test over per-question values (judge verdicts 0/1, or F1): under
  the null hypothesis that configurations A and B are exchangeable for each question, the sign of
  each difference b_i - a_i is a fair coin. Sign vectors are drawn (or, on request, enumerated) in
  blocks and applied as one matrix product.

Everything is seeded with numpy's Generator(PCG64(seed)): the same inputs and seed give the same
interval and p-value on every machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

_BLOCK = 2048  # resamples / sign vectors per matrix product: bounds memory at B x n


def _as_matrix(values: Sequence[float] | np.ndarray) -> tuple[np.ndarray, bool]:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim not in (1, 2):
        raise ValueError(f"values must be [n] or [n, metrics], got shape {array.shape}")
    if array.shape[0] == 0:
        raise ValueError("cannot bootstrap an empty set of values")
    if not np.all(np.isfinite(array)):
        raise ValueError("values contain NaN or infinity")
    return (array[:, None], True) if array.ndim == 1 else (array, False)


def _resampled_means(values: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """[n_boot, m] means of bootstrap resamples of the rows of `values` [n, m]."""
    n = values.shape[0]
    uniform = np.full(n, 1.0 / n)
    out = np.empty((n_boot, values.shape[1]))
    for start in range(0, n_boot, _BLOCK):
        stop = min(start + _BLOCK, n_boot)
        counts = rng.multinomial(n, uniform, size=stop - start)
        out[start:stop] = counts @ values / n
    return out


def _interval(boot: np.ndarray, level: float, squeeze: bool) -> tuple[Any, Any]:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(boot, [tail, 1.0 - tail], axis=0)
    return (float(lo[0]), float(hi[0])) if squeeze else (lo, hi)


def bootstrap_mean_ci(
    values: Sequence[float] | np.ndarray, n_boot: int = 10_000, seed: int = 0, level: float = 0.95
) -> tuple[Any, Any]:
    """Percentile bootstrap interval of the mean. values [n] -> (lo, hi) floats; [n, m] -> arrays [m]."""
    matrix, squeeze = _as_matrix(values)
    rng = np.random.Generator(np.random.PCG64(seed))
    return _interval(_resampled_means(matrix, n_boot, rng), level, squeeze)


def bootstrap_category_mean_ci(
    values: Sequence[float] | np.ndarray,
    categories: Sequence[str],
    n_boot: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[Any, Any]:
    """Percentile interval of the mean of category means, resampling within each category.

    The category sizes are fixed by the benchmark, so each resample keeps them (stratified
    bootstrap); the statistic is the unweighted mean over categories of each category's mean.
    """
    matrix, squeeze = _as_matrix(values)
    labels = np.asarray([str(c) for c in categories])
    if labels.shape[0] != matrix.shape[0]:
        raise ValueError(f"{matrix.shape[0]} values but {labels.shape[0]} categories")
    rng = np.random.Generator(np.random.PCG64(seed))
    groups = sorted(set(labels.tolist()))  # fixed order: the seed then fixes every draw
    boot = np.zeros((n_boot, matrix.shape[1]))
    for group in groups:
        boot += _resampled_means(matrix[labels == group], n_boot, rng)
    return _interval(boot / len(groups), level, squeeze)


def category_mean(values: Sequence[float] | np.ndarray, categories: Sequence[str]) -> Any:
    """Unweighted mean over categories of the per-category means (float for [n], array for [n, m])."""
    matrix, squeeze = _as_matrix(values)
    labels = np.asarray([str(c) for c in categories])
    means = np.stack([matrix[labels == g].mean(axis=0) for g in sorted(set(labels.tolist()))])
    result = means.mean(axis=0)
    return float(result[0]) if squeeze else result


def _sign_blocks_exact(k: int):
    """Every one of the 2**k sign vectors, in blocks of [<=_BLOCK*8, k] (+1/-1)."""
    bits = np.arange(k, dtype=np.int64)
    total = 1 << k
    step = _BLOCK * 8
    for start in range(0, total, step):
        codes = np.arange(start, min(start + step, total), dtype=np.int64)
        yield 1.0 - 2.0 * ((codes[:, None] >> bits) & 1)


def _sign_blocks_random(k: int, n_permutations: int, rng: np.random.Generator):
    for start in range(0, n_permutations, _BLOCK):
        size = min(_BLOCK, n_permutations - start)
        yield 1.0 - 2.0 * rng.integers(0, 2, size=(size, k), dtype=np.int8)


def paired_permutation_test(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    n_permutations: int = 10_000,
    seed: int = 0,
    method: str = "monte_carlo",
    weights: Sequence[float] | np.ndarray | None = None,
) -> dict[str, Any]:
    """Two-sided paired sign-flip permutation test of B against A.

    Statistic: T = sum_i w_i (b_i - a_i), w_i = 1/n by default (the difference of means; pass
    w_i = 1 / (n_categories * n_category(i)) for the difference of category means).
    method "monte_carlo": p = (1 + #{|T*| >= |T|}) / (1 + n_permutations), the +1 counting the
    observed labelling, so p is never 0. method "exact": every sign vector of the non-zero
    differences is enumerated (at most 24 of them), p = #{|T*| >= |T|} / 2**k.
    Returns {"p_value", "diff" (T), "mean_a", "mean_b", "gained" (b_i > a_i, i.e. A wrong -> B
    right for verdicts), "lost" (b_i < a_i), "n", "method", "n_permutations"}.
    """
    a_values = np.asarray(a, dtype=np.float64).ravel()
    b_values = np.asarray(b, dtype=np.float64).ravel()
    if a_values.shape != b_values.shape:
        raise ValueError(f"paired test needs equal lengths, got {a_values.size} and {b_values.size}")
    n = a_values.size
    if n == 0:
        raise ValueError("paired test needs at least one pair")
    if not (np.all(np.isfinite(a_values)) and np.all(np.isfinite(b_values))):
        raise ValueError("paired test values contain NaN or infinity")
    w = np.full(n, 1.0 / n) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    if w.shape != (n,):
        raise ValueError(f"weights must have one entry per pair ({n}), got {w.size}")

    diffs = b_values - a_values
    observed = float(diffs @ w)
    nonzero = diffs != 0
    weighted = diffs[nonzero] * w[nonzero]  # only non-zero differences can change sign
    k = int(weighted.size)
    # Sums of the same terms in another order differ by rounding only; the tolerance keeps a
    # permuted statistic equal to the observed one from being counted as smaller.
    tolerance = 1e-9 * max(1.0, float(np.abs(weighted).sum()))
    threshold = abs(observed) - tolerance

    if method == "exact":
        if k > 24:
            raise ValueError(f"exact enumeration of 2**{k} sign vectors is too large; use monte_carlo")
        extreme = sum(
            int(np.count_nonzero(np.abs(block @ weighted) >= threshold)) for block in _sign_blocks_exact(k)
        )
        p_value = extreme / float(1 << k)
        draws = 1 << k
    elif method == "monte_carlo":
        if n_permutations < 1:
            raise ValueError(f"n_permutations must be positive, got {n_permutations}")
        rng = np.random.Generator(np.random.PCG64(seed))
        extreme = sum(
            int(np.count_nonzero(np.abs(block @ weighted) >= threshold))
            for block in _sign_blocks_random(k, n_permutations, rng)
        )
        p_value = (1 + extreme) / (1 + n_permutations)
        draws = n_permutations
    else:
        raise ValueError(f"unknown method {method!r}; choose monte_carlo or exact")

    return {
        "p_value": float(p_value),
        "diff": observed,
        # the statistic's own means (weighted ones with weights): mean_b - mean_a is diff
        "mean_a": float(a_values.mean() if weights is None else a_values @ w),
        "mean_b": float(b_values.mean() if weights is None else b_values @ w),
        "gained": int(np.count_nonzero(b_values > a_values)),
        "lost": int(np.count_nonzero(b_values < a_values)),
        "n": int(n),
        "method": method,
        "n_permutations": int(draws),
    }
