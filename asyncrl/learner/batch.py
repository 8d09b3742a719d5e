"""From `list[Group]` to padded tensors, and from one optimizer batch to ranks and micro-batches.

Alignment (the one convention every learner tensor follows): row `b` holds the token sequence
`s = prompt_ids + response_ids` right-padded to width `L`. The causal LM's output at position `t` predicts
token `s[t+1]`, so every per-token tensor is indexed by the *predicting* position:

    loss_mask[b, t]        = 1  iff  s[t+1] is a response token whose trajectory loss_mask is 1
    rollout_logprobs[b, t] = log mu(s[t+1] | s[:t+1])           (the engine's log-prob of that token)
    learner_logprobs[b, t] = log pi(s[t+1] | s[:t+1])           (computed by the learner, same layout)

Response token `j` (at sequence position `P + j`) therefore sits at column `P - 1 + j`; the last column of
a row (`seq_len - 1`) and the padding never carry loss. A critic's value at column `t` is V of the state
`s[:t+1]`, i.e. the value before emitting the token the column scores, which is what GAE needs.

Exactness (architecture invariant 5): `token_weights` are computed ONCE over the whole optimizer batch
(`asyncrl.algo.recipes.compute_token_weights`), and outcome advantages once over the whole rollout batch
(they need all rewards of a group and, for `batch_norm`, of the batch). With `learner.mini_batches` > 1
the rollout batch is cut into mini-batches of whole groups (`split_mini_batches`): the advantages stay
those of the rollout batch, the weights are recomputed over each mini-batch, which is one optimizer
batch. Splitting rows across ranks or micro-batches slices those tensors; summing the slices' losses gives
the optimizer batch's loss. Critic advantages (GAE, VAPO) need the critic's values and are computed per
sequence on the rank (`advantages` is zero here for them).

Packed micro-batches (`asyncrl.learner.packing`) keep these rows for every loss tensor; only the model's forward runs
on the packed layout (`TrainBatch.layout`), whose log-probs and values are gathered back into this alignment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import numpy as np
import torch

from asyncrl.types import Group, Trajectory

if TYPE_CHECKING:
    from asyncrl.learner.packing import PackedLayout

__all__ = [
    "CRITIC_ADVANTAGES",
    "TrainBatch",
    "build_batch",
    "dummy_microbatch",
    "loss_needs_whole_groups",
    "micro_batches",
    "split_mini_batches",
    "split_rows",
]

# Advantage estimators that need critic values (computed on the rank, per sequence).
CRITIC_ADVANTAGES = ("gae", "vapo")


def loss_needs_whole_groups(recipe) -> bool:
    """GVPO's loss couples the sequences of a group (mean of the implicit rewards), so a group may not be
    split across ranks or micro-batches. Every other surrogate is per token or per sequence."""
    return recipe.loss == "gvpo"


@dataclass
class TrainBatch:
    """Padded rows of one optimizer batch (or of a rank's / micro-batch's share of it).

    Invariant: every [B, L] tensor uses the predicting-position alignment of the module docstring;
    `token_weights` and `value_weights` were computed over the WHOLE optimizer batch, so summing
    `(per_token_loss * token_weights)` over any partition of the rows gives the batch loss; `group_ids`
    are dense ids in [0, num_groups) of the whole batch; padding has attention_mask 0, loss_mask 0 and
    weight 0. `L == max(seq_lens)` (rows are trimmed on selection).
    """

    input_ids: torch.Tensor  # int64 [B, L]
    attention_mask: torch.Tensor  # int64 [B, L], 1 on the seq_len real tokens
    position_ids: torch.Tensor  # int64 [B, L], 0..seq_len-1 then 0 on padding
    loss_mask: torch.Tensor  # bool [B, L]
    rollout_logprobs: torch.Tensor  # float32 [B, L], 0 where loss_mask is 0
    advantages: torch.Tensor  # float32 [B, L]; outcome advantages, zeros for critic estimators
    token_weights: torch.Tensor  # float32 [B, L]; the policy loss reduction of the whole batch
    value_weights: torch.Tensor  # float32 [B, L]; token-mean weights of the whole batch (critic loss)
    rewards: torch.Tensor  # float32 [B], task reward plus the recipe's shaping (`shape_rewards`)
    group_ids: torch.Tensor  # int64 [B], dense over the whole batch
    dones: torch.Tensor  # bool [B], `is_terminal` (False = truncated: GAE bootstraps)
    seq_lens: torch.Tensor  # int64 [B], prompt + response tokens
    num_groups: int
    lags: torch.Tensor | None = None  # int64 [B], each row's policy lag (per-lag mismatch figures); None = unknown
    routed_experts: torch.Tensor | None = None
    """int16 [B, L, moe_layers, top_k]: the engine's experts for the token AT position t (not the predicting-position
    alignment: a route belongs to the token the layer processes), -1 where none was recorded (the learner routes that
    token itself: `asyncrl.learner.routing`); None when no trajectory of the batch carries routes."""
    prompt_lens: torch.Tensor | None = None  # int64 [B], prompt tokens of each row; None = unknown (never shared)
    layout: PackedLayout | None = None
    """The packed forward of these rows (`asyncrl.learner.packing`), set on a packed micro-batch; None = padded rows."""

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens, prompt included: the unit of the micro-batch budget and rank balance."""
        return int(self.seq_lens.sum())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_slots(self) -> int:
        """Tokens the forward computes, padding included: B x L padded, the bins' slots packed."""
        return self.layout.slots if self.layout is not None else int(self.input_ids.numel())

    def select(self, rows: Sequence[int]) -> TrainBatch:
        """The given rows (in that order), trimmed to their longest sequence."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        width = int(self.seq_lens[index].max()) if len(index) else 0
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value[index]
                if value.dim() >= 2:  # [B, L, ...] per-position tensors
                    value = value[:, :width]
            fields[f.name] = value
        return TrainBatch(**dict(fields, layout=None))


def build_batch(groups: Sequence[Group], recipe, lags: Sequence[int] | None = None) -> TrainBatch:
    """Pad the trajectories of `groups` into one TrainBatch and compute the whole-batch quantities:
    shaped rewards (the recipe's DAPO overlong penalty on response lengths), outcome advantages (unless
    the recipe's estimator needs a critic) and the reduction weights.

    `recipe` is an `asyncrl.algo.recipes.Recipe`. When `recipe.denominator_after_rejection` is set the
    weights here count the mask before rejection; the learner recomputes them from its own old log-probs
    with statistics all-reduced across ranks. `lags` (one per trajectory, `Batch.lags`) lets the learner split
    its mismatch figures by staleness bucket.
    """
    from asyncrl.algo.recipes import compute_advantages, shape_rewards

    trajectories = [(g, t) for g, group in enumerate(groups) for t in group.trajectories]
    if not trajectories:
        raise ValueError("build_batch: no trajectories")
    seq_lens = [len(t.prompt_ids) + len(t.response_ids) for _, t in trajectories]
    num_rows, width = len(trajectories), max(seq_lens)

    input_ids = np.zeros((num_rows, width), np.int64)
    attention_mask = np.zeros((num_rows, width), np.int64)
    position_ids = np.zeros((num_rows, width), np.int64)
    loss_mask = np.zeros((num_rows, width), bool)
    rollout_logprobs = np.zeros((num_rows, width), np.float32)
    for b, (_, t) in enumerate(trajectories):
        prompt_len, n = len(t.prompt_ids), seq_lens[b]
        if prompt_len < 1:
            raise ValueError(
                f"trajectory {t.group_id}/{t.sample_index} has an empty prompt: nothing predicts its first token"
            )
        input_ids[b, :prompt_len] = t.prompt_ids
        input_ids[b, prompt_len:n] = t.response_ids
        attention_mask[b, :n] = 1
        position_ids[b, :n] = np.arange(n)
        # Response token j is predicted at column prompt_len - 1 + j (see the module docstring).
        cols = slice(prompt_len - 1, n - 1)
        loss_mask[b, cols] = np.asarray(t.loss_mask) != 0
        rollout_logprobs[b, cols] = np.where(loss_mask[b, cols], t.rollout_logprobs, 0.0)

    mask = torch.from_numpy(loss_mask)
    task_rewards = torch.tensor([t.reward for _, t in trajectories], dtype=torch.float32)
    rewards = shape_rewards(recipe, task_rewards, [len(t.response_ids) for _, t in trajectories])
    group_ids = torch.tensor([g for g, _ in trajectories], dtype=torch.long)
    if recipe.advantage in CRITIC_ADVANTAGES:
        advantages = torch.zeros(num_rows, width)
    else:
        advantages, _ = compute_advantages(recipe, rewards, group_ids, mask)
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        position_ids=torch.from_numpy(position_ids),
        loss_mask=mask,
        rollout_logprobs=torch.from_numpy(rollout_logprobs),
        advantages=advantages.float(),
        **_reduction_weights(recipe, mask, group_ids),
        rewards=rewards,
        group_ids=group_ids,
        dones=torch.tensor([is_terminal(t) for _, t in trajectories]),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long),
        num_groups=len(groups),
        lags=torch.tensor(list(lags), dtype=torch.long) if lags is not None else None,
        routed_experts=_routes([t for _, t in trajectories], width),
        prompt_lens=torch.tensor([len(t.prompt_ids) for _, t in trajectories], dtype=torch.long),
    )


def _routes(trajectories: Sequence[Trajectory], width: int) -> torch.Tensor | None:
    """`TrainBatch.routed_experts` of these rows: each trajectory's routes from position 0 on, -1 elsewhere; None
    when none has routes. ValueError when two disagree on the MoE layers or experts per token."""
    recorded = [t.routed_experts for t in trajectories if t.routed_experts is not None]
    if not recorded:
        return None
    shapes = {r.shape[1:] for r in recorded}
    if len(shapes) > 1:
        raise ValueError(f"build_batch: trajectories' routed_experts disagree on [moe_layers, top_k]: {sorted(shapes)}")
    routes = np.full((len(trajectories), width, *shapes.pop()), -1, np.int16)
    for b, t in enumerate(trajectories):
        if t.routed_experts is not None:
            routes[b, : len(t.routed_experts)] = t.routed_experts
    return torch.from_numpy(routes)


def is_terminal(trajectory: Trajectory) -> bool:
    """Ended by the model or its environment (end-of-sequence, an environment's `stop` or `tool_error`), so GAE
    takes no value after it; a trajectory cut by a limit (max_tokens, max_turns, context, timeout) is not, and
    GAE bootstraps from V(s_T)."""
    return trajectory.finish_reason in ("stop", "tool_error") and not trajectory.truncated


class _ReductionWeights(TypedDict):
    token_weights: torch.Tensor
    value_weights: torch.Tensor


def _reduction_weights(recipe, mask: torch.Tensor, group_ids: torch.Tensor) -> _ReductionWeights:
    """`token_weights` and `value_weights` of the optimizer batch whose rows are given (whole).

    When `recipe.denominator_after_rejection` is set the token weights count the mask before rejection:
    a placeholder the ranks replace once old log-probs exist."""
    from asyncrl.algo.recipes import compute_token_weights
    from asyncrl.algo.reduction import reduction_weights

    if recipe.denominator_after_rejection:
        token_weights = reduction_weights(recipe.reduction, mask, group_ids, recipe.l_max)
    else:
        token_weights = compute_token_weights(recipe, mask, group_ids)
    return {"token_weights": token_weights, "value_weights": reduction_weights("token_mean", mask)}


def split_mini_batches(batch: TrainBatch, mini_batches: int, recipe) -> list[TrainBatch]:
    """Cut a rollout batch into `mini_batches` optimizer batches of whole groups, dealt in order (group
    ids 0..G-1 in G / mini_batches consecutive runs; when G does not divide, the first runs get one group
    more, and with fewer groups than mini-batches every group is its own). Advantages are kept (they
    are the rollout batch's); the reduction weights are recomputed over each mini-batch, so its loss is
    that mini-batch computed whole. One mini-batch returns `batch` itself."""
    if mini_batches < 1:
        raise ValueError(f"mini_batches must be >= 1 (got {mini_batches})")
    if mini_batches == 1:
        return [batch]
    group_ids = batch.group_ids.numpy()
    runs = [run for run in np.array_split(np.arange(batch.num_groups), mini_batches) if len(run)]
    parts = [batch.select(np.flatnonzero(np.isin(group_ids, run)).tolist()) for run in runs]
    return [dataclasses.replace(p, **_reduction_weights(recipe, p.loss_mask, p.group_ids)) for p in parts]


def _units(batch: TrainBatch, keep_groups: bool, shared: Sequence[Sequence[int]] = ()) -> list[list[int]]:
    """Rows that must stay together: whole groups, or the `shared` row lists and single rows."""
    if not keep_groups:
        together = {i for rows in shared for i in rows}
        return [list(rows) for rows in shared] + [[i] for i in range(batch.num_rows) if i not in together]
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(batch.group_ids.tolist()):
        by_group.setdefault(g, []).append(i)
    return list(by_group.values())


def _row_tokens(batch: TrainBatch, shared: Sequence[Sequence[int]]) -> list[float]:
    """Tokens each row costs the forward: its length, less its share of a prompt it shares with its group."""
    tokens = batch.seq_lens.double()
    for rows in shared:
        prompt_len = int(batch.prompt_lens[rows[0]]) if batch.prompt_lens is not None else 0
        tokens[list(rows)] -= prompt_len * (1 - 1 / len(rows))
    return tokens.tolist()


def split_rows(
    batch: TrainBatch, num_ranks: int, keep_groups: bool = False, share_prompts: bool = False
) -> list[TrainBatch]:
    """Partition the rows over `num_ranks`, balancing the tokens their forward computes (longest-first greedy
    onto the least loaded rank). With `keep_groups` whole groups are the unit; with `share_prompts` the rows of a
    group that may share their prompt (`packing.shared_groups`) are, and count that prompt once. A rank may get
    zero rows; it still takes part in every collective (see `dummy_microbatch`). One rank takes `batch` itself."""
    from asyncrl.learner.packing import shared_groups

    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1 (got {num_ranks})")
    if num_ranks == 1:
        return [batch]
    shared = shared_groups(batch) if share_prompts else []
    tokens = _row_tokens(batch, shared)
    units = sorted(_units(batch, keep_groups, shared), key=lambda u: -sum(tokens[i] for i in u))
    load = [0.0] * num_ranks
    assigned: list[list[int]] = [[] for _ in range(num_ranks)]
    for unit in units:
        rank = min(range(num_ranks), key=lambda r: (load[r], r))
        assigned[rank].extend(unit)
        load[rank] += sum(tokens[i] for i in unit)
    return [batch.select(sorted(rows)) for rows in assigned]


def micro_batches(rows: TrainBatch, tokens_per_microbatch: int, keep_groups: bool = False) -> list[TrainBatch]:
    """Pack rows into micro-batches whose PADDED size (rows x longest row) stays within
    `tokens_per_microbatch`; rows are taken longest first so padding stays small. A unit longer than the
    budget gets a micro-batch of its own. With `keep_groups` whole groups are the unit."""
    if tokens_per_microbatch < 1:
        raise ValueError(f"tokens_per_microbatch must be >= 1 (got {tokens_per_microbatch})")
    lengths = rows.seq_lens.tolist()
    units = sorted(_units(rows, keep_groups), key=lambda u: -max(lengths[i] for i in u))
    packs: list[list[int]] = []
    current: list[int] = []
    current_width = 0
    for unit in units:
        width = max([current_width] + [lengths[i] for i in unit])
        if current and (len(current) + len(unit)) * width > tokens_per_microbatch:
            packs.append(current)
            current, width = [], max(lengths[i] for i in unit)
        current.extend(unit)
        current_width = width
    if current:
        packs.append(current)
    return [rows.select(p) for p in packs]


def dummy_microbatch(num_groups: int = 1) -> TrainBatch:
    """A one-row, two-token micro-batch with zero loss mask and weights.

    FSDP2 runs collectives in every forward and backward, so all ranks must process the same number of
    micro-batches; a rank with fewer rows runs these, whose loss is an exact 0 connected to the graph."""
    zeros_i = torch.zeros(1, 2, dtype=torch.long)
    zeros_f = torch.zeros(1, 2)
    return TrainBatch(
        input_ids=zeros_i,
        attention_mask=torch.ones(1, 2, dtype=torch.long),
        position_ids=torch.arange(2).unsqueeze(0),
        loss_mask=torch.zeros(1, 2, dtype=torch.bool),
        rollout_logprobs=zeros_f,
        advantages=zeros_f,
        token_weights=zeros_f,
        value_weights=zeros_f,
        rewards=torch.zeros(1),
        group_ids=torch.zeros(1, dtype=torch.long),
        dones=torch.ones(1, dtype=torch.bool),
        seq_lens=torch.full((1,), 2, dtype=torch.long),
        num_groups=num_groups,
    )
