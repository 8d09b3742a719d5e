"""Random groups for the learner tests (no engine needed); hand-made trajectories come from
`asyncrl.testing.make_trajectory`."""

from __future__ import annotations

import numpy as np

from asyncrl.testing import make_trajectory
from asyncrl.types import Group


def random_groups(num_groups=3, group_size=2, seed=0, vocab=16, max_prompt=5, max_response=6):
    """Groups of random token sequences with random rewards and rollout log-probs; some rows have
    masked (tool) tokens and some are truncated.

    Not `asyncrl.testing.random_groups`: that one draws in another order, and the golden run's expected
    numbers depend on these exact sequences."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        members = []
        for i in range(group_size):
            prompt_len, response_len = int(rng.integers(1, max_prompt + 1)), int(rng.integers(1, max_response + 1))
            mask = rng.random(response_len) > 0.2
            prompt, response = rng.integers(3, vocab, prompt_len), rng.integers(3, vocab, response_len)
            members.append(
                make_trajectory(
                    response,
                    prompt_ids=prompt,
                    group_id=f"g{g}",
                    sample_index=i,
                    rollout_logprobs=-rng.random(response_len) * 3,
                    loss_mask=mask,
                    reward=float(rng.integers(0, 2)) if i else float(rng.random()),
                    finish_reason="stop" if rng.random() < 0.7 else "length",
                )
            )
        groups.append(Group(f"g{g}", members))
    return groups
