"""Small hand-made groups for the learner tests (no engine needed)."""

from __future__ import annotations

import numpy as np

from asyncrl.types import Group, Trajectory


def trajectory(prompt, response, logprobs=None, loss_mask=None, reward=0.0, group="g0", index=0, finish="stop", version=0):
    n = len(response)
    return Trajectory(
        prompt_id=group,
        group_id=group,
        sample_index=index,
        prompt_ids=np.asarray(prompt, np.int32),
        response_ids=np.asarray(response, np.int32),
        rollout_logprobs=np.asarray(logprobs if logprobs is not None else [-1.0] * n, np.float32),
        loss_mask=np.asarray(loss_mask if loss_mask is not None else [1] * n, np.int8),
        versions=np.full(n, version, np.int32),
        finish_reason=finish,
        reward=reward,
    )


def random_groups(num_groups=3, group_size=2, seed=0, vocab=16, max_prompt=5, max_response=6, version=0):
    """Groups of random token sequences with random rewards and rollout log-probs; some rows have
    masked (tool) tokens and some are truncated."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        members = []
        for i in range(group_size):
            prompt_len, response_len = int(rng.integers(1, max_prompt + 1)), int(rng.integers(1, max_response + 1))
            mask = (rng.random(response_len) > 0.2).astype(np.int8)
            members.append(
                trajectory(
                    rng.integers(3, vocab, prompt_len),
                    rng.integers(3, vocab, response_len),
                    logprobs=-rng.random(response_len) * 3,
                    loss_mask=mask,
                    reward=float(rng.integers(0, 2)) if i else float(rng.random()),
                    group=f"g{g}",
                    index=i,
                    finish="stop" if rng.random() < 0.7 else "length",
                    version=version,
                )
            )
        groups.append(Group(f"g{g}", members))
    return groups
