"""Issue #18's question: how far can RL lift a W1 warm start? Builds one warm-start variant and runs the plain
on-policy loop (benchmarks/plain_grpo.py) from it, so a variant's liftability is measured without asyncrl's
machinery in the way.

A variant differs from the default start (`add-1m`, 2,000 examples, attention dropout 0.2, stop at 0.2
validation accuracy, seed 0) in its example count, dropout, stopping target, seed, batch size, preset or number
of layers; the plain loop's flags
(plain_grpo.LoopSettings) vary the RL side. The result JSON holds the start's
metadata (greedy and sampled accuracy, answer entropy) and the plain loop's greedy held-out accuracy every
`--eval-every` steps.

    python benchmarks/warm_start_lift.py --label default --steps 200
    python benchmarks/warm_start_lift.py --label no_dropout --dropout 0 --steps 200
    python benchmarks/warm_start_lift.py --label ex20k --examples 20000 --dropout 0 --steps 200
    python benchmarks/warm_start_lift.py --label target0.12 --target 0.12 --steps 200
    python benchmarks/warm_start_lift.py --label deep8 --layers 8 --steps 200
    python benchmarks/warm_start_lift.py --label add-3m --preset add-3m --steps 200
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import common  # benchmarks/common.py: a script's own folder is on sys.path


def parse_args(add_loop_options) -> argparse.Namespace:
    """`add_loop_options`: plain_grpo's, passed in because that module may only be imported after
    common.set_runtime_env()."""
    from asyncrl.config import ModelConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="names the variant in the result file")
    parser.add_argument("--examples", type=int, default=ModelConfig().warm_start_examples, help="warm-start examples")
    parser.add_argument("--target", type=float, default=0.2, help="validation accuracy that stops the warm start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dropout", type=float, default=ModelConfig().warm_start_dropout, help="warm-start attention dropout")
    parser.add_argument("--preset", default="add-1m", help="model preset (asyncrl.models.PRESETS, e.g. add-3m)")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    parser.add_argument("--steps", type=int, default=200, help="plain-loop steps")
    parser.add_argument("--eval-every", type=int, default=20)
    add_loop_options(parser)
    common.add_output_options(parser, "warm_start_lift", "20 plain-loop steps")
    return parser.parse_args()


def variant_preset(preset: str, layers: int | None) -> str:
    """`preset`, or a copy of it with `layers` layers registered as `<preset>-<layers>l`."""
    from asyncrl.models import PRESETS

    if layers is None or layers == PRESETS[preset].num_layers:
        return preset
    PRESETS[name := f"{preset}-{layers}l"] = dataclasses.replace(PRESETS[preset], num_layers=layers)
    return name


def main() -> None:
    common.set_runtime_env()
    import torch

    import plain_grpo
    from asyncrl.models import build_model, num_parameters
    from asyncrl.envs.warm_start import warm_start

    args = parse_args(plain_grpo.add_loop_options)
    load = common.load_average()
    preset = variant_preset(args.preset, args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(preset, tmp, seed=args.seed)
        start = warm_start(model_dir, args.examples, 40, 1e-3, 999, target=args.target, seed=args.seed, batch_size=args.batch_size,
                           dropout=args.dropout, report=print)
        torch.set_num_threads(1)
        evals = plain_grpo.train(model_dir, 20 if args.quick else args.steps, args.eval_every, plain_grpo.loop_settings(args))
    gain = max(e["accuracy"] for e in evals) - evals[0]["accuracy"]
    print(f"{args.label}: start {evals[0]['accuracy']:.3f}, best {evals[0]['accuracy'] + gain:.3f} (+{gain:.3f})")
    result = {"label": args.label, "preset": preset, "parameters": num_parameters(preset), "args": vars(args) | {"out": None},
              "warm_start": start, "plain_loop": evals, "best_gain": round(gain, 4), "machine": common.machine(load)}  # fmt: skip
    common.write_json(common.output_path(f"warm_start_lift_{args.label}", args), result)


if __name__ == "__main__":
    main()
