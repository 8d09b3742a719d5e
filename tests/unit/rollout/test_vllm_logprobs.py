"""Reading vLLM's per-token log-probs (`vllm_compat.sampled_logprobs` / `top_logprobs`): the flat layout that
`Engine.generate` asks for and the per-position dicts give the same numbers, built here by vLLM's own append
function exactly as its output processor does (sampled token first, then the top-k by rank)."""

from __future__ import annotations

import pytest
from vllm.logprobs import FlatLogprobs, append_logprobs_for_next_position

from asyncrl.rollout import vllm_compat

# (sampled token, its rank, its log-prob), then the top-2 (token, log-prob) of the position.
POSITIONS = [((7, 1, -0.1), [(7, -0.1), (3, -2.5)]), ((4, 3, -3.0), [(9, -0.2), (5, -1.9)]), ((9, 2, -0.9), [(2, -0.7), (9, -0.9)])]
SAMPLED = [7, 4, 9]


def _both(k: int):
    flat, dicts = FlatLogprobs(), []
    for (token, rank, logprob), top in POSITIONS:
        ids, values = [token, *(t for t, _ in top[:k])], [logprob, *(v for _, v in top[:k])]
        for container in (flat, dicts):
            append_logprobs_for_next_position(container, ids, values, [None] * len(ids), rank, k)
    return flat, dicts


@pytest.mark.parametrize("k", [0, 2])
def test_flat_and_dict_log_probs_read_the_same_sampled_and_top_k_values(k):
    flat, dicts = _both(k)
    assert vllm_compat.sampled_logprobs(flat, SAMPLED) == vllm_compat.sampled_logprobs(dicts, SAMPLED) == [-0.1, -3.0, -0.9]
    top = vllm_compat.top_logprobs(flat, k)
    assert top == vllm_compat.top_logprobs(dicts, k)
    if k == 2:  # the sampled token of position 1 (rank 3) is not among the top 2; position 2's is (rank 2)
        assert top == [{7: -0.1, 3: -2.5}, {9: -0.2, 5: -1.9}, {2: -0.7, 9: -0.9}]


def test_a_flat_layout_whose_first_entry_is_not_the_sampled_token_is_refused():
    flat, _ = _both(0)
    with pytest.raises(RuntimeError, match="sampled token first"):
        vllm_compat.sampled_logprobs(flat, [7, 5, 9])
