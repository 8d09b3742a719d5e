"""pass@k (the Codex paper's unbiased estimator) and mean@k, with numbers checked by hand."""

import itertools
from math import comb

import pytest

from asyncrl.algo.evaluation import pass_at_k, score_samples


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 4, 2) == 1.0  # n - c = 1 < k: every pair holds a pass
    assert pass_at_k(4, 1, 4) == 1.0


def test_pass_at_k_is_the_fraction_of_k_subsets_that_hold_a_pass():
    for n, c, k in [(6, 2, 3), (8, 3, 2), (7, 1, 5)]:
        samples = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / comb(n, k))


def test_scores_of_an_evaluation():
    # Prompt A: 2 of 4 pass; prompt B: none, one partial 0.5 reward (not a pass).
    scores = score_samples([[1.0, 0.0, 1.0, 0.0], [0.0, 0.5, 0.0, 0.0]])
    assert scores.mean_at_k == pytest.approx(2.5 / 8)
    # pass@1 = (2/4 + 0) / 2; pass@2 = (1 - C(2,2)/C(4,2) + 0) / 2 = (5/6) / 2; pass@4 = (1 + 0) / 2.
    assert scores.pass_at == pytest.approx({1: 0.25, 2: 5 / 12, 3: 0.5, 4: 0.5})


def test_one_greedy_sample_gives_the_accuracy():
    scores = score_samples([[1.0], [0.0], [1.0]])
    assert scores.mean_at_k == pytest.approx(2 / 3) and scores.pass_at == pytest.approx({1: 2 / 3})


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError):
        score_samples([[1.0, 0.0], [1.0]])
