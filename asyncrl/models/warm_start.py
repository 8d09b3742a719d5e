"""Supervised warm start for W1 `add`, and transformers-only generation, sampling and greedy evaluation.

The warm start stops early, so the RL run starts from a model with low but non-zero held-out accuracy
(WORKLOADS.md W1, which allows at most 2,000 examples: the default). Loss is on answer tokens (and EOS) only.
It trains with attention dropout 0.2 (`model.warm_start_dropout`; the saved model has none): at the same
validation target, that start is one RL lifts about twice as far as the one trained without (below).

`add` has a sharp supervised learning curve (2,000 examples, batch 32, lr 1e-3: held-out 0.18 / 0.20 / 0.29 /
0.39 / 0.53 after epochs 14-18; 20,000 examples: validation 0.125 -> 0.300 within 50 steps), and where an
epoch count lands used to move with thread scheduling. The warm start therefore runs on one thread with
deterministic kernels (the same settings give the same weights) and stops at a validation accuracy target,
which also holds on a CPU whose kernels round differently. What was measured about the result goes into its
metadata: greedy held-out accuracy, the reward of 8 samples per prompt at T=1 (~0.6x greedy here) and the
per-token answer entropy along them, since GRPO updates only learn from groups whose samples disagree.

Full epochs are not what makes a start liftable: a plain GRPO loop (benchmarks/plain_grpo.py) from 16
full epochs (0.286 held-out) reached 0.528 after 120 steps, as it did from the early-stopped start of the
same accuracy (0.552); see issue #18. Coverage is not what caps it either (measured 2026-12-01, plain loop
at lr 2e-4, 100 steps): a start from another seed (0.33 greedy, pass@8 0.68 and pass@32 0.875 at T=1) reached
0.45; batch 64 without warm-up and weight decay 0.01 (0.19, pass@32 0.71) reached 0.27 at 60 steps; label
smoothing 0.1 (0.15, pass@32 0.61) reached 0.27 at 80. A faster RL step does not help: lr 5e-4 and 1e-3
collapse the default start to ~0 within 20 steps. Nor is the start's accuracy or the model's shape (plain loop,
lr 2e-4, 200 steps, measured 2026-12-01 under load 8-15): stopping at a lower target gave 0.078 -> 0.27 (80
steps) and 0.152 -> 0.454 (+0.30); 8 layers (2.0M parameters, 0.296) -> 0.600 at 180 steps, 0.578 at 200; hidden
256 (3M, 0.282) -> 0.45 at 140; a loss on the prompt tokens too kept the start near 0 (0.012 after 20 epochs
at batch 64). No start tried gained more than +0.30 in 200 plain-loop steps.

What does lift (measured 2026-12-02, plain loop lr 2e-4, load 2-6): more examples seen fewer times. 20,000
examples, stopped at the same 0.2 validation target (1,475 steps, 2.36 epochs): 0.226 -> 0.41-0.42 (20 steps),
0.46-0.50 (40), 0.52 (100), 0.624-0.638 (200; two sampling streams), +0.40-0.41, then 0.710 (240),
0.740 (320), 0.754 (360: +0.53, issue #18's plain loop from its own start reached 0.76 at 350);
with the loop at lr 3e-4 and Adam beta2 0.99, 0.634-0.676 at 200 (+0.41-0.45). 10,000 examples (0.208 after 2.56 epochs)
reached 0.614 (+0.41). Not for every seed: seed 1 on 20,000 examples passes the target after 1.36 epochs at
0.164 held-out (sampled reward 0.09, entropy 0.83 nats) and gains +0.20 in 200 steps.

What lifts within W1's 2,000 examples (measured 2026-12-02, plain loop lr 2e-4, seed 0): regularising the
warm start against memorising its examples. Attention dropout 0.2 reaches the 0.2 validation target after
1,650 steps (26 epochs, against 14.7 without) at 0.202 held-out (sampled reward 0.10, entropy 0.75 nats); the
plain loop lifts it to 0.460 (60 steps), 0.592 (120), 0.668 (200: +0.47), 0.762 (300: +0.56). Dropout 0.1: 0.256
-> 0.602 at 180 steps (+0.35); weight decay 0.1: 0.194 -> 0.536 (+0.34); dropout 0.1 with weight decay 0.1:
0.176 -> 0.586 at 280 (+0.41). Dropout slows the supervised transition, which is its risk: with dropout 0.3, and
with 0.2 for seed 1, 60 epochs never reached the target (validation 0.01-0.10), and a start below the target is
one RL cannot lift. So a warm start that has not met its target within `model.warm_start_epochs` goes on without
dropout for as many epochs again (`_train_to_target`; its metadata records the step as `dropout_off_at_step`).

A memorised start is the hard one to lift: an annealed, converged start (cosine to 0 over 40 epochs of 2,000,
batch 32; 0.418, sampled reward 0.34, entropy 0.39 nats) fell to 0.32-0.36 in 60 steps; annealing over 20
epochs (cosine or linear, batch 32 or 64) ends before add's sharp transition (0.01-0.05, RL cannot start).
RL-side changes from the 2,000-example start do not close the gap: advantages without the std division
(Dr. GRPO) 0.312 -> 0.550 at 180 steps (+0.24); 64 prompts x 8 per step 0.590 at 160 (+0.28, twice the samples).
From the 20,000-example start they change little either (200 steps): Dr. GRPO 0.644 (+0.42), beta2 0.99 alone
0.614 (+0.39), 16 prompts x 16 samples 0.554 (+0.33).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.envs import add
from asyncrl.envs.data import add_prompt, heldout_add_prompts
from asyncrl.envs.rewards import exact_match


VALIDATION_SEED = 31_337
EVAL_EVERY_STEPS = 25
WARMUP_STEPS = 50
PLAIN_SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # the full distribution, as the engines sample


def _examples(tokenizer, n: int, max_operand: int, seed: int) -> tuple[list[tuple[list[int], int]], set[tuple[int, int]]]:
    """(ids, prompt_length) pairs (prompt + answer + EOS), and the operand pairs used."""
    stream = add.train_pairs(add.WARM_START_SEED + seed, max_operand)
    out, pairs = [], set()
    for _ in range(n):
        a, b = next(stream)
        pairs.add((a, b))
        prompt = tokenizer(add.prompt_text(a, b), add_special_tokens=False).input_ids
        answer = tokenizer(str(a + b), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        out.append((list(prompt) + list(answer), len(prompt)))
    return out, pairs


def _validation_prompts(tokenizer, n: int, max_operand: int, exclude: set[tuple[int, int]]):
    """`n` prompts disjoint from the held-out set and from the warm-start examples."""
    exclude = exclude | set(add.heldout_pairs(max_operand=max_operand))
    stream = add.train_pairs(VALIDATION_SEED, max_operand, exclude=exclude)
    return [add_prompt(tokenizer, *next(stream), f"val-{i}") for i in range(n)]


def _batch(tokenizer, chunk):
    """Padded (input ids, attention, labels) of examples `(ids, supervised)`: `supervised` is the prompt length
    (every later token is learned) or a 0/1 flag per token (a multi-turn example: observations are not)."""
    width = max(len(ids) for ids, _ in chunk)
    input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id)
    labels = torch.full((len(chunk), width), -100)
    attn = torch.zeros((len(chunk), width), dtype=torch.long)
    for r, (ids, supervised) in enumerate(chunk):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        if isinstance(supervised, int):
            labels[r, supervised : len(ids)] = torch.tensor(ids[supervised:])
        else:
            labels[r, : len(ids)] = torch.where(torch.tensor(supervised, dtype=torch.bool), torch.tensor(ids), -100)
        attn[r, : len(ids)] = 1
    return input_ids, attn, labels


@contextmanager
def deterministic(seed: int):
    """One thread, deterministic kernels, seeded: where a fixed epoch count lands on `add`'s sharp curve
    moved with thread scheduling (reductions split differently), so the warm start pins all three."""
    threads, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(strict)


def _train(model, tokenizer, data, epochs: int, lr: float, rng: random.Random, batch_size: int, stop,
           first_step: int = 0) -> tuple[int, float]:
    """AdamW with a linear warm-up then constant lr; `stop(step)` is asked every EVAL_EVERY_STEPS steps (steps
    counted from `first_step`). Returns the step count reached and the last batch's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP_STEPS))
    step, loss = first_step, float("nan")
    for _ in range(epochs):
        rng.shuffle(data)
        for i in range(0, len(data), batch_size):
            model.train()
            input_ids, attn, labels = _batch(tokenizer, data[i : i + batch_size])
            out = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
            out.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step, loss = step + 1, float(out.detach())
            if step % EVAL_EVERY_STEPS == 0 and stop(step):
                return step, loss
    return step, loss


def _train_to_target(model, tokenizer, data, epochs: int, lr: float, rng: random.Random, batch_size: int, stop,
                     reached: Callable[[], bool]) -> tuple[int, float, int | None]:
    """`_train`, and when a run with dropout has not `reached()` its target within `epochs`, up to `epochs`
    more without dropout: dropout delays `add`'s supervised transition, for some seeds past any epoch budget
    (module docstring), and a start below the target is one RL cannot lift. -> the steps, the last loss and
    the step at which dropout was switched off (None: it was not)."""
    steps, loss = _train(model, tokenizer, data, epochs, lr, rng, batch_size, stop)
    if reached() or not _switch_off_attention_dropout(model):
        return steps, loss, None
    total, loss = _train(model, tokenizer, data, epochs, lr, rng, batch_size, stop, first_step=steps)
    return total, loss, steps


def _switch_off_attention_dropout(model) -> bool:
    """-> whether any attention module had dropout on."""
    was_on = False
    for module in model.modules():
        if getattr(module, "attention_dropout", 0.0):
            module.attention_dropout, was_on = 0.0, True
    return was_on


def warm_start(
    model_dir: str | Path,
    examples: int,
    epochs: int,
    lr: float,
    max_operand: int,
    target: float | None = None,
    seed: int = 0,
    batch_size: int = 32,
    dropout: float = 0.0,
    report: Callable[[str], None] | None = None,
) -> dict:
    """Supervised training on `examples` pairs for `epochs` (or until greedy accuracy on a validation
    set reaches `target`, checked every EVAL_EVERY_STEPS steps), deterministically. Saves the model in
    place and returns what was measured about it: greedy held-out accuracy, the mean reward of 8 samples
    per held-out prompt at T=1 and the answer entropy along them (what a GRPO group has to work with).
    `dropout` is the attention dropout while training (saved as 0: it is a warm-start regulariser, not the
    learner's); it is switched off if the target is not met within `epochs` (`_train_to_target`). `report` is
    told the validation accuracy at each check."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with deterministic(seed):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attention_dropout=dropout)
        data, pairs = _examples(tokenizer, examples, max_operand, seed)
        validation = _validation_prompts(tokenizer, 200, max_operand, pairs) if target is not None else []
        val_acc: list[float] = []

        def reached(step: int) -> bool:
            if target is None:
                return False
            model.eval()
            val_acc.append(greedy_accuracy(model, tokenizer, validation))
            if report is not None:
                report(f"warm start: step {step}, validation accuracy {val_acc[-1]:.3f} (target {target})")
            return val_acc[-1] >= target

        def target_met() -> bool:
            return target is None or bool(val_acc and val_acc[-1] >= target)

        start = time.perf_counter()
        steps, loss, dropout_off = _train_to_target(model, tokenizer, data, epochs, lr, random.Random(seed), batch_size, reached, target_met)
        train_s = time.perf_counter() - start
        model.eval()
        model.config.attention_dropout = 0.0
        model.save_pretrained(model_dir, safe_serialization=True)
        heldout = heldout_add_prompts(tokenizer, 500, max_operand)
        reward, entropy = sampled_profile(model, tokenizer, heldout)
        return {
            "heldout_accuracy": greedy_accuracy(model, tokenizer, heldout),
            "sampled_reward_t1": round(reward, 4),
            "answer_entropy_nats": round(entropy, 4),
            "validation_accuracy": val_acc[-1] if val_acc else None,
            "target": target,
            "target_reached": target_met(),
            "steps": steps,
            "epochs": round(steps / max(1, -(-len(data) // batch_size)), 2),
            "attention_dropout": dropout,
            "dropout_off_at_step": dropout_off,
            "train_seconds": round(train_s, 2),
            "final_loss": loss,
        }


def left_pad(tokenizer, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids right-aligned (left padding) and their attention mask, as `generate` wants them."""
    width = max(len(p.prompt_ids) for p in prompts)
    input_ids = torch.full((len(prompts), width), tokenizer.pad_token_id)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        input_ids[r, width - len(p.prompt_ids) :] = torch.tensor(p.prompt_ids)
        attn[r, width - len(p.prompt_ids) :] = 1
    return input_ids, attn


@dataclass(frozen=True)
class Samples:
    """Generated responses of left-padded prompts: `sequences` = prompt columns then response columns."""

    sequences: torch.Tensor  # (B, prompt_width + new tokens)
    attention: torch.Tensor  # (B, same): prompt padding and tokens after EOS are 0
    prompt_width: int
    rewards: torch.Tensor  # (B,) exact match of each response

    @property
    def response_mask(self) -> torch.Tensor:
        return self.attention[:, self.prompt_width :]


@torch.no_grad()
def generate(model, tokenizer, prompts, *, sample: bool, max_new_tokens: int = 8) -> Samples:
    """One response per prompt (repeat a prompt to get a group), greedy or at temperature 1, scored
    with the W1 reward; a response counts up to and including its EOS."""
    input_ids, attn = left_pad(tokenizer, prompts)
    width, eos = input_ids.shape[1], tokenizer.eos_token_id
    out = model.generate(
        input_ids=input_ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=sample,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, **(PLAIN_SAMPLING if sample else {}),
    )
    response = out[:, width:]
    is_eos = (response == eos).long()
    before_eos = (is_eos.cumsum(1) - is_eos) == 0  # up to and including the first EOS
    rewards = torch.zeros(len(prompts))
    for r, p in enumerate(prompts):
        gen = response[r][before_eos[r]].tolist()
        finished = bool(gen) and gen[-1] == eos
        text = tokenizer.decode(gen[:-1] if finished else gen, skip_special_tokens=True)
        rewards[r] = exact_match(text, p.ground_truth, finish_reason="stop" if finished else "length")
    return Samples(out, torch.cat([attn, before_eos.long()], dim=1), width, rewards)


def response_logits(model, samples: Samples) -> torch.Tensor:
    """Logits that predicted each response token, (B, new tokens, vocab). Left padding needs no position
    shift: rotary attention depends only on distances between tokens."""
    logits = model(input_ids=samples.sequences, attention_mask=samples.attention).logits
    return logits[:, samples.prompt_width - 1 : -1]


@torch.no_grad()
def sampled_profile(model, tokenizer, prompts, n: int = 8) -> tuple[float, float]:
    """Mean reward of `n` samples per prompt at T=1, and mean per-token entropy (nats) of the answer
    distribution along them: how much reward a GRPO group finds, and how much room sampling explores."""
    samples = generate(model, tokenizer, [p for p in prompts for _ in range(n)], sample=True)
    logp = torch.log_softmax(response_logits(model, samples), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    mask = samples.response_mask.float()
    return float(samples.rewards.mean()), float((entropy * mask).sum() / mask.sum())


def greedy_accuracy(model, tokenizer, prompts, max_new_tokens: int = 8, batch_size: int = 250) -> float:
    """Exact-match accuracy of greedy decoding with transformers (left padding)."""
    correct = sum(
        float(generate(model, tokenizer, prompts[i : i + batch_size], sample=False, max_new_tokens=max_new_tokens).rewards.sum())
        for i in range(0, len(prompts), batch_size)
    )
    return correct / max(1, len(prompts))


# ---------------------------------------------------------------------------------------------------
# The `calc` agent task (asyncrl.envs.calc): a start that calls the calculator sometimes, not always


def calc_example(tokenizer, text: str, answer: str, use_tool: bool) -> tuple[list[int], list[int]]:
    """(ids, supervised flags) of one episode exactly as the rollout worker assembles it: prompt, then either
    `[expr]` + observation `=answer;` (not supervised) + answer, or the answer at once; then EOS."""
    from asyncrl.envs.calc import call_text, result_text

    def enc(s: str) -> list[int]:
        return list(tokenizer(s, add_special_tokens=False).input_ids)

    ids, flags = enc(text), [0] * len(enc(text))
    if use_tool:
        call, observation = enc(call_text(text.rstrip("="))), enc(result_text(answer))
        ids, flags = ids + call + observation, flags + [1] * len(call) + [0] * len(observation)
    final = enc(answer) + [tokenizer.eos_token_id]
    return ids + final, flags + [1] * len(final)


def warm_start_calc(model_dir: str | Path, examples: int, epochs: int, lr: float, operands: int = 3, seed: int = 0,
                    tool_fraction: float = 0.3, batch_size: int = 32) -> dict:
    """Supervised start for `calc`: `tool_fraction` of the examples call the calculator, the rest answer in the
    head (which a tiny model gets mostly wrong), for a fixed number of epochs, deterministically. The result
    calls the tool sometimes but not reliably, so RL has both success and tool use to raise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.envs import calc

    with deterministic(seed):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        rng, problems = random.Random(seed), calc.train_problems("calc", add.WARM_START_SEED + seed, operands)
        data = [calc_example(tokenizer, *next(problems), rng.random() < tool_fraction) for _ in range(examples)]
        start = time.perf_counter()
        steps, loss = _train(model, tokenizer, data, epochs, lr, rng, batch_size, lambda _step: False)
        model.eval()
        model.save_pretrained(model_dir, safe_serialization=True)
    return {"task": "calc", "tool_fraction": tool_fraction, "steps": steps, "epochs": epochs,
            "train_seconds": round(time.perf_counter() - start, 2), "final_loss": loss}
