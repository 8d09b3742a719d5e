"""The staleness rule at its boundaries, with η = 2 unless said otherwise: every figure checkable by hand."""

import pytest

from asyncrl.staleness import Staleness

ETA = Staleness(2)


def test_a_sample_with_lag_eta_is_trainable_and_one_with_lag_eta_plus_one_is_not():
    assert ETA.trainable(min_version=3, learner_version=5)  # lag 5 - 3 = 2 = η
    assert not ETA.trainable(min_version=2, learner_version=5)  # lag 3 = η + 1
    assert ETA.trainable(min_version=5, learner_version=5)  # lag 0


def test_the_oldest_trainable_version_is_the_learner_version_minus_eta():
    assert ETA.oldest_trainable_version(5) == 3  # tokens of version 3 have lag 2; version 2 would have lag 3
    assert ETA.trainable(ETA.oldest_trainable_version(5), 5)
    assert not ETA.trainable(ETA.oldest_trainable_version(5) - 1, 5)


def test_a_step_is_the_last_chance_for_a_group_started_eta_versions_before_it():
    assert not ETA.last_chance(start_version=4, learner_version=5)  # 5 - 4 = 1 < η: step 6 may still train it
    assert ETA.last_chance(start_version=3, learner_version=5)  # 5 - 3 = 2 = η: step 6 could not
    assert ETA.last_chance(start_version=2, learner_version=5)  # already past: the gate still holds the step


def test_an_engine_aborts_a_request_only_once_its_first_token_is_more_than_eta_versions_old():
    assert not ETA.certain_to_exceed(first_version=3, served_version=5)  # 5 - 3 = 2 = η: may still be trained
    assert ETA.certain_to_exceed(first_version=2, served_version=5)  # 3 > η: any later step sees lag >= 3


def test_admission_admits_eta_plus_one_batches_ahead_of_the_admission_version():
    # v = 1, η = 2, B = 3: (1 + 2 + 1) * 3 = 12 groups; group 11 (0-based) is trained at step 11 // 3 = 3 = v + η.
    assert ETA.admission_limit(admission_version=1, batch_groups=3) == 12
    assert Staleness(0).admission_limit(admission_version=0, batch_groups=4) == 4  # sync: one batch at a time


def test_the_controller_keeps_eta_plus_two_batches_of_prompts_queued():
    assert ETA.prompts_ahead(prompts_per_step=8) == 32  # (2 + 2) * 8
    assert Staleness(0).prompts_ahead(prompts_per_step=8) == 16


def test_only_eta_zero_is_synchronous():
    assert Staleness(0).synchronous
    assert not Staleness(1).synchronous


def test_a_negative_bound_is_rejected():
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        Staleness(-1)
