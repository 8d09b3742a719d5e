"""Supervised warm start for W1 `add`, and transformers-only generation, sampling and greedy evaluation.

The warm start stops early, so the RL run starts from a model with low but non-zero held-out accuracy
(W1 allows at most 2,000 examples, benchmarks/README.md: the default). Loss is on answer tokens (and EOS) only.
It trains with attention dropout 0.2 (`model.warm_start_dropout`; the saved model has none): at the same
validation target, that start is one RL lifts about twice as far as the one trained without (below).

`add` has a sharp supervised learning curve (2,000 examples, batch 32, lr 1e-3: held-out 0.18 / 0.20 / 0.29 /
0.39 / 0.53 after epochs 14-18; 20,000 examples: validation 0.125 -> 0.300 within 50 steps), and where a fixed
epoch count lands on it moves with thread scheduling. The warm start therefore runs on one thread with
deterministic kernels (the same settings give the same weights) and stops at a validation accuracy target,
which also holds on a CPU whose kernels round differently. What was measured about the result goes into its
metadata: greedy held-out accuracy, the reward of 8 samples per prompt at T=1 (~0.6x greedy here) and the
per-token answer entropy along them, since GRPO updates only learn from groups whose samples disagree.

Why dropout (every variant, its command and its curve: benchmarks/RESULTS.md, "W1 `add` — how far RL lifts a
warm start"): a start that has memorised its examples is one RL cannot lift far. Without dropout, 2,000
examples seen ~15 times gave a start the plain GRPO loop (benchmarks/plain_grpo.py, lr 2e-4) lifted +0.26 in
200 steps before a plateau near 0.6, whatever changed on the RL side (advantages, batch shape, Adam beta2, lr;
5e-4 collapses it) or in the start (its accuracy, depth, width, full epochs, label smoothing, a loss on the
prompt too); an annealed, converged start got worse under RL. 20,000 examples seen 2.4 times lifted +0.40 (the
`add_20k` recipe, outside W1's rule). Within 2,000, attention dropout 0.2 lifted +0.47 at 200 steps (+0.56 at
300), weight decay 0.1 or dropout 0.1 about +0.34.

Dropout also delays the supervised transition (26 epochs instead of 14.7 for seed 0), and for seeds 1 and 2 it
does not come within the 40-epoch budget; going on without dropout from there reaches the target for seed 1
(+0.27) but not for seed 2 (0.084 held-out after 40 more epochs: RL cannot start). So a dropout run that misses
its target is given up and the start is trained again from its initial weights without dropout, which is the
start without dropout exactly (`_train_to_target`; the metadata records `dropout_given_up_after`): never worse
than a start without dropout, and for seed 0, the default, the dropout start.
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
CHAT_EVAL_EVERY_STEPS = 50
"""How often the chat warm start checks its target: with `calc_agents_sdk`'s model here the check (50 greedy episodes
in two batched turns) takes a few seconds, the 50 steps before it ~50 s."""
CHAT_VALIDATION_PROBLEMS = 50
"""Problems the chat warm start's target is checked on."""
WARMUP_STEPS = 50
PLAIN_SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # the full distribution, as the engines sample


def _examples(
    tokenizer, n: int, max_operand: int, seed: int
) -> tuple[list[tuple[list[int], int]], set[tuple[int, int]]]:
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


def _train(
    model, tokenizer, data, epochs: int, lr: float, rng: random.Random, batch_size: int, stop
) -> tuple[int, float]:
    """AdamW with a linear warm-up then constant lr; `stop(step)` is asked every EVAL_EVERY_STEPS steps.
    Returns the steps taken and the last batch's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP_STEPS))
    step, loss = 0, float("nan")
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


def _train_to_target(
    model,
    tokenizer,
    data,
    epochs: int,
    lr: float,
    seed: int,
    batch_size: int,
    stop,
    reached: Callable[[], bool],
    report: Callable[[str], None],
) -> tuple[int, float, int | None]:
    """`_train` (on a copy of `data`, shuffled by a `seed` stream); when a run with dropout has not `reached()`
    its target within `epochs`, the same run again from the initial weights without dropout. Dropout delays
    `add`'s supervised transition, for some seeds past any budget, and a start below the target is one RL
    cannot lift; the second run is the start without dropout exactly (module docstring). -> the steps of both
    runs, the last loss and the steps of the dropout run when it was given up (None: it was not)."""
    initial = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    steps, loss = _train(model, tokenizer, list(data), epochs, lr, random.Random(seed), batch_size, stop)
    if reached() or not _switch_off_attention_dropout(model):
        return steps, loss, None
    report(f"warm start: no target after {steps} steps with dropout; training again from the start without it")
    model.load_state_dict(initial)
    more, loss = _train(model, tokenizer, list(data), epochs, lr, random.Random(seed), batch_size, stop)
    return steps + more, loss, steps


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
    learner's); if the target is not met within `epochs`, the start is trained again without it
    (`_train_to_target`). `report` is told the validation accuracy at each check."""
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
        steps, loss, dropout_off = _train_to_target(
            model, tokenizer, data, epochs, lr, seed, batch_size, reached, target_met, report or (lambda _text: None)
        )
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
            "dropout_given_up_after": dropout_off,
            "train_seconds": round(train_s, 2),
            "final_loss": loss,
        }


def left_pad(tokenizer, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows right-aligned (left padding) and their attention mask, as `generate` wants them."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        input_ids[r, width - len(row) :] = torch.tensor(row)
        attn[r, width - len(row) :] = 1
    return input_ids, attn


def _generate(model, tokenizer, rows: list[list[int]], max_new_tokens: int, sample: bool):
    """`model.generate` on left-padded `rows`, greedy or at temperature 1 -> (sequences, prompt attention)."""
    input_ids, attn = left_pad(tokenizer, rows)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attn,
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **(PLAIN_SAMPLING if sample else {}),
    )
    return out, attn


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
    out, attn = _generate(model, tokenizer, [list(p.prompt_ids) for p in prompts], max_new_tokens, sample)
    width, eos = attn.shape[1], tokenizer.eos_token_id
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
        float(
            generate(
                model, tokenizer, prompts[i : i + batch_size], sample=False, max_new_tokens=max_new_tokens
            ).rewards.sum()
        )
        for i in range(0, len(prompts), batch_size)
    )
    return correct / max(1, len(prompts))


# ---------------------------------------------------------------------------------------------------
# The agent tasks (asyncrl.envs.calc): a start that calls the calculator sometimes, not always


def calc_example(
    tokenizer, text: str, answer: str, use_tool: bool, expression: str | None = None
) -> tuple[list[int], list[int]]:
    """(ids, supervised flags) of one episode exactly as the rollout worker assembles it: prompt, then either
    `[expression]` (default: the `calc` prompt without its `=`) + observation `=answer;` (not supervised) +
    answer, or the answer at once; then EOS."""
    from asyncrl.envs.calc import call_text, result_text

    def enc(s: str) -> list[int]:
        return list(tokenizer(s, add_special_tokens=False).input_ids)

    ids, flags = enc(text), [0] * len(enc(text))
    if use_tool:
        call = enc(call_text(expression if expression is not None else text.rstrip("=")))
        observation = enc(result_text(answer))
        ids, flags = ids + call + observation, flags + [1] * len(call) + [0] * len(observation)
    final = enc(answer) + [tokenizer.eos_token_id]
    return ids + final, flags + [1] * len(final)


def warm_start_calc(
    model_dir: str | Path,
    examples: int,
    epochs: int,
    lr: float,
    operands: int = 3,
    seed: int = 0,
    tool_fraction: float = 0.3,
    batch_size: int = 32,
    task: str = "calc",
) -> dict:
    """Supervised start for an agent task with the calculator (`calc`, `word_problems`): `tool_fraction` of the
    examples call the calculator with the expression that solves the problem (`calc.tool_expression`), the rest
    answer in the head (which a tiny model gets mostly wrong), for a fixed number of epochs, deterministically.
    The result calls the tool sometimes but not reliably, so RL has both success and tool use to raise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.envs import calc

    with deterministic(seed):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        rng, problems = random.Random(seed), calc.train_problems(task, add.WARM_START_SEED + seed, operands)
        data = [
            calc_example(tokenizer, text, answer, rng.random() < tool_fraction, calc.tool_expression(task, text))
            for text, answer in (next(problems) for _ in range(examples))
        ]
        start = time.perf_counter()
        steps, loss = _train(model, tokenizer, data, epochs, lr, rng, batch_size, lambda _step: False)
        model.eval()
        model.save_pretrained(model_dir, safe_serialization=True)
    return {
        "task": task,
        "tool_fraction": tool_fraction,
        "steps": steps,
        "epochs": epochs,
        "train_seconds": round(time.perf_counter() - start, 2),
        "final_loss": loss,
    }


# ---------------------------------------------------------------------------------------------------
# The `calc` task as tool-calling chat (asyncrl.envs.chat_calc), for a model family with a BPE tokenizer


def chat_example(tokenizer, messages: list[dict], tools: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, supervised flags) of a conversation rendered with the tokenizer's chat template, as the endpoint feeds
    and captures it: the text before each assistant message (with its generation prompt) is observation, the
    assistant message's own text (through its end-of-turn token) is sampled, so supervised. Each piece is encoded
    on its own, as the engine samples a turn's tokens after a prompt it was fed."""

    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages[:upto], tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    ids: list[int] = []
    flags: list[int] = []
    done = ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(k, True), render(k + 1, False)
        turn = through[len(before) :]
        eos = tokenizer.eos_token
        sampled = turn[: turn.index(eos) + len(eos)]
        observation = tokenizer(before[len(done) :], add_special_tokens=False).input_ids
        model = tokenizer(sampled, add_special_tokens=False).input_ids
        ids, flags = ids + observation + model, flags + [0] * len(observation) + [1] * len(model)
        done = before + sampled
    return ids, flags


def warm_start_chat_calc(
    model_dir: str | Path,
    examples: int,
    epochs: int,
    lr: float,
    operands: int = 3,
    seed: int = 0,
    tool_fraction: float = 0.5,
    batch_size: int = 16,
    target: float | None = None,
    report: Callable[[str], None] | None = None,
    task: str = "calc",
) -> dict:
    """Supervised start for `task` (`calc`, `word_problems`) as tool-calling chat
    (`asyncrl.envs.chat_calc.conversation`) in the chat format of the model's own tokenizer: `tool_fraction` of the
    examples call the calculator (a real tool call, e.g. ChatML's `<tool_call>{json}</tool_call>`), the rest answer
    at once; deterministically, for `epochs` or, with `target`, until greedy whole-episode success on
    CHAT_VALIDATION_PROBLEMS validation problems (disjoint from the held-out set and the examples) reaches it,
    checked every CHAT_EVAL_EVERY_STEPS steps. The copies the task needs (the expression into the call, the result
    into the answer) form abruptly, each at a step that moves with the examples' order
    (benchmarks/notes/agent_framework.md), so a fixed step count may land before or after them; a target does not.
    Measures the start on 50 held-out problems (`chat_calc_profile`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.envs import calc, chat_calc

    with deterministic(seed):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        rng, problems = random.Random(seed), calc.train_problems(task, add.WARM_START_SEED + seed, operands)
        tools = [chat_calc.CALCULATOR_TOOL]
        drawn = [next(problems) for _ in range(examples)]
        data = [
            chat_example(tokenizer, chat_calc.conversation(*p, rng.random() < tool_fraction, task), tools)
            for p in drawn
        ]
        validation = _chat_validation(drawn, operands, task) if target is not None else []
        curve: list[tuple[int, float]] = []

        def reached(step: int) -> bool:
            if target is None or step % CHAT_EVAL_EVERY_STEPS:
                return False
            model.eval()
            curve.append((step, chat_calc_profile(model, tokenizer, validation, task=task)["success"]))
            model.train()
            if report is not None:
                report(f"warm start: step {step}, validation episode success {curve[-1][1]:.3f} (target {target})")
            return curve[-1][1] >= target

        start = time.perf_counter()
        steps, loss = _train(model, tokenizer, data, epochs, lr, rng, batch_size, reached)
        model.eval()
        model.save_pretrained(model_dir, safe_serialization=True)
        profile = chat_calc_profile(model, tokenizer, calc.heldout_problems(task, 50, operands), task=task)
    return {
        "task": task,
        "format": "chat",
        "tool_fraction": tool_fraction,
        "steps": steps,
        "epochs": epochs,
        "target": target,
        "target_reached": target is None or bool(curve and curve[-1][1] >= target),
        "validation_success": curve,
        "train_seconds": round(time.perf_counter() - start, 2),
        "final_loss": loss,
        **profile,
    }


def _chat_validation(drawn: list[tuple[str, str]], operands: int, task: str) -> list[tuple[str, str]]:
    """CHAT_VALIDATION_PROBLEMS `task` problems outside the held-out set and the warm start's examples `drawn`."""
    from asyncrl.envs import calc

    exclude = {text for text, _ in drawn} | {text for text, _ in calc.heldout_problems(task, 500, operands)}
    stream = calc.train_problems(task, VALIDATION_SEED, operands, exclude=exclude)
    return [next(stream) for _ in range(CHAT_VALIDATION_PROBLEMS)]


@torch.no_grad()
def _greedy_replies(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int) -> list[str]:
    """The model's next assistant turn of each conversation (with the calculator tool), greedy, in one left-padded
    batch."""
    from asyncrl.envs import chat_calc

    if not conversations:
        return []
    prompts = [
        tokenizer.apply_chat_template(c, tools=[chat_calc.CALCULATOR_TOOL], add_generation_prompt=True, tokenize=False)
        for c in conversations
    ]
    out, attn = _generate(
        model, tokenizer, [tokenizer(p, add_special_tokens=False).input_ids for p in prompts], max_new_tokens, False
    )
    return [tokenizer.decode(row[attn.shape[1] :], skip_special_tokens=True) for row in out]


def chat_calc_profile(
    model, tokenizer, problems: list[tuple[str, str]], max_new_tokens: int = 48, task: str = "calc"
) -> dict:
    """Greedy episodes on `problems`: the fraction whose first turn is one well-formed calculator call
    (`tool_call_rate`), the fraction whose call is on the expression that solves it (`exact_call_rate`), of the
    other first turns the fraction that is the right answer (`direct_accuracy`), and whole-episode `success` (a
    call is answered with the calculator's result, then the model's answer counts)."""
    import json

    from asyncrl.envs import chat_calc
    from asyncrl.envs.calc import tool_expression

    first = _greedy_replies(model, tokenizer, [chat_calc.question(text) for text, _ in problems], max_new_tokens)
    calls = [chat_calc.called_expression(reply) for reply in first]
    called = {k: e for k, e in enumerate(calls) if e is not None}
    followups = [
        chat_calc.question(problems[k][0])
        + [
            chat_calc.tool_call_message(e),
            chat_calc.tool_message(chat_calc.run_tool(chat_calc.TOOL_NAME, json.dumps({"expression": e}))),
        ]
        for k, e in called.items()
    ]
    finals = dict(zip(called, _greedy_replies(model, tokenizer, followups, max_new_tokens), strict=True))
    right = [finals.get(k, first[k]).strip() == answer for k, (_, answer) in enumerate(problems)]
    direct = [k for k, e in enumerate(calls) if e is None]
    n = max(1, len(problems))
    return {
        "tool_call_rate": round(len(called) / n, 4),
        "exact_call_rate": round(sum(e == tool_expression(task, problems[k][0]) for k, e in called.items()) / n, 4),
        "direct_accuracy": round(sum(right[k] for k in direct) / max(1, len(direct)), 4),
        "success": round(sum(right) / n, 4),
    }
