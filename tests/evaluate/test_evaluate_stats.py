"""Bootstrap intervals and the paired sign-flip permutation test against hand-computable cases."""

from __future__ import annotations

import numpy as np
import pytest

from memfit_gpu.evaluate.stats import (
    bootstrap_category_mean_ci,
    bootstrap_mean_ci,
    category_mean,
    paired_permutation_test,
)

# ----------------------------------------------------------------------------- bootstrap


def test_bootstrap_constant_and_single_value():
    assert bootstrap_mean_ci([0.7] * 50, n_boot=500) == (pytest.approx(0.7), pytest.approx(0.7))
    assert bootstrap_mean_ci([0.3], n_boot=500) == (pytest.approx(0.3), pytest.approx(0.3))


def test_bootstrap_two_points():
    # Resample means of {0, 1} are 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4: both 2.5 % tails
    # lie inside the point masses at 0 and 1.
    assert bootstrap_mean_ci([0.0, 1.0], n_boot=4000, seed=3) == (0.0, 1.0)


def test_bootstrap_matches_normal_approximation():
    # 200 ones and 200 zeros: the mean's standard error is sqrt(0.25 / 400) = 0.025, so the 95 %
    # interval is about 0.5 -/+ 1.96 * 0.025 = [0.451, 0.549].
    values = np.array([1.0, 0.0] * 200)
    lo, hi = bootstrap_mean_ci(values, n_boot=20_000, seed=0)
    assert lo == pytest.approx(0.451, abs=0.006)
    assert hi == pytest.approx(0.549, abs=0.006)


def test_bootstrap_seeded_and_columns_share_resamples():
    rng = np.random.default_rng(5)
    matrix = rng.random((120, 3))
    lo, hi = bootstrap_mean_ci(matrix, n_boot=3000, seed=11)
    assert lo.shape == hi.shape == (3,)
    assert np.all(lo < matrix.mean(axis=0)) and np.all(matrix.mean(axis=0) < hi)
    # The same seed draws the same resamples whatever the number of columns.
    for j in range(3):
        assert bootstrap_mean_ci(matrix[:, j], n_boot=3000, seed=11) == (
            pytest.approx(lo[j]),
            pytest.approx(hi[j]),
        )
    assert bootstrap_mean_ci(matrix[:, 0], n_boot=3000, seed=11) == bootstrap_mean_ci(
        matrix[:, 0], n_boot=3000, seed=11
    )
    assert bootstrap_mean_ci(matrix[:, 0], n_boot=3000, seed=12) != bootstrap_mean_ci(
        matrix[:, 0], n_boot=3000, seed=11
    )


def test_category_mean_and_its_stratified_bootstrap():
    # 10 questions all right in category "a", 90 all wrong in "b": the mean of category means is
    # (1 + 0) / 2 = 0.5 in every stratified resample, while the question mean is 0.1.
    values = [1.0] * 10 + [0.0] * 90
    cats = ["a"] * 10 + ["b"] * 90
    assert category_mean(values, cats) == pytest.approx(0.5)
    assert float(np.mean(values)) == pytest.approx(0.1)
    assert bootstrap_category_mean_ci(values, cats, n_boot=1000) == (pytest.approx(0.5), pytest.approx(0.5))
    # category "a" now varies: mean of {0, 1} resamples spans [0, 1], so the average spans [0, 0.5]
    values2 = [0.0, 1.0] + [0.0] * 90
    cats2 = ["a", "a"] + ["b"] * 90
    assert bootstrap_category_mean_ci(values2, cats2, n_boot=4000) == (pytest.approx(0.0), pytest.approx(0.5))


def test_bootstrap_errors():
    with pytest.raises(ValueError, match="empty"):
        bootstrap_mean_ci([])
    with pytest.raises(ValueError, match="NaN"):
        bootstrap_mean_ci([0.1, float("nan")])
    with pytest.raises(ValueError, match="3 values but 2 categories"):
        bootstrap_category_mean_ci([1, 2, 3], ["a", "b"])


# ----------------------------------------------------------------------------- permutation test


def test_all_equal_gives_p_one():
    a = [1, 0, 1, 1, 0]
    for method in ("monte_carlo", "exact"):
        result = paired_permutation_test(a, a, n_permutations=500, method=method)
        assert result["p_value"] == 1.0
        assert (result["gained"], result["lost"], result["diff"], result["n"]) == (0, 0, 0.0, 5)


def test_exact_enumeration_hand_counts():
    # d = (1, 1, 1, 1, 0): sum 4 is reached in absolute value only by all-plus and all-minus,
    # 2 of the 2^4 sign vectors of the non-zero differences: p = 2/16.
    result = paired_permutation_test([0, 0, 0, 0, 0], [1, 1, 1, 1, 0], method="exact")
    assert result["p_value"] == pytest.approx(0.125)
    assert (result["gained"], result["lost"], result["n"]) == (4, 0, 5)
    assert result["diff"] == pytest.approx(0.8)
    assert result["mean_a"] == 0.0 and result["mean_b"] == pytest.approx(0.8)
    # d = (1, 1, 1, -1, 0, 0): |sum| >= 2 for sums -4, -2, 2, 4: C(4,0)+C(4,1)+C(4,3)+C(4,4) = 10 of 16
    result = paired_permutation_test([0, 0, 0, 1, 1, 0], [1, 1, 1, 0, 1, 0], method="exact")
    assert result["p_value"] == pytest.approx(10 / 16)
    assert (result["gained"], result["lost"]) == (3, 1)
    # F1 differences (0.5, 0.25, -0.1): signed sums +-0.85, +-0.65, +-0.35, +-0.15; |.| >= 0.65 in 4 of 8
    result = paired_permutation_test([0.0, 0.5, 0.6], [0.5, 0.75, 0.5], method="exact")
    assert result["p_value"] == pytest.approx(0.5)
    assert (result["gained"], result["lost"]) == (2, 1)


def test_monte_carlo_agrees_with_exact_and_is_seeded():
    rng = np.random.default_rng(7)
    a = rng.integers(0, 2, size=40).astype(float)
    b = a.copy()
    flip = rng.choice(40, size=14, replace=False)
    b[flip[:10]] = 1 - b[flip[:10]]  # some discordant pairs in each direction
    exact = paired_permutation_test(a, b, method="exact")
    mc = paired_permutation_test(a, b, n_permutations=40_000, seed=1)
    # Monte Carlo standard error is at most sqrt(0.25 / 40000) = 0.0025
    assert mc["p_value"] == pytest.approx(exact["p_value"], abs=0.01)
    assert (mc["gained"], mc["lost"]) == (exact["gained"], exact["lost"])
    again = paired_permutation_test(a, b, n_permutations=40_000, seed=1)
    assert again == mc
    p_values = {paired_permutation_test(a, b, n_permutations=999, seed=s)["p_value"] for s in range(5)}
    assert len(p_values) > 1  # the seed does change the draws


def test_monte_carlo_plus_one_correction():
    # 30 gains and no losses: a random sign vector reaches |sum| = 30 with probability 2^-29,
    # so none of 99 draws does and p = (1 + 0) / (1 + 99).
    result = paired_permutation_test([0] * 30, [1] * 30, n_permutations=99, seed=0)
    assert result["p_value"] == pytest.approx(0.01)
    assert result["n_permutations"] == 99


def test_weighted_statistic_is_difference_of_category_means():
    a = np.array([0, 0, 1, 1, 1, 0], dtype=float)
    b = np.array([1, 0, 1, 0, 1, 1], dtype=float)
    cats = ["x", "x", "y", "y", "y", "y"]
    weights = np.array([1 / (2 * 2)] * 2 + [1 / (2 * 4)] * 4)
    result = paired_permutation_test(a, b, method="exact", weights=weights)
    # x: 0 -> 1/2, y: 3/4 -> 3/4; mean of the category differences (1/2 + 0) / 2 = 1/4
    expected = category_mean(b, cats) - category_mean(a, cats)
    assert result["diff"] == pytest.approx(expected)
    assert result["diff"] == pytest.approx(0.25)
    # the means are the statistic's own (the mean of category means), so that mean_b - mean_a is diff
    # (they were the plain question means, 1/2 and 2/3, in compare --json's category-mean block)
    assert (result["mean_a"], result["mean_b"]) == (pytest.approx(category_mean(a, cats)),
                                                    pytest.approx(category_mean(b, cats)))
    assert result["mean_b"] - result["mean_a"] == pytest.approx(result["diff"])
    # non-zero weighted differences +1/4 (x), -1/8 and +1/8 (y); signed sums of +-1/4 +-1/8 +-1/8 are
    # 1/2, 1/4, 1/4, 0, 0, -1/4, -1/4, -1/2: |.| >= 1/4 in 6 of 8
    assert result["p_value"] == pytest.approx(6 / 8)


def test_permutation_errors():
    with pytest.raises(ValueError, match="equal lengths"):
        paired_permutation_test([1, 0], [1])
    with pytest.raises(ValueError, match="at least one pair"):
        paired_permutation_test([], [])
    with pytest.raises(ValueError, match="too large"):
        paired_permutation_test([0] * 30, [1] * 30, method="exact")
    with pytest.raises(ValueError, match="unknown method"):
        paired_permutation_test([0], [1], method="bayes")
