"""A plain on-policy GRPO loop on W1 `add`: the baseline that tells a warm start's liftability apart from
asyncrl's machinery.

No Ray, no vLLM, no replay queue: each step samples 32 prompts x 8 answers at T=1 with transformers
`generate`, normalises rewards within each group, and takes one AdamW step (lr 2e-4, clip 1) on a
token-mean REINFORCE loss (one update per batch, so a PPO ratio would be 1). Greedy held-out accuracy
(asyncrl's 500 prompts) is measured every `--eval-every` steps; the clock leaves the evaluations out.

    python benchmarks/plain_grpo.py [--model DIR] [--steps 120] [--eval-every 10] [--out PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from asyncrl.envs.data import add_prompt_stream, heldout_add_prompts
from asyncrl.models.warm_start import generate, greedy_accuracy, response_logits

PROMPTS_PER_STEP = 32
GROUP = 8
MAX_TOKENS = 6  # configs/default.yaml rollout.max_tokens


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """(r - group mean) / (group std + 1e-6): a group whose samples all score alike gets 0."""
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)


def grpo_step(model, tokenizer, opt, prompts) -> float:
    """Sample a group per prompt, one optimizer step; returns the batch's mean reward."""
    model.eval()
    samples = generate(model, tokenizer, [p for p in prompts for _ in range(GROUP)], sample=True, max_new_tokens=MAX_TOKENS)
    model.train()
    logp = torch.log_softmax(response_logits(model, samples), dim=-1)
    taken = logp.gather(-1, samples.sequences[:, samples.prompt_width :, None]).squeeze(-1)
    mask = samples.response_mask.float()
    advantages = group_advantages(samples.rewards, GROUP)[:, None]
    loss = -(advantages * taken * mask).sum() / mask.sum()  # token-mean over the batch
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(samples.rewards.mean())


def train(model_dir: str | Path, steps: int, eval_every: int, lr: float = 2e-4, seed: int = 0, log=print) -> list[dict]:
    """Plain GRPO from `model_dir`; returns the evaluations (step, samples_trained,
    wall_s: training seconds so far, evaluations left out as the TRL peer's clock does, accuracy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    stream = add_prompt_stream(tokenizer, seed)  # the controller's stream for data.seed
    heldout = heldout_add_prompts(tokenizer)
    evals, train_s, reward = [], 0.0, float("nan")
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            model.eval()
            accuracy = greedy_accuracy(model, tokenizer, heldout)
            evals.append({"step": step, "samples_trained": step * PROMPTS_PER_STEP * GROUP, "wall_s": round(train_s, 2), "accuracy": accuracy})
            log(f"step {step:4d}  reward {reward:.3f}  heldout {evals[-1]['accuracy']:.3f}  {train_s:.0f}s")
        if step < steps:
            start = time.perf_counter()
            reward = grpo_step(model, tokenizer, opt, list(itertools.islice(stream, PROMPTS_PER_STEP)))
            train_s += time.perf_counter() - start
    return evals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the cached warm start of configs/default.yaml)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    parser.add_argument("--out", type=Path, help="write the evaluations as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from asyncrl.config import RECIPES, load_config
        from asyncrl.models import ensure_model

        args.model = ensure_model(load_config(RECIPES / "default.yaml"))
    evals = train(args.model, args.steps, args.eval_every, args.lr)
    if args.out:
        args.out.write_text(json.dumps({"model": str(args.model), "lr": args.lr, "evals": evals}, indent=2))


if __name__ == "__main__":
    main()
