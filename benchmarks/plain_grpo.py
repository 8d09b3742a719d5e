"""A plain on-policy GRPO loop on W1 `add`: the baseline that tells a warm start's liftability apart from
asyncrl's machinery.

No Ray, no vLLM, no replay queue: each step samples 32 prompts x 8 answers at T=1 with transformers
`generate`, normalises rewards within each group, and takes one AdamW step (lr 2e-4, clip 1) on a
token-mean REINFORCE loss (one update per batch, so a PPO ratio would be 1). Greedy held-out accuracy
(asyncrl's 500 prompts) is measured every `--eval-every` steps, with the mean sampled reward and the per-token
entropy of the answers sampled at the last step (whether a plateau comes with a collapsed distribution); the
clock leaves the evaluations out. `LoopSettings` holds the knobs issue #18 asked to vary (batch shape, Adam's
beta2, advantages without the std division as in Dr. GRPO).

    python benchmarks/plain_grpo.py [--model DIR] [--steps 120] [--eval-every 10] [--out PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from asyncrl.envs.data import add_prompt_stream, heldout_add_prompts
from asyncrl.envs.warm_start import generate, greedy_accuracy, response_logits

MAX_TOKENS = 6  # configs/default.yaml rollout.max_tokens


@dataclass(frozen=True)
class LoopSettings:
    """One plain-loop recipe; the defaults are the baseline every W1 comparison uses."""

    lr: float = 2e-4
    prompts_per_step: int = 32
    group: int = 8
    beta2: float = 0.999  # AdamW's second-moment decay
    std_normalise: bool = True  # False: r - group mean (Dr. GRPO), so near-unanimous groups are not amplified


@dataclass(frozen=True)
class StepStats:
    """What one step sampled: the mean reward and the mean per-token entropy (nats) of its answers."""

    reward: float
    entropy: float


def group_advantages(rewards: torch.Tensor, group: int, std_normalise: bool = True) -> torch.Tensor:
    """r - group mean, divided by (group std + 1e-6) unless `std_normalise` is off: a group whose samples all
    score alike gets 0."""
    r = rewards.view(-1, group)
    centred = r - r.mean(1, keepdim=True)
    return (centred / (r.std(1, keepdim=True) + 1e-6) if std_normalise else centred).view(-1)


def grpo_step(model, tokenizer, opt, prompts, settings: LoopSettings) -> StepStats:
    """Sample a group per prompt, one optimizer step."""
    model.eval()
    samples = generate(model, tokenizer, [p for p in prompts for _ in range(settings.group)], sample=True, max_new_tokens=MAX_TOKENS)
    model.train()
    logp = torch.log_softmax(response_logits(model, samples), dim=-1)
    taken = logp.gather(-1, samples.sequences[:, samples.prompt_width :, None]).squeeze(-1)
    mask = samples.response_mask.float()
    advantages = group_advantages(samples.rewards, settings.group, settings.std_normalise)[:, None]
    loss = -(advantages * taken * mask).sum() / mask.sum()  # token-mean over the batch
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    entropy = -(logp.detach().exp() * logp.detach()).sum(-1)
    return StepStats(float(samples.rewards.mean()), float((entropy * mask).sum() / mask.sum()))


def train(model_dir: str | Path, steps: int, eval_every: int, settings: LoopSettings = LoopSettings(), seed: int = 0, log=print) -> list[dict]:
    """Plain GRPO from `model_dir`; returns the evaluations (step, samples_trained, wall_s: training seconds so
    far, evaluations left out as the TRL peer's clock does, accuracy, and the last step's reward and entropy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, settings.beta2), weight_decay=0.0)
    stream = add_prompt_stream(tokenizer, seed)  # the controller's stream for data.seed
    heldout = heldout_add_prompts(tokenizer)
    evals, train_s, stats = [], 0.0, StepStats(float("nan"), float("nan"))
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            model.eval()
            accuracy = greedy_accuracy(model, tokenizer, heldout)
            samples = step * settings.prompts_per_step * settings.group
            evals.append({"step": step, "samples_trained": samples, "wall_s": round(train_s, 2), "accuracy": accuracy} | asdict(stats))
            log(f"step {step:4d}  reward {stats.reward:.3f}  entropy {stats.entropy:.3f}  heldout {accuracy:.3f}  {train_s:.0f}s")
        if step < steps:
            start = time.perf_counter()
            stats = grpo_step(model, tokenizer, opt, list(itertools.islice(stream, settings.prompts_per_step)), settings)
            train_s += time.perf_counter() - start
    return evals


def add_loop_options(parser: argparse.ArgumentParser) -> None:
    """The LoopSettings flags, shared with benchmarks/warm_start_lift.py."""
    default = LoopSettings()
    parser.add_argument("--lr", type=float, default=default.lr, help="plain-loop learning rate")
    parser.add_argument("--prompts-per-step", type=int, default=default.prompts_per_step)
    parser.add_argument("--group", type=int, default=default.group, help="samples per prompt")
    parser.add_argument("--beta2", type=float, default=default.beta2, help="AdamW beta2")
    parser.add_argument("--no-std", dest="std_normalise", action="store_false", help="advantages r - group mean (Dr. GRPO)")


def loop_settings(args: argparse.Namespace) -> LoopSettings:
    return LoopSettings(args.lr, args.prompts_per_step, args.group, args.beta2, args.std_normalise)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the cached warm start of configs/default.yaml)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=10)
    add_loop_options(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    parser.add_argument("--out", type=Path, help="write the evaluations as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from asyncrl.config import RECIPES, load_config
        from asyncrl.envs.model_dir import ensure_model

        args.model = ensure_model(load_config(RECIPES / "default.yaml"))
    settings = loop_settings(args)
    evals = train(args.model, args.steps, args.eval_every, settings)
    if args.out:
        args.out.write_text(json.dumps({"model": str(args.model), "settings": asdict(settings), "evals": evals}, indent=2))


if __name__ == "__main__":
    main()
