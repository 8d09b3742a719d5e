"""W1 `add` peer baseline: TRL's GRPOTrainer, held-out accuracy against wall-clock and trained samples.

Trains from the same cached warm-start checkpoint, on the same prompt stream, with the same group size
(32 prompts x 8 samples = 256 completions per optimizer step), learning rate, AdamW betas, gradient clip,
sampling temperature and completion length as asyncrl's default run (configs/default.yaml). TRL runs
synchronously in one process on the CPU: generate with transformers, score, one optimizer step, repeat.

The held-out set (500 prompts) is scored greedily with `asyncrl.models.warm_start.greedy_accuracy` at step 0
and every `--eval-every` steps. The reported wall-clock EXCLUDES that evaluation time (asyncrl's own
records include its vLLM evaluation, which is a small part of a step); the total is kept in `eval_s`.
Writes benchmarks/results/peer_trl.json (peer_trl_quick.json with --quick).

    python benchmarks/peer_trl.py [--steps N] [--eval-every K] [--target 0.5] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from learning_add import time_to_target  # benchmarks/ is on sys.path when a script there runs

RESULTS = Path(__file__).parent / "results"
# TRL's loss closest to plain GRPO with group-normalised advantages (asyncrl `grpo` preset: advantage grpo,
# loss ppo, reduction seq_mean_token_mean). One optimizer step per generation batch, so the PPO ratio is 1.
LOSS_TYPE = "grpo"
SCALE_REWARDS = "group"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (each 32 prompts x 8 samples)")
    parser.add_argument("--eval-every", type=int, default=10, help="held-out evaluation period in steps")
    parser.add_argument("--target", type=float, default=0.5, help="held-out accuracy whose wall-clock is reported")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 steps, evaluation every 2")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default benchmarks/results/peer_trl[_quick].json)")
    args = parser.parse_args()
    for key, value in (("RAY_AUTH_MODE", "disabled"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("VLLM_CPU_KVCACHE_SPACE", "1"), ("HF_HUB_OFFLINE", "1")):
        os.environ.setdefault(key, value)
    steps, every = (4, 2) if args.quick else (args.steps, args.eval_every)
    out_path = args.out or RESULTS / ("peer_trl_quick.json" if args.quick else "peer_trl.json")

    import itertools

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.config import RECIPES, load_config
    from asyncrl.envs.data import add_prompt_stream, heldout_add_prompts
    from asyncrl.envs.rewards import exact_match
    from asyncrl.models import ensure_model
    from asyncrl.models.warm_start import greedy_accuracy

    cfg = load_config(RECIPES / "default.yaml")
    model_dir = ensure_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = tokenizer.eos_token_id

    group = cfg.rollout.samples_per_prompt
    prompts_per_step = cfg.learner.prompts_per_step
    # The controller's stream (asyncrl.envs.data.train_stream): seeded with data.seed, consumed in order.
    stream = add_prompt_stream(tokenizer, cfg.data.seed, cfg.data.max_operand)
    train = list(itertools.islice(stream, steps * prompts_per_step))
    heldout = heldout_add_prompts(tokenizer, cfg.data.eval_prompts, cfg.data.max_operand)

    # TRL tokenizes plain prompts with `processing_class(text=prompts)["input_ids"]` (special tokens on):
    # they must be exactly the ids asyncrl's engines see.
    trl_ids = tokenizer(text=[p.text for p in train])["input_ids"]
    mismatched = [p.text for p, ids in zip(train, trl_ids) if list(ids) != list(p.prompt_ids)]
    if mismatched:
        raise SystemExit(f"TRL would feed different prompt ids than asyncrl for {len(mismatched)} prompts, e.g. {mismatched[0]!r}")
    dataset = Dataset.from_list([{"prompt": p.text, "ground_truth": p.ground_truth} for p in train])

    def add_reward(prompts, completions, completion_ids, ground_truth, **_):
        """W1 exact match: the text decoded without special tokens, and the completion ended with EOS."""
        return [
            exact_match(text, gt, finish_reason="stop" if eos in ids else "length")
            for text, ids, gt in zip(completions, completion_ids, ground_truth)
        ]

    lr_schedule = "constant" if cfg.learner.warmup_steps == 0 else "constant_with_warmup"
    settings = {
        "model_dir": str(model_dir),
        "steps": steps,
        "prompts_per_step": prompts_per_step,
        "num_generations": group,
        "completions_per_step": prompts_per_step * group,
        "learning_rate": cfg.learner.lr,
        "lr_scheduler": lr_schedule,
        "warmup_steps": cfg.learner.warmup_steps,
        "adam_betas": list(cfg.learner.betas),
        "weight_decay": cfg.learner.weight_decay,
        "max_grad_norm": cfg.learner.grad_clip,
        "temperature": cfg.rollout.temperature,
        "top_p": cfg.rollout.top_p,
        "top_k": 0,
        "max_completion_length": cfg.rollout.max_tokens,
        "loss_type": LOSS_TYPE,
        "scale_rewards": SCALE_REWARDS,
        "beta": 0.0,
        "num_iterations": 1,
        "steps_per_generation": 1,
        "gradient_accumulation_steps": 1,
        "per_device_train_batch_size": prompts_per_step * group,
        "shuffle_dataset": False,
        "data_seed": cfg.data.seed,
        "seed": 0,
        "eval_every": every,
        "eval_prompts": len(heldout),
        "eval": "greedy, transformers (asyncrl.models.warm_start.greedy_accuracy); excluded from wall_s",
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "loadavg_1m_start": round(os.getloadavg()[0], 2),
    }

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="peer_trl-"),
        max_steps=steps,
        per_device_train_batch_size=prompts_per_step * group,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=group,
        max_completion_length=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=0,
        learning_rate=cfg.learner.lr,
        lr_scheduler_type=lr_schedule,
        warmup_steps=cfg.learner.warmup_steps,
        optim="adamw_torch",
        adam_beta1=cfg.learner.betas[0],
        adam_beta2=cfg.learner.betas[1],
        weight_decay=cfg.learner.weight_decay,
        max_grad_norm=cfg.learner.grad_clip,
        beta=0.0,
        loss_type=LOSS_TYPE,
        scale_rewards=SCALE_REWARDS,
        mask_truncated_completions=cfg.buffer.filter_overlong,
        shuffle_dataset=False,
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )

    class TimedGRPOTrainer(GRPOTrainer):
        """Records the seconds of each step spent generating (transformers.generate) and scoring."""

        gen_s = 0.0
        score_s = 0.0

        def _generate(self, prompts):
            begin = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                self.gen_s += time.perf_counter() - begin

        def _generate_and_score_completions(self, inputs):
            begin, gen_before = time.perf_counter(), self.gen_s
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self.score_s += time.perf_counter() - begin - (self.gen_s - gen_before)

    class HeldoutEval(TrainerCallback):
        """Greedy held-out accuracy at step 0 and every `every` steps; wall-clock excludes evaluation."""

        def __init__(self):
            self.evals: list[dict] = []
            self.steps: list[dict] = []
            self.eval_s = 0.0
            self.start = 0.0
            self.pending: list[str] = []

        def wall(self) -> float:
            return time.perf_counter() - self.start - self.eval_s

        def evaluate(self, model, step: int) -> None:
            wall_s = self.wall()
            begin = time.perf_counter()
            model.eval()
            accuracy = greedy_accuracy(model, tokenizer, heldout, max_new_tokens=cfg.rollout.max_tokens)
            model.train()
            spent = time.perf_counter() - begin
            self.eval_s += spent
            record = {"step": step, "samples_trained": step * prompts_per_step * group, "wall_s": round(wall_s, 2), "accuracy": accuracy}
            self.evals.append(record)
            # Printed after the step's own line (on_log runs after on_step_end).
            self.pending.append(f"eval  step {step:>4}  samples {record['samples_trained']:>6}  wall {wall_s:7.1f}s  accuracy {accuracy:.3f}  (eval took {spent:.1f}s)")
            if step == 0:
                self.flush()

        def flush(self) -> None:
            for line in self.pending:
                print(line, flush=True)
            self.pending.clear()

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.start = time.perf_counter()
            self.evaluate(model, 0)

        def on_step_begin(self, args, state, control, **kwargs):
            self.step_begin = time.perf_counter()
            self.gen_before, self.score_before = trainer.gen_s, trainer.score_s

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step_s = time.perf_counter() - self.step_begin
            gen_s, score_s = trainer.gen_s - self.gen_before, trainer.score_s - self.score_before
            self.steps.append({"step": state.global_step, "step_s": step_s, "generate_s": gen_s, "score_s": score_s, "train_s": step_s - gen_s - score_s})
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                self.evaluate(model, state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and self.steps:
                s = self.steps[-1]
                s.update(reward=logs["reward"], frac_reward_zero_std=logs.get("frac_reward_zero_std"))
                print(
                    f"step {state.global_step:>4}  reward {logs['reward']:.3f}  zero-std groups {logs.get('frac_reward_zero_std', float('nan')):.2f}  "
                    f"{s['step_s']:.2f}s (generate {s['generate_s']:.2f}, score {s['score_s']:.2f}, loss+backward+step {s['train_s']:.2f})",
                    flush=True,
                )
            self.flush()

        def on_train_end(self, args, state, control, **kwargs):
            self.flush()

    callback = HeldoutEval()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=add_reward, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[callback])
    for noisy in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(noisy)
    trainer.train()
    wall_s = callback.wall()
    settings["loadavg_1m_end"] = round(os.getloadavg()[0], 2)

    evals = callback.evals
    timed = callback.steps[1:] or callback.steps  # the first step also pays one-off warm-up costs
    mean = lambda key: sum(s[key] for s in timed) / len(timed)  # noqa: E731
    typical = sorted(timed, key=lambda s: s["step_s"])[len(timed) // 2]  # the median step, with its own breakdown
    result = {
        "peer": "trl",
        "trl_version": trl.__version__,
        "settings": settings,
        "start_accuracy": evals[0]["accuracy"],
        "final_accuracy": evals[-1]["accuracy"],
        "wall_clock_s": round(wall_s, 2),
        "samples_trained": trainer.state.global_step * prompts_per_step * group,
        "time_to_target_s": time_to_target(evals, args.target),
        "target": args.target,
        "eval_s": round(callback.eval_s, 2),
        "step_s_mean": round(mean("step_s"), 3),
        "step_breakdown_s_mean": {k: round(mean(k), 3) for k in ("generate_s", "score_s", "train_s")},
        # The median step is the better figure on a shared machine: a busy neighbour inflates some steps 10-50x.
        "step_s_median": round(typical["step_s"], 3),
        "step_breakdown_s_median": {k: round(typical[k], 3) for k in ("generate_s", "score_s", "train_s")},
        "steps": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()} for s in callback.steps],
        "evals": evals,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))

    step_s = result["step_s_median"]
    b = result["step_breakdown_s_median"]
    print(f"\nW1 add, TRL {trl.__version__} GRPOTrainer ({LOSS_TYPE}, scale_rewards={SCALE_REWARDS}), {steps} steps, target accuracy {args.target}")
    print(f"{'step':>5} {'samples':>8} {'wall s':>7} {'accuracy':>8}")
    for e in evals:
        print(f"{e['step']:>5} {e['samples_trained']:>8} {e['wall_s']:>7.1f} {e['accuracy']:>8.3f}")
    ttt = f"{result['time_to_target_s']:.0f}s" if result["time_to_target_s"] is not None else "-"
    print(
        f"start {result['start_accuracy']:.3f}  final {result['final_accuracy']:.3f}  wall {wall_s:.0f}s (+{callback.eval_s:.0f}s eval, excluded)  "
        f"t(target) {ttt}\nmedian {step_s:.2f} s/step (mean {result['step_s_mean']:.2f}): generate {b['generate_s'] / step_s:.0%}, score {b['score_s'] / step_s:.0%}, "
        f"loss+backward+optimizer {b['train_s'] / step_s:.0%}"
    )
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
