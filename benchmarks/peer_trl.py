"""W1 `add` peer baseline: TRL's GRPOTrainer, held-out accuracy against wall-clock and trained samples.

Trains from the same cached warm-start checkpoint, on the same prompt stream, with the same group size
(32 prompts x 8 samples = 256 completions per optimizer step), learning rate, AdamW betas, gradient clip,
sampling temperature and completion length as asyncrl's default run (configs/default.yaml). TRL runs
synchronously in one process on the CPU: generate with transformers, score, one optimizer step, repeat.

The held-out set (500 prompts) is scored greedily with `asyncrl.envs.warm_start.greedy_accuracy` at step 0
and every `--eval-every` steps. The reported wall-clock EXCLUDES that evaluation time (asyncrl's own
records include its vLLM evaluation, which is a small part of a step); the total is kept in `eval_s`.
Writes benchmarks/results/peer_trl.json (peer_trl_quick.json with --quick).

    python benchmarks/peer_trl.py [--steps N] [--eval-every K] [--target 0.5] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import common  # benchmarks/common.py: a script's own folder is on sys.path
from learning_add import time_to_target

# TRL's loss closest to plain GRPO with group-normalised advantages (asyncrl `grpo` preset: advantage grpo,
# loss ppo, reduction seq_mean_token_mean). One optimizer step per generation batch, so the PPO ratio is 1.
LOSS_TYPE = "grpo"
SCALE_REWARDS = "group"
SAME_AS_GRPO_ARGS = (
    "weight_decay", "max_grad_norm", "temperature", "top_p", "top_k", "max_completion_length", "loss_type",
    "scale_rewards", "beta", "num_iterations", "steps_per_generation", "gradient_accumulation_steps",
    "per_device_train_batch_size", "shuffle_dataset",
)  # fmt: skip
"""Settings recorded under their `GRPOConfig` name."""


# ---------------------------------------------------------------------------------------------------
# The workload and the trainer's settings, both asyncrl's.


def load_prompts(cfg, tokenizer, steps: int) -> tuple[list, list]:
    """The controller's training stream (asyncrl.envs.data.train_stream: seeded with data.seed, consumed in
    order) for `steps` steps, and the held-out prompts."""
    from asyncrl.envs.data import add_prompt_stream, heldout_add_prompts

    stream = add_prompt_stream(tokenizer, cfg.data.seed, cfg.data.max_operand)
    train = list(itertools.islice(stream, steps * cfg.learner.prompts_per_step))
    # TRL tokenizes plain prompts with `processing_class(text=prompts)["input_ids"]` (special tokens on):
    # they must be exactly the ids asyncrl's engines see.
    trl_ids = tokenizer(text=[p.text for p in train])["input_ids"]
    mismatched = [p.text for p, ids in zip(train, trl_ids) if list(ids) != list(p.prompt_ids)]
    if mismatched:
        raise SystemExit(f"TRL would feed different prompt ids than asyncrl for {len(mismatched)} prompts, e.g. {mismatched[0]!r}")
    return train, heldout_add_prompts(tokenizer, cfg.data.eval_prompts, cfg.data.max_operand)


def add_reward(eos: int) -> Callable[..., list[float]]:
    """W1 exact match: the text decoded without special tokens, and the completion ended with EOS."""
    from asyncrl.envs.rewards import exact_match

    def reward(prompts, completions, completion_ids, ground_truth, **_):
        return [
            exact_match(text, gt, finish_reason="stop" if eos in ids else "length")
            for text, ids, gt in zip(completions, completion_ids, ground_truth)
        ]

    return reward


def grpo_args(cfg, steps: int) -> dict:
    """The `GRPOConfig` arguments that mirror asyncrl's run: one optimizer step per generation batch of
    prompts_per_step x G completions, no KL, no data shuffling."""
    group = cfg.rollout.samples_per_prompt
    return dict(
        max_steps=steps, num_generations=group, learning_rate=cfg.learner.lr, **lr_schedule(cfg.learner),
        warmup_steps=cfg.learner.warmup_steps, adam_beta1=cfg.learner.betas[0], adam_beta2=cfg.learner.betas[1],
        weight_decay=cfg.learner.weight_decay, max_grad_norm=cfg.learner.grad_clip, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, max_completion_length=cfg.rollout.max_tokens, loss_type=LOSS_TYPE,
        scale_rewards=SCALE_REWARDS, beta=0.0, num_iterations=1, steps_per_generation=1, gradient_accumulation_steps=1,
        per_device_train_batch_size=cfg.learner.prompts_per_step * group, shuffle_dataset=False, seed=0,
    )  # fmt: skip


def lr_schedule(learner) -> dict:
    """transformers' scheduler for the recipe's `learner.lr_decay` (the same shape after the warm-up)."""
    if learner.lr_decay == "constant":
        return {"lr_scheduler_type": "constant" if learner.warmup_steps == 0 else "constant_with_warmup"}
    if learner.lr_decay == "cosine":
        return {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": learner.min_lr_ratio}}
    if learner.min_lr_ratio == 0:
        return {"lr_scheduler_type": "linear"}
    raise ValueError(f"learner.lr_decay = 'linear' with learner.min_lr_ratio = {learner.min_lr_ratio}: transformers has no such "
                     "schedule for the peer; use min_lr_ratio 0 or cosine")


def run_settings(grpo: dict, cfg, model_dir, every: int, eval_prompts: int) -> dict:
    """What the result records of the run: the GRPO arguments (under asyncrl's names where they differ)
    and the machine."""
    import torch

    return {
        "model_dir": str(model_dir),
        "steps": grpo["max_steps"],
        "prompts_per_step": cfg.learner.prompts_per_step,
        "num_generations": grpo["num_generations"],
        "completions_per_step": grpo["per_device_train_batch_size"],
        "learning_rate": grpo["learning_rate"],
        "lr_scheduler": grpo["lr_scheduler_type"],
        "warmup_steps": grpo["warmup_steps"],
        "adam_betas": [grpo["adam_beta1"], grpo["adam_beta2"]],
        **{key: grpo[key] for key in SAME_AS_GRPO_ARGS},
        "data_seed": cfg.data.seed,
        "seed": grpo["seed"],
        "eval_every": every,
        "eval_prompts": eval_prompts,
        "eval": "greedy, transformers (asyncrl.envs.warm_start.greedy_accuracy); excluded from wall_s",
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "loadavg_1m_start": round(common.load_average(), 2),
    }


def grpo_config(grpo: dict, cfg):
    """`grpo` (the arguments of `grpo_args`) plus what makes it a quiet single-process CPU run that saves nothing."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="peer_trl-"), **grpo, optim="adamw_torch",
        mask_truncated_completions=cfg.buffer.filter_overlong, use_vllm=False, use_cpu=True, fp16=False,
        gradient_checkpointing=False, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        data_seed=0, dataloader_num_workers=0,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Timing and evaluation inside TRL's loop.


@dataclass
class GenerationTimers:
    """Seconds TRL has spent so far generating (transformers.generate) and scoring (rewards, advantages,
    log-probs); the trainer adds to them, the progress record reads them per step."""

    generate_s: float = 0.0
    score_s: float = 0.0


def timed_trainer_class(timers: GenerationTimers):
    """GRPOTrainer that adds the time of each generation and scoring to `timers`."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            begin = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                timers.generate_s += time.perf_counter() - begin

        def _generate_and_score_completions(self, inputs):
            begin, generate_before = time.perf_counter(), timers.generate_s
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                timers.score_s += time.perf_counter() - begin - (timers.generate_s - generate_before)

    return TimedGRPOTrainer


class Progress:
    """Held-out accuracy at step 0 and every `every` steps, and each step's time split; the wall clock
    excludes evaluation."""

    def __init__(self, accuracy: Callable[[object], float], samples_per_step: int, every: int, timers: GenerationTimers):
        self.accuracy, self.samples_per_step, self.every, self.timers = accuracy, samples_per_step, every, timers
        self.evals: list[dict] = []
        self.steps: list[dict] = []
        self.eval_s = 0.0
        self.start = 0.0
        self.pending: list[str] = []
        self.step_began = self.generate_before = self.score_before = 0.0

    def wall(self) -> float:
        return time.perf_counter() - self.start - self.eval_s

    def begin(self, model) -> None:
        self.start = time.perf_counter()
        self.evaluate(model, 0)

    def evaluate(self, model, step: int) -> None:
        wall_s = self.wall()
        begin = time.perf_counter()
        model.eval()
        accuracy = self.accuracy(model)
        model.train()
        spent = time.perf_counter() - begin
        self.eval_s += spent
        record = {"step": step, "samples_trained": step * self.samples_per_step, "wall_s": round(wall_s, 2), "accuracy": accuracy}
        self.evals.append(record)
        # Printed after the step's own line (on_log runs after on_step_end).
        self.pending.append(f"eval  step {step:>4}  samples {record['samples_trained']:>6}  wall {wall_s:7.1f}s  accuracy {accuracy:.3f}  (eval took {spent:.1f}s)")
        if step == 0:
            self.flush()

    def step_begin(self) -> None:
        self.step_began = time.perf_counter()
        self.generate_before, self.score_before = self.timers.generate_s, self.timers.score_s

    def step_end(self, model, step: int, max_steps: int) -> None:
        step_s = time.perf_counter() - self.step_began
        generate_s, score_s = self.timers.generate_s - self.generate_before, self.timers.score_s - self.score_before
        self.steps.append({"step": step, "step_s": step_s, "generate_s": generate_s, "score_s": score_s, "train_s": step_s - generate_s - score_s})
        if step % self.every == 0 or step == max_steps:
            self.evaluate(model, step)

    def log(self, step: int, logs: dict | None) -> None:
        if logs and "reward" in logs and self.steps:
            s = self.steps[-1]
            s.update(reward=logs["reward"], frac_reward_zero_std=logs.get("frac_reward_zero_std"))
            print(
                f"step {step:>4}  reward {logs['reward']:.3f}  zero-std groups {logs.get('frac_reward_zero_std', float('nan')):.2f}  "
                f"{s['step_s']:.2f}s (generate {s['generate_s']:.2f}, score {s['score_s']:.2f}, loss+backward+step {s['train_s']:.2f})",
                flush=True,
            )
        self.flush()

    def flush(self) -> None:
        for line in self.pending:
            print(line, flush=True)
        self.pending.clear()


def progress_callback(progress: Progress):
    """The TrainerCallback that hands TRL's loop events to `progress`."""
    from transformers import TrainerCallback

    class ProgressEvents(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            progress.begin(model)

        def on_step_begin(self, args, state, control, **kwargs):
            progress.step_begin()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            progress.step_end(model, state.global_step, state.max_steps)

        def on_log(self, args, state, control, logs=None, **kwargs):
            progress.log(state.global_step, logs)

        def on_train_end(self, args, state, control, **kwargs):
            progress.flush()

    return ProgressEvents()


# ---------------------------------------------------------------------------------------------------
# The result.


def result_record(settings: dict, progress: Progress, wall_s: float, steps_done: int, target: float) -> dict:
    import trl

    timed = progress.steps[1:] or progress.steps  # the first step also pays one-off warm-up costs
    mean = lambda key: sum(s[key] for s in timed) / len(timed)  # noqa: E731
    typical = sorted(timed, key=lambda s: s["step_s"])[len(timed) // 2]  # the median step, with its own breakdown
    parts = ("generate_s", "score_s", "train_s")
    return {
        "peer": "trl",
        "trl_version": trl.__version__,
        "settings": settings,
        "start_accuracy": progress.evals[0]["accuracy"],
        "final_accuracy": progress.evals[-1]["accuracy"],
        "wall_clock_s": round(wall_s, 2),
        "samples_trained": steps_done * progress.samples_per_step,
        "time_to_target_s": time_to_target(progress.evals, target),
        "target": target,
        "eval_s": round(progress.eval_s, 2),
        "step_s_mean": round(mean("step_s"), 3),
        "step_breakdown_s_mean": {k: round(mean(k), 3) for k in parts},
        # The median step is the better figure on a shared machine: a busy neighbour inflates some steps 10-50x.
        "step_s_median": round(typical["step_s"], 3),
        "step_breakdown_s_median": {k: round(typical[k], 3) for k in parts},
        "steps": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()} for s in progress.steps],
        "evals": progress.evals,
    }


def print_summary(result: dict) -> None:
    steps, target = result["settings"]["steps"], result["target"]
    print(f"\nW1 add, TRL {result['trl_version']} GRPOTrainer ({LOSS_TYPE}, scale_rewards={SCALE_REWARDS}), {steps} steps, target accuracy {target}")
    print(f"{'step':>5} {'samples':>8} {'wall s':>7} {'accuracy':>8}")
    for e in result["evals"]:
        print(f"{e['step']:>5} {e['samples_trained']:>8} {e['wall_s']:>7.1f} {e['accuracy']:>8.3f}")
    ttt = f"{result['time_to_target_s']:.0f}s" if result["time_to_target_s"] is not None else "-"
    step_s, b = result["step_s_median"], result["step_breakdown_s_median"]
    print(
        f"start {result['start_accuracy']:.3f}  final {result['final_accuracy']:.3f}  wall {result['wall_clock_s']:.0f}s "
        f"(+{result['eval_s']:.0f}s eval, excluded)  t(target) {ttt}\n"
        f"median {step_s:.2f} s/step (mean {result['step_s_mean']:.2f}): generate {b['generate_s'] / step_s:.0%}, "
        f"score {b['score_s'] / step_s:.0%}, loss+backward+optimizer {b['train_s'] / step_s:.0%}"
    )


# ---------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (each 32 prompts x 8 samples)")
    parser.add_argument("--eval-every", type=int, default=10, help="held-out evaluation period in steps")
    parser.add_argument("--target", type=float, default=0.5, help="held-out accuracy whose wall-clock is reported")
    parser.add_argument("--bf16", action="store_true", help="TRL's bf16 mixed precision (bf16=True), with eager attention as asyncrl's "
                        "bf16 learner on CPU (torch's bf16 SDPA backward on CPU is slow on short rows)")
    common.add_output_options(parser, "peer_trl", "smoke run: 4 steps, evaluation every 2")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    common.set_runtime_env()  # before transformers and datasets read it
    steps, every = (4, 2) if args.quick else (args.steps, args.eval_every)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from asyncrl.config import RECIPES, load_config
    from asyncrl.envs.model_dir import ensure_model
    from asyncrl.envs.warm_start import greedy_accuracy

    cfg = load_config(RECIPES / "default.yaml")
    model_dir = ensure_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **({"attn_implementation": "eager"} if args.bf16 else {}))
    train, heldout = load_prompts(cfg, tokenizer, steps)
    grpo = grpo_args(cfg, steps) | {"bf16": args.bf16}
    settings = run_settings(grpo, cfg, model_dir, every, len(heldout)) | {"bf16": args.bf16}

    timers = GenerationTimers()
    progress = Progress(
        lambda m: greedy_accuracy(m, tokenizer, heldout, max_new_tokens=cfg.rollout.max_tokens),
        grpo["per_device_train_batch_size"], every, timers,
    )  # fmt: skip
    dataset = Dataset.from_list([{"prompt": p.text, "ground_truth": p.ground_truth} for p in train])
    trainer = timed_trainer_class(timers)(
        model=model, reward_funcs=add_reward(tokenizer.eos_token_id), args=grpo_config(grpo, cfg),
        train_dataset=dataset, processing_class=tokenizer, callbacks=[progress_callback(progress)],
    )  # fmt: skip
    for noisy in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(noisy)
    trainer.train()
    wall_s = progress.wall()
    settings["loadavg_1m_end"] = round(common.load_average(), 2)

    result = result_record(settings, progress, wall_s, trainer.state.global_step, args.target)
    out = common.output_path("peer_trl", args)
    common.write_json(out, result)
    print_summary(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
