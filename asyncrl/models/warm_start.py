"""Supervised warm start for W1 `add` and a transformers-only greedy evaluator.

The warm start trains on at most a few thousand examples so the RL run starts from a model with low
but non-zero held-out accuracy (WORKLOADS.md W1). Loss is on answer tokens (and EOS) only.

`add` has a sharp supervised learning curve: the same recipe gives 1% after 13 epochs and 86% after 20,
and where an epoch count lands moves with thread scheduling. So the warm start stops at a validation
accuracy target instead. A model stopped there is also sharp enough that sampling at T=1 still finds
the right answer (sampled reward ~0.6x greedy accuracy), which GRPO-family updates need: a flatter
model with the same greedy accuracy gave ~4% sampled reward and RL could not lift it.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from asyncrl.envs import add
from asyncrl.envs.data import add_prompt, heldout_add_prompts
from asyncrl.envs.rewards import exact_match


VALIDATION_SEED = 31_337
EVAL_EVERY_STEPS = 25
WARMUP_STEPS = 50


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
    width = max(len(ids) for ids, _ in chunk)
    input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id)
    labels = torch.full((len(chunk), width), -100)
    attn = torch.zeros((len(chunk), width), dtype=torch.long)
    for r, (ids, plen) in enumerate(chunk):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        labels[r, plen : len(ids)] = torch.tensor(ids[plen:])
        attn[r, : len(ids)] = 1
    return input_ids, attn, labels


def warm_start(
    model_dir: str | Path,
    examples: int,
    epochs: int,
    lr: float,
    max_operand: int,
    target: float | None = None,
    seed: int = 0,
    batch_size: int = 32,
) -> dict:
    """Supervised training on `examples` pairs for at most `epochs`, stopping once greedy accuracy on a
    validation set reaches `target` (checked every EVAL_EVERY_STEPS steps). Saves the model in place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data, pairs = _examples(tokenizer, examples, max_operand, seed)
    validation = _validation_prompts(tokenizer, 200, max_operand, pairs) if target is not None else []
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP_STEPS))
    rng = random.Random(seed)
    start = time.perf_counter()
    step, val_acc, loss = 0, None, torch.tensor(float("nan"))

    def batches():
        for _ in range(epochs):
            rng.shuffle(data)
            for i in range(0, len(data), batch_size):
                yield data[i : i + batch_size]

    model.train()
    for chunk in batches():
        input_ids, attn, labels = _batch(tokenizer, chunk)
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if target is not None and step % EVAL_EVERY_STEPS == 0:
            model.eval()
            val_acc = greedy_accuracy(model, tokenizer, validation)
            model.train()
            if val_acc >= target:
                break
    train_s = time.perf_counter() - start
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    accuracy = greedy_accuracy(model, tokenizer, heldout_add_prompts(tokenizer, 500, max_operand))
    return {
        "heldout_accuracy": accuracy,
        "validation_accuracy": val_acc,
        "target": target,
        "target_reached": target is None or (val_acc is not None and val_acc >= target),
        "steps": step,
        "epochs": round(step / max(1, -(-len(data) // batch_size)), 2),
        "train_seconds": round(train_s, 2),
        "final_loss": float(loss.detach()),
    }


@torch.no_grad()
def greedy_accuracy(model, tokenizer, prompts, max_new_tokens: int = 8, batch_size: int = 250) -> float:
    """Exact-match accuracy of greedy decoding with transformers (left padding)."""
    correct = 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p.prompt_ids) for p in chunk)
        input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, p in enumerate(chunk):
            input_ids[r, width - len(p.prompt_ids) :] = torch.tensor(p.prompt_ids)
            attn[r, width - len(p.prompt_ids) :] = 1
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        for r, p in enumerate(chunk):
            gen = out[r, width:].tolist()
            finished = tokenizer.eos_token_id in gen
            if finished:
                gen = gen[: gen.index(tokenizer.eos_token_id)]
            text = tokenizer.decode(gen, skip_special_tokens=True)
            correct += exact_match(text, p.ground_truth, finish_reason="stop" if finished else "length")
    return correct / max(1, len(prompts))
