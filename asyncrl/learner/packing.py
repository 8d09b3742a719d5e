"""Packed micro-batches (`learner.packing`, `learner.share_group_prompt`): the layout the model's forward sees.

A micro-batch keeps the padded [B, L] rows of `batch.py` for everything the loss reads (masks, weights, advantages,
log-probs); only the forward runs on a packed layout: `N` bins of `C` slots, each bin holding several sequences
one after the other, with position ids restarting per sequence and an attention mask that never crosses them. The
learner's log-probs (and a critic's values) are gathered back into the rows' [B, L] alignment, so the loss, its
exact reduction and the mismatch figures are the padded path's computed on the same per-token values.

With `share_group_prompt` the samples of a group whose prompt token ids are identical (and, with MoE routes, whose
prompt routes are) share one prompt segment: `prompt, response_1, ..., response_k` in one bin, each response seeing
the prompt and itself (causally) and no other response, its position ids continuing from the prompt's end. The
prompt's activations are computed once and receive the gradient of every response; the column that predicts a
response's first token reads the prompt's last hidden state with that response's token. Mathematically this is the
unshared forward; in floats it differs by summation order only.

A micro-batch's bins are as wide as its longest piece (a sequence, or a shared prompt with its responses), at least
`PACK_WIDTH` (within the budget), and it has as many bins as fit `tokens_per_microbatch` slots. Attention costs a
bin's width per token, so bins stay narrow: sequences are taken longest first, and later micro-batches' bins narrow.

Exact only for attention that applies the mask as given: transformers' `sdpa` and `eager` (`packable`); any
other implementation (flash, flex) and a model the learner cannot mask (`packable` says why) keep padded rows.
Sliding windows (Gemma 2, Mistral, Qwen with `use_sliding_window`) are applied on position ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from asyncrl.learner.batch import TrainBatch

__all__ = ["PACK_WIDTH", "PackedLayout", "packable", "packed_micro_batches", "shared_groups"]

PACK_WIDTH = 128
"""The narrowest bin (slots) unless the budget is smaller: two W1 groups with their shared prompts (~50 tokens each).
Attention costs a bin's width per token, so wider bins cost more (W1, add-1m, shared prompts: 128 took 0.6-0.8x
256's step in two runs on a loaded machine)."""

_MASKED_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass(frozen=True)
class _Piece:
    """Rows laid out together in a bin: one row (`prompt_len` 0), or a group's rows sharing their first
    `prompt_len` tokens."""

    rows: tuple[int, ...]
    prompt_len: int
    tokens: int


@dataclass
class PackedLayout:
    """The packed forward of one micro-batch of B rows (width L): `N` bins of `C` slots.

    Invariant: `token_slot[b, t]` is the flat slot (`n * C + c`) holding row b's token t (-1 past its sequence);
    every (slot, next token) pair a row's log-prob column needs is one query, `column_query[b, t]` its index
    (`Q`, one past the last query, where column t predicts nothing: the last token and padding)."""

    input_ids: torch.Tensor  # int64 [N, C]
    position_ids: torch.Tensor  # int64 [N, C]
    block: torch.Tensor  # int64 [N, C]: sequences attend within their block only; -1 on empty slots
    sample: torch.Tensor  # int64 [N, C]: a response's row, -1 on a shared prompt (seen by the block's samples)
    token_slot: torch.Tensor  # int64 [B, L]
    query_slot: torch.Tensor  # int64 [Q]
    query_target: torch.Tensor  # int64 [Q]
    column_query: torch.Tensor  # int64 [B, L]
    routed_experts: torch.Tensor | None  # int16 [N, C, moe_layers, top_k], -1 where none

    @property
    def slots(self) -> int:
        return int(self.input_ids.numel())

    @property
    def tokens(self) -> int:
        """Tokens the forward computes (shared prompts once)."""
        return int((self.block >= 0).sum())

    def to(self, device: torch.device) -> PackedLayout:
        return PackedLayout(
            **{
                f.name: v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v
                for f in dataclasses.fields(self)
            }
        )

    def attention_mask(self, config, dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
        """The mask the decoder takes as given: [N, 1, C, C] (bool for sdpa, additive in `dtype` for eager), or one
        per layer type (`full_attention`, `sliding_attention`) for models with both."""
        width = self.input_ids.shape[1]
        index = torch.arange(width, device=self.block.device)
        causal = index[None, :] <= index[:, None]
        same = self.block[:, :, None] == self.block[:, None, :]
        seen = (self.sample[:, None, :] < 0) | (self.sample[:, None, :] == self.sample[:, :, None])
        diagonal = torch.eye(width, dtype=torch.bool, device=causal.device)
        full = (causal & same & seen) | diagonal
        window = getattr(config, "sliding_window", None)
        types = set(getattr(config, "layer_types", None) or [])
        masks = {"full_attention": full}
        if window is not None and (not types or "sliding_attention" in types):
            distance = self.position_ids[:, :, None] - self.position_ids[:, None, :]
            masks["sliding_attention"] = full & ((distance < window) | diagonal)
        if config._attn_implementation == "eager":
            masks = {
                k: torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
                for k, m in masks.items()
            }
        masks = {k: m.unsqueeze(1) for k, m in masks.items()}
        if types and len(masks) > 1:
            return {t: masks[t] for t in types}
        return masks.get("sliding_attention", masks["full_attention"])

    def gather(self, per_slot: torch.Tensor) -> torch.Tensor:
        """[N*C, ...] per-slot values -> [B, L, ...] per row token (zeros past the sequence)."""
        padded = torch.cat([per_slot, per_slot.new_zeros(1, *per_slot.shape[1:])])
        return padded[torch.where(self.token_slot >= 0, self.token_slot, per_slot.shape[0])]

    def scatter_queries(self, per_query: torch.Tensor) -> torch.Tensor:
        """[Q] per-query log-probs -> [B, L] in the rows' predicting-position alignment (0 where nothing)."""
        return torch.cat([per_query, per_query.new_zeros(1)])[self.column_query]


def packable(model) -> str | None:
    """None when the packed forward of this transformers model is its padded forward; else why not."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in _MASKED_IMPLEMENTATIONS:
        return f"attention {implementation!r} does not take a packed mask (packing needs {_MASKED_IMPLEMENTATIONS})"
    return None


def shared_groups(rows: TrainBatch) -> list[list[int]]:
    """Row lists (two or more rows of one group) whose prompts are identical token for token, with identical
    engine routes over the prompt when the rows carry routes: the rows that may share one prompt segment."""
    if rows.prompt_lens is None:
        return []
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(rows.group_ids.tolist()):
        by_group.setdefault(g, []).append(i)
    out = []
    for members in by_group.values():
        prompt_len = int(rows.prompt_lens[members[0]])
        if len(members) < 2 or any(int(rows.prompt_lens[i]) != prompt_len for i in members):
            continue
        same = bool((rows.input_ids[members, :prompt_len] == rows.input_ids[members[0], :prompt_len]).all())
        if rows.routed_experts is not None:
            routes = rows.routed_experts[members, :prompt_len]
            same = same and bool((routes == routes[:1]).all())
        if same:
            out.append(members)
    return out


def _pieces(rows: TrainBatch, share: bool, width: int) -> list[_Piece]:
    """Every row once: in a shared piece (split so that each fits `width`) or alone."""
    lengths = rows.seq_lens.tolist()
    prompt_lens = rows.prompt_lens.tolist() if rows.prompt_lens is not None else []  # none: no shared groups
    pieces, shared = [], set()
    for members in shared_groups(rows) if share else []:
        prompt_len = prompt_lens[members[0]]
        current: list[int] = []
        for i in members:
            if current and prompt_len + sum(lengths[j] - prompt_len for j in current + [i]) > width:
                pieces.append(_shared(current, prompt_len, lengths))
                current = []
            current.append(i)
        pieces.append(_shared(current, prompt_len, lengths))
        shared.update(members)
    pieces += [_Piece((i,), 0, lengths[i]) for i in range(len(lengths)) if i not in shared]
    return pieces


def _shared(members: Sequence[int], prompt_len: int, lengths: Sequence[int]) -> _Piece:
    if len(members) == 1:
        return _Piece((members[0],), 0, lengths[members[0]])
    return _Piece(tuple(members), prompt_len, prompt_len + sum(lengths[i] - prompt_len for i in members))


def _units(rows: TrainBatch, pieces: list[_Piece], keep_groups: bool) -> list[list[_Piece]]:
    """Pieces that go into one micro-batch: each alone, or (`keep_groups`) all of a group's."""
    if not keep_groups:
        return [[p] for p in pieces]
    by_group: dict[int, list[_Piece]] = {}
    for p in pieces:
        by_group.setdefault(int(rows.group_ids[p.rows[0]]), []).append(p)
    return list(by_group.values())


def packed_micro_batches(
    rows: TrainBatch, tokens_per_microbatch: int, share: bool, keep_groups: bool = False
) -> list[TrainBatch]:
    """`rows` (a `TrainBatch`) as micro-batches whose packed layout (`TrainBatch.layout`) has at most
    `tokens_per_microbatch` slots (a unit wider than that gets a micro-batch of its own). Units are taken
    largest first, each piece into the first bin of the open micro-batch it fits, a new bin while the budget
    allows, else a new micro-batch, whose bins are as wide as its first unit's largest piece (at least
    `PACK_WIDTH`): later micro-batches hold shorter sequences in narrower bins. With `keep_groups` a group's rows
    stay in one micro-batch."""
    if tokens_per_microbatch < 1:
        raise ValueError(f"tokens_per_microbatch must be >= 1 (got {tokens_per_microbatch})")
    narrowest = min(PACK_WIDTH, tokens_per_microbatch)
    pieces = _pieces(rows, share, max(int(rows.seq_lens.max()), narrowest))
    units = sorted(_units(rows, pieces, keep_groups), key=lambda u: -sum(p.tokens for p in u))
    packs: list[tuple[int, list[list[_Piece]]]] = []
    for unit in units:
        if not packs or not _place(packs[-1][1], unit, packs[-1][0], tokens_per_microbatch):
            packs.append((max([narrowest] + [p.tokens for p in unit]), []))
            _place(packs[-1][1], unit, packs[-1][0], None)
    return [_micro_batch(rows, bins) for _, bins in packs]


def _place(bins: list[list[_Piece]], unit: list[_Piece], width: int, budget: int | None) -> bool:
    """Put `unit`'s pieces into `bins` of `width` slots (first fit, new bins while `(bins + 1) * width <= budget`;
    None: no limit); False, with `bins` unchanged, when they do not fit."""
    trial = [list(b) for b in bins]
    for piece in sorted(unit, key=lambda p: -p.tokens):
        fit = next((b for b in trial if sum(p.tokens for p in b) + piece.tokens <= width), None)
        if fit is None:
            if budget is not None and ((len(trial) + 1) * width > budget or piece.tokens > width):
                return False
            trial.append(fit := [])
        fit.append(piece)
    bins[:] = trial
    return True


def _micro_batch(rows: TrainBatch, bins: list[list[_Piece]]) -> TrainBatch:
    """The rows of `bins` (in bin order) with their packed layout."""
    order = [i for b in bins for p in b for i in p.rows]
    mb = rows.select(order)
    new = {old: k for k, old in enumerate(order)}
    remapped = [[dataclasses.replace(p, rows=tuple(new[i] for i in p.rows)) for p in b] for b in bins]
    return dataclasses.replace(mb, layout=_layout(mb, remapped))


def _layout(mb: TrainBatch, bins: list[list[_Piece]]) -> PackedLayout:
    """Slots of `bins`: each piece one block (a shared prompt, then its responses; or one row)."""
    width = max(sum(p.tokens for p in b) for b in bins)
    ids, lens = mb.input_ids.numpy(), mb.seq_lens.tolist()
    shape = (len(bins), width)
    input_ids, positions = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
    block, sample = np.full(shape, -1, np.int64), np.full(shape, -1, np.int64)
    token_slot = np.full(tuple(mb.input_ids.shape), -1, np.int64)
    blocks = 0
    for n, pieces in enumerate(bins):
        at = 0
        for p in pieces:
            head = p.prompt_len
            block[n, at : at + p.tokens], blocks = blocks, blocks + 1
            if head:  # the shared prompt, from the piece's first row
                input_ids[n, at : at + head], positions[n, at : at + head] = ids[p.rows[0], :head], np.arange(head)
                token_slot[list(p.rows), :head] = n * width + np.arange(at, at + head)
                at += head
            for b in p.rows:
                span = slice(at, at + lens[b] - head)
                input_ids[n, span], positions[n, span] = ids[b, head : lens[b]], np.arange(head, lens[b])
                sample[n, span] = b
                token_slot[b, head : lens[b]] = n * width + np.arange(span.start, span.stop)
                at = span.stop
    return PackedLayout(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(positions),
        block=torch.from_numpy(block),
        sample=torch.from_numpy(sample),
        token_slot=torch.from_numpy(token_slot),
        **_queries(ids, lens, token_slot),
        routed_experts=_packed_routes(mb.routed_experts, token_slot, shape),
    )


def _queries(ids: np.ndarray, lens: Sequence[int], token_slot: np.ndarray) -> dict[str, torch.Tensor]:
    """The distinct (slot, next token) pairs of every row's columns 0..seq_len-2 and each column's pair."""
    rows = np.repeat(np.arange(len(lens)), [n - 1 for n in lens])
    cols = np.concatenate([np.arange(n - 1) for n in lens]) if len(lens) else np.zeros(0, np.int64)
    slots, targets = token_slot[rows, cols], ids[rows, cols + 1]
    keys = slots * (int(ids.max()) + 1) + targets
    unique, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    column_query = np.full(ids.shape, len(unique), np.int64)
    column_query[rows, cols] = inverse.reshape(-1)
    return {
        "query_slot": torch.from_numpy(slots[first]),
        "query_target": torch.from_numpy(targets[first]),
        "column_query": torch.from_numpy(column_query),
    }


def _packed_routes(routes: torch.Tensor | None, token_slot: np.ndarray, shape: tuple[int, int]) -> torch.Tensor | None:
    """Each slot's engine routes (a shared prompt's are its rows', identical by `shared_groups`)."""
    if routes is None:
        return None
    packed = torch.full((shape[0] * shape[1], *routes.shape[2:]), -1, dtype=routes.dtype)
    real = torch.from_numpy(token_slot) >= 0
    packed[torch.from_numpy(token_slot)[real]] = routes[:, : token_slot.shape[1]][real]
    return packed.reshape(*shape, *routes.shape[2:])
