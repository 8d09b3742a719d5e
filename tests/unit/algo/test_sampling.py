"""The processed sampling distribution (temperature -> top-k -> top-p, vLLM semantics) on a 4-token vocab."""

import math

import pytest
import torch

from asyncrl.algo.sampling import RAW, SamplingDistribution, in_support, logprob_gap, processed_logits, token_logprobs

# p = [0.1, 0.2, 0.3, 0.4]: ascending cumulative mass 0.1, 0.3, 0.6, 1.0.
LOGITS = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()


def probs(dist: SamplingDistribution, logits: torch.Tensor = LOGITS) -> list[float]:
    return torch.softmax(processed_logits(logits, dist), dim=-1).tolist()


def test_nothing_truncated_is_the_plain_softmax_at_the_temperature():
    assert probs(RAW) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    # T = 0.5 squares the probabilities: [1, 4, 9, 16] / 30.
    assert probs(SamplingDistribution(temperature=0.5)) == pytest.approx([1 / 30, 4 / 30, 9 / 30, 16 / 30])
    assert not RAW.truncates and SamplingDistribution(top_k=3).truncates and SamplingDistribution(top_p=0.9).truncates


def test_top_k_keeps_the_k_largest_and_renormalises():
    assert probs(SamplingDistribution(top_k=2)) == pytest.approx([0, 0, 3 / 7, 4 / 7])  # 0.3 / 0.7, 0.4 / 0.7
    assert probs(SamplingDistribution(top_k=4)) == pytest.approx([0.1, 0.2, 0.3, 0.4])  # k = vocab: off
    # After temperature: T = 0.5 gives [1, 4, 9, 16] / 30, top-2 -> [9, 16] / 25.
    assert probs(SamplingDistribution(temperature=0.5, top_k=2)) == pytest.approx([0, 0, 9 / 25, 16 / 25])


def test_top_k_keeps_every_token_tied_with_the_kth():
    # logits [1, 1, 1, 0], k = 2: the 2nd largest is 1, so all three 1s stay (vLLM: drop only logits < kth).
    assert probs(SamplingDistribution(top_k=2), torch.tensor([1.0, 1.0, 1.0, 0.0])) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0])


def test_top_p_drops_the_least_likely_tail_of_mass_at_most_one_minus_p():
    # 1 - 0.75 = 0.25: only the 0.1 tail is <= 0.25 -> [0.2, 0.3, 0.4] / 0.9.
    assert probs(SamplingDistribution(top_p=0.75)) == pytest.approx([0, 2 / 9, 3 / 9, 4 / 9])
    # 1 - 0.5 = 0.5: tails 0.1 and 0.3 go -> [0.3, 0.4] / 0.7.
    assert probs(SamplingDistribution(top_p=0.5)) == pytest.approx([0, 0, 3 / 7, 4 / 7])
    # The most likely token always stays, even when top_p is tiny.
    assert probs(SamplingDistribution(top_p=0.01)) == pytest.approx([0, 0, 0, 1])


def test_top_p_acts_on_what_top_k_kept_renormalised():
    # top-2 -> [3/7, 4/7] = [0.43, 0.57]; then 1 - 0.5 = 0.5 drops the 0.43 tail -> only token 3. (top-p alone
    # on the original distribution would keep tokens 2 and 3: the order matters.)
    assert probs(SamplingDistribution(top_k=2, top_p=0.5)) == pytest.approx([0, 0, 0, 1])
    assert probs(SamplingDistribution(top_p=0.5)) == pytest.approx([0, 0, 3 / 7, 4 / 7])


def test_token_logprobs_are_the_renormalised_log_probs_and_minus_inf_outside():
    logits = LOGITS.expand(3, 4)
    got = token_logprobs(logits, torch.tensor([3, 2, 0]), SamplingDistribution(top_k=2))
    assert got[:2].tolist() == pytest.approx([math.log(4 / 7), math.log(3 / 7)])
    assert got[2].item() == float("-inf")


def test_a_token_outside_the_support_leaves_the_mask_and_gets_no_gradient():
    logits = LOGITS.clone().expand(2, 4).clone().requires_grad_(True)
    learner = token_logprobs(logits, torch.tensor([3, 0]), SamplingDistribution(top_k=2))  # [log 4/7, -inf]
    old = torch.tensor([math.log(0.5), math.log(0.1)])
    mask, (learner_kept, old_kept) = in_support(torch.tensor([True, True]), [learner, old])
    assert mask.tolist() == [True, False]
    assert old_kept.tolist() == pytest.approx([math.log(0.5), 0.0])
    (learner_kept * mask).sum().backward()
    assert torch.isfinite(logits.grad).all()
    # d log(4/7) / d logits over the kept set {2, 3}: one-hot(3) - [0, 0, 3/7, 4/7]; the dropped row gets 0.
    assert logits.grad[0].tolist() == pytest.approx([0, 0, -3 / 7, 3 / 7])
    assert logits.grad[1].tolist() == [0, 0, 0, 0]


def test_logprob_gap_treats_minus_inf_on_both_sides_as_agreement():
    inf = float("-inf")
    assert logprob_gap([-1.0, inf], [-1.25, inf]) == 0.25
    assert logprob_gap([-1.0, inf], [-1.0, -3.0]) == float("inf")


def test_an_impossible_distribution_is_rejected():
    with pytest.raises(ValueError, match="top_p"):
        SamplingDistribution(top_p=0.0)
